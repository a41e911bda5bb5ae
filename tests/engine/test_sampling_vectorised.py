"""The accelerators' sampler (sampling_vectorised.py): each draw's token the per-draw sampler's, its parts exactly
the searches they replace, and a greedy step that does no sampling work."""

from __future__ import annotations

from typing import Any

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest

from model_service.engine import Engine
from model_service.loading import build_engine, resolve
from model_service.logits_processing import History, idle_controls, kth_largest
from model_service.sampling import (
    KEPT_FLOOR,
    SamplingParams,
    _search_threshold_probs,
    categorical,
    sample_tokens,
    seed_key,
    split_key,
)
from model_service.sampling_vectorised import (
    CANDIDATES,
    draw_tokens,
    kth_values,
    monotone_keys,
    nucleus_thresholds,
    top_candidates,
)

from tests.engine.conftest import Runner, golden_server_config
from tests.engine.test_speculative import SPEC, requests, serve

SAMPLE = jax.jit(sample_tokens, static_argnames=("vectorised",))  # arguments, not constants: XLA folds constants
LARGE = 16384 + 37  # above the sort's and lax.top_k's sizes, not a whole number of chunks


def keys(n: int, first: int = 0) -> jax.Array:
    return jnp.stack([split_key(seed_key(jnp.uint32(first + s)))[1] for s in range(n)])


def rows(rng: np.random.Generator, scales: list[float], v: int = LARGE) -> jax.Array:
    return jnp.asarray(rng.normal(size=(len(scales), v)).astype(np.float32) * np.asarray(scales, np.float32)[:, None])


@pytest.mark.parametrize("m", [1, 20, CANDIDATES])
def test_top_candidates_are_lax_top_k_with_its_order_of_ties(m: int) -> None:
    rng = np.random.default_rng(m)
    tied = rng.integers(-3, 4, (2, LARGE)).astype(np.float32)  # thousands of equal values per row
    spread = rng.normal(size=(2, LARGE)).astype(np.float32)
    spread[1, -5:] = 100.0  # the largest in the padded last chunk
    x = jnp.asarray(np.concatenate([tied, spread]))
    got = jax.jit(top_candidates, static_argnums=1)(monotone_keys(x), m)
    assert np.array_equal(np.asarray(got), np.asarray(jax.lax.top_k(x, m)[1]))


def test_kth_values_are_the_searchs_kth_largest_with_ties_and_signed_zeros() -> None:
    rng = np.random.default_rng(1)
    x = np.round(rng.normal(size=(6, LARGE)), 1).astype(np.float32)
    x[2] = -np.abs(x[2])  # its 60th largest is a zero
    x[:, :50] = 0.0
    x[:, 50:100] = -0.0
    k = jnp.asarray([1, 7, 60, CANDIDATES, CANDIDATES + 1, 5000], jnp.int32)
    got = jax.jit(kth_values)(jnp.asarray(x), k, jnp.ones((6,), bool))
    want = jax.jit(jax.vmap(kth_largest))(jnp.asarray(x), k)
    assert np.array_equal(np.asarray(got), np.asarray(want))  # the same value (-0.0 may stand for +0.0)


def test_nucleus_thresholds_are_the_searchs_inside_and_beyond_the_candidates() -> None:
    rng = np.random.default_rng(2)
    # peaked rows keep a few ids (the candidates' bisection), flat ones most of the vocabulary (the search)
    x = rows(rng, [8.0, 8.0, 4.0, 0.5, 0.5, 8.0])
    x = x.at[2, :300].set(0.0).at[2, 300:600].set(-0.0)  # signed zeros
    x = x.at[5, 1000:].set(-1e10)  # a masked row
    top_p = jnp.asarray([0.9, 1e-9, 0.95, 0.95, 0.3, 0.999], jnp.float32)
    probs = jax.nn.softmax(x, axis=-1)
    got = jax.jit(nucleus_thresholds)(x, probs, top_p, jnp.ones((6,), bool))
    want = jax.jit(jax.vmap(_search_threshold_probs))(x, probs, top_p)
    assert np.array_equal(np.asarray(got), np.asarray(want))  # the same value (-0.0 may stand for +0.0)
    kept = np.sum(np.asarray(x) >= np.asarray(got)[:, None], axis=1)
    assert kept[0] < CANDIDATES and kept[3] > CANDIDATES  # both ways were taken


def test_draws_are_categoricals_whether_the_kept_entries_are_listed_or_not() -> None:
    rng = np.random.default_rng(3)
    x = np.array(rows(rng, [3.0] * 6))
    x[0, np.argsort(x[0])[:-40]] = -1e10  # 40 kept: listed
    x[1, np.argsort(x[1])[:-CANDIDATES]] = -1e10  # exactly CANDIDATES kept: listed
    x[2, np.argsort(x[2])[:-(CANDIDATES + 1)]] = -1e10  # one more: the whole row's draw
    x[3, :] = -1e10  # nothing above the floor
    x[4, np.argsort(x[4])[:-3]] = KEPT_FLOOR * 2
    k = keys(6, 7)
    got = jax.jit(draw_tokens)(k, jnp.asarray(x), jnp.ones((6,), bool))
    want = [int(categorical(k[i], jnp.asarray(x[i:i + 1]))) for i in range(6)]
    assert list(np.asarray(got)) == want


def _settings(v: int) -> tuple[SamplingParams, Any, History]:
    """Seven slots: greedy, greedy with alternatives, nucleus, every control, top-k beyond the candidates, min_p with
    min_tokens, and one that never draws."""
    s = 7
    params = SamplingParams(jnp.asarray([0, 0, 0.8, 0.7, 1.0, 1.2, 1.0], jnp.float32),
                            jnp.asarray([1, 0.9, 0.9, 0.95, 1, 1, 1], jnp.float32),
                            jnp.ones((s, v), bool).at[5, :v // 2].set(False), jnp.ones((s,), bool),
                            jnp.asarray([0, 5, 0, 20, 3, 0, 0], jnp.int32))
    c = idle_controls(s, v)
    c = c._replace(top_k=c.top_k.at[3].set(40).at[4].set(CANDIDATES + 50), min_p=c.min_p.at[5].set(0.05),
                   repetition=c.repetition.at[3].set(1.3), presence=c.presence.at[3].set(0.5),
                   frequency=c.frequency.at[3].set(0.2), bias_ids=c.bias_ids.at[3, 0].set(11),
                   bias=c.bias.at[3, 0].set(30.0), min_left=c.min_left.at[5].set(2),
                   ends=c.ends.at[5, 0].set(v - 1))
    rng = np.random.default_rng(4)
    history = History(jnp.asarray(rng.random((s, v)) < 0.01), jnp.asarray(rng.integers(0, 3, (s, v)), jnp.int32))
    return params, c, history


@pytest.mark.parametrize("v", [512, LARGE])
def test_each_draw_gets_the_per_draw_samplers_token(v: int) -> None:
    params, controls, history = _settings(v)
    rng = np.random.default_rng(v)
    logits = rows(rng, [4.0, 4.0, 8.0, 2.0, 4.0, 1.0, 4.0, 4.0], v)
    index = jnp.asarray([0, 1, 2, 3, 4, 5, 6, 3], jnp.int32)  # entry 7 draws again from slot 3 (a draft)
    used = jnp.asarray([1, 1, 1, 1, 1, 1, 0, 1], bool)
    pending = jnp.full((8, 2), v, jnp.int32).at[7, 0].set(11)
    chain = jnp.asarray([0, 0, 0, 0, 0, 0, 0, 1], jnp.int32)

    def run(vectorised: bool, controlled: bool) -> Any:
        extra = (controls, history) if controlled else (None, None)
        return SAMPLE(keys(8), logits, params, *extra, index=index, used=used, vectorised=vectorised,
                      pending=pending, chain=chain)

    for controlled in (False, True):
        want, got = run(False, controlled), run(True, controlled)
        for field in ("token", "top_ids", "bad"):
            assert np.array_equal(np.asarray(getattr(got, field)), np.asarray(getattr(want, field))), field
        # Probabilities: the same values, summed over [B, V] here and over [V] one draw at a time there.
        np.testing.assert_allclose(np.asarray(got.prob), np.asarray(want.prob), rtol=1e-6, atol=0)
        np.testing.assert_allclose(np.asarray(got.top_probs), np.asarray(want.top_probs), rtol=1e-6, atol=0)
        assert int(got.token[6]) == 0 and float(got.prob[6]) == 0  # the entry that does not draw


def _primitives(jaxpr: Any, into_conds: bool = True) -> set[str]:
    """The primitives a jaxpr runs, with those of its sub-jaxprs (of its conds' branches too, unless not into_conds)."""
    names = set()
    for eqn in jaxpr.eqns:
        names.add(eqn.primitive.name)
        if into_conds or eqn.primitive.name != "cond":
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                names |= _primitives(sub, into_conds)
    return names


def test_a_greedy_step_does_no_sampling_work_and_each_stage_runs_under_its_own_condition() -> None:
    v = LARGE
    params, controls, history = _settings(v)
    logits = jnp.zeros((4, v), jnp.float32)
    jaxpr = jax.make_jaxpr(lambda: sample_tokens(keys(4), logits, params, controls, history,
                                                 index=jnp.arange(4, dtype=jnp.int32), vectorised=True))().jaxpr
    [step] = [e for e in jaxpr.eqns if e.primitive.name == "cond"]  # one decision for the whole step
    greedy, sampled = (_primitives(b.jaxpr) for b in step.params["branches"])
    work = {"while", "scan", "top_k", "sort", "cond", "scatter-add", "shift_left"}  # searches, top-k, controls, noise
    assert not greedy & work, greedy & work
    assert {"scan", "top_k", "cond"} <= sampled
    # In a sampling step, each stage sits under a cond of its own: nothing but selects and cheap reductions run for a
    # stage no draw uses (the searches, the top-k's, the noise, the controls' scatters).
    outside = _primitives(step.params["branches"][1].jaxpr, into_conds=False)
    assert not outside & work - {"cond"}, outside & work


def test_the_generic_backend_draws_the_cpu_backends_tokens_with_every_control_drafts_and_n(
        golden_engine: Engine, running: Runner) -> None:
    """Greedy and seeded requests with every control, n = 2, min_tokens and speculative drafts (verified draws: the
    penalties' pending drafts, min_tokens's chain) through the scheduler: the same tokens on both backends."""
    config = golden_server_config(backend="generic", slots=4, speculative=SPEC)
    generic = build_engine(config, resolve(config))
    assert generic.model.backend.vectorised_sampling and not golden_engine.model.backend.vectorised_sampling
    reqs = requests(generic.vocab_size)
    cpu, on = running(golden_engine), running(generic, speculative=SPEC)
    for group in (reqs[:3], reqs[3:6], reqs[6:]):
        want, got = serve(cpu, group), serve(on, group)
        assert [{i: [t[0] for t in o.tokens] for i, o in r.items()} for r in got] == \
            [{i: [t[0] for t in o.tokens] for i, o in r.items()} for r in want]
        for r_got, r_want in zip(got, want):
            for i, o in r_got.items():  # probabilities within the two backends' logits' rounding
                np.testing.assert_allclose([t[1] for t in o.tokens], [t[1] for t in r_want[i].tokens], rtol=1e-4)


@pytest.mark.parametrize("v", [512, LARGE])
def test_a_draws_result_is_the_same_bits_whatever_else_its_step_asks_for(v: int) -> None:
    """A greedy draw alone (the greedy step), beside a sampled draw, and beside a draw with every control: the same
    token, probability and alternatives, bit for bit; likewise a nucleus draw beside greedy or controlled ones."""
    params, controls, history = _settings(v)
    logits = rows(np.random.default_rng(5), [4.0] * 7, v)

    def run(entries: list[int]) -> Any:
        index = jnp.asarray(entries, jnp.int32)
        return SAMPLE(keys(len(entries)), logits[index], params, controls, history, index=index, vectorised=True)

    for entry, others in ((0, [2, 3]), (2, [0, 3]), (1, [4, 5])):
        alone = run([entry, entry])
        for other in others:
            beside = run([entry, other])
            for field in ("token", "prob", "top_ids", "top_probs", "bad"):
                a, b = np.asarray(getattr(alone, field))[0], np.asarray(getattr(beside, field))[0]
                assert a.tobytes() == b.tobytes(), (entry, other, field, a, b)


def test_the_benchmark_draws_the_same_tokens_before_and_after() -> None:
    """benchmarks/sampler.py's points (the mapped sampler against this one) run and agree on every token."""
    from benchmarks.sampler import CASES, point

    for case in CASES:
        p = point(case, 3, LARGE, runs=1)
        assert p["tokens_equal"] and p["before_ms"] > 0 and p["after_ms"] > 0, p
