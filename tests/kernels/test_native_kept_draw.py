"""The draw among the entries the sampler's filters kept: the native listing (kernels.values_above) against NumPy,
and sampling.categorical_kept against the whole row's draw (sampling.categorical): the same token, bit for bit,
for rows the nucleus, top-k or the token mask filtered, for rows whose kept entries overflow every list, and for
rows where the shortcut must not be taken (everything masked, a NaN)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model_service import kernels
from model_service.ops.native import KernelNucleus
from model_service.ops.xla import SearchNucleus
from model_service.sampling import (
    KEPT_FLOOR,
    MASKED_LOGIT,
    _gumbel_at,
    _sample_filtered,
    categorical,
    categorical_kept,
    gumbel_noise,
    top_p_filter,
)

pytestmark = pytest.mark.skipif(not kernels.available(), reason="native kernels not built")
VOCAB = 131072

above = jax.jit(kernels.values_above, static_argnums=(1, 2))
kept_draw = jax.jit(categorical_kept, static_argnums=2)
whole_draw = jax.jit(lambda key, row: categorical(key, row[None]))


def listing(values: np.ndarray, floor: float, cap: int) -> tuple[np.ndarray, int, np.float32]:
    """NumPy's answer for one row: the indices above the floor (first cap), their count, the row's largest value."""
    hits = np.flatnonzero(values > np.float32(floor))
    top = np.float32(np.nan) if np.isnan(values).any() else values.max()
    return hits[:cap], len(hits), top


@pytest.mark.parametrize("v", [VOCAB, 1003, 7, 1])
@pytest.mark.parametrize("density", [0.0, 0.05, 0.5, 1.0])
def test_lists_the_values_above_the_floor_as_numpy_does(v: int, density: float) -> None:
    rng = np.random.default_rng(v + int(density * 100))
    rows = rng.normal(0, 3, (3, v)).astype(np.float32)
    rows[rng.random((3, v)) >= density] = MASKED_LOGIT
    cap = max(1, v // 4)
    ids, count, top = (np.asarray(a) for a in above(jnp.asarray(rows), KEPT_FLOOR, cap))
    for r in range(3):
        want_ids, want_count, want_top = listing(rows[r], KEPT_FLOOR, cap)
        assert count[r] == want_count
        np.testing.assert_array_equal(ids[r, :min(want_count, cap)], want_ids)
        assert top[r] == want_top


def test_a_nan_anywhere_makes_the_rows_top_nan_and_leaves_the_other_rows_alone() -> None:
    rows = np.full((2, 1001), MASKED_LOGIT, np.float32)
    rows[:, 5] = 1.0
    rows[0, 1000] = np.nan  # in the tail past the last whole step of eight
    _, count, top = above(jnp.asarray(rows), KEPT_FLOOR, 8)
    assert np.isnan(np.asarray(top)[0]) and np.asarray(top)[1] == 1.0
    assert list(np.asarray(count)) == [1, 1]


def filtered_rows(rng: np.random.Generator) -> list[tuple[str, jax.Array]]:
    """Rows as the sampler's filters leave them: the nucleus at several masses and shapes, a top-k cut, a token mask
    leaving a few ids, ties among the kept, more kept than the largest list, nothing filtered."""
    out = []
    for scale in (0.5, 3.0, 8.0):
        logits = jnp.asarray(rng.normal(0, scale, (1, VOCAB)).astype(np.float32))
        for top_p in (0.3, 0.9, 0.99):
            out.append((f"nucleus scale {scale} top_p {top_p}", top_p_filter(logits, jnp.array([[top_p]]), True)[0]))
    row = rng.normal(0, 2, VOCAB).astype(np.float32)
    kth = np.sort(row)[-40]
    out.append(("top-k 40", jnp.asarray(np.where(row >= kth, row, MASKED_LOGIT).astype(np.float32))))
    masked = np.full(VOCAB, MASKED_LOGIT, np.float32)
    masked[[3, 77, 131071]] = [0.5, 0.5, -2.0]  # a tie between the first two
    out.append(("mask of three ids, tied", jnp.asarray(masked)))
    wide = rng.normal(0, 1, VOCAB).astype(np.float32)
    wide[rng.random(VOCAB) < 0.5] = MASKED_LOGIT
    out.append(("half kept: past every list", jnp.asarray(wide)))
    out.append(("nothing filtered", jnp.asarray(rng.normal(0, 1, VOCAB).astype(np.float32))))
    return out


def test_the_kept_draw_is_the_whole_rows_draw_bit_for_bit() -> None:
    rng = np.random.default_rng(0)
    for name, row in filtered_rows(rng):
        for seed in range(12):
            key = jax.random.split(jax.random.PRNGKey(seed))[1]
            assert int(kept_draw(key, row, (2048, 8192, 32768))) == int(whole_draw(key, row)), (name, seed)


def test_small_lists_on_a_small_vocabulary_draw_the_same_tokens() -> None:
    rng = np.random.default_rng(1)
    for trial in range(40):
        row = rng.normal(0, 2, 1000).astype(np.float32)
        row[rng.random(1000) < rng.uniform(0.5, 1.0)] = MASKED_LOGIT  # 0-50 % kept: every list size and past them
        row[rng.integers(1000)] = 1.0  # at least one kept
        key = jax.random.PRNGKey(trial)
        assert int(kept_draw(key, jnp.asarray(row), (16, 64, 256))) == int(whole_draw(key, jnp.asarray(row)))


@pytest.mark.parametrize("kind", ["all masked", "kept just above the floor", "nan"])
def test_rows_the_shortcut_cannot_answer_take_the_whole_rows_draw(kind: str) -> None:
    row = np.full(VOCAB, MASKED_LOGIT, np.float32)
    if kind == "kept just above the floor":  # the row's largest value is not above the margin
        row[[10, 20]] = -9e8
    elif kind == "nan":
        row[[10, 20]] = [1.0, np.nan]
    for seed in range(6):
        key = jax.random.PRNGKey(seed)
        got, want = int(kept_draw(key, jnp.asarray(row), (2048,))), int(whole_draw(key, jnp.asarray(row)))
        assert got == want


def test_noise_for_some_counters_is_the_whole_rows_noise_at_them() -> None:
    key = jax.random.PRNGKey(7)
    ids = jnp.asarray(np.random.default_rng(2).choice(VOCAB, 5000, replace=False).astype(np.int32))
    np.testing.assert_array_equal(np.asarray(jax.jit(_gumbel_at)(key, ids)),
                                  np.asarray(jax.jit(gumbel_noise, static_argnums=1)(key, VOCAB))[np.asarray(ids)])


def test_a_sampled_slot_gives_the_same_token_and_probability_with_and_without_the_native_sampler() -> None:
    rng = np.random.default_rng(3)
    one = jax.jit(lambda key, logits, nucleus: _sample_filtered(
        key, logits, jnp.float32(0.7), jnp.float32(0.9), jnp.ones(VOCAB, bool), jnp.int32(0), nucleus=nucleus),
        static_argnums=2)
    for seed in range(10):
        logits, key = jnp.asarray(rng.normal(0, 3, VOCAB).astype(np.float32)), jax.random.PRNGKey(seed)
        native, xla = one(key, logits, KernelNucleus()), one(key, logits, SearchNucleus())
        assert int(native.token) == int(xla.token)
        assert np.float32(native.prob).tobytes() == np.float32(xla.prob).tobytes()
