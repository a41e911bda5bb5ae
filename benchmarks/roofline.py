"""Decode-step roofline: bytes one decode step must read, over the read bandwidth this machine
reaches (measured in the same run), against the measured step time (benchmarks.step).

    python -m benchmarks.roofline --config ../shared/bench/medium.json --batch 1,8

Bytes come from the model config alone: every attention matrix (int8, float32 scales), the experts
the batch's tokens route to (top-k of E per token; for a batch, the expected number of distinct
experts under uniform routing, E * (1 - (1 - k/E)^B)), router and norms, the embedding rows of the
batch and the whole tied unembedding table (compute dtype), and the KV cache of every slot over the
whole context (the step attends over fixed-shape memory). Bandwidth is a jitted sum over a 256 MiB
float32 array (what XLA streams from memory) and, for the int8 weights, a jitted convert-and-sum of
256 MiB of int8 (the conversion, not the memory, limits int8 on CPU); the bound uses the best of the
runs. A config whose bytes fit the CPU caches (golden: ~2-5 MB) is not bound by memory at all.
"""

from __future__ import annotations

import json
import pathlib
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import results, step
from benchmarks.stack import use_model_xla_flags
from model_service.config import ModelConfig, load_model_config
from serving_common.flags import EnvArgumentParser, positive_int

F32 = 4
ROW_BLOCKS = 8  # row-parallel int8 matrices carry 8 scale blocks


def expected_experts(cfg: ModelConfig, batch: int) -> float:
    """Distinct experts per layer that `batch` tokens select, expected under uniform top-k routing."""
    e, k = cfg.model.num_experts, cfg.model.num_selected_experts
    return e * (1.0 - (1.0 - k / e) ** batch)


def step_bytes(cfg: ModelConfig, batch: int, experts: float, dtype_bytes: int = F32) -> dict[str, float]:
    """Bytes read by one decode step, by part; int8 weights apart from everything else."""
    t = cfg.model
    d, f, layers = t.emb_size, t.ffn_size, t.num_layers
    q_width, kv_width = t.num_q_heads * t.key_size, t.num_kv_heads * t.key_size
    attention_int8 = layers * (2 * d * q_width + 2 * d * kv_width)  # query, output; key, value
    attention_scales = layers * F32 * (q_width + 2 * kv_width + ROW_BLOCKS * d)
    expert_int8 = 3 * d * f  # linear, linear_v [d, f]; linear_1 [f, d]
    expert_scales = F32 * (2 * f + ROW_BLOCKS * d)
    return {
        "attention_int8": float(attention_int8),
        "moe_int8": layers * experts * expert_int8,
        "scales": attention_scales + layers * experts * expert_scales,
        "router_and_norms": float(layers * (d * t.num_experts + 4 * d) * F32 + d * F32),
        "embedding_rows": float(batch * d * dtype_bytes),
        "unembedding": float(cfg.vocab_size * d * dtype_bytes),
        "kv_cache": float(layers * 2 * batch * t.num_kv_heads * cfg.sequence_len * t.key_size * dtype_bytes),
    }


def weight_bytes(cfg: ModelConfig, dtype_bytes: int = F32) -> float:
    """Bytes of all parameters in memory (every expert, the table once): checks step_bytes' terms."""
    parts = step_bytes(cfg, 0, cfg.model.num_experts, dtype_bytes)
    return sum(v for k, v in parts.items() if k not in ("embedding_rows", "kv_cache"))


def _times(fn: Any, arg: Any, runs: int) -> list[float]:
    jax.block_until_ready(fn(arg))
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        jax.block_until_ready(fn(arg))
        times.append(time.perf_counter() - start)
    return times


def read_bandwidth(mib: int = 256, runs: int = 10) -> dict[str, float]:
    """GB/s of a jitted float32 sum and of a jitted int8 -> float32 convert-and-sum: the best run (the
    bound the machine can reach; on a shared machine other runs lose the cores) and the median."""
    n_bytes = mib << 20
    f32 = jnp.asarray(np.ones(n_bytes // F32, np.float32))
    i8 = jnp.asarray(np.ones(n_bytes, np.int8))
    t_f32 = _times(jax.jit(jnp.sum), f32, runs)
    t_i8 = _times(jax.jit(lambda a: jnp.sum(a.astype(jnp.float32))), i8, runs)
    return {"bytes": float(n_bytes), "runs": runs,
            "f32_sum_gb_s": n_bytes / min(t_f32) / 1e9, "int8_convert_sum_gb_s": n_bytes / min(t_i8) / 1e9,
            "f32_sum_median_gb_s": n_bytes / statistics.median(t_f32) / 1e9,
            "int8_convert_sum_median_gb_s": n_bytes / statistics.median(t_i8) / 1e9}


def roofline(cfg: ModelConfig, batch: int, bandwidth: dict[str, float], measured_ms: float,
             dtype_bytes: int = F32) -> dict[str, Any]:
    parts = step_bytes(cfg, batch, expected_experts(cfg, batch), dtype_bytes)
    total = sum(parts.values())
    int8 = parts["attention_int8"] + parts["moe_int8"]
    f32_bw, i8_bw = bandwidth["f32_sum_gb_s"] * 1e9, bandwidth["int8_convert_sum_gb_s"] * 1e9
    bound_ms = total / f32_bw * 1e3
    int8_aware_ms = ((total - int8) / f32_bw + int8 / i8_bw) * 1e3
    return {"batch": batch, "experts_per_layer": expected_experts(cfg, batch), "bytes": parts, "total_mb": total / 1e6,
            "roofline_ms": bound_ms, "int8_aware_bound_ms": int8_aware_ms, "measured_step_ms": measured_ms,
            "measured_over_roofline": measured_ms / bound_ms, "measured_over_int8_aware": measured_ms / int8_aware_ms,
            "measured_tokens_per_s": batch / measured_ms * 1e3, "roofline_tokens_per_s": batch / bound_ms * 1e3,
            "fits_in_cache": total < 32e6}


def run(config: str, batches: Sequence[int], runs: int, dtype: str = "float32") -> dict[str, Any]:
    cfg = load_model_config(config)
    bandwidth = read_bandwidth()
    rows = []
    for batch in batches:
        measured = step.run(step.parser().parse_args(["--config", config, "--batch", str(batch), "--dtype", dtype,
                                                      "--runs", str(runs)]))
        dtype_bytes = jnp.dtype(dtype).itemsize
        rows.append({**roofline(cfg, batch, bandwidth, measured["decode_step_ms"], dtype_bytes), "step": measured})
    return {"benchmark": "roofline", "config": config, "dtype": dtype, "bandwidth": bandwidth,
            "bandwidth_after": read_bandwidth(), "weights_mb": weight_bytes(cfg) / 1e6, "rows": rows,
            **results.provenance()}


def main(argv: Sequence[str] | None = None) -> int:
    p = EnvArgumentParser(env_prefix="GROK_BENCH", prog="python -m benchmarks.roofline",
                          description=__doc__.split("\n\n")[0])
    p.add_env_argument("--config", required=True, help="model preset or JSON config")
    p.add_env_argument("--batch", default="1,8", help="batch sizes, comma-separated")
    p.add_env_argument("--runs", type=positive_int, default=10, help="timed decode steps per batch (median)")
    p.add_env_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="compute dtype")
    p.add_env_argument("--out", default=None, help="also write the JSON here")
    args = p.parse_args(argv)
    use_model_xla_flags()
    report = run(args.config, [int(b) for b in args.batch.split(",")], args.runs, args.dtype)
    if args.out:
        results.write_json(pathlib.Path(args.out), report)
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
