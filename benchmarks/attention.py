"""Native paged attention vs XLA's per-row path, interleaved in one process; print JSON.

    python -m benchmarks.attention [--runs 10] [--shapes medium,grok] [--points decode1_256,...] [--isa avx512]

Shapes: medium (Hq 16, Hkv 8, D 32) and Grok-1 (Hq 48, Hkv 8, D 128), float32 pools of 16-position blocks.
Points: one decode row at context 256 / 2048 / 8192 (decode1_N), 8 decode rows of 8 sequences at 256
(decode8_256) and a 64-row prompt chunk of one sequence at positions 0..63, 2048..2111 and 6000..6063
(prompt64_P). Each point alternates the native call (model_service.kernels.attention.paged_attention) with the
jitted layers.paged_attention_rows (the engine's row-invariant XLA path, key chunk 128) call by call and reports
the median milliseconds of each, their ratio (native / xla) and effective GFLOP/s (4 * D flops per visible
(query head, key) pair). Prompt points also time layers.paged_attention of the chunk as one row of 64 queries
(the old prefill path, not row-invariant) for scale. Run it on a quiet machine: `load` records the 1-minute load
average before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from model_service import kernels
from model_service.kernels import attention
from model_service.model.layers import paged_attention, paged_attention_rows

SHAPES = {"medium": (16, 8, 32), "grok": (48, 8, 128)}  # Hq, Hkv, D
BS, CONTEXT, CHUNK, MULT = 16, 8192, 128, 0.08838834764831845
POINTS = {  # name -> (sequences, rows per sequence, first position): rows of one sequence are consecutive
    "decode1_256": (1, 1, 255), "decode1_2048": (1, 1, 2047), "decode1_8192": (1, 1, 8191),
    "decode8_256": (8, 1, 255), "prompt64_0": (1, 64, 0), "prompt64_2048": (1, 64, 2048),
    "prompt64_6000": (1, 64, 6000),
}


class Inputs:
    """A pool holding each sequence's blocks up to its last row (shuffled), the rows' queries and limits."""

    def __init__(self, rng: np.random.Generator, shape: tuple[int, int, int], point: tuple[int, int, int]) -> None:
        hq, hkv, d = shape
        seqs, per, first = point
        table_len = CONTEXT // BS
        used = (first + per - 1) // BS + 1  # blocks each sequence fills
        nblk = seqs * used + 1
        self.k = jnp.asarray(rng.standard_normal((nblk, hkv, BS, d), dtype=np.float32))
        self.v = jnp.asarray(rng.standard_normal((nblk, hkv, BS, d), dtype=np.float32))
        tables = np.full((seqs, table_len), nblk - 1, np.int32)  # unused entries: a spare block
        tables[:, :used] = rng.permutation(seqs * used).reshape(seqs, used)
        self.tables = jnp.asarray(tables)
        self.seq = jnp.asarray(np.repeat(np.arange(seqs), per).astype(np.int32))
        self.limit = jnp.asarray(np.tile(first + np.arange(per), seqs).astype(np.int32))
        rows = seqs * per
        self.q = jnp.asarray(rng.standard_normal((rows, hq, d), dtype=np.float32) / np.sqrt(d))
        self.rows = jnp.ones((rows,), jnp.bool_)
        self.flops = 4 * d * hq * int(np.sum(np.asarray(self.limit) + 1))


def _interleaved(fns: dict[str, Callable[[], Any]], runs: int) -> dict[str, float]:
    for fn in fns.values():
        jax.block_until_ready(fn())  # compile + warm
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(runs):
        for name, fn in fns.items():
            start = time.perf_counter()
            jax.block_until_ready(fn())
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def _forms(x: Inputs, isa: str | None, with_chunk: bool) -> dict[str, Callable[[], Any]]:
    native = jax.jit(lambda q, k, v, t, s, lim, r: attention.paged_attention(q, k, v, t, s, lim, r, MULT, isa=isa))
    rows = jax.jit(lambda q, k, v, t, lim, r: paged_attention_rows(q[:, None], k, v, t, lim[:, None], MULT, CHUNK, r))
    fns: dict[str, Callable[[], Any]] = {
        "native": lambda: native(x.q, x.k, x.v, x.tables, x.seq, x.limit, x.rows),
        "xla_rows": lambda: rows(x.q, x.k, x.v, x.tables[x.seq], x.limit, x.rows),
    }
    if with_chunk:  # the whole chunk as one row of T queries (all rows share sequence 0)
        chunk = jax.jit(lambda q, k, v, t, lim: paged_attention(q[None], k, v, t[:1], lim[None], MULT, CHUNK))
        fns["xla_chunk"] = lambda: chunk(x.q, x.k, x.v, x.tables, x.limit)
    return fns


def run(args: argparse.Namespace) -> dict[str, Any]:
    if not attention.available():
        raise SystemExit("native kernels are not available (pip install -e . builds them)")
    rng = np.random.default_rng(0)
    load_before = os.getloadavg()[0]
    points = []
    for shape_name in args.shapes:
        for name in args.points:
            x = Inputs(rng, SHAPES[shape_name], POINTS[name])
            ms = _interleaved(_forms(x, args.isa, name.startswith("prompt")), args.runs)
            point = {"shape": shape_name, "point": name, "rows": int(x.q.shape[0]),
                     "native_ms": round(ms["native"], 4), "xla_rows_ms": round(ms["xla_rows"], 4),
                     "ratio": round(ms["native"] / ms["xla_rows"], 4),
                     "native_gflops": round(x.flops / ms["native"] / 1e6, 2),
                     "xla_rows_gflops": round(x.flops / ms["xla_rows"] / 1e6, 2)}
            if "xla_chunk" in ms:
                point["xla_chunk_ms"] = round(ms["xla_chunk"], 4)
            points.append(point)
            print(json.dumps(point), file=sys.stderr, flush=True)  # progress: a full run takes minutes
    return {"isa": args.isa or kernels.default_isa(), "supported": list(kernels.supported_isas()), "runs": args.runs,
            "cpus": os.cpu_count(), "load": [round(load_before, 2), round(os.getloadavg()[0], 2)], "points": points}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.attention", description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=10, help="calls of each form per point (median reported)")
    p.add_argument("--shapes", type=lambda s: s.split(","), default=list(SHAPES), help="e.g. medium,grok")
    p.add_argument("--points", type=lambda s: s.split(","), default=list(POINTS), help=f"of {','.join(POINTS)}")
    p.add_argument("--isa", choices=sorted(kernels.ISAS), default=None, help="native path (default: the fastest)")
    return p


def main(argv: list[str] | None = None) -> int:
    print(json.dumps(run(parser().parse_args(argv))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
