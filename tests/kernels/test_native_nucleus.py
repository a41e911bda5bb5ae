"""The native nucleus threshold (kernels.nucleus_threshold) against a float64 NumPy reference of the sorted rule,
against sampling.py's XLA search, and inside the sampler: the same tokens with and without it.

The reference sorts a row ascending, sums the probabilities in float64 and takes the logit where the sum first
reaches 1 - top_p (float32). The kernel sums the same float64 masses in another order, so the two could only
differ where a sum lands within ~1e-16 of the target: random rows never do, and every check here is exact.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model_service import kernels
from model_service.ops.native import KernelNucleus
from model_service.sampling import (
    SamplingParams,
    _search_threshold_probs,
    sample_tokens,
    seed_key,
    split_key,
    top_p_filter,
)

pytestmark = pytest.mark.skipif(not kernels.available(), reason="native kernels not built")
TOP_PS = (0.1, 0.5, 0.9, 0.95, 0.999)
VOCAB = 131072

threshold = jax.jit(kernels.nucleus_threshold)
softmax = jax.jit(functools.partial(jax.nn.softmax, axis=-1))


def reference(logits: np.ndarray, probs: np.ndarray, top_p: float) -> np.float32:
    """The sorted rule for one row in NumPy: float64 cumulative mass, float32 target."""
    target = np.float32(1) - np.float32(top_p)
    order = np.argsort(logits, kind="stable")
    ascending = logits[order]
    if target <= 0:
        return ascending[0]
    reached = np.cumsum(probs[order].astype(np.float64)) >= np.float64(target)
    return ascending[np.argmax(reached)] if reached.any() else ascending[-1]


def check_against_reference(logits: np.ndarray, top_ps: np.ndarray, probs: np.ndarray | None = None) -> None:
    """Every row of one call equals the reference (logits [R, V], top_ps [R])."""
    if probs is None:
        probs = np.asarray(softmax(jnp.asarray(logits)))
    got = np.asarray(threshold(jnp.asarray(logits), jnp.asarray(probs), jnp.asarray(top_ps, jnp.float32)))
    want = np.array([reference(l, p, t) for l, p, t in zip(logits, probs, top_ps)], np.float32)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("v", [VOCAB, 1001, 3])
@pytest.mark.parametrize("scale", [0.5, 5.0], ids=["flat", "peaked"])
def test_random_rows_match_the_sorted_reference(v: int, scale: float) -> None:
    rng = np.random.default_rng(v + int(scale * 10))
    logits = rng.normal(0, scale, (len(TOP_PS), v)).astype(np.float32)
    check_against_reference(logits, np.array(TOP_PS, np.float32))


def test_masked_logits_with_zero_probability_are_ordered_below_every_kept_one() -> None:
    rng = np.random.default_rng(1)
    logits = rng.normal(0, 2, (6, VOCAB)).astype(np.float32)
    logits[rng.random(logits.shape) < 0.7] = -1e10  # the sampler's masked value
    probs = np.asarray(softmax(jnp.asarray(logits)))
    assert np.all(probs[logits == -1e10] == 0)
    top_ps = np.array(TOP_PS + (1.0,), np.float32)  # top_p 1: target 0, the threshold is the masked value
    check_against_reference(logits, top_ps, probs)
    assert float(threshold(jnp.asarray(logits[-1]), jnp.asarray(probs[-1]), jnp.float32(1.0))) == -1e10


def test_ties_give_the_tied_logit() -> None:
    rng = np.random.default_rng(2)
    logits = (rng.integers(0, 6, (len(TOP_PS), VOCAB)) * 0.5).astype(np.float32)  # six values, ~22k copies each
    logits[:, ::7] = 0.0
    logits[:, 1::7] = -0.0  # equal to 0.0 but a different bit pattern
    check_against_reference(logits, np.array(TOP_PS, np.float32))


def test_target_at_or_below_zero_gives_the_row_minimum() -> None:
    rng = np.random.default_rng(3)
    logits = rng.normal(0, 1, (3, 5000)).astype(np.float32)
    probs = softmax(jnp.asarray(logits))
    got = threshold(jnp.asarray(logits), probs, jnp.asarray([1.0, 1.5, 1.0 + 1e-7], jnp.float32))
    np.testing.assert_array_equal(np.asarray(got), logits.min(axis=1))


def test_unreachable_target_gives_the_row_maximum_as_the_xla_search_does() -> None:
    rng = np.random.default_rng(4)
    logits = rng.normal(0, 1, (3, VOCAB)).astype(np.float32)
    # Masses summing to less than 1: targets of 1 (top_p 1e-9 and 0 round to it in float32) and above are never
    # reached, the case float rounding creates with a true softmax.
    probs = softmax(jnp.asarray(logits)) * 0.999
    top_ps = jnp.asarray([1e-9, 0.0, -0.5], jnp.float32)
    got = np.asarray(threshold(jnp.asarray(logits), probs, top_ps))
    np.testing.assert_array_equal(got, logits.max(axis=1))
    xla = jax.jit(jax.vmap(_search_threshold_probs))(jnp.asarray(logits), probs, top_ps)
    np.testing.assert_array_equal(got, np.asarray(xla))


def test_a_row_with_nan_does_not_disturb_the_others() -> None:
    rng = np.random.default_rng(5)
    logits = rng.normal(0, 1, (3, 4096)).astype(np.float32)
    logits[1, 17] = np.nan  # the sampler flags such a row as bad; its threshold may be anything
    top_ps = np.array([0.9, 0.9, 0.5], np.float32)
    probs = np.asarray(softmax(jnp.asarray(logits)))
    got = np.asarray(threshold(jnp.asarray(logits), jnp.asarray(probs), jnp.asarray(top_ps)))
    for r in (0, 2):
        assert got[r] == reference(logits[r], probs[r], top_ps[r])


def test_equals_the_xla_search() -> None:
    # The XLA search sums float32 masses, the kernel float64: they can differ only when a float32 masked sum
    # lands within rounding of the target, which continuous random logits do not produce.
    rng = np.random.default_rng(6)
    logits = jnp.asarray(np.concatenate([rng.normal(0, 0.5, (5, VOCAB)), rng.normal(0, 5, (5, VOCAB))]), jnp.float32)
    top_ps = jnp.asarray(TOP_PS * 2, jnp.float32)
    probs = softmax(logits)
    xla = jax.jit(jax.vmap(_search_threshold_probs))(logits, probs, top_ps)
    np.testing.assert_array_equal(np.asarray(threshold(logits, probs, top_ps)), np.asarray(xla))


def test_a_rows_threshold_does_not_depend_on_the_other_rows() -> None:
    rng = np.random.default_rng(7)
    logits = jnp.asarray(rng.normal(0, 2, (8, VOCAB)), jnp.float32)
    probs, top_ps = softmax(logits), jnp.asarray(rng.uniform(0.05, 0.99, 8), jnp.float32)
    together = np.asarray(threshold(logits, probs, top_ps))
    alone = [float(threshold(logits[r:r + 1], probs[r:r + 1], top_ps[r:r + 1])[0]) for r in range(8)]
    np.testing.assert_array_equal(together, np.array(alone, np.float32))
    vmapped = jax.jit(jax.vmap(kernels.nucleus_threshold))(logits, probs, top_ps)  # rank-1 rows under vmap
    np.testing.assert_array_equal(np.asarray(vmapped), together)


def test_mismatched_shapes_are_rejected_with_the_shapes() -> None:
    with pytest.raises(ValueError, match=r"\(2, 8\) and \(2, 9\)"):
        kernels.nucleus_threshold(jnp.zeros((2, 8)), jnp.zeros((2, 9)), jnp.ones((2,)))


def test_top_p_filter_keeps_the_same_logits_with_the_kernel() -> None:
    rng = np.random.default_rng(8)
    row = jnp.asarray(rng.normal(0, 3, (1, VOCAB)), jnp.float32)
    for p in (0.3, 0.9):
        top_p = jnp.full((1, 1), p, jnp.float32)
        np.testing.assert_array_equal(np.asarray(top_p_filter(row, top_p, native=True)),
                                      np.asarray(top_p_filter(row, top_p)))


def test_sampler_draws_the_same_tokens_with_the_kernel() -> None:
    rng = np.random.default_rng(9)
    b = 8
    logits = jnp.asarray(rng.normal(0, 3, (b, VOCAB)), jnp.float32)
    temperature = jnp.asarray([0.0, 0.7, 1.0, 1.3, 0.7, 0.5, 1.0, 0.0], jnp.float32)  # two greedy slots
    top_p = jnp.asarray([0.9, 1.0, 0.9, 0.95, 0.5, 0.999, 0.1, 1.0], jnp.float32)  # two slots skip the filter
    params = SamplingParams(temperature, top_p, jnp.ones((b, VOCAB), bool), jnp.ones((b,), bool),
                            jnp.full((b,), 8, jnp.int32))
    xla = jax.jit(sample_tokens)
    native = jax.jit(functools.partial(sample_tokens, nucleus=KernelNucleus()))
    for seed in (1, 2, 3):
        keys = jnp.stack([split_key(seed_key(jnp.uint32(seed * 100 + s)))[1] for s in range(b)])
        want, got = xla(keys, logits, params), native(keys, logits, params)
        for field in ("token", "prob", "top_ids", "top_probs", "bad"):
            np.testing.assert_array_equal(np.asarray(getattr(got, field)), np.asarray(getattr(want, field)), field)
