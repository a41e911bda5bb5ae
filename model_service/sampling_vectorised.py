"""The sampler of a whole step's draws at once, for accelerators (`Backend.vectorised_sampling`).

Each draw's result is the same function of its row as the per-draw sampler of sampling.py (`_sample_active`, what
the CPU runs one draw after another): the same token for the same key, the same probabilities up to the rounding of
a sum over the step's rows at once rather than over one row, and the same bits whatever else the step asks for
(tests/engine/test_sampling_vectorised.py). What differs is what a step computes. Mapping the per-draw function
over the draws turned its branches into selects, so every draw ran both samplers, both threshold searches, the
noise and the alternatives. Here each stage is one batched computation over the step's draws under one `lax.cond`
over the whole step, decided on the device:

- no draw of the step samples (temperature 0, top_p 1, no alternatives, no control): one masked argmax per row
  and its probability, nothing else;
- each control, top-k, the nucleus, min-p, the random draw and the alternatives run only when some draw of the
  step uses them (a draw that does not keeps its row by a select, which is exact: the stage is its identity).

Large vocabularies are never sorted. The `CANDIDATES` largest entries of a row come from a two-stage top-k (the
largest entry of each chunk, the chunks holding the largest, the largest among those: `top_candidates`), exact
with the order and ties of `lax.top_k`. From them: top-k's k-th largest value directly (k <= CANDIDATES); the
nucleus threshold by a bisection over the candidates (1 + log2(CANDIDATES) probes instead of 32 over the value
range, each probe the same masked sum as sampling_ops's search, so the same threshold); the draw's noise for the
kept entries only when they are all candidates (as sampling_ops.categorical_kept). A row outside those cases takes
sampling_ops's own search or full draw, under a cond that runs only when some row needs it.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from model_service.logits_processing import (
    Controls,
    History,
    add_bias,
    apply_penalties,
    hold_ends,
    kth_largest,
    min_p_filter,
    penalized,
)
from model_service.sampling_ops import (
    FLOAT32_MAX,
    KEPT_FLOOR,
    KEPT_MARGIN,
    MASKED_LOGIT,
    SORT_MAX_VOCAB,
    TOP_K,
    SampleResult,
    SamplingParams,
    _gumbel_at,
    _search_threshold_probs,
    _sort_threshold,
    categorical,
    first_argmax,
)

CANDIDATES = 1024  # entries kept per row by the two-stage top-k (a nucleus or top-k within them skips the search)
DIRECT_TOP_K = 8192  # up to this row length lax.top_k runs on the row itself


def monotone_keys(x: jax.Array) -> jax.Array:
    """int32 keys ordered as the float32 values x are (-0.0 below +0.0; NaNs at the ends), same shape."""
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    sign = jnp.uint32(0x80000000)
    return jax.lax.bitcast_convert_type(jnp.where(bits >= sign, ~bits, bits | sign) ^ sign, jnp.int32)


def _unsigned_keys(x: jax.Array) -> jax.Array:
    """sampling_ops._search_threshold_probs's uint32 keys of x (the same order as `monotone_keys`)."""
    return jax.lax.bitcast_convert_type(monotone_keys(x), jnp.uint32) ^ jnp.uint32(0x80000000)


def _from_unsigned_keys(keys: jax.Array) -> jax.Array:
    """The float32 values of `_unsigned_keys`."""
    sign = jnp.uint32(0x80000000)
    return jax.lax.bitcast_convert_type(jnp.where(keys >= sign, keys ^ sign, ~keys), jnp.float32)


def chunk_size(v: int, m: int) -> int:
    """The chunk of the two-stage top-k: about sqrt(v / m) (balances the chunk maxima against the candidates)."""
    c = 8
    while (2 * c) ** 2 * m <= v:
        c *= 2
    return c


def top_candidates(x: jax.Array, m: int) -> jax.Array:
    """The ids of the m largest values of each row of x [B, V] float32, largest first, ties lower id first: exactly
    `lax.top_k(x, m)[1]`, without a top-k over the whole row when V is large. [B, m] int32.

    A chunk's largest entry (by value, then lower id) ranks the chunk; each of the m largest entries lies in one
    of the m best-ranked chunks (otherwise m chunks each hold a larger entry). Those chunks, in id order, hold m*c
    entries; their top-k is the row's, ties going to the lower id as lax.top_k's do."""
    b, v = x.shape
    c = chunk_size(v, m)
    n = -(-v // c)
    if v <= DIRECT_TOP_K or n < m:
        return jax.lax.top_k(x, m)[1].astype(jnp.int32)
    padded = jnp.pad(x, ((0, 0), (0, n * c - v)), constant_values=-jnp.inf)  # pads come last: never chosen first
    chunks = jnp.max(padded.reshape(b, n, c), axis=-1)  # [B, n]
    best = jnp.sort(jax.lax.top_k(chunks, m)[1], axis=-1)  # [B, m] chunk ids, ascending
    ids = (best[:, :, None] * c + jnp.arange(c, dtype=best.dtype)).reshape(b, m * c)  # [B, m*c] ascending
    at = jax.lax.top_k(jnp.take_along_axis(padded, ids, axis=1), m)[1]  # [B, m]
    return jnp.minimum(jnp.take_along_axis(ids, at, axis=1), v - 1).astype(jnp.int32)  # a pad only on a NaN row


def _take(x: jax.Array, ids: jax.Array) -> jax.Array:
    """x [B, V] at ids [B] -> [B]."""
    return jnp.take_along_axis(x, ids[:, None], axis=1)[:, 0]


def kth_values(row: jax.Array, k: jax.Array, on: jax.Array) -> jax.Array:
    """logits_processing.kth_largest of each row [B, V] for k [B] (rows with `on`): from the candidates when
    k <= CANDIDATES (where -0.0 and +0.0 tie: either may stand for the other, the same kept set), by the search
    otherwise. [B]."""
    m = min(CANDIDATES, row.shape[-1])
    vals = jnp.take_along_axis(row, top_candidates(row, m), axis=1)  # [B, m] largest first
    fast = _take(vals, jnp.clip(k - 1, 0, m - 1))
    slow = on & (k > m)
    return jax.lax.cond(jnp.any(slow), lambda: jnp.where(slow, jax.vmap(kth_largest)(row, k), fast), lambda: fast)


def nucleus_thresholds(row: jax.Array, probs: jax.Array, top_p: jax.Array, on: jax.Array) -> jax.Array:
    """sampling_ops._search_threshold_probs of each row [B, V] with its softmax probs [B, V] and top_p [B]: the
    smallest value whose mass at or below it reaches 1 - top_p. [B].

    That value is a candidate unless the mass below the smallest candidate already reaches it; then a
    bisection over the candidates (largest first) finds the last one whose mass reaches it, each probe the
    search's own masked sum, so the decisions and the threshold are the search's. Other rows: the search."""
    b, v = row.shape
    m = min(CANDIDATES, v)
    # -0.0 keyed as +0.0 (the value 0 one key): the kept set, `row >= threshold`, is the same either way, and the
    # candidates (lax.top_k's order, where -0.0 == +0.0) are then in key order once their keys are sorted.
    keys = _unsigned_keys(jnp.where(row == 0, jnp.float32(0), row))  # [B, V]
    cand = jnp.sort(jnp.take_along_axis(keys, top_candidates(row, m), axis=1), axis=-1)[:, ::-1]  # [B, m] descending
    target = 1 - top_p

    def reaches(at: jax.Array) -> jax.Array:  # [B] uint32 -> [B] bool: the mass at or below `at` reaches target
        return jnp.sum(jnp.where(keys <= at[:, None], probs, 0.0), axis=-1) >= target

    # Below the smallest candidate: the keys up to the value just under it, the search's probe there.
    inside = jnp.sum(jnp.where(keys < cand[:, m - 1:], probs, 0.0), axis=-1) < target

    def probe(_: int, bounds: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        lo, hi = bounds  # the last candidate whose mass reaches the target (0 if none) is in [lo, hi]
        mid = (lo + hi + 1) // 2
        enough = reaches(_take(cand, mid))
        return jnp.where(enough, mid, lo), jnp.where(enough, hi, mid - 1)

    steps = max(1, (m - 1).bit_length())
    lo, _ = jax.lax.fori_loop(0, steps, probe, (jnp.zeros((b,), jnp.int32), jnp.full((b,), m - 1, jnp.int32)))
    fast = _from_unsigned_keys(_take(cand, lo))
    slow = on & ~inside
    return jax.lax.cond(jnp.any(slow), lambda: jnp.where(slow, jax.vmap(_search_threshold_probs)(row, probs, top_p),
                                                         fast), lambda: fast)


def draw_tokens(keys: jax.Array, row: jax.Array, sampled: jax.Array) -> jax.Array:
    """sampling_ops.categorical of each filtered row [B, V] with its key [B, 2] (rows with `sampled`). [B] int32.

    As sampling_ops.categorical_kept: when a row's largest value is above KEPT_MARGIN, only its entries above
    KEPT_FLOOR can win; when they are at most CANDIDATES they are all candidates, and the noise is computed for
    the candidates alone (the same hash of (key, id), the same float steps), the first maximum taken by id."""
    b, v = row.shape
    m = min(CANDIDATES, v)
    full = lambda: jax.vmap(lambda k, r: categorical(k, r[None]))(keys, row)  # noqa: E731
    if m == v or not jax.config.jax_threefry_partitionable:
        return full()
    fits = (jnp.max(row, axis=-1) > KEPT_MARGIN) & (jnp.sum(row > KEPT_FLOOR, axis=-1) <= m)  # False for NaN

    def listed() -> jax.Array:
        ids = top_candidates(row, m)  # [B, m]
        vals = jnp.take_along_axis(row, ids, axis=1)
        noisy = jnp.where(vals > KEPT_FLOOR, jax.vmap(_gumbel_at)(keys, ids) + vals, -jnp.inf)
        best = jnp.max(noisy, axis=-1, keepdims=True)
        return jnp.min(jnp.where(noisy == best, ids, v), axis=-1).astype(jnp.int32)

    zeros = jnp.zeros((b,), jnp.int32)
    fast = jax.lax.cond(jnp.any(sampled & fits), listed, lambda: zeros)
    rest = sampled & ~fits
    return jax.lax.cond(jnp.any(rest), lambda: jnp.where(fits, fast, full()), lambda: fast)


def alternatives(probs: jax.Array) -> tuple[jax.Array, jax.Array]:
    """lax.top_k(probs, TOP_K) of each row [B, V] of probabilities (>= 0: their float order is their keys')."""
    k = min(TOP_K, probs.shape[-1])
    ids = top_candidates(probs, k)
    return jnp.take_along_axis(probs, ids, axis=1), ids


def _where(on: jax.Array, new: tuple[jax.Array, ...], old: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
    """Per row [B]: `new` where on, else `old` (arrays [B, ...])."""
    return tuple(jnp.where(on.reshape(on.shape + (1,) * (n.ndim - 1)), n, o) for n, o in zip(new, old))


Stage = Callable[..., tuple[jax.Array, ...]]


def _when(flag: jax.Array, on: jax.Array, stage: Stage, operands: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
    """`stage(*operands)` for the rows with `on`, computed only when some row with `flag` has it."""
    return jax.lax.cond(jnp.any(flag & on), lambda o: _where(on, stage(*o), o), lambda o: o, operands)


def _controls_on(c: Controls, v: int, chain: jax.Array) -> tuple[jax.Array, ...]:
    """Per draw [B] bool: logit_bias, penalties, top-k, min-p, min_tokens's bar (sampling._sample_active's tests)."""
    return (jnp.any(c.bias_ids < v, axis=-1), penalized(c), (c.top_k > 0) & (c.top_k < v), c.min_p > 0,
            c.min_left > chain)


def _penalised(x: jax.Array, c: Controls, history: History, rows: jax.Array, pending: jax.Array | None) -> jax.Array:
    counts = jnp.take(history.counts, rows, axis=0)  # [B, V], plus the drafts drawn before each draw this step
    if pending is not None:
        counts = jax.vmap(lambda n, p: n.at[p].add(1, mode="drop"))(counts, pending)
    return jax.vmap(apply_penalties)(x, jnp.take(history.prompt, rows, axis=0), counts, c.repetition, c.presence,
                                     c.frequency)


def _top_k(row: jax.Array, exps: jax.Array, k: jax.Array, on: jax.Array) -> tuple[jax.Array, jax.Array]:
    kept = row >= kth_values(row, k, on)[:, None]
    return jnp.where(kept, row, MASKED_LOGIT), jnp.where(kept, exps, 0.0)


def _nucleus(row: jax.Array, exps: jax.Array, top_p: jax.Array, on: jax.Array) -> tuple[jax.Array, jax.Array]:
    if row.shape[-1] <= SORT_MAX_VOCAB:  # the reference's sort, as sampling.py at this size
        threshold = jax.vmap(lambda r, p: _sort_threshold(r[None], p.reshape(1, 1))[0, 0])(row, top_p)
    else:
        threshold = nucleus_thresholds(row, exps / jnp.sum(exps, axis=-1, keepdims=True), top_p, on)
    kept = row >= threshold[:, None]
    return jnp.where(kept, row, MASKED_LOGIT), jnp.where(kept, exps, 0.0)


def _tempered(x: jax.Array, scale: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The masked tempered row [B, V] (clipped to finite, as sampling._sample_filtered) and its exponentials."""
    row = jnp.where(mask, jnp.clip(x / scale[:, None], -FLOAT32_MAX, FLOAT32_MAX), MASKED_LOGIT)
    return row, jnp.exp(row - jnp.max(row, axis=-1, keepdims=True))


def _probs(exps: jax.Array) -> jax.Array:
    """The softmax of the filtered row [B, V] from its exponentials (divided where it is read, as sampling.py)."""
    return exps / jnp.sum(exps, axis=-1, keepdims=True)


def _result(draws: jax.Array, token: jax.Array, probs: jax.Array, top: tuple[jax.Array, jax.Array] | None,
            raw: jax.Array) -> SampleResult:
    """The step's SampleResult; entries that do not draw get sampling._idle_result's zeros."""
    b, v = raw.shape
    k = min(TOP_K, v)
    top_probs, top_ids = top if top is not None else (jnp.zeros((b, k), jnp.float32), jnp.zeros((b, k), jnp.int32))
    bad = ~jnp.all(jnp.isfinite(raw), axis=-1)
    out = (token, _take(probs, token), top_ids.astype(jnp.int32), top_probs, bad)
    return SampleResult(*_where(draws, out, tuple(jnp.zeros_like(a) for a in out)))


def _greedy(logits: jax.Array, mask: jax.Array, draws: jax.Array) -> SampleResult:
    """A step whose draws all take the argmax and report nothing but its probability (at temperature 1): reductions
    over the masked row, nothing [B, V] stored. The argmax's exponential is exp(0) = 1, so its probability is
    1 / the sum, the division `_probs` makes there."""
    b, k = logits.shape[0], min(TOP_K, logits.shape[-1])
    row = jnp.where(mask, jnp.clip(logits, -FLOAT32_MAX, FLOAT32_MAX), MASKED_LOGIT)  # logits / 1, as `_tempered`
    top = jnp.max(row, axis=-1, keepdims=True)
    total = jnp.sum(jnp.exp(row - top), axis=-1)
    token = jax.vmap(first_argmax)(row)
    prob = jnp.exp(_take(row, token) - top[:, 0]) / total
    out = (token, prob, jnp.zeros((b, k), jnp.int32), jnp.zeros((b, k), jnp.float32),
           ~jnp.all(jnp.isfinite(logits), axis=-1))
    return SampleResult(*_where(draws, out, tuple(jnp.zeros_like(a) for a in out)))


def _sampled(keys: jax.Array, logits: jax.Array, temperature: jax.Array, top_p: jax.Array, num_top: jax.Array,
             mask: jax.Array, c: Controls | None, history: History | None, rows: jax.Array, draws: jax.Array,
             pending: jax.Array | None, on: tuple[jax.Array, ...] | None) -> SampleResult:
    """sampling._sample_filtered's steps over every draw at once, each stage only when some draw uses it."""
    x = logits
    if c is not None:  # bias and penalties on the raw logits, then min_tokens's bar on the mask
        bias_on, pen_on, top_k_on, min_p_on, barred = on
        (x,) = _when(draws, bias_on, lambda x: (jax.vmap(add_bias)(x, c.bias_ids, c.bias),), (x,))
        (x,) = _when(draws, pen_on, lambda x: (_penalised(x, c, history, rows, pending),), (x,))
        (mask,) = _when(draws, barred, lambda m: (jax.vmap(hold_ends)(m, c.ends),), (mask,))
    greedy = temperature <= 0
    # Greedy draws report probabilities at temperature 1 (proto: Token.probability).
    row, exps = _tempered(x, jnp.where(greedy, jnp.float32(1), temperature).astype(x.dtype), mask)
    if c is not None:
        row, exps = _when(draws, top_k_on, lambda r, e: _top_k(r, e, c.top_k, top_k_on), (row, exps))
    nucleus_on = top_p < 1
    row, exps = _when(draws, nucleus_on, lambda r, e: _nucleus(r, e, top_p.astype(r.dtype), nucleus_on),
                      (row, exps))
    if c is not None:
        row, exps = _when(draws, min_p_on, lambda r, e: jax.vmap(lambda r1, e1, p: min_p_filter(
            r1, e1, p, MASKED_LOGIT))(r, e, c.min_p), (row, exps))
    argmax = jax.vmap(first_argmax)(row)
    drawn = draws & ~greedy
    token = jax.lax.cond(jnp.any(drawn), lambda: jnp.where(greedy, argmax, draw_tokens(keys, row, drawn)),
                         lambda: argmax)
    probs = _probs(exps)
    k = min(TOP_K, logits.shape[-1])
    none = (jnp.zeros((logits.shape[0], k), probs.dtype), jnp.zeros((logits.shape[0], k), jnp.int32))
    asked = num_top > 0  # a draw that asks for none reports zeros, as the per-draw sampler's
    top = jax.lax.cond(jnp.any(draws & asked), lambda: _where(asked, alternatives(probs), none), lambda: none)
    return _result(draws, token, probs, top, logits)


def sample_batched(keys: jax.Array, logits: jax.Array, params: SamplingParams, controls: Controls | None,
                   history: History | None, rows: jax.Array, draws: jax.Array, pending: jax.Array | None = None,
                   chain: jax.Array | None = None) -> SampleResult:
    """sampling.sample_tokens(vectorised=True): keys [B, 2], logits [B, V] float32, entry i drawing with row
    rows[i] of the settings when draws[i]; pending / chain as sample_tokens."""
    v = logits.shape[-1]
    temperature, top_p, num_top = (jnp.take(a, rows) for a in (params.temperature, params.top_p, params.num_top))
    mask = jnp.take(params.mask, rows, axis=0)  # [B, V]
    samples = (temperature > 0) | (top_p < 1) | (num_top > 0)
    c, on = None, None
    if controls is not None:
        c = jax.tree.map(lambda a: jnp.take(a, rows, axis=0), controls)
        on = _controls_on(c, v, jnp.zeros_like(rows) if chain is None else chain)
        samples = samples | on[0] | on[1] | on[2] | on[3] | on[4]
    return jax.lax.cond(jnp.any(draws & samples),
                        lambda: _sampled(keys, logits, temperature, top_p, num_top, mask, c, history, rows, draws,
                                         pending, on),
                        lambda: _greedy(logits, mask, draws))
