"""Probe the generic backend's expert forms on the device at hand: one MoE layer's experts for a step of rows.

    python -m benchmarks.moe_probe                       # on the TPU host: Grok-1 width and medium, bf16
    python -m benchmarks.moe_probe --dtype float32       # the faithful mode (the kernel's three bf16 passes)
    python -m benchmarks.moe_probe --small               # anywhere (CPU: the kernel in interpret mode)

For each width and row count (default 1, 8, 64, 256 rows, top-2 routing drawn at random) it times:
  pallas (tm,tk,tn)   grouped.experts_sorted with the Pallas kernel (int8 widened in its tiles), a few tilings;
  ragged              grouped.experts_sorted with jax.lax.ragged_dot on the dequantised stack (XLA widens first);
  cond                moe.experts_by_cond over one buffer per expert (today's generic decode form).
Each line of JSON gives the median ms over --iters calls, the bytes of the experts the rows actually select
(3 int8 matrices and their scales per selected expert) and that over the time (GB/s; v5e's HBM: ~819 GB/s),
and the largest difference from cond's output relative to its largest value (a check that the kernel compiled
right on the chip). Weights are random int8 drawn on the device; stacked and per-expert forms are held one
after the other, not together (Grok-1 width: 4.8 GB each).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.results import emit
from model_service.config import load_model_config
from model_service.kernels.tpu.grouped_matmul import Tiling
from model_service.model.grouped import GroupedExperts, experts_sorted
from model_service.model.layers import ExpertStack, Products, QuantizedWeight
from model_service.model.moe import ExpertWeights, Routing, experts_by_cond
from model_service.model.weights import GroupedWeight

WIDTHS = {"grok1": (6144, 32768, 8, 2), "medium": (512, 2736, 8, 2), "small": (256, 688, 8, 2)}  # d, f, E, k
MEDIUM = pathlib.Path("../shared/bench/medium.json")  # checked against WIDTHS["medium"] where present
TILINGS = ((128, 1024, 2048), (128, 512, 1024), (64, 1024, 2048), (128, 2048, 2048))  # (tm, tk, tn)
MATRICES = ((0, 1, 1), (0, 1, 1), (1, 0, 8))  # (K is f?, N is f?, scale blocks): linear, linear_v, linear_1


def _shapes(d: int, f: int) -> list[tuple[int, int, int]]:
    return [(f if kf else d, f if nf else d, blocks) for kf, nf, blocks in MATRICES]


def _matrix(key: jax.Array, e: int, k: int, n: int, blocks: int) -> tuple[jax.Array, jax.Array]:
    """Expert e's int8 [K, N] and scales [blocks, N] (bfloat16 values), the same whichever form asks."""
    kw, ks = jax.random.split(jax.random.fold_in(key, e))
    weight = jax.random.randint(kw, (k, n), -127, 128, jnp.int32).astype(jnp.int8)
    scales = jax.random.uniform(ks, (blocks, n), jnp.float32, 0.9, 1.1) / (127 * np.sqrt(k))
    return weight, scales.astype(jnp.bfloat16).astype(jnp.float32)


def stacked_experts(key: jax.Array, d: int, f: int, e: int) -> GroupedExperts:
    out = []
    for i, (k, n, blocks) in enumerate(_shapes(d, f)):
        # lax.map: one expert's temporaries at a time (a vmap would hold [E, K, N] int32 bits: 6.4 GB at Grok-1)
        make = jax.jit(lambda kk, k=k, n=n, blocks=blocks: jax.lax.map(
            lambda j: _matrix(kk, j, k, n, blocks), jnp.arange(e)))
        out.append(GroupedWeight(*make(jax.random.fold_in(key, i))))
    return GroupedExperts(*out)


def per_expert(key: jax.Array, d: int, f: int, e: int) -> ExpertWeights:
    """The same matrices one buffer per expert in layers.QuantizedWeight's layout (column-parallel [N, K])."""
    out = []
    for i, (k, n, blocks) in enumerate(_shapes(d, f)):
        def one(kk: jax.Array, j: int, k: int = k, n: int = n, blocks: int = blocks) -> QuantizedWeight:
            w, s = _matrix(kk, j, k, n, blocks)
            return QuantizedWeight(w.T if blocks == 1 else w, s)
        make = jax.jit(one, static_argnums=1)
        out.append(ExpertStack(tuple(make(jax.random.fold_in(key, i), j) for j in range(e))))
    return ExpertWeights(*out)


def _time(fn: Callable[..., Any], args: tuple[Any, ...], iters: int) -> tuple[float, float, Any]:
    start = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    compile_s = time.perf_counter() - start
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times), compile_s, out


def selected_bytes(experts: np.ndarray, d: int, f: int) -> int:
    """Bytes of the experts some row selected: 3 int8 matrices and their float32 scales each."""
    per = sum(k * n + blocks * n * 4 for k, n, blocks in _shapes(d, f))
    return len(np.unique(experts)) * per


def _inputs(rng: np.random.Generator, m: int, d: int, e: int, top: int, dtype: Any) -> tuple[jax.Array, ...]:
    x = jnp.asarray(rng.standard_normal((m, d)), dtype)
    probs = jax.nn.softmax(jnp.asarray(rng.standard_normal((m, e)) * 2, jnp.float32), axis=-1)
    gates, experts = jax.lax.top_k(probs, top)
    return x, experts.astype(jnp.int32), gates


def probe(name: str, d: int, f: int, e: int, top: int, rows: list[int], dtype: Any, tilings: list[Tiling],
          iters: int, pallas: str, others: bool = True) -> list[dict[str, Any]]:
    key = jax.random.PRNGKey(0)
    inputs = {m: _inputs(np.random.default_rng(m), m, d, e, top, dtype) for m in rows}
    results: list[dict[str, Any]] = []
    outputs: dict[tuple[int, str], np.ndarray] = {}

    def record(m: int, form: str, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        try:
            ms, compile_s, out = _time(fn, args, iters)
        except Exception as err:  # a tiling the chip refuses: say so and go on with the others
            results.append({"width": name, "rows": m, "form": form, "error": f"{type(err).__name__}: {err}"[:400]})
            return
        outputs[(m, form)] = np.asarray(out, np.float32)
        nbytes = selected_bytes(np.asarray(inputs[m][1]), d, f)
        results.append({"width": name, "rows": m, "form": form, "dtype": jnp.dtype(dtype).name, "ms": round(ms, 4),
                        "compile_s": round(compile_s, 1), "selected_bytes": nbytes,
                        "gb_per_s": round(nbytes / ms / 1e6, 2)})
        print(json.dumps(results[-1]), file=sys.stderr, flush=True)

    w = stacked_experts(key, d, f, e)
    for m in rows:
        for t in tilings:
            fn = jax.jit(lambda x, ex, g, w, t=t: experts_sorted(x, ex, g, w, None, pallas, t))
            record(m, f"pallas {tuple(t)}", fn, (*inputs[m], w))
        if others:
            record(m, "ragged", jax.jit(lambda x, ex, g, w: experts_sorted(x, ex, g, w, None, "ragged")),
                   (*inputs[m], w))
    del w
    if not others:  # the tilings checked against the first one instead of cond
        for r in results:
            ref, out = outputs.get((r["rows"], f"pallas {tuple(tilings[0])}")), outputs.get((r["rows"], r["form"]))
            if ref is not None and out is not None:
                r["max_diff_vs_first_tiling"] = float(np.abs(out - ref).max() / max(np.abs(ref).max(), 1e-30))
        return results
    w_cond = per_expert(key, d, f, e)
    for m in rows:
        fn = jax.jit(lambda x, ex, g, w: experts_by_cond(x, Routing(g, ex), w, None, Products.DOT))
        record(m, "cond", fn, (*inputs[m], w_cond))
    for r in results:
        ref, out = outputs.get((r["rows"], "cond")), outputs.get((r["rows"], r["form"]))
        if ref is not None and out is not None:
            r["max_diff_vs_cond"] = float(np.abs(out - ref).max() / max(np.abs(ref).max(), 1e-30))
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true", help="small shapes (d=256, f=688) at 1 and 8 rows")
    parser.add_argument("--widths", default="grok1,medium", help="comma list of grok1, medium, small")
    parser.add_argument("--rows", default=None, help="comma list of row counts (default 1,8,64,256)")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--tilings", default=None, help="kernel tilings tm:tk:tn[:widen],... (default: a few)")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--pallas-only", action="store_true", help="time the kernel's tilings only (no ragged, cond)")
    parser.add_argument("--out", default=None, help="also write the JSON here")
    args = parser.parse_args(argv)
    on_tpu = jax.devices()[0].platform == "tpu"
    widths = ["small"] if args.small else args.widths.split(",")
    rows = [int(r) for r in (args.rows or ("1,8" if args.small else "1,8,64,256")).split(",")]
    tilings = [Tiling(*(int(v) for v in t.split(":"))) for t in args.tilings.split(",")] if args.tilings else \
        [Tiling(*t) for t in (TILINGS[:2] if args.small else TILINGS)]
    results = []
    for name in widths:
        shape = WIDTHS[name]
        if name == "medium" and MEDIUM.exists():
            t = load_model_config(str(MEDIUM)).model
            shape = (t.emb_size, t.ffn_size, t.num_experts, t.num_selected_experts)
        results += probe(name, *shape, rows, jnp.dtype(args.dtype), tilings, args.iters,
                         "pallas" if on_tpu else "pallas_interpret", not args.pallas_only)
    report = {"device": str(jax.devices()[0].device_kind), "jax": jax.__version__, "python": platform.python_version(),
              "pallas_interpret": not on_tpu, "results": results}
    emit(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
