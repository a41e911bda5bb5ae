"""sample_tokens: the reference's order of operations, masks, greedy, keys, batch invariance."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model_service.sampling import (
    SamplingParams,
    build_mask,
    categorical,
    gumbel_noise,
    first_argmax,
    seed_key,
    split_key,
    top_p_filter,
)
from model_service.sampling import sample_tokens as _sample_tokens

V = 6
sample_tokens = jax.jit(_sample_tokens)  # one compile per shape instead of op-by-op tracing


def params(temperature: list[float], top_p: list[float], mask: np.ndarray | None = None) -> SamplingParams:
    b = len(temperature)
    m = np.ones((b, V), bool) if mask is None else mask
    return SamplingParams(jnp.asarray(temperature, jnp.float32), jnp.asarray(top_p, jnp.float32), jnp.asarray(m),
                          jnp.ones((b,), bool), jnp.full((b,), 8, jnp.int32))


def keys(seeds: list[int]) -> jax.Array:
    return jnp.stack([split_key(seed_key(jnp.uint32(s)))[1] for s in seeds])


LOGITS = np.log(np.array([0.05, 0.05, 0.1, 0.2, 0.25, 0.35], np.float32))


def test_top_p_filter_keeps_the_smallest_set_reaching_the_mass() -> None:
    # ascending probs .05 .05 .1 .2 .25 .35, cumulative .05 .1 .2 .4 .65 1.0; 1 - 0.6 = 0.4 -> index 3 (0.2)
    out = np.asarray(top_p_filter(jnp.asarray(LOGITS[None]), jnp.full((1, 1), 0.6)))[0]
    assert np.allclose(out[3:], LOGITS[3:]) and np.all(out[:3] == -1e10)


def test_greedy_is_argmax_and_reports_probability_at_temperature_one() -> None:
    res = sample_tokens(keys([1]), jnp.asarray(LOGITS[None]), params([0.0], [1.0]))
    assert int(res.token[0]) == 5
    assert float(res.prob[0]) == pytest.approx(0.35, rel=1e-5)
    assert list(np.asarray(res.top_ids[0][:3])) == [5, 4, 3]
    assert np.allclose(np.asarray(res.top_probs[0][:3]), [0.35, 0.25, 0.2], rtol=1e-5)


def test_probability_comes_from_the_filtered_tempered_distribution() -> None:
    res = sample_tokens(keys([3]), jnp.asarray(LOGITS[None]), params([0.5], [0.6]))
    # At T=0.5 the probabilities square: .0104 .0104 .0417 .1667 .2604 .5104, so the 0.6 nucleus
    # (cumulative >= 0.4 from below) keeps only ids 4 and 5.
    kept = np.exp(LOGITS[4:] / 0.5)
    kept /= kept.sum()
    token = int(res.token[0])
    assert token in (4, 5)
    assert float(res.prob[0]) == pytest.approx(kept[token - 4], rel=1e-5)


def test_masked_and_pad_tokens_are_never_sampled() -> None:
    logits = np.zeros((1, V), np.float32)
    logits[0, 0] = 50.0  # pad would win every draw
    mask = build_mask(V, pad_id=0, allowed=(), blocked=(4,))
    draws = {int(sample_tokens(keys([s]), jnp.asarray(logits), params([1.0], [1.0], mask[None])).token[0])
             for s in range(40)}
    assert draws == {1, 2, 3, 5}


def test_allowed_ids_restrict_the_draw() -> None:
    mask = build_mask(V, pad_id=0, allowed=(2, 3), blocked=(3,))
    assert list(np.flatnonzero(mask)) == [2]


def test_seeded_draw_uses_the_second_half_of_split_prngkey() -> None:
    logits = jnp.asarray(np.random.default_rng(0).normal(size=(1, 64)).astype(np.float32))
    p = SamplingParams(jnp.ones((1,)), jnp.ones((1,)), jnp.ones((1, 64), bool), jnp.ones((1,), bool),
                       jnp.zeros((1,), jnp.int32))
    for seed in range(5):
        expected = jax.random.categorical(jax.random.split(jax.random.PRNGKey(seed))[1], logits)[0]
        assert int(sample_tokens(keys([seed]), logits, p).token[0]) == int(expected)


def test_a_slot_result_does_not_depend_on_the_other_slots() -> None:
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(4, 64)).astype(np.float32) * 3
    mask = np.ones((4, 64), bool)
    mask[2, :10] = False
    p4 = SamplingParams(jnp.asarray([0.7, 0.0, 1.3, 0.2]), jnp.asarray([0.9, 1.0, 0.5, 0.95]), jnp.asarray(mask),
                        jnp.ones((4,), bool), jnp.asarray([8, 0, 3, 8], jnp.int32))
    k4 = keys([11, 12, 13, 14])
    together = sample_tokens(k4, jnp.asarray(logits), p4)
    for i in range(4):
        one = SamplingParams(*(leaf[i:i + 1] for leaf in p4))
        alone = sample_tokens(k4[i:i + 1], jnp.asarray(logits[i:i + 1]), one)
        assert int(alone.token[0]) == int(together.token[i])
        assert float(alone.prob[0]) == float(together.prob[i])


def test_non_finite_logits_flag_only_their_slot() -> None:
    logits = np.zeros((2, V), np.float32)
    logits[1, 3] = np.nan
    res = sample_tokens(keys([1, 2]), jnp.asarray(logits), params([1.0, 1.0], [1.0, 1.0]))
    assert list(np.asarray(res.bad)) == [False, True]


def test_threshold_search_matches_the_reference_sort_rule() -> None:
    from model_service.sampling import _search_threshold, _sort_threshold

    rng = np.random.default_rng(5)
    rows = rng.normal(size=(12, 4096)).astype(np.float32) * rng.uniform(0.5, 6, size=(12, 1)).astype(np.float32)
    rows[3, :2000] = -1e10  # masked ids, as the sampler leaves them
    rows[4, 100:110] = rows[4, 99]  # ties at the top
    tops = np.array([0.1, 0.5, 0.9, 0.95, 0.99, 1.0, 0.3, 0.7, 0.8, 0.999, 0.6, 0.2], np.float32)
    search = jax.jit(jax.vmap(_search_threshold))(jnp.asarray(rows), jnp.asarray(tops))
    sort = jax.jit(jax.vmap(_sort_threshold))(jnp.asarray(rows[:, None]), jnp.asarray(tops[:, None, None]))
    assert np.array_equal(np.asarray(search), np.asarray(sort)[:, 0, 0])


def test_a_nucleus_too_small_to_reach_keeps_the_top_token_on_large_vocabularies() -> None:
    # top_p below float32's half-ulp of 1 makes the target 1 - top_p exactly 1, which a row whose float32
    # probabilities sum to a hair under 1 never reaches. The search must then keep the top logit: it used to
    # step one past it and mask every logit (token 0, probability NaN).
    v, b = 16384, 8
    logits = jnp.asarray(np.random.default_rng(0).normal(size=(b, v)), jnp.float32)
    assert np.any(np.asarray(jnp.sum(jax.nn.softmax(logits, axis=-1), axis=-1)) < 1)  # some row falls short
    p = SamplingParams(jnp.ones((b,)), jnp.full((b,), 1e-9, jnp.float32), jnp.ones((b, v), bool), jnp.ones((b,), bool),
                       jnp.zeros((b,), jnp.int32))
    res = sample_tokens(keys(list(range(b))), logits, p)
    assert list(np.asarray(res.token)) == list(np.asarray(jnp.argmax(logits, axis=-1)))
    assert np.all(np.asarray(res.prob) == 1)


def test_free_slots_are_not_sampled() -> None:
    p = params([1.0, 1.0], [1.0, 1.0])._replace(active=jnp.asarray([True, False]))
    res = sample_tokens(keys([1, 2]), jnp.asarray(np.stack([LOGITS, LOGITS])), p)
    assert float(res.prob[0]) > 0 and float(res.prob[1]) == 0 and not bool(res.bad[1])


def test_categorical_draw_is_bit_identical_to_jax_random_categorical() -> None:
    ours, reference = jax.jit(categorical), jax.jit(lambda k, r: jax.random.categorical(k, r)[0])
    rng = np.random.default_rng(3)
    for i in range(40):
        row = rng.standard_normal((1, [6, 1000, 131072][i % 3])).astype(np.float32) * rng.uniform(0.1, 30)
        if i % 4 == 0:
            row[0, : row.shape[1] // 2] = -1e10  # masked half, as the nucleus filter leaves it
        key = jax.random.PRNGKey(i)
        assert int(ours(key, jnp.asarray(row))) == int(reference(key, jnp.asarray(row)))


@pytest.mark.parametrize("n", [1, 7, 1000, 131072])
def test_gumbel_noise_is_bit_identical_to_jax_random_gumbel(n: int) -> None:
    ours = jax.jit(gumbel_noise, static_argnums=1)
    reference = jax.jit(lambda k: jax.random.gumbel(k, (1, n), jnp.float32)[0])
    for seed in (0, 1, 12345, 2**32 - 1):
        key = jax.random.split(jax.random.PRNGKey(seed))[1]  # a draw key, as the sampler's schedule makes them
        np.testing.assert_array_equal(np.asarray(ours(key, n)).view(np.uint32),
                                      np.asarray(reference(key)).view(np.uint32))


@pytest.mark.parametrize("values", [[1.0, 3.0, 3.0, 2.0], [1.0, np.nan, 3.0, np.nan], [-np.inf, -np.inf],
                                    [np.inf, 0.0, np.inf], [-0.0, 0.0]])
def test_first_argmax_matches_jnp_argmax_on_ties_nan_and_inf(values: list[float]) -> None:
    x = jnp.asarray(values, jnp.float32)
    assert int(jax.jit(first_argmax)(x)) == int(jnp.argmax(x))
