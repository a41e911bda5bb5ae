"""Token sampling as the reference's `sample_token` defines it, vectorised over batch slots.

Every slot carries its own temperature, nucleus mass, token mask, number of alternatives and PRNG key,
and each slot's draw is computed by a per-slot function mapped over the slots, so a request's tokens
never depend on what the other slots hold (batch invariance). The order of operations is the
reference's: divide by the temperature, mask disallowed ids with -1e10, nucleus-filter, draw with
`jax.random.categorical`; the reported probability and top-k alternatives come from the softmax of the
filtered logits. Temperature 0 is greedy (argmax of the filtered logits; probabilities then use
temperature 1). Work nobody asked for is skipped: free slots, the nucleus search at top_p 1, the draw
of a greedy slot, the alternatives of a slot that wants none, the noise of entries the filters removed
(with the native kernels: `categorical_kept`); one exponential pass serves the nucleus search and the
reported probabilities.

The controls (logit_bias, penalties, top-k, min-p, min_tokens: sampling_settings.py for their order) are applied
when `sample_tokens` gets their per-slot settings, each under its own per-slot condition, so a slot that
uses none of them runs exactly the steps above.

Key schedule (the reference's): `key = PRNGKey(seed)`, `(rest, draw) = split(key)`; the first token
is drawn with `draw`; before each later token the slot's `rest` is split again the same way.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from model_service import kernels
from model_service.logits_processing import (
    Controls,
    History,
    add_bias,
    apply_penalties,
    hold_ends,
    min_p_filter,
    penalized,
    top_k_filter,
)
from model_service.sampling_settings import MAX_TOP_LOGPROBS, build_mask  # noqa: F401 - the engine builds masks

TOP_K = MAX_TOP_LOGPROBS  # alternatives computed per token (serving_common/limits.py declares how many)
SORT_MAX_VOCAB = 8192  # up to this vocabulary size the nucleus threshold uses the reference's sort
MASKED_LOGIT = -1e10  # the reference's value for removed logits
FLOAT32_MAX = float(np.finfo(np.float32).max)


class SamplingParams(NamedTuple):
    """Per-slot sampling settings: a pytree whose leaves all lead with the slot axis [B]."""

    temperature: jax.Array  # [B] float32, >= 0 (0 = greedy)
    top_p: jax.Array  # [B] float32 in (0, 1]
    mask: jax.Array  # [B, V] bool, True = may be sampled
    active: jax.Array  # [B] bool, False for a free slot (its result is not computed)
    num_top: jax.Array  # [B] int32, alternatives the request reports (0..TOP_K; 0 skips computing them)


class SampleResult(NamedTuple):
    """What one sampling step yields for every slot."""

    token: jax.Array  # [B] int32
    prob: jax.Array  # [B] float32, probability of `token` under the filtered distribution
    top_ids: jax.Array  # [B, TOP_K] int32, most probable first
    top_probs: jax.Array  # [B, TOP_K] float32
    bad: jax.Array  # [B] bool, the slot's logits were not finite (its request must fail)



def seed_key(seed: jax.Array) -> jax.Array:
    """PRNGKey(seed) for a uint32 seed, as the reference builds it: [2] uint32."""
    return jax.random.PRNGKey(seed)


def split_key(key: jax.Array) -> tuple[jax.Array, jax.Array]:
    """One step of the reference's schedule for one slot: (key to keep, key to draw with)."""
    rest, draw = jax.random.split(key)
    return rest, draw


def split_keys(keys: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`split_key` for every slot: keys [B, 2] -> (rest [B, 2], draw [B, 2])."""
    return jax.vmap(split_key)(keys)


def top_p_filter(logits: jax.Array, top_p: jax.Array, native: bool = False) -> jax.Array:
    """Nucleus filter of one row: logits [1, V], top_p [1, 1] -> logits [1, V].

    The reference's rule: sort ascending, softmax, and the first index whose cumulative probability
    reaches 1 - top_p names the threshold logit; every logit below it becomes -1e10. Large
    vocabularies find the same threshold by a search instead of a full sort (see `_search_threshold`),
    or with `native` by one call of the native kernel (`kernels.nucleus_threshold`).
    """
    if logits.shape[-1] <= SORT_MAX_VOCAB:
        threshold = _sort_threshold(logits, top_p)
    elif native:
        threshold = kernels.nucleus_threshold(logits, jax.nn.softmax(logits), top_p[:, 0])[:, None]
    else:
        threshold = _search_threshold(logits[0], top_p[0, 0]).reshape(1, 1)
    return jnp.where(logits >= threshold, logits, MASKED_LOGIT)


def _sort_threshold(logits: jax.Array, top_p: jax.Array) -> jax.Array:
    ascending = jax.lax.sort(logits, is_stable=False)  # [1, V]
    cumulative = jnp.cumsum(jax.nn.softmax(ascending), axis=-1)  # [1, V]
    threshold_idx = jnp.argmax(cumulative >= 1 - top_p, axis=-1)  # [1]
    return jnp.take_along_axis(ascending, threshold_idx[:, None], axis=-1)  # [1, 1]


def _search_threshold(logits: jax.Array, top_p: jax.Array) -> jax.Array:
    """The smallest logit v with P(logit <= v) >= 1 - top_p: the sorted rule's threshold, without a sort."""
    return _search_threshold_probs(logits, jax.nn.softmax(logits), top_p)


def _search_threshold_probs(logits: jax.Array, probs: jax.Array, top_p: jax.Array) -> jax.Array:
    """`_search_threshold` given softmax(logits) [V].

    Binary search over the order-preserving uint32 image of the float logits; each probe is
    one masked sum over the vocabulary (a full sort of 131072 logits costs ~40 ms on CPU, this ~1.5).
    """
    bits = jax.lax.bitcast_convert_type(logits, jnp.uint32)
    sign = jnp.uint32(0x80000000)
    keys = jnp.where(bits >= sign, ~bits, bits | sign)  # unsigned and monotone in the float value
    target = 1 - top_p

    def probe(_: int, bounds: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        lo, hi = bounds
        mid = lo + (hi - lo) // 2
        enough = jnp.sum(jnp.where(keys <= mid, probs, 0.0)) >= target
        # Once lo == hi the search is done; probing on would step past the maximum when the row's float32 mass
        # never reaches the target (top_p under ~6e-8 makes it 1), masking every logit. Then the top one stays.
        searching = lo < hi
        return jnp.where(searching & ~enough, mid + 1, lo), jnp.where(searching & enough, mid, hi)

    lo, _ = jax.lax.fori_loop(0, 32, probe, (jnp.min(keys), jnp.max(keys)))
    bits = jnp.where(lo >= sign, lo ^ sign, ~lo)
    return jax.lax.bitcast_convert_type(bits, logits.dtype)


def first_argmax(x: jax.Array) -> jax.Array:
    """`jnp.argmax` of a 1-D array, bit-identical (first maximum; first NaN if any), as int32.

    XLA-CPU lowers argmax to a two-operand reduction that does not vectorise (~2.5 ms over 131072 logits);
    a max followed by a min over the matching indices is two plain reductions (~0.3 ms).
    """
    top = jnp.max(x)
    ids = jnp.arange(x.shape[0], dtype=jnp.int32)
    hit = (x == top) | (jnp.isnan(top) & jnp.isnan(x))  # max is NaN iff some entry is NaN: take the first NaN
    return jnp.min(jnp.where(hit, ids, jnp.int32(x.shape[0])))


_THREEFRY_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))


def _threefry2x32(k1: jax.Array, k2: jax.Array, x1: jax.Array, x2: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The Threefry-2x32 hash (20 rounds) jax.random uses, written out so XLA fuses it into one pass: jax lowers
    it on CPU as a 5-step loop that materialises its uint32 state each step (~3x slower over a vocabulary).
    Integer arithmetic only, so the bits are the same however it is compiled."""
    ks = (k1, k2, k1 ^ k2 ^ jnp.uint32(0x1BD11BDA))
    x1, x2 = x1 + ks[0], x2 + ks[1]
    for i in range(5):
        for r in _THREEFRY_ROTATIONS[i % 2]:
            x1 = x1 + x2
            x2 = x1 ^ ((x2 << jnp.uint32(r)) | (x2 >> jnp.uint32(32 - r)))
        x1, x2 = x1 + ks[(i + 1) % 3], x2 + ks[(i + 2) % 3] + jnp.uint32(i + 1)
    return x1, x2


def gumbel_noise(key: jax.Array, n: int) -> jax.Array:
    """`jax.random.gumbel(key, (1, n), float32)[0]` (the default "low" mode), bit-identical: the partitionable
    threefry bits of counters 0..n-1 (b1 ^ b2), their top 23 bits as a uniform in [tiny, 1), then -log(-log u)
    with XLA's own log. jax's function itself where jax draws its bits another way."""
    if not jax.config.jax_threefry_partitionable:
        return jax.random.gumbel(key, (1, n), jnp.float32)[0]
    return _gumbel_at(key, jnp.arange(n, dtype=jnp.uint32))


def categorical(key: jax.Array, row: jax.Array) -> jax.Array:
    """`jax.random.categorical(key, row)[0]` for one float32 row [1, V], bit-identical: the same gumbel noise
    (`gumbel_noise`) plus the logits, then `first_argmax` instead of jnp.argmax."""
    return first_argmax(gumbel_noise(key, row.shape[-1]) + row[0])


def _gumbel_at(key: jax.Array, ids: jax.Array) -> jax.Array:
    """The gumbel noise of counters `ids` (partitionable bits): `gumbel_noise(key, n)[ids]` for ids < n, computed for
    those ids only, each value the same integer hash of (key, id) and the same float steps whatever is beside it."""
    b1, b2 = _threefry2x32(key[0], key[1], jnp.zeros(ids.shape, jnp.uint32), ids.astype(jnp.uint32))
    one = jax.lax.bitcast_convert_type(((b1 ^ b2) >> jnp.uint32(9)) | jnp.uint32(0x3F800000), jnp.float32)
    tiny = jnp.float32(np.finfo(np.float32).tiny)
    uniform = jnp.maximum(tiny, (one - jnp.float32(1)) * (jnp.float32(1) - tiny) + tiny)
    return -jnp.log(-jnp.log(uniform))


# The draw among what the filters kept. The filters set what they remove to MASKED_LOGIT (-1e10), where a gumbel value
# (between about -4.5 and 16) is lost in rounding; any entry at or below KEPT_FLOOR stays below -1e9 + 16 with its
# noise. When the row's largest value is above KEPT_MARGIN, that entry alone, noise included, beats all of them, so
# the argmax over the entries above the floor (in ascending order, so ties still go to the first) is the argmax
# over the row: the noise is needed for those entries only. A nucleus of top_p 0.9 keeps a few percent of a large
# vocabulary; the draw then hashes a few thousand counters instead of all of them.
KEPT_FLOOR = -1e9
KEPT_MARGIN = -5e8
# The kept entries are drawn among in the smallest list that holds them; each size is a branch the draws program
# compiles (~0.5 s without the persistent cache), and a list of 8,192 costs ~25 us a row.
KEPT_SIZES = (8192, 32768)


def categorical_kept(key: jax.Array, row: jax.Array, sizes: tuple[int, ...] = KEPT_SIZES) -> jax.Array:
    """`categorical(key, row[None])` for one filtered float32 row [V], bit-identical, with the noise computed only for
    the entries above KEPT_FLOOR when they fit the largest of `sizes` (the native kernel lists them); otherwise, or
    when the row's largest value is not above KEPT_MARGIN (or is NaN), the whole row's draw."""
    v = row.shape[-1]
    sizes = tuple(n for n in sizes if n < v)
    if not sizes or not jax.config.jax_threefry_partitionable:
        return categorical(key, row[None])
    ids, count, top = kernels.values_above(row, KEPT_FLOOR, sizes[-1])

    def among(n: int):
        def draw() -> jax.Array:
            some = ids[:n]
            noisy = _gumbel_at(key, some) + jnp.take(row, some, mode="clip")
            return some[first_argmax(jnp.where(jnp.arange(n) < count, noisy, -jnp.inf))]
        return draw

    fits = (top > KEPT_MARGIN) & (count <= sizes[-1])  # False for a NaN top
    which = jnp.where(fits, jnp.sum(count > jnp.asarray(sizes, jnp.int32)), len(sizes))
    return jax.lax.switch(which, [among(n) for n in sizes] + [lambda: categorical(key, row[None])])


def _sample_active(key: jax.Array, logits: jax.Array, temperature: jax.Array, top_p: jax.Array, mask: jax.Array,
                   num_top: jax.Array, extra: SlotControls | None = None, native: bool = False) -> SampleResult:
    """A slot that uses no control runs the reference's steps alone (one condition for all of them: the off path
    carries no per-control branches or buffers); otherwise each control is applied under its own condition."""
    if extra is None:
        return _sample_filtered(key, logits, temperature, top_p, mask, num_top, native=native)
    c, v = extra.controls, logits.shape[-1]
    used = (jnp.any(c.bias_ids < v) | penalized(c)
            | ((c.top_k > 0) & (c.top_k < v)) | (c.min_p > 0) | extra.barred)
    return jax.lax.cond(used, lambda: _sample_filtered(key, logits, temperature, top_p, mask, num_top, extra, native),
                        lambda: _sample_filtered(key, logits, temperature, top_p, mask, num_top, native=native))


def _sample_filtered(
    key: jax.Array,  # [2] uint32
    logits: jax.Array,  # [V] float32
    temperature: jax.Array,  # [] float32
    top_p: jax.Array,  # [] float32
    mask: jax.Array,  # [V] bool
    num_top: jax.Array,  # [] int32
    extra: SlotControls | None = None,
    native: bool = False,  # large vocabularies: the nucleus threshold from the native kernel, not XLA's search
) -> SampleResult:
    raw = logits
    if extra is not None:  # bias and penalties act on the raw logits (sampling_settings.py: order of operations)
        logits = _biased_and_penalized(logits, extra)
        with jax.named_scope("min_tokens"):
            mask = jax.lax.cond(extra.barred, lambda m: hold_ends(m, extra.controls.ends), lambda m: m, mask)
    greedy = temperature <= 0
    # Greedy requests report probabilities at temperature 1 (proto: Token.probability).
    scale = jnp.where(greedy, jnp.float32(1), temperature).astype(logits.dtype)
    # Clipped to finite: a tiny temperature or repetition_penalty (both valid) overflows a logit to inf,
    # and inf - max(row) is NaN in every probability. Identity on finite values, so exact; fused here.
    row = jnp.where(mask, jnp.clip(logits / scale, -FLOAT32_MAX, FLOAT32_MAX), MASKED_LOGIT)  # [V]
    # softmax(row) = exp(row - max) / sum; the nucleus keeps the max, so the filtered softmax has the same
    # exponentials with the removed ones exactly 0 (exp(-1e10 - max) underflows to 0 as well).
    exps = jnp.exp(row - jnp.max(row))  # [V]
    if extra is not None:  # top-k keeps the max too, so the same argument holds after it
        k = extra.controls.top_k
        with jax.named_scope("top_k"):
            row, exps = jax.lax.cond((k > 0) & (k < row.shape[-1]),
                                     lambda o: top_k_filter(o[0], o[1], k, MASKED_LOGIT), lambda o: o, (row, exps))

    def nucleus(operands: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        r, e = operands
        p = top_p.astype(r.dtype)
        if r.shape[-1] <= SORT_MAX_VOCAB:
            threshold = _sort_threshold(r[None], p.reshape(1, 1))[0, 0]
        elif native:  # the same threshold (see kernels.nucleus_threshold) from one call instead of 32 masked sums
            threshold = kernels.nucleus_threshold(r, e / jnp.sum(e), p)
        else:
            threshold = _search_threshold_probs(r, e / jnp.sum(e), p)
        kept = r >= threshold
        return jnp.where(kept, r, MASKED_LOGIT), jnp.where(kept, e, 0.0)

    # Both shortcuts are exact: top_p = 1 keeps every logit, and a greedy slot takes the argmax.
    with jax.named_scope("nucleus"):
        row, exps = jax.lax.cond(top_p < 1, nucleus, lambda operands: operands, (row, exps))
    if extra is not None:
        min_p = extra.controls.min_p
        with jax.named_scope("min_p"):
            row, exps = jax.lax.cond(min_p > 0, lambda o: min_p_filter(o[0], o[1], min_p, MASKED_LOGIT),
                                     lambda o: o, (row, exps))
    with jax.named_scope("draw"):
        sample = (lambda r: categorical_kept(key, r)) if native else (lambda r: categorical(key, r[None]))
        drawn = jax.lax.cond(greedy, lambda r: first_argmax(r), sample, row)
    with jax.named_scope("probabilities"):
        total = jnp.sum(exps)  # the softmax of the filtered row is exps / total, divided where it is read
        k = min(TOP_K, row.shape[-1])
        top_probs, top_ids = jax.lax.cond(
            num_top > 0, lambda e: tuple(jax.lax.top_k(e / total, k)),
            lambda e: (jnp.zeros((k,), e.dtype), jnp.zeros((k,), jnp.int32)), exps)
    bad = ~jnp.all(jnp.isfinite(raw))
    # The same division as the row's (XLA turns it into a product by 1 / total), computed where it is read.
    return SampleResult(drawn, (exps / total)[drawn], top_ids.astype(jnp.int32), top_probs, bad)


def _biased_and_penalized(logits: jax.Array, extra: SlotControls) -> jax.Array:
    """logit_bias, then the penalties, each skipped when the slot does not use it (exact: identity)."""
    c = extra.controls
    with jax.named_scope("logit_bias"):
        logits = jax.lax.cond(jnp.any(c.bias_ids < logits.shape[-1]), lambda x: add_bias(x, c.bias_ids, c.bias),
                              lambda x: x, logits)
    def penalise(x: jax.Array) -> jax.Array:  # the slot's history rows are read here only, where they are used
        counts = extra.history.counts[extra.row]  # plus the tokens drawn before this one in the same step (drafts)
        if extra.pending is not None:
            counts = counts.at[extra.pending].add(1, mode="drop")
        return apply_penalties(x, extra.history.prompt[extra.row], counts, c.repetition, c.presence, c.frequency)

    with jax.named_scope("penalties"):
        return jax.lax.cond(penalized(c), penalise, lambda x: x, logits)


class SlotControls(NamedTuple):
    """One slot's controls (its row of `Controls`) and where its token history is: row `row` of `history`, read only
    by the penalties (a [V] copy of each per draw otherwise)."""

    controls: Controls
    history: History  # every slot's: prompt [S, V] bool, counts [S, V] int32
    row: jax.Array  # [] int32
    pending: jax.Array | None = None  # [K] int32 tokens this draw's history has beyond counts (V: none)
    barred: jax.Array | bool = False  # [] bool: min_tokens bars this draw from the slot's ending ids


def _idle_result(v: int) -> SampleResult:
    k = min(TOP_K, v)
    return SampleResult(jnp.int32(0), jnp.float32(0), jnp.zeros((k,), jnp.int32), jnp.zeros((k,), jnp.float32),
                        jnp.bool_(False))


def sample_tokens(keys: jax.Array, logits: jax.Array, params: SamplingParams, controls: Controls | None = None,
                  history: History | None = None, native: bool = False, index: jax.Array | None = None,
                  used: jax.Array | None = None, vectorised: bool = False,
                  pending: jax.Array | None = None, chain: jax.Array | None = None) -> SampleResult:
    """Draw one token per entry. keys [B, 2] (draw keys), logits [B, V] float32.

    Entries are processed one after another (a loop, not vmap) so that the per-entry branches are real: an
    unused entry computes nothing (not even the copy of its row), a greedy one skips the nucleus filter
    and the random draw (top_p = 1 skips the filter too; both shortcuts are exact), and an entry's result
    is computed exactly as if it were alone. `controls` and `history` (both or neither) add the controls of
    sampling_settings.py; without them the reference's sampler alone is compiled. `native` (a static choice,
    for one device with the native kernels built) finds large vocabularies' nucleus thresholds with
    `kernels.nucleus_threshold` instead of XLA's search: the same threshold except where a float32 sum lands
    within rounding of 1 - top_p. `index` [B] int32 (default: entry i) names the row of `params`, `controls`
    and `history` that entry i draws with (the engine's per-slot settings); `used` [B] bool (default:
    params.active at that row) says which entries draw at all. `vectorised` (accelerators, `native` unused) computes
    every entry at once instead, one stage at a time, each stage only when some entry uses it (a greedy step
    is one masked argmax per entry; sampling_vectorised.py): each entry's token is the same function of its row.
    `pending` [B, K] int32 (V: none) are tokens entry i's penalties count beyond its row of `history` (drafts
    drawn before it in the same step, speculative decoding). `chain` [B] int32 (default 0) says which of its slot's
    draws in this step entry i is (speculative decoding verifies several): min_tokens bars it from the slot's
    ending ids while that is below the draws the slot has left to bar (`Controls.min_left`).
    """
    assert (controls is None) == (history is None)
    b, v = logits.shape
    logits = logits.astype(jnp.float32)
    rows = jnp.arange(b, dtype=jnp.int32) if index is None else index
    draws = jnp.take(params.active, rows) if used is None else used

    def one(i: jax.Array) -> SampleResult:  # entry i's settings are read only here, inside its used branch
        j = rows[i]
        if controls is not None:
            c = jax.tree.map(lambda a: a[j], controls)
            extra = SlotControls(c, history, j, None if pending is None else pending[i],
                                 c.min_left > (0 if chain is None else chain[i]))
        else:
            extra = None
        return _sample_active(keys[i], logits[i], params.temperature[j], params.top_p[j], params.mask[j],
                              params.num_top[j], extra, native)

    def body(i: jax.Array, out: SampleResult) -> SampleResult:
        res = jax.lax.cond(draws[i], one, lambda _: _idle_result(v), i)
        return jax.tree.map(lambda all_, r: all_.at[i].set(r), out, res)

    if vectorised:  # one batched computation per stage, each only when a draw uses it (sampling_vectorised.py)
        from model_service.sampling_vectorised import sample_batched

        return sample_batched(keys, logits, params, controls, history, rows, draws, pending, chain)
    zeros = jax.tree.map(lambda r: jnp.zeros((b,) + r.shape, r.dtype), _idle_result(v))
    # Entries after the last used one are idle: the loop stops there (a step of one draw on a many-slot engine
    # runs one iteration, not one per slot).
    count = jnp.max(jnp.where(draws, jnp.arange(1, b + 1, dtype=jnp.int32), 0))
    return jax.lax.fori_loop(0, count, body, zeros)
