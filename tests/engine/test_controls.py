"""Issue 12's sampling controls against NumPy references of their definitions (vLLM's), their order of
operations, the exactness of "off", and batch invariance with the controls on."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model_service.logits_processing import Controls, History, controls_row, idle_controls, kth_largest
from model_service.sampling import TOP_K, SamplingParams, seed_key, split_key
from model_service.sampling import sample_tokens as _sample_tokens
from model_service.sampling_settings import GREEDY, MAX_LOGIT_BIAS, SamplingSettings
from model_service.validation import controls_problem

sample_tokens = jax.jit(_sample_tokens)
MASKED = -1e10


def empty_history(slots: int, vocab_size: int) -> History:
    return History(jnp.zeros((slots, vocab_size), bool), jnp.zeros((slots, vocab_size), jnp.int32))


# ---- NumPy references ---------------------------------------------------------------------------------
def np_penalties(logits: np.ndarray, prompt: np.ndarray, counts: np.ndarray, rep: float, pres: float,
                 freq: float) -> np.ndarray:
    """vLLM's apply_penalties for one row."""
    out = logits.astype(np.float32).copy()
    seen = prompt | (counts > 0)
    pos = seen & (out > 0)
    neg = seen & (out <= 0)
    out[pos] /= np.float32(rep)
    out[neg] *= np.float32(rep)
    out -= np.float32(freq) * counts.astype(np.float32)
    out -= np.float32(pres) * (counts > 0).astype(np.float32)
    return out


def np_top_p(row: np.ndarray, top_p: float) -> np.ndarray:
    """The reference's nucleus rule: threshold = first ascending logit whose cumulative mass >= 1 - top_p."""
    if top_p >= 1:
        return row
    asc = np.sort(row)
    p = np.exp(asc - asc.max())
    cum = np.cumsum(p / p.sum())
    threshold = asc[np.argmax(cum >= 1 - top_p)]
    return np.where(row >= threshold, row, MASKED)


def np_distribution(logits: np.ndarray, c: SamplingSettings, temperature: float, top_p: float,
                    mask: np.ndarray, prompt: np.ndarray, counts: np.ndarray, drawn: int = 0) -> np.ndarray:
    """The filtered distribution a slot draws from after `drawn` draws: sampling_settings.py's order of operations,
    in NumPy."""
    if drawn < c.min_tokens:  # vLLM's min_tokens: the ending ids are -inf, unless nothing else is left
        held = mask.copy()
        held[list(c.ends)] = False
        mask = held if held.any() else mask
    x = logits.astype(np.float32).copy()
    for token, bias in c.logit_bias:
        x[token] += np.float32(bias)
    x = np_penalties(x, prompt, counts, c.repetition_penalty, c.presence_penalty, c.frequency_penalty)
    x = np.where(mask, x / np.float32(temperature if temperature > 0 else 1.0), MASKED)
    if 0 < c.top_k < x.size:
        x = np.where(x >= np.sort(x)[-c.top_k], x, MASKED)
    x = np_top_p(x, top_p)
    if c.min_p > 0:
        p = np.exp(x - x.max())
        p /= p.sum()
        x = np.where(p >= c.min_p * p.max(), x, MASKED)
    p = np.exp(x - x.max())
    return p / p.sum()


# ---- helpers ----------------------------------------------------------------------------------------------
def draw_keys(seeds: list[int]) -> jax.Array:
    return jnp.stack([split_key(seed_key(jnp.uint32(s)))[1] for s in seeds])


def params(temps: list[float], tops: list[float], mask: np.ndarray) -> SamplingParams:
    b = len(temps)
    return SamplingParams(jnp.asarray(temps, jnp.float32), jnp.asarray(tops, jnp.float32), jnp.asarray(mask),
                          jnp.ones((b,), bool), jnp.full((b,), 8, jnp.int32))


def stack_controls(cs: list[SamplingSettings], vocab: int) -> Controls:
    rows = [controls_row(c, vocab) for c in cs]
    return Controls(*(jnp.asarray(np.concatenate(leaves)) for leaves in zip(*rows)))


CASES = [
    SamplingSettings(logit_bias=((3, 5.0), (0, -100.0), (7, 2.5))),
    SamplingSettings(repetition_penalty=1.8),
    SamplingSettings(repetition_penalty=0.6, presence_penalty=0.7, frequency_penalty=-0.4),
    SamplingSettings(presence_penalty=-1.5, frequency_penalty=2.0),
    SamplingSettings(top_k=3),
    SamplingSettings(top_k=1),
    SamplingSettings(min_p=0.2),
    SamplingSettings(top_k=5, min_p=0.05, repetition_penalty=1.3, frequency_penalty=0.5,
                     logit_bias=((1, 3.0), (6, -2.0))),
    SamplingSettings(min_tokens=1, ends=(3, 5)),
    SamplingSettings(min_tokens=4, ends=(2,), logit_bias=((2, 20.0),), top_k=2),  # the ending id would win
    SamplingSettings(min_tokens=2, ends=tuple(range(8))),  # only ending ids may be drawn: they still are
]


@pytest.mark.parametrize("c", CASES, ids=range(len(CASES)))
@pytest.mark.parametrize("temperature,top_p", [(0.7, 1.0), (1.3, 0.8), (0.0, 1.0)])
def test_each_control_gives_the_numpy_reference_distribution(c: SamplingSettings, temperature: float,
                                                             top_p: float) -> None:
    # V = 8 = the alternatives reported, so top_ids/top_probs are the whole filtered distribution.
    v, b = 8, 3
    rng = np.random.default_rng(7)
    logits = rng.normal(size=(b, v)).astype(np.float32) * 2
    logits[1] -= 1.0  # negative logits too, for the repetition rule's two branches
    mask = np.ones((b, v), bool)
    mask[2, 4] = False
    prompt = rng.random((b, v)) < 0.4
    counts = rng.integers(0, 3, (b, v)).astype(np.int32)
    res = sample_tokens(draw_keys([1, 2, 3]), jnp.asarray(logits), params([temperature] * b, [top_p] * b, mask),
                        stack_controls([c] * b, v), History(jnp.asarray(prompt), jnp.asarray(counts)))
    for i in range(b):
        want = np_distribution(logits[i], c, temperature, top_p, mask[i], prompt[i], counts[i])
        got = np.zeros(v, np.float32)
        got[np.asarray(res.top_ids[i])] = np.asarray(res.top_probs[i])
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-7)
        token = int(res.token[i])
        assert want[token] > 0
        if temperature == 0:
            assert token == int(np.argmax(want))


def test_top_k_and_min_p_on_a_large_vocabulary_match_numpy() -> None:
    # Past SORT_MAX_VOCAB: the top-k threshold is a search, top_p the reference's binary search.
    v = 20000
    rng = np.random.default_rng(3)
    logits = (rng.normal(size=(2, v)) * 3).astype(np.float32)
    logits[0, 100:120] = logits[0].max()  # ties at the top: all kept by top-k 5
    mask = np.ones((2, v), bool)
    cs = [SamplingSettings(top_k=5), SamplingSettings(top_k=40, min_p=0.3)]
    res = sample_tokens(draw_keys([4, 5]), jnp.asarray(logits), params([0.9, 1.0], [1.0, 0.95], mask),
                        stack_controls(cs, v), empty_history(2, v))
    for i, (c, t, p) in enumerate(zip(cs, [0.9, 1.0], [1.0, 0.95])):
        want = np_distribution(logits[i], c, t, p, mask[i], np.zeros(v, bool), np.zeros(v, np.int32))
        top = np.sort(want)[::-1][:TOP_K]
        np.testing.assert_allclose(np.asarray(res.top_probs[i]), top, rtol=2e-5, atol=1e-7)
        assert want[int(res.token[i])] > 0


def test_kth_largest_is_exact_with_ties_masks_and_signed_zeros() -> None:
    rng = np.random.default_rng(11)
    rows = [rng.normal(size=300).astype(np.float32) * 4, np.full(50, 2.0, np.float32),
            np.array([-0.0, 0.0, -1.0, 3.0, -1e10, -1e10], np.float32), rng.integers(-3, 3, 200).astype(np.float32)]
    f = jax.jit(kth_largest)
    for row in rows:
        for k in {1, 2, 3, len(row) // 2, len(row)}:
            assert float(f(jnp.asarray(row), jnp.int32(k))) == float(np.sort(row)[-k])


def test_drawn_tokens_stay_in_the_top_k() -> None:
    v = 64
    logits = np.random.default_rng(2).normal(size=(1, v)).astype(np.float32)
    allowed = set(np.argsort(logits[0])[-4:].tolist())
    c = stack_controls([SamplingSettings(top_k=4)], v)
    draws = {int(sample_tokens(draw_keys([s]), jnp.asarray(logits), params([2.0], [1.0], np.ones((1, v), bool)),
                               c, empty_history(1, v)).token[0]) for s in range(60)}
    assert draws <= allowed and len(draws) > 1


def test_controls_off_are_bit_identical_to_the_reference_sampler() -> None:
    v, b = 1000, 6
    rng = np.random.default_rng(4)
    logits = jnp.asarray((rng.normal(size=(b, v)) * 5).astype(np.float32))
    mask = np.ones((b, v), bool)
    mask[1, :300] = False
    p = params([0.0, 0.7, 1.0, 1.5, 0.3, 1.0], [1.0, 0.9, 0.5, 1.0, 0.99, 1.0], mask)
    keys = draw_keys([9, 8, 7, 6, 5, 4])
    history = History(jnp.asarray(rng.random((b, v)) < 0.5), jnp.asarray(rng.integers(0, 4, (b, v)), jnp.int32))
    plain = sample_tokens(keys, logits, p)
    off = sample_tokens(keys, logits, p, idle_controls(b, v), history)
    for a, c in zip(plain, off):
        assert np.array_equal(np.asarray(a), np.asarray(c))


def test_a_slot_with_controls_does_not_depend_on_its_neighbours() -> None:
    v, b = 256, 4
    rng = np.random.default_rng(6)
    logits = jnp.asarray((rng.normal(size=(b, v)) * 3).astype(np.float32))
    p = params([0.8, 0.0, 1.2, 0.5], [1.0, 0.9, 0.7, 1.0], np.ones((b, v), bool))
    cs = stack_controls([CASES[-1], GREEDY, SamplingSettings(top_k=10, presence_penalty=1.0),
                         SamplingSettings(min_p=0.1, logit_bias=((5, 50.0),))], v)
    history = History(jnp.asarray(rng.random((b, v)) < 0.3), jnp.asarray(rng.integers(0, 3, (b, v)), jnp.int32))
    keys = draw_keys([1, 2, 3, 4])
    together = sample_tokens(keys, logits, p, cs, history)
    for i in range(b):
        one = lambda tree: jax.tree.map(lambda x: x[i:i + 1], tree)  # noqa: E731
        alone = sample_tokens(keys[i:i + 1], logits[i:i + 1], one(p), one(cs), one(history))
        for a, t in zip(alone, together):
            assert np.array_equal(np.asarray(a)[0], np.asarray(t)[i])


def test_min_tokens_bars_the_ending_ids_from_the_draws_before_it_and_no_later_one() -> None:
    """Entry i is its slot's `chain[i]`-th draw this step; a slot resumed after `drawn` draws bars fewer."""
    v = 8
    rng = np.random.default_rng(11)
    logits = rng.normal(size=(5, v)).astype(np.float32)
    logits[:, 6] = 30.0  # greedy takes the ending id 6 whenever it may
    settings = SamplingSettings(min_tokens=3, ends=(6, 0))
    slot_rows = [controls_row(settings, v), controls_row(settings, v, drawn=2)]
    cs = Controls(*(jnp.asarray(np.concatenate(leaves)) for leaves in zip(*slot_rows)))
    assert np.asarray(cs.min_left).tolist() == [3, 1]
    index = jnp.asarray([0, 0, 0, 0, 1], jnp.int32)  # slot 0 draws four times this step, slot 1 once
    chain = jnp.asarray([0, 1, 2, 3, 0], jnp.int32)
    res = sample_tokens(draw_keys([1] * 5), jnp.asarray(logits), params([0.0, 0.0], [1.0, 1.0], np.ones((2, v), bool)),
                        cs, empty_history(2, v), index=index, used=jnp.ones(5, bool), chain=chain)
    tokens = np.asarray(res.token).tolist()
    assert tokens[3] == 6 and all(t == int(np.argmax(np.where(np.arange(v) % 6 == 0, -np.inf, logits[i])))
                                  for i, t in enumerate(tokens[:3]))
    assert tokens[4] == int(np.argmax(np.where(np.arange(v) % 6 == 0, -np.inf, logits[4])))




@pytest.mark.parametrize("c,field", [
    (SamplingSettings(top_k=-2), "top_k"), (SamplingSettings(min_p=1.5), "min_p"),
    (SamplingSettings(min_p=float("nan")), "min_p"), (SamplingSettings(repetition_penalty=0.0), "repetition_penalty"),
    (SamplingSettings(presence_penalty=2.5), "presence_penalty"),
    (SamplingSettings(frequency_penalty=-3.0), "frequency_penalty"),
    (SamplingSettings(logit_bias=((10, 1.0),)), "logit_bias"), (SamplingSettings(logit_bias=((1, 101.0),)), "logit_bias"),
    (SamplingSettings(logit_bias=((1, 1.0), (1, 2.0))), "logit_bias"),
    (SamplingSettings(logit_bias=tuple((i, 1.0) for i in range(MAX_LOGIT_BIAS + 1))), "logit_bias"),
])
def test_out_of_range_controls_are_named(c: SamplingSettings, field: str) -> None:
    assert controls_problem(c, 10 if field != "logit_bias" or len(c.logit_bias) < 5 else 1000).startswith(f"{field}:")
    assert controls_problem(SamplingSettings(top_k=-1, min_p=1.0, repetition_penalty=0.01, presence_penalty=-2.0,
                                             frequency_penalty=2.0, logit_bias=((9, -100.0),)), 10) == ""
