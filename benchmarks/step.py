"""Time the engine's step with random int8 weights: one prompt's rows, then decode steps; print JSON.

    python -m benchmarks.step --config PATH_OR_PRESET --batch N --dtype float32 [--mesh 1,1] [--prompt-len 32]
        [--active M]   # only M of the N slots decode (the others are idle)
        [--prompts P]  # the prefill step computes P prompts of --prompt-len rows together (default 1)
        [--tile T]     # rows per tile (default: the engine's choice for this platform)
        [--step-tokens R]  # rows per step (default: the engine's)
        [--products auto|native|native-int8|xla]  # as the model service's flag
        [--sampled]    # draw with temperature 0.7, top_p 0.9 (default: greedy)
        [--controls]   # with --sampled: every request also uses the sampling controls (top_k, min_p, the three
                       # penalties, 16 logit_bias entries)

The low-level tool under benchmarks.roofline (which calls `run`): the first step (its compilation) is
reported separately; step times are medians of --runs runs. A step is the whole engine step: the token rows
through the network, the unembedding of the drawn rows and the sampler.
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

from benchmarks.stack import use_model_xla_flags
from model_service.checkpoint import random_params
from model_service.config import PRODUCT_CHOICES, MeshConfig, load_model_config, validate
from model_service.engine import Engine
from model_service.host_memory import huge_pages
from model_service.backend import choose_products
from model_service.model import GrokModel
from model_service.sampling_settings import GREEDY, SamplingSettings
from model_service.sharding import make_mesh
from model_service.step_batch import SlotStart, StepBatch


def _timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def batch(engine: Engine, rows: list[tuple[int, int, int | None]], draws: list[tuple[int, int]],
          starts: tuple[SlotStart, ...] = ()) -> StepBatch:
    """A step of rows (slot, position, token or None for the slot's last draw) drawing at (row, slot)."""
    r, p = engine.max_rows, engine.max_samples
    tokens, from_last = np.zeros(r, np.int32), np.zeros(r, bool)
    positions, seq = np.zeros(r, np.int32), np.zeros(r, np.int32)
    for i, (slot, pos, tok) in enumerate(rows):
        seq[i], positions[i] = slot, pos
        from_last[i], tokens[i] = tok is None, tok or 0
    sample_rows, sample_slots = np.zeros(p, np.int32), np.full(p, engine.slots, np.int32)
    for i, (row, slot) in enumerate(draws):
        sample_rows[i], sample_slots[i] = row, slot
    return StepBatch(tokens, from_last, positions, seq, len(rows), engine.model.dense_tables(engine.slots),
                     sample_rows, sample_slots, starts=starts)


def settings(args: argparse.Namespace, vocab: int, rng: np.random.Generator) -> SamplingSettings:
    if not args.sampled:
        return GREEDY
    if not args.controls:
        return SamplingSettings(temperature=0.7, top_p=0.9)
    bias = tuple((int(t), 1.5) for t in rng.choice(vocab, 16, replace=False))
    return SamplingSettings(temperature=0.7, top_p=0.9, top_k=50, min_p=0.05, repetition_penalty=1.1,
                            presence_penalty=0.3, frequency_penalty=0.2, logit_bias=bias)


def run(args: argparse.Namespace) -> dict[str, Any]:
    cfg = load_model_config(args.config)
    mesh_cfg = MeshConfig.parse(args.mesh)
    validate(cfg, mesh_cfg)
    mesh = make_mesh(mesh_cfg)
    dtype = jnp.dtype(args.dtype)
    model = GrokModel(cfg, mesh, dtype, choose_products(args.products, mesh, dtype))
    params, load_s = _timed(lambda: jax.block_until_ready(
        random_params(cfg, mesh, dtype, args.seed, pack=model.products.native,
                      int8_table=model.products.int8, stacked=model.backend.stacked_experts)))
    slots = max(args.batch, args.prompts)
    engine = Engine(model, params, cfg, mesh, slots, step_tokens=args.step_tokens or max(
        args.prompts * args.prompt_len, slots), tile=args.tile)
    rng = np.random.default_rng(args.seed)
    s = settings(args, cfg.vocab_size, rng)
    prompts = [rng.integers(3, cfg.vocab_size, args.prompt_len).tolist() for _ in range(slots)]
    state = engine.init_state()

    def prefill(first: int, count: int) -> StepBatch:
        rows = [(slot, p, prompts[slot][p]) for slot in range(first, first + count) for p in range(args.prompt_len)]
        draws = [((i + 1) * args.prompt_len - 1, first + i) for i in range(count)]
        starts = tuple(SlotStart(slot, slot, s, tuple(prompts[slot])) for slot in range(first, first + count))
        return batch(engine, rows, draws, starts)

    def step(b: StepBatch) -> float:
        nonlocal state
        start = time.perf_counter()
        state, pending = engine.step(state, b)
        pending.get()
        return time.perf_counter() - start

    prefill_compile = step(prefill(0, args.prompts))
    huge_pages(engine.params)  # as the model service does once compiled (--huge-pages on)
    prefill_times = [step(prefill(0, args.prompts)) for _ in range(args.runs)]
    for first in range(0, slots, args.prompts):  # every slot holds a prompt
        step(prefill(first, min(args.prompts, slots - first)))
    active = args.batch if args.active is None else min(args.active, args.batch)
    position = args.prompt_len
    decode_times = []
    for i in range(args.runs + 1):
        rows = [(slot, position, None) for slot in range(active)]
        t = step(batch(engine, rows, [(slot, slot) for slot in range(active)]))
        position += 1
        if i:
            decode_times.append(t)
    decode_ms = statistics.median(decode_times) * 1e3
    prefill_ms = statistics.median(prefill_times) * 1e3
    return {
        "config": args.config, "batch": args.batch, "active": active, "tile": engine.tile,
        "step_tokens": engine.max_rows, "products": model.products.value, "dtype": args.dtype, "mesh": args.mesh,
        "devices": mesh_cfg.size, "platform": jax.devices()[0].platform, "prompt_len": args.prompt_len,
        "prompts": args.prompts, "sampled": bool(args.sampled), "controls": bool(args.controls),
        "params_init_s": round(load_s, 3), "prefill_compile_s": round(prefill_compile, 3),
        "prefill_ms": round(prefill_ms, 3), "prefill_tokens_per_s": round(args.prompts * args.prompt_len / prefill_ms
                                                                         * 1e3, 2),
        "decode_compile_s": round(prefill_compile, 3), "decode_step_ms": round(decode_ms, 3),
        "decode_tokens_per_s": round(active / decode_ms * 1e3, 2), "runs": args.runs,
    }


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.step", description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True, help="preset name (grok-1) or JSON config path")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--active", type=int, default=None, help="slots decoding (default: all)")
    p.add_argument("--prompts", type=int, default=1, help="prompts computed together in the prefill step")
    p.add_argument("--tile", type=int, default=None, help="rows per tile (default: the engine's)")
    p.add_argument("--step-tokens", type=int, default=None, help="rows per step (default: the prompts' rows)")
    p.add_argument("--sampled", action="store_true", help="temperature 0.7, top_p 0.9 (default: greedy)")
    p.add_argument("--controls", action="store_true", help="with --sampled: top_k, min_p, penalties, logit_bias on")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--products", choices=PRODUCT_CHOICES, default="auto",
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
