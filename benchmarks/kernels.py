"""Native kernel vs XLA's products at the medium config's shapes, interleaved in one process; print JSON.

    python -m benchmarks.kernels [--runs 50] [--rows 1,8] [--nucleus]
    python -m benchmarks.kernels --grok [--runs 3] [--rows 1,2,8,32,64,256] [--threads 1 --cpu-time]
        [--shapes expert_linear,expert_linear_1] [--activations int8]

Points: one whole expert (gelu(x W) * (x V) U, W/V 512x2736 column-parallel int8, U 2736x512 row-parallel
with 8 block scales) and the float32 unembedding (131072x512), at each row count. Each point alternates
the two forms call by call and reports the median milliseconds of each and their ratio (native / xla).
--nucleus measures the sampler's nucleus threshold instead: one row of the medium vocabulary at top_p 0.9, flat
(normal(0, 0.5)) and peaked (normal(0, 5)) logits, the native call against sampling.py's XLA search.
--grok measures the native products alone at Grok-1's shapes (emb 6,144, experts 32,768 wide, 48/8 heads of
128, vocabulary 131,072), each "before" (the rows form for every row count: the kernel as it was, bit for bit)
against "after" (the form the kernel picks, `auto`), alternating call by call: the experts' column-parallel
and row-parallel int8 matrices, the attention's, and the unembedding table in float32, in bfloat16 (the
released checkpoint's type; before = the float32 table, the only one there was) and in 13 bits a value (the
same bfloat16 values, pack_bf16_in_13; before = the bfloat16 table). ms (median) and GFLOP/s. With
--activations int8 the int8 matrices' "after" rounds the rows to int8 first (the opt-in `--products native-int8`),
so the point reads what the int8 product gains over the exact float32 one.
Run it on a quiet machine: it measures wall time. `load` records the 1-minute load average before and after.
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
from model_service.host_memory import huge_pages
from model_service.model.layers import ExpertStack, Products, QuantizedWeight, product
from model_service.model.moe import ExpertWeights, _expert_rows
from model_service.model.packed import LANES, PackedWeight, pack_bf16_in_13, pack_float, pack_quantized
from model_service.sampling import _search_threshold_probs

EMB, FFN, VOCAB = 512, 2736, 131072


def _expert(rng: np.random.Generator) -> tuple[ExpertWeights, ExpertWeights]:
    """One expert as XLA's layout (one-expert stacks) and packed."""
    def q(k: int, n: int, blocks: int) -> QuantizedWeight:
        w = rng.integers(-127, 128, (k, n), dtype=np.int8)
        s = rng.uniform(0.5, 1.5, (blocks, n)).astype(np.float32) / 127 / np.sqrt(k)
        return QuantizedWeight(w.T.copy() if blocks == 1 else w, s)
    mats = [q(EMB, FFN, 1), q(EMB, FFN, 1), q(FFN, EMB, 8)]
    xla = ExpertWeights(*(ExpertStack((jax.tree.map(jnp.asarray, m),)) for m in mats))
    packed = ExpertWeights(*(ExpertStack((jax.tree.map(jnp.asarray, pack_quantized(m, None)),)) for m in mats))
    return xla, packed


def _unembedding(rng: np.random.Generator) -> tuple[jax.Array, PackedWeight]:
    """The float32 table [V, D] as XLA's product reads it ([N, K]) and packed as the model packs it."""
    table = rng.standard_normal((VOCAB, EMB), dtype=np.float32) * 0.02
    return jnp.asarray(table), jax.tree.map(jnp.asarray, pack_float(table.T, None, table=True))


def _interleaved(fns: dict[str, Callable[[], Any]], runs: int,
                 clock: Callable[[], float] = time.perf_counter) -> dict[str, float]:
    for fn in fns.values():
        jax.block_until_ready(fn())  # compile + warm
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(runs):
        for name, fn in fns.items():
            start = clock()
            jax.block_until_ready(fn())
            times[name].append(clock() - start)
    return {name: round(statistics.median(t) * 1e3, 4) for name, t in times.items()}


def _nucleus_points(rng: np.random.Generator, runs: int) -> list[dict[str, Any]]:
    """One row's threshold per call, as the sampler takes it (one call per slot inside lax.map)."""
    native, xla = jax.jit(kernels.nucleus_threshold), jax.jit(_search_threshold_probs)
    points = []
    for name, scale in (("flat", 0.5), ("peaked", 5.0)):
        logits = jnp.asarray(rng.normal(0, scale, VOCAB), jnp.float32)
        probs, top_p = jax.nn.softmax(logits), jnp.float32(0.9)
        fns = {"xla": lambda: xla(logits, probs, top_p), "native": lambda: native(logits, probs, top_p)}
        ms = _interleaved(fns, runs)
        points.append({"shape": f"nucleus_{name}", "rows": 1, "xla_ms": ms["xla"], "native_ms": ms["native"],
                       "ratio": round(ms["native"] / ms["xla"], 3)})
    return points


GROK_EMB, GROK_FFN, GROK_QKV, GROK_KV = 6144, 32768, 48 * 128, 8 * 128
# name: (K, N, scale blocks); int8 weights
GROK_INT8 = {"expert_linear": (GROK_EMB, GROK_FFN, 1), "expert_linear_1": (GROK_FFN, GROK_EMB, 8),
             "attn_query": (GROK_EMB, GROK_QKV, 1), "attn_key_value": (GROK_EMB, GROK_KV, 1),
             "attn_output": (GROK_QKV, GROK_EMB, 8)}


def _grok_weights(rng: np.random.Generator,
                  shapes: list[str] | None = None) -> dict[str, tuple[jax.Array, jax.Array | None, int, int]]:
    """name -> (packed weight [N/16, K, 16], scales or None, K, N) on the device, random (the table's forms only
    where `shapes` asks for one of them)."""
    out: dict[str, tuple[jax.Array, jax.Array | None, int, int]] = {}
    for name, (k, n, blocks) in GROK_INT8.items():
        w = rng.integers(-127, 128, (n // LANES, k, LANES), dtype=np.int8)
        s = rng.uniform(0.5, 1.5, (blocks, n)).astype(np.float32) / 127 / np.sqrt(k)
        out[name] = (jnp.asarray(w), jnp.asarray(s), k, n)
    if shapes is not None and not any(name.startswith("table") for name in shapes):
        huge_pages(list(out.values()))
        return out
    host = np.empty((VOCAB // LANES, GROK_EMB, LANES), np.float32)  # 3.2 GB: drawn and scaled in place
    rng.standard_normal(dtype=np.float32, out=host)
    host *= 0.02
    table = jnp.asarray(host)
    del host
    out["table_f32"] = (table, None, GROK_EMB, VOCAB)
    out["table_bf16"] = (table.astype(jnp.bfloat16), None, GROK_EMB, VOCAB)
    # The same bfloat16 values held in 13 bits (pack_bf16_in_13 reads the table [V, D]).
    rows = np.asarray(out["table_bf16"][0]).transpose(0, 2, 1).reshape(VOCAB, GROK_EMB)
    held = pack_bf16_in_13(rows)
    del rows
    if held is not None:
        out["table_in_13"] = (jnp.asarray(held[0]), jnp.asarray(held[1]), GROK_EMB, VOCAB)
    huge_pages(list(out.values()))  # as the service backs its weights (--huge-pages): reads vary less
    return out


def _grok_points(rng: np.random.Generator, rows: list[int], runs: int, threads: int,
                 cpu_time: bool, shapes: list[str] | None = None, activations: str = "float32") -> list[dict[str, Any]]:
    weights = _grok_weights(rng, shapes)
    program = jax.jit(kernels.matmul, static_argnames=("n_out", "form", "threads", "activations"))
    clock = time.process_time if cpu_time else time.perf_counter
    points = []
    for m in rows:
        x = jnp.asarray(rng.standard_normal((m, GROK_EMB), dtype=np.float32))
        x_ffn = jnp.asarray(rng.standard_normal((m, GROK_FFN), dtype=np.float32))
        for name, (w, s, k, n) in weights.items():
            if shapes is not None and name not in shapes:
                continue
            before = {"table_bf16": "table_f32", "table_in_13": "table_bf16"}.get(name)
            before = w if before is None else weights[before][0]
            xs = x_ffn if k == GROK_FFN else x
            if name == "table_in_13":  # its s is the dictionary, not scales
                held, scales = {"dictionary": s}, None
            else:
                held, scales = ({"activations": activations} if name in GROK_INT8 else {}), s
            fns = {"before": lambda: program(xs, before, scales, n_out=n, form="rows", threads=threads),
                   "after": lambda: program(xs, w, scales, n_out=n, form="auto", threads=threads, **held)}
            ms = _interleaved(fns, runs, clock)
            gflop = 2 * m * k * n / 1e9
            points.append({"shape": name, "k": k, "n": n, "rows": m, "before_ms": ms["before"], "after_ms": ms["after"],
                           "before_gflops": round(gflop / ms["before"] * 1e3, 1),
                           "after_gflops": round(gflop / ms["after"] * 1e3, 1),
                           "ratio": round(ms["after"] / ms["before"], 3)})
            print(json.dumps(points[-1]), file=sys.stderr, flush=True)
    return points


def run(args: argparse.Namespace) -> dict[str, Any]:
    if not kernels.available():
        raise SystemExit("native kernels are not available (pip install -e . builds them)")
    rng = np.random.default_rng(0)
    if args.grok:
        load_before = os.getloadavg()[0]
        points = _grok_points(rng, args.rows, args.runs, args.threads, args.cpu_time, args.shapes, args.activations)
        return {"isa": kernels.supported_isas()[-1], "activations": args.activations, "runs": args.runs, "cpus": os.cpu_count(),
                "threads": args.threads or "all", "clock": "process cpu time" if args.cpu_time else "wall",
                "load": [round(load_before, 2), round(os.getloadavg()[0], 2)], "points": points}
    if args.nucleus:
        load_before = os.getloadavg()[0]
        points = _nucleus_points(rng, args.runs)
        load = [round(load_before, 2), round(os.getloadavg()[0], 2)]
        return {"runs": args.runs, "cpus": os.cpu_count(), "load": load, "points": points}
    xla_w, packed_w = _expert(rng)
    table, packed_table = _unembedding(rng)
    load_before = os.getloadavg()[0]
    points = []
    for m in args.rows:
        x = jnp.asarray(rng.standard_normal((m, EMB), dtype=np.float32))
        expert_xla = jax.jit(lambda x, w: _expert_rows(x, w, 0, Products.FUSED_REDUCE))
        expert_native = jax.jit(lambda x, w: _expert_rows(x, w, 0, Products.NATIVE))
        unembed_xla = jax.jit(lambda x, t: product(x, t, Products.FUSED_REDUCE))
        unembed_native = jax.jit(lambda x, t: product(x, t, Products.NATIVE))
        for shape, fns in (("expert", {"xla": lambda: expert_xla(x, xla_w), "native": lambda: expert_native(x, packed_w)}),
                           ("unembedding", {"xla": lambda: unembed_xla(x, table),
                                            "native": lambda: unembed_native(x, packed_table)})):
            ms = _interleaved(fns, args.runs)
            points.append({"shape": shape, "rows": m, "xla_ms": ms["xla"], "native_ms": ms["native"],
                           "ratio": round(ms["native"] / ms["xla"], 3)})
    return {"isa": kernels.supported_isas()[-1], "lanes": LANES, "runs": args.runs, "cpus": os.cpu_count(),
            "load": [round(load_before, 2), round(os.getloadavg()[0], 2)], "points": points}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.kernels", description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=50, help="calls of each form per point (median reported)")
    p.add_argument("--rows", type=lambda s: [int(v) for v in s.split(",")], default=[1, 8], help="e.g. 1,8")
    p.add_argument("--nucleus", action="store_true", help="measure the nucleus threshold instead of the products")
    p.add_argument("--grok", action="store_true", help="the native products alone at Grok-1's shapes, before/after")
    p.add_argument("--shapes", type=lambda s: s.split(","), default=None,
                   help="--grok: only these points, e.g. table_bf16,table_in_13 (default: every one)")
    p.add_argument("--activations", choices=tuple(kernels.ACTIVATIONS), default="float32",
                   help="--grok: int8 rounds the rows to int8 in the after form of the int8 weights (the opt-in "
                        "--products native-int8; gflops then count int8 multiply-adds x 2); before stays float32 rows")
    p.add_argument("--threads", type=int, default=0, help="--grok: kernel threads (default 0: XLA's pool, all cores)")
    p.add_argument("--cpu-time", action="store_true",
                   help="--grok: time by process CPU time (with --threads 1: one core's rate even on a busy box; "
                        "bandwidth-bound points then count their memory stalls)")
    return p


def main(argv: list[str] | None = None) -> int:
    print(json.dumps(run(parser().parse_args(argv))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
