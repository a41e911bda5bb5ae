"""How much prompt a step takes while other requests decode, from the step times measured so far.

A step that decodes running streams and also computes prompt rows takes longer than the decode alone; the streams'
inter-token gap is that step's time. `Pacing` keeps running estimates of the time of a step that only decodes
(`decode`) and of what prompt rows add to it, and gives prompts `budget()` row-equivalents so that a mixed step
takes about `slowdown` times a decode step (`--decode-slowdown`): a long prompt entering slows the running streams'
typical step by at most that much, on any machine, and still progresses by at least `min_rows` (MIN_ROWS)
row-equivalents of rows a step, whatever its keys' read costs. Until the estimates exist, prompts get `initial`
rows. The factor moves the median gap while a long prompt is computed, not the streams' slowest gaps: on a 2-core
CPU decode steps alone already take 1.4-1.7x their median at the 99th percentile (docs/performance.md, "the long
prompt"), so aiming the allowance at a tail would only make the prompt slower without removing the box's own
jitter.

What prompt rows add has two parts. A row's cost grows with its position: it attends to every key before it; one
row at position p costs 1 + p / key_scale row-equivalents, key_scale being the number of keys whose attention
costs as much as a row's products (`key_scale` of a model config); `per_row` is the seconds of one. And a prompt
chunk's sequence has its keys read once a step, whatever its rows (measured on a 2-core CPU, medium at context
8,192, float32, a chunk at position 3,000: ~8 ms for any rows plus ~1.45 ms a row, beside a 17.9 ms decode);
`per_key` is the seconds of one key so read. Priced by rows alone, a few rows far into a prompt looked dear,
and a new prompt at position 0 after them got a fraction of the rows the allowance pays for, while rows priced
at position 0 would overrun the allowance far into a prompt. A long prompt's steps move both together (a few
rows at a slowly growing position), so they cannot be told apart by a joint fit over recent steps: `per_row` is
measured on steps whose chunks held few keys (a prompt's first chunk), and `per_key` on the others as what
they took beyond their rows. The plan (plan.py) charges a chunk's keys at `keys_per_row()` keys to a
row-equivalent.

And a step with any prompt rows may cost a part that does not grow with them (`fixed`): on a TPU v5e, medium in
float32, a decode step of 56 streams took 7.9 ms, the same step with one 32-token prompt entering 17.7 ms and with
eight 24.3 ms (`benchmarks.closed_loop --step-probe`): starting the slots (its program alone 2.8 ms) and what a
step with prompt rows runs beyond a decode step's (3.8 ms at the same row bucket) cost most of it whatever the
rows. Priced by rows alone, that part made a row look dear and the budget one prompt a step, so every step paid it
and prompts queued (docs/benchmarks.md). Where several recent rows-alone steps' costs spread
enough and a line through them (least squares, older steps forgotten) explains their times, it tells the two
apart (a long prompt alone has two such steps, its first chunks, which any line fits: it keeps the ratio); a mixed
step then takes the rows the allowance pays for beyond the fixed part, and where the fixed part alone takes the
allowance, the rows that cost as much as it: each mixed step carries enough prompt to be worth what it costs the
streams. No JAX, no clock: the scheduler feeds it measurements.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from model_service.config import ModelConfig

DEFAULT_SLOWDOWN = 1.8  # a mixed step takes at most this many times a decode-only step
MIN_ROWS = 4.0  # prompts progress at least this many row-equivalents of rows per step (their keys' read aside)
SMOOTHING = 0.25  # weight of the newest measurement in the decode step's running estimate
FEW_KEYS = 1.0  # a step whose prompt chunks held at most this many keys a row-equivalent measures rows alone
FORGET = 0.8  # each older step weighs this much less in the fits of per_key and of fixed / per_row
SPREAD = 0.05  # the rows-alone steps' costs must vary this much (variance over squared mean) to fit a fixed part
FIT_WEIGHT = 2.0  # ... over at least this weight of steps (3 recent ones: two noisy points fit any line)
FIT_R2 = 0.5  # ... and the line must explain half their times' variance (a row bucket makes it a staircase)


def key_scale(cfg: ModelConfig) -> float:
    """Keys whose attention (scores and values over every query head and layer) costs one row's products."""
    t = cfg.model
    per_key = 2 * t.num_q_heads * t.key_size
    products = (t.emb_size * (t.num_q_heads + 2 * t.num_kv_heads) * t.key_size + t.num_q_heads * t.key_size
                * t.emb_size + t.num_selected_experts * 3 * t.emb_size * t.ffn_size + t.emb_size * t.num_experts)
    return products / per_key


def rows_cost(start: int, rows: int, scale: float) -> float:
    """Row-equivalents of rows start .. start + rows - 1 of one sequence (their keys' read not included)."""
    return rows + (rows * start + rows * (rows - 1) / 2) / scale


def chunk_rows(start: int, length: int, budget: float, scale: float, keys_per_row: float = math.inf,
               floor: float = 0.0) -> int:
    """How many rows from position `start` (at most length - start, at least one) fit `budget` row-equivalents:
    n rows cost start / keys_per_row (the sequence's keys, read once) + rows_cost(start, n, scale). Rows whose
    own cost is within `floor` are given even where the keys' read leaves no budget for them."""
    n, cost, own = 0, start / keys_per_row, 0.0
    while start + n < length:
        step = 1 + (start + n) / scale
        cost, own = cost + step, own + step
        if cost > budget and own > floor and n > 0:
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
    per_key: float = 0.0  # seconds a prompt chunk's key adds to a step (its sequence's keys are read once a step)
    min_rows: float = MIN_ROWS  # prompts progress at least this many row-equivalents of rows a step
    rows_alone: bool = False  # per_row was measured on steps whose keys were few (else it holds their cost too)
    fixed: float = 0.0  # seconds a step with prompt rows adds whatever its rows (0 until the costs tell it apart)
    _keys_sq: float = 0.0  # the fit of per_key: sums of keys * keys and keys * added, older steps forgotten
    _keys_by_added: float = 0.0
    _rows_fit: tuple[float, ...] = (0.0,) * 6  # the rows-alone steps' sums: weight, x, x^2, y, x*y, y^2

    def observe(self, seconds: float, decoding: bool, prompt_cost: float, prompt_keys: float = 0.0) -> None:
        """A step of `seconds` that decoded (or not) and computed `prompt_cost` row-equivalents of prompt rows in
        chunks whose sequences held `prompt_keys` keys before them."""
        if not decoding or seconds <= 0:
            return
        if prompt_cost == 0:
            self.decode = _smooth(self.decode, seconds)
            return
        if self.decode is None:
            return
        added = max(0.0, seconds - self.decode)
        if prompt_keys <= FEW_KEYS * prompt_cost or not self.rows_alone:
            # Rows alone (a prompt's first chunk), or nothing better yet: what the rows cost beside the keys.
            alone = prompt_keys <= FEW_KEYS * prompt_cost
            rows_added = max(0.0, added - self.per_key * prompt_keys)
            if alone and self._fit_rows(prompt_cost, rows_added):
                self.rows_alone = True
                return
            self.fixed = 0.0
            self.per_row = _smooth(self.per_row if alone == self.rows_alone else None, rows_added / prompt_cost)
            self.rows_alone = self.rows_alone or alone
        else:
            # The keys' read is what the step took beyond its rows at the rows' own measured cost, fitted by least
            # squares over recent steps: a step's noise over a few keys (a prompt's second chunk) weighs little.
            assert self.per_row is not None
            self._keys_sq = FORGET * self._keys_sq + prompt_keys * prompt_keys
            self._keys_by_added = FORGET * self._keys_by_added + prompt_keys * (
                added - self.fixed - self.per_row * prompt_cost)
            self.per_key = max(0.0, self._keys_by_added / self._keys_sq)

    def _fit_rows(self, cost: float, added: float) -> bool:
        """Add a rows-alone step to the line added = fixed + per_row * cost; True where it sets both (enough steps
        whose costs spread enough, a line that explains their times and rises from a fixed part of at least 0)."""
        w, x, xx, y, xy, yy = (FORGET * v for v in self._rows_fit)
        w, x, xx, y, xy, yy = w + 1.0, x + cost, xx + cost * cost, y + added, xy + cost * added, yy + added * added
        self._rows_fit = (w, x, xx, y, xy, yy)
        spread = w * xx - x * x  # w^2 times the costs' variance
        if w < FIT_WEIGHT or spread <= SPREAD * x * x:
            return False
        together = w * xy - x * y  # w^2 times their covariance with the times
        slope = together / spread
        intercept = (y - slope * x) / w
        times = w * yy - y * y  # w^2 times the times' variance
        if slope <= 0 or intercept < 0 or together * together < FIT_R2 * spread * times:
            return False
        self.per_row, self.fixed = slope, intercept
        return True

    def budget(self) -> float:
        """Prompt row-equivalents the next step may take while something decodes (its chunks' keys included, at
        keys_per_row() keys to one): what the allowance pays for beyond the fixed part, at least the rows that
        cost as much as the fixed part, at least min_rows."""
        if self.decode is None or not self.per_row:
            return min(self.initial, self.ceiling)
        rows = ((self.slowdown - 1) * self.decode - self.fixed) / self.per_row
        if self.fixed > 0:  # a mixed step carries at least the rows that cost as much as its fixed part
            rows = max(rows, self.fixed / self.per_row)
        return min(self.ceiling, max(self.min_rows, rows))

    def keys_per_row(self) -> float:
        """Keys of a prompt chunk's sequence whose read costs one row-equivalent (inf: none measured)."""
        if not self.per_row or self.per_key <= 0:
            return math.inf
        return self.per_row / self.per_key


def _smooth(estimate: float | None, measured: float) -> float:
    return measured if estimate is None else estimate + SMOOTHING * (measured - estimate)
