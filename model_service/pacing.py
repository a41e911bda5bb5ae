"""How much prompt a step takes while other requests decode, from the step times measured so far.

A step that decodes running streams and also computes prompt rows takes longer than the decode alone; the
streams' inter-token gap is that step's time. `Pacing` keeps two running estimates, the time of a step that
only decodes (`decode`) and the time one prompt row adds (`per_row`), and gives prompts `budget()` rows' worth
so that a mixed step takes at most `slowdown` times a decode step (`--decode-slowdown`): a long prompt entering
slows the running streams' typical step by at most that much, on any machine, and still progresses by at least
MIN_ROWS rows a step. Until both estimates exist, prompts get `initial` rows. The factor moves the median gap
while a long prompt is computed, not the streams' slowest gaps: on a 2-core CPU decode steps alone already
take 1.4-1.7x their median at the 99th percentile, and a smaller factor only makes the prompt take longer
(docs/performance.md, "the long prompt").

A row's cost grows with its position: it attends to every key before it. One row at position p costs
1 + p / key_scale row-equivalents, key_scale being the number of keys whose attention costs as much as a row's
products (`key_scale` of a model config). No JAX, no clock: the scheduler feeds it measurements.
"""

from __future__ import annotations

from dataclasses import dataclass

from model_service.config import ModelConfig

DEFAULT_SLOWDOWN = 1.8  # a mixed step takes at most this many times a decode-only step
MIN_ROWS = 4.0  # prompts progress at least this much per step
SMOOTHING = 0.25  # weight of the newest measurement in the running estimates


def key_scale(cfg: ModelConfig) -> float:
    """Keys whose attention (scores and values over every query head and layer) costs one row's products."""
    t = cfg.model
    per_key = 2 * t.num_q_heads * t.key_size
    products = (t.emb_size * (t.num_q_heads + 2 * t.num_kv_heads) * t.key_size + t.num_q_heads * t.key_size
                * t.emb_size + t.num_selected_experts * 3 * t.emb_size * t.ffn_size + t.emb_size * t.num_experts)
    return products / per_key


def chunk_rows(start: int, length: int, budget: float, scale: float) -> int:
    """How many rows from position `start` (at most length - start, at least one) fit `budget` row-equivalents:
    n rows cost n + (n * start + n * (n - 1) / 2) / scale."""
    n, cost = 0, 0.0
    while start + n < length:
        cost += 1 + (start + n) / scale
        if cost > budget and n > 0:
            break
        n += 1
    return n


@dataclass
class Pacing:
    initial: float  # prompt row-equivalents per step until the estimates exist
    ceiling: float  # never more than this (the step's rows)
    decode: float | None = None  # seconds of a step that only decodes
    per_row: float | None = None  # seconds a prompt row-equivalent adds to a step
    slowdown: float = DEFAULT_SLOWDOWN  # a mixed step's time over a decode-only step's, at most

    def observe(self, seconds: float, decoding: bool, prompt_cost: float) -> None:
        """A step of `seconds` that decoded (or not) and computed `prompt_cost` row-equivalents of prompt."""
        if not decoding or seconds <= 0:
            return
        if prompt_cost == 0:
            self.decode = seconds if self.decode is None else self.decode + SMOOTHING * (seconds - self.decode)
        elif self.decode is not None:
            added = max(0.0, seconds - self.decode) / prompt_cost
            self.per_row = added if self.per_row is None else self.per_row + SMOOTHING * (added - self.per_row)

    def budget(self) -> float:
        """Prompt row-equivalents the next step may take while something decodes."""
        if self.decode is None or not self.per_row:
            return min(self.initial, self.ceiling)
        return min(self.ceiling, max(MIN_ROWS, (self.slowdown - 1) * self.decode / self.per_row))
