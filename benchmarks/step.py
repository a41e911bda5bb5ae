"""Time prefill and one decode step of the Grok-1 network with random int8 weights; print JSON.

    python -m benchmarks.step --config PATH_OR_PRESET --batch N --dtype float32 [--mesh 1,1] [--prompt-len 32]
        [--active M]   # only the first M of the N slots hold a request (the others are free slots)

The low-level tool under benchmarks.roofline (which calls `run`): compile time is reported
separately; step times are medians of --runs runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from model_service.checkpoint import random_params
from model_service.config import MeshConfig, load_model_config, validate
from model_service.model import GrokModel
from model_service.sharding import make_mesh


def _timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    start = time.perf_counter()
    out = jax.block_until_ready(fn())
    return out, time.perf_counter() - start


def run(args: argparse.Namespace) -> dict[str, Any]:
    cfg = load_model_config(args.config)
    mesh_cfg = MeshConfig.parse(args.mesh)
    validate(cfg, mesh_cfg)
    mesh = make_mesh(mesh_cfg)
    dtype = jnp.dtype(args.dtype)
    params, load_s = _timed(lambda: random_params(cfg, mesh, dtype, args.seed))
    model = GrokModel(cfg, mesh, dtype)
    rng = np.random.default_rng(args.seed)
    tokens = jnp.asarray(rng.integers(3, cfg.vocab_size, (1, args.prompt_len)), jnp.int32)
    length = jnp.int32(args.prompt_len)

    prefill = jax.jit(model.prefill).lower(params, tokens, length)
    prefill, prefill_compile = _timed(prefill.compile)
    (_, prefix), _ = _timed(lambda: prefill(params, tokens, length))
    prefill_times = [_timed(lambda: prefill(params, tokens, length))[1] for _ in range(args.runs)]

    mem_sh = model.memory_shardings(args.batch)
    insert = jax.jit(model.insert, donate_argnums=0, out_shardings=mem_sh)
    memory = jax.jit(model.init_memory, static_argnums=0, out_shardings=mem_sh)(args.batch)
    for slot in range(args.batch):
        memory = insert(memory, prefix, jnp.int32(slot))
    step_tokens = jnp.asarray(rng.integers(3, cfg.vocab_size, (args.batch,)), jnp.int32)
    active_slots = args.batch if args.active is None else min(args.active, args.batch)
    active = jnp.arange(args.batch) < active_slots  # [B] bool: free slots never make an expert run
    decode = jax.jit(model.decode, donate_argnums=2, out_shardings=(None, mem_sh))
    decode_c, decode_compile = _timed(lambda: decode.lower(params, step_tokens, memory, active).compile())
    (_, memory), _ = _timed(lambda: decode_c(params, step_tokens, memory, active))
    decode_times = []
    for _ in range(args.runs):
        (_, memory), dt = _timed(lambda: decode_c(params, step_tokens, memory, active))
        decode_times.append(dt)
    decode_ms = statistics.median(decode_times) * 1e3
    return {
        "config": args.config, "batch": args.batch, "active": active_slots,
        "dtype": args.dtype, "mesh": args.mesh,
        "devices": mesh_cfg.size, "platform": jax.devices()[0].platform, "prompt_len": args.prompt_len,
        "params_init_s": round(load_s, 3),
        "prefill_compile_s": round(prefill_compile, 3), "prefill_ms": round(statistics.median(prefill_times) * 1e3, 3),
        "decode_compile_s": round(decode_compile, 3), "decode_step_ms": round(decode_ms, 3),
        "decode_tokens_per_s": round(active_slots / decode_ms * 1e3, 2), "runs": args.runs,
    }


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.step", description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True, help="preset name (grok-1) or JSON config path")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--active", type=int, default=None, help="slots holding a request (default: all)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--mesh", default="1,1", help="DATA,MODEL")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--runs", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    return p


def main(argv: list[str] | None = None) -> int:
    print(json.dumps(run(parser().parse_args(argv))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
