"""The sampler's building blocks, shared by the per-draw sampler (sampling.py, what the CPU runs) and the step-wide
one (sampling_vectorised.py, what accelerators run): the per-slot settings and results, the reference's key
schedule, the nucleus threshold (the reference's sort, or a search over the values), the bit-exact argmax and
gumbel draw of `jax.random.categorical`, and the draw among the kept entries only."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from model_service import kernels
from model_service.sampling_settings import MAX_TOP_LOGPROBS

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
