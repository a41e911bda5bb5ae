"""One config's device points in one process (started by benchmarks.device): the engine as the model service
builds it (random int8 weights, default backend and step shape), compiled, then timed on prompts and decode
steps; prints one JSON line.

    python benchmarks/device_points.py --config PATH --dtype bfloat16 --streams 1,8,64 --prompt-rows 8x32
        --long-prompt 2048 --runs 10

Run by path with the measured checkout first on PYTHONPATH: everything it imports (model_service, benchmarks.step's
`batch`, benchmarks.stack's process settings) comes from that checkout, so one copy of this file measures a
before and an after. Points, in this order, on one engine of max(streams) slots (the largest point's):
  prompts-PxL  P prompts of L tokens started together (cut into steps of the engine's rows); then every slot
               gets a prompt;
  decode-N     one decode step of N streams (each row its slot's next token, greedy draws);
  long-L       one prompt of L tokens in one slot (the steps the engine cuts it into).
A point's first run is reported apart (it includes any compilation `Engine.compile` left), the others timed:
the median of `--runs`, the host waiting for each step's draws; decode also dispatched back to back
(`pipelined_ms`: the host waits once, at the end).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any, Callable

import numpy as np


def build(config: str, dtype: str, slots: int, seed: int, backend: str = "auto",
          moe: str = "auto", layers: str = "auto", attention: str = "auto",
          products: str = "auto") -> tuple[Any, float]:
    """The model service's engine for `config` with random weights, and the seconds its weights took."""
    from model_service.loading import ServerConfig, load_engine, resolve

    # A checkout from before --layers / --attention takes neither: passed only when asked for.
    chosen = {k: v for k, v in (("layers", layers), ("attention", attention), ("products", products)) if v != "auto"}
    server = ServerConfig(config=config, checkpoint=None, random_init=True, dtype=dtype, slots=slots,
                          random_seed=seed, backend=backend, moe=moe, **chosen)
    start = time.perf_counter()
    engine = load_engine(server, resolve(server))
    import jax

    jax.block_until_ready(engine.params)
    return engine, time.perf_counter() - start


class Driver:
    """Steps of prompts and decode rows on one engine, the state threaded through; each slot's next position."""

    def __init__(self, engine: Any, seed: int) -> None:
        from benchmarks import step as step_tool
        from model_service.sampling_settings import GREEDY

        self.engine, self.batch, self.greedy = engine, step_tool.batch, GREEDY
        self.state = engine.init_state()
        self.rng = np.random.default_rng(seed)
        self.position = [0] * engine.slots

    def prompt_batches(self, prompts: dict[int, list[int]]) -> list[Any]:
        """The steps that compute `prompts` (slot -> tokens): their rows in order, cut into steps of the engine's
        rows; each prompt's slot starts in the step that holds its first row and draws at its last row."""
        from model_service.step_batch import SlotStart

        rows = [(slot, p, tok) for slot, toks in prompts.items() for p, tok in enumerate(toks)]
        size = self.engine.max_rows
        out = []
        for first in range(0, len(rows), size):
            part = rows[first:first + size]
            starts = tuple(SlotStart(s, s, self.greedy, tuple(prompts[s])) for s, p, _ in part if p == 0)
            draws = [(i, s) for i, (s, p, _) in enumerate(part) if p == len(prompts[s]) - 1]
            out.append(self.batch(self.engine, part, draws, starts))
        for slot, toks in prompts.items():
            self.position[slot] = len(toks)
        return out

    def decode_batch(self, slots: list[int]) -> Any:
        rows = [(s, self.position[s], None) for s in slots]
        for s in slots:
            self.position[s] += 1
        return self.batch(self.engine, rows, [(i, s) for i, s in enumerate(slots)])

    def mixed_batch(self, slots: list[int], prompts: dict[int, list[int]]) -> Any:
        """One step: a decode row for each of `slots`, then every row of `prompts` (slot -> tokens, started again
        in this step and drawing at their last rows): a step that decodes streams while prompts enter."""
        from model_service.step_batch import SlotStart

        rows = [(s, self.position[s], None) for s in slots] + [
            (s, p, tok) for s, toks in prompts.items() for p, tok in enumerate(toks)]
        draws = [(i, s) for i, (s, p, tok) in enumerate(rows) if tok is None or p == len(prompts[s]) - 1]
        for s in slots:
            self.position[s] += 1
        for s, toks in prompts.items():
            self.position[s] = len(toks)
        starts = tuple(SlotStart(s, s, self.greedy, tuple(toks)) for s, toks in prompts.items())
        return self.batch(self.engine, rows, draws, starts)

    def run(self, batches: list[Any]) -> float:
        """Dispatch the steps back to back; seconds until the last one's draws are on the host."""
        start = time.perf_counter()
        pending = None
        for b in batches:
            self.state, pending = self.engine.step(self.state, b)
        if pending is not None:
            pending.get()
        return time.perf_counter() - start

    def tokens(self, n: int) -> list[int]:
        return self.rng.integers(3, self.engine.vocab_size, n).tolist()


def timed(name: str, runs: int, once: Any) -> dict[str, Any]:
    """`once()` -> seconds, run 1 + runs times: the first apart, the median of the rest in ms."""
    first = once()
    times = [once() * 1e3 for _ in range(runs)]
    return {"name": name, "first_s": round(first, 4), "ms": statistics.median(times), "ms_min": min(times),
            "ms_max": max(times), "runs": runs}


def prompts_point(d: Driver, count: int, length: int, runs: int) -> dict[str, Any]:
    prompts = {s: d.tokens(length) for s in range(count)}
    steps = len(d.prompt_batches(prompts))
    point = timed(f"prompts-{count}x{length}", runs, lambda: d.run(d.prompt_batches(prompts)))
    return {**point, "kind": "prompt", "prompts": count, "prompt_len": length, "rows": count * length,
            "draws": count, "steps": steps, "kv_tokens": count * length, "keys_seen": count * length * (length + 1) / 2}


def fill_slots(d: Driver, length: int) -> None:
    """A prompt of `length` tokens in every slot that holds none yet (unmeasured): each can then decode."""
    d.run(d.prompt_batches({s: d.tokens(length) for s in range(d.engine.slots) if d.position[s] == 0}))


def decode_point(d: Driver, streams: int, runs: int) -> dict[str, Any]:
    slots = list(range(streams))
    held: list[int] = []

    def once() -> float:
        held.append(sum(d.position[s] + 1 for s in slots))  # every row's key is written and read this step
        return d.run([d.decode_batch(slots)])

    point = timed(f"decode-{streams}", runs, once)
    pipelined = d.run([d.decode_batch(slots) for _ in range(runs)]) / runs * 1e3
    tokens = statistics.mean(held[1:])
    return {**point, "kind": "decode", "streams": streams, "rows": streams, "draws": streams, "steps": 1,
            "pipelined_ms": pipelined, "kv_tokens": tokens, "keys_seen": tokens}


def long_point(d: Driver, length: int, runs: int) -> dict[str, Any]:
    prompt = {0: d.tokens(length)}
    steps = len(d.prompt_batches(prompt))
    point = timed(f"long-{length}", runs, lambda: d.run(d.prompt_batches(prompt)))
    return {**point, "kind": "prompt", "prompts": 1, "prompt_len": length, "rows": length, "draws": 1,
            "steps": steps, "kv_tokens": length, "keys_seen": length * (length + 1) / 2}


def progress(message: str) -> None:
    """A line on stderr as each stage ends: what a run cut short by its time limit still reports."""
    print(f"[{time.perf_counter() - STARTED:.1f} s] {message}", file=sys.stderr, flush=True)


STARTED = time.perf_counter()


def device_facts() -> dict[str, Any]:
    import jax

    dev = jax.devices()[0]
    stats = dev.memory_stats() if hasattr(dev, "memory_stats") else None
    return {"platform": dev.platform, "kind": dev.device_kind, "count": jax.device_count(),
            "jax": jax.__version__, "memory": {k: stats[k] for k in ("bytes_in_use", "peak_bytes_in_use",
                                                                      "bytes_limit") if k in stats} if stats else None}


def measure(args: argparse.Namespace) -> dict[str, Any]:
    streams = [int(s) for s in args.streams.split(",") if s]
    count, length = (int(x) for x in args.prompt_rows.split("x")) if args.prompt_rows else (0, 0)
    slots = max(streams + [count, 1])
    engine, init_s = build(args.config, args.dtype, slots, args.seed, args.backend, args.moe, args.layers,
                           args.attention, args.products)
    import os

    progress(f"built in {init_s:.1f} s; compiling (NPROC={os.environ.get('NPROC')!r}, "
             f"XLA_FLAGS={os.environ.get('XLA_FLAGS')!r}, {len(os.sched_getaffinity(0))} CPUs)")
    begin = time.perf_counter()
    compiled = engine.compile()
    compile_s = time.perf_counter() - begin
    progress(f"compiled in {compile_s:.1f} s: {', '.join(f'{k} {v:.1f}' for k, v in compiled.items())}")
    backend = getattr(engine.model, "backend", None)
    out: dict[str, Any] = {
        "config": args.config, "dtype": args.dtype, "params_init_s": round(init_s, 3),
        "compile_s": {k: round(v, 3) for k, v in compiled.items()}, "compile_total_s": round(compile_s, 3),
        "engine": {"slots": engine.slots, "max_rows": engine.max_rows, "tile": getattr(engine, "tile", None),
                   "sequence_len": engine.sequence_len, "backend": getattr(backend, "name", None),
                   "products": getattr(getattr(backend, "products", None), "value", None),
                   "scan_layers": getattr(backend, "scan_layers", None)},
        "points": []}
    d = Driver(engine, args.seed)
    todo: list[Callable[[], dict[str, Any] | None]] = []
    if count:
        todo.append(lambda: prompts_point(d, count, length, args.prompt_runs))
    todo.append(lambda: fill_slots(d, args.decode_prompt))
    todo += [lambda n=n: decode_point(d, n, args.runs) for n in streams]
    if args.long_prompt:
        todo.append(lambda: long_point(d, args.long_prompt, args.long_runs))
    out["errors"] = []
    for point in todo:
        try:
            result = point()
        except Exception as e:  # noqa: BLE001 - a point that fails (out of memory, say) is reported, the rest run
            out["errors"].append(f"{type(e).__name__}: {str(e)[:500]}")
            continue
        if result is not None:
            out["points"].append(result)
            progress(f"{result['name']}: {result['ms']:.3f} ms (first {result['first_s']:.2f} s)")
    out["device"] = device_facts()
    return out


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True, help="model config JSON")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    p.add_argument("--streams", default="1,8,64", help="decode points: streams, comma-separated")
    p.add_argument("--prompt-rows", default="8x32", help="the prompts point, PROMPTSxTOKENS ('' for none)")
    p.add_argument("--decode-prompt", type=int, default=32, help="tokens of each decoding slot's prompt")
    p.add_argument("--long-prompt", type=int, default=2048, help="tokens of the long prompt (0: none)")
    p.add_argument("--runs", type=int, default=10, help="timed decode steps per point (median)")
    p.add_argument("--prompt-runs", type=int, default=5)
    p.add_argument("--long-runs", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--backend", default="auto", help="as the model service's --backend (auto: the platform's)")
    p.add_argument("--moe", default="auto", help="as the model service's --moe (auto: the backend's choice)")
    p.add_argument("--layers", default="auto", help="as the model service's --layers (auto: scan on the generic "
                   "backend)")
    p.add_argument("--attention", default="auto", help="as the model service's --attention (auto: batched)")
    p.add_argument("--products", default="auto", help="as the model service's --products (int8: int8 rows on the "
                   "matrix unit, the generic backend's opt-in)")
    return p


def main(argv: list[str] | None = None) -> int:
    from benchmarks.stack import use_model_xla_flags

    use_model_xla_flags()  # the model service's process settings, before JAX computes
    print(json.dumps(measure(parser().parse_args(argv))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
