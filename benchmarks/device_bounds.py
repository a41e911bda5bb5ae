"""Each device point's own bound, from the model config alone: the bytes its work must read at the chip's memory
bandwidth, and the FLOPs that count at the chip's peak (benchmarks.device).

Bytes (benchmarks.roofline.step_bytes' parts, the KV term replaced by the KV in use):
  experts     the experts the point's rows select: the expected number of distinct experts per layer under
              uniform top-k routing, E * (1 - (1 - k/E)^rows) (2 for one decode row, all 8 for a prompt's rows),
              int8, with their float32 scales;
  attention   every layer's query, key, value and output matrices (int8) and their scales;
  table       the vocabulary table, read whole by the unembedding, in the compute dtype (as the model holds it);
  router, norms and the rows' embedding entries;
  kv          KV in use: layers x 2 x kv_heads x key_size x dtype bytes x the tokens the rows' sequences hold.
FLOPs that count: 2 x active parameters x rows (attention matrices, router, the k selected experts; the table for
each drawn row) plus attention's QK and AV products over the keys each row sees (4 x q_heads x key_size a key).
A point's work is a unit (one decode step; a set of prompts however many steps the engine cuts them into: its
weights counted once), and its bound is the larger of the two times.

The chip's figures (TPU v5e): 819e9 B/s of HBM and 197e12 FLOP/s in bfloat16. In float32 the same peak is used:
XLA's default matmul precision on TPU multiplies float32 operands in one bfloat16 pass (../shared/FACTS.md), so a
float32 step that reaches this bound runs at the bfloat16 rate; a faithful float32 mode that multiplies in several
passes shows its cost as a larger ratio.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from benchmarks.roofline import expected_experts, step_bytes
from model_service.config import ModelConfig

HBM_BYTES_PER_S = 819e9
PEAK_FLOPS = 197e12
PEAK_NOTE = ("197e12 FLOP/s (TPU v5e, bfloat16) for both dtypes: XLA's default precision multiplies float32 in one "
             "bfloat16 pass on TPU")


@dataclass(frozen=True)
class Work:
    """What a point computes: `rows` token rows (all of a decode step, or every prompt row), `draws` rows whose
    logits are drawn from, `kv_tokens` tokens its sequences hold, `keys_seen` keys summed over its rows."""

    rows: int
    draws: int
    kv_tokens: float
    keys_seen: float


def kv_bytes_per_token(cfg: ModelConfig, dtype_bytes: int) -> int:
    t = cfg.model
    return t.num_layers * 2 * t.num_kv_heads * t.key_size * dtype_bytes


def read_bytes(cfg: ModelConfig, work: Work, dtype_bytes: int) -> dict[str, float]:
    """Bytes the point must read, by part."""
    experts = expected_experts(cfg, work.rows)
    parts = step_bytes(cfg, work.rows, experts, dtype_bytes)
    return {"experts_int8": parts["moe_int8"], "attention_int8": parts["attention_int8"], "scales": parts["scales"],
            "router_and_norms": parts["router_and_norms"], "embedding_rows": parts["embedding_rows"],
            "table": parts["unembedding"], "kv": work.kv_tokens * kv_bytes_per_token(cfg, dtype_bytes)}


def active_parameters(cfg: ModelConfig) -> int:
    """Parameters one token row multiplies by (the table apart): every layer's attention matrices, its router and
    the k experts it selects."""
    t = cfg.model
    d, f = t.emb_size, t.ffn_size
    attention = 2 * d * t.num_q_heads * t.key_size + 2 * d * t.num_kv_heads * t.key_size
    return t.num_layers * (attention + d * t.num_experts + t.num_selected_experts * 3 * d * f)


def flops(cfg: ModelConfig, work: Work) -> dict[str, float]:
    """FLOPs that count, by part."""
    t = cfg.model
    return {"matrices": 2.0 * active_parameters(cfg) * work.rows,
            "unembedding": 2.0 * cfg.vocab_size * t.emb_size * work.draws,
            "attention": 4.0 * t.num_layers * t.num_q_heads * t.key_size * work.keys_seen}


def bound(cfg: ModelConfig, work: Work, dtype_bytes: int, bandwidth: float = HBM_BYTES_PER_S,
          peak: float = PEAK_FLOPS) -> dict[str, Any]:
    """The point's bound: bytes over `bandwidth` and FLOPs over `peak`, each in ms, and the larger."""
    parts, ops = read_bytes(cfg, work, dtype_bytes), flops(cfg, work)
    total, total_ops = sum(parts.values()), sum(ops.values())
    read_ms, flop_ms = total / bandwidth * 1e3, total_ops / peak * 1e3
    return {"experts_per_layer": expected_experts(cfg, work.rows), "bytes": parts, "total_bytes": total,
            "read_ms": read_ms, "flops": ops, "total_flops": total_ops, "flop_ms": flop_ms,
            "bound_ms": max(read_ms, flop_ms), "bound_by": "memory" if read_ms >= flop_ms else "compute"}


def judged(measured_ms: float, b: dict[str, Any], tokens: int) -> dict[str, float]:
    """The measured time against its bound: the ratio, the shares of the bandwidth and of the peak it reached,
    and tokens a second (decode: the streams' tokens; prompts: the prompt tokens)."""
    return {"over_bound": measured_ms / b["bound_ms"], "bandwidth_share": b["read_ms"] / measured_ms,
            "peak_share": b["flop_ms"] / measured_ms, "tokens_per_s": tokens / measured_ms * 1e3}
