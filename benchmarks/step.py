"""Time prefill and one decode step of the Grok-1 network with random int8 weights; print JSON.

    python -m benchmarks.step --config PATH_OR_PRESET --batch N --dtype float32 [--mesh 1,1] [--prompt-len 32]
        [--active M]   # only the first M of the N slots hold a request (the others are free slots)
        [--tile T]     # decode rows per tile (default: the engine's choice for this platform and batch)
        [--products auto|native|xla]  # as the model service's flag
        [--sampled]    # time the engine's whole step instead: decode + sampling (temperature 0.7, top_p 0.9)
        [--controls]   # with --sampled: every request also uses issue 12's controls (top_k, min_p, the three
                       # penalties, 16 logit_bias entries)

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
from model_service.engine import Engine, choose_row_tile
from model_service.model import GrokModel, Products, choose_products
from model_service.sampling_settings import SamplingSettings
from model_service.sharding import make_mesh
from benchmarks.stack import use_model_xla_flags


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
    model = GrokModel(cfg, mesh, dtype, choose_products(args.products, mesh, dtype))
    pack = model.products is Products.NATIVE
    params, load_s = _timed(lambda: random_params(cfg, mesh, dtype, args.seed, pack=pack))
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
    tile = choose_row_tile(args.tile, args.batch, mesh)
    tiles = None if tile == args.batch else jnp.int32(-(-active_slots // tile))
    if args.sampled:
        return {**_engine_step(args, cfg, mesh, model, params, active_slots), "prefill_ms":
                round(statistics.median(prefill_times) * 1e3, 3), "prefill_compile_s": round(prefill_compile, 3)}
    decode = jax.jit(lambda p, t, m, a: model.decode(p, t, m, None, a, tile=tile, tiles_to_run=tiles), donate_argnums=2,
                     out_shardings=(None, mem_sh))
    decode_c, decode_compile = _timed(lambda: decode.lower(params, step_tokens, memory, active).compile())
    (_, memory), _ = _timed(lambda: decode_c(params, step_tokens, memory, active))
    decode_times = []
    for _ in range(args.runs):
        (_, memory), dt = _timed(lambda: decode_c(params, step_tokens, memory, active))
        decode_times.append(dt)
    decode_ms = statistics.median(decode_times) * 1e3
    return {
        "config": args.config, "batch": args.batch, "active": active_slots, "tile": tile,
        "products": model.products.value, "dtype": args.dtype, "mesh": args.mesh,
        "devices": mesh_cfg.size, "platform": jax.devices()[0].platform, "prompt_len": args.prompt_len,
        "params_init_s": round(load_s, 3),
        "prefill_compile_s": round(prefill_compile, 3), "prefill_ms": round(statistics.median(prefill_times) * 1e3, 3),
        "decode_compile_s": round(decode_compile, 3), "decode_step_ms": round(decode_ms, 3),
        "decode_tokens_per_s": round(active_slots / decode_ms * 1e3, 2), "runs": args.runs,
    }


def _engine_step(args: argparse.Namespace, cfg: Any, mesh: Any, model: GrokModel, params: Any,
                 active_slots: int) -> dict[str, Any]:
    """The engine's whole decode step (model + sampling) with `active_slots` sampled requests."""
    engine = Engine(model, params, cfg, mesh, args.batch, (args.prompt_len,), args.tile)
    state = engine.init_decode_state()
    rng = np.random.default_rng(args.seed)
    sampling = SamplingSettings(temperature=0.7, top_p=0.9)
    if args.controls:
        bias = tuple((int(t), 1.5) for t in rng.choice(cfg.vocab_size, 16, replace=False))
        sampling = SamplingSettings(temperature=0.7, top_p=0.9, top_k=50, min_p=0.05, repetition_penalty=1.1,
                                    presence_penalty=0.3, frequency_penalty=0.2, logit_bias=bias)
    for slot in range(active_slots):
        prefix, _ = engine.prefill(rng.integers(3, cfg.vocab_size, args.prompt_len).tolist(), sampling, seed=slot)
        state = engine.insert(prefix, state, slot)
    (state, pending), compile_s = _timed(lambda: engine.generate(state))
    pending.get()
    times = []
    for _ in range(args.runs):
        start = time.perf_counter()
        state, pending = engine.generate(state)
        pending.get()
        times.append(time.perf_counter() - start)
    step_ms = statistics.median(times) * 1e3
    return {"config": args.config, "batch": args.batch, "active": active_slots, "tile": engine.row_tile,
            "products": model.products.value, "dtype": args.dtype, "mesh": args.mesh, "devices": mesh.size, "platform": jax.devices()[0].platform,
            "prompt_len": args.prompt_len, "sampled": True, "controls": bool(args.controls), "step_compile_s": round(compile_s, 3),
            "step_ms": round(step_ms, 3), "tokens_per_s": round(active_slots / step_ms * 1e3, 2), "runs": args.runs}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.step", description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True, help="preset name (grok-1) or JSON config path")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--active", type=int, default=None, help="slots holding a request (default: all)")
    p.add_argument("--tile", type=int, default=None, help="decode rows per tile (default: the engine's)")
    p.add_argument("--sampled", action="store_true", help="time the engine step: decode + sampling")
    p.add_argument("--controls", action="store_true", help="with --sampled: top_k, min_p, penalties, logit_bias on")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--products", choices=["auto", "native", "xla"], default="auto",
                   help="as the model service's --products (native: the int8 CPU kernel)")
    p.add_argument("--mesh", default="1,1", help="DATA,MODEL")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--runs", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    return p


def main(argv: list[str] | None = None) -> int:
    use_model_xla_flags()  # the model service's process settings, before JAX computes
    print(json.dumps(run(parser().parse_args(argv))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
