"""The accelerator's step (the generic backend, here on CPU): one program a step, compiled before serving for each
row bucket; a step runs the least bucket holding its rows, and serving compiles nothing more."""

from __future__ import annotations

import dataclasses
import os
import threading
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model_service.backend import row_buckets
from model_service.engine import Engine, accepted_draws, compile_threads
from model_service.loading import build_engine, resolve
from model_service.requests import GenerationRequest
from model_service.step_batch import empty_batch
from tests.engine.conftest import Runner, golden_requests, golden_server_config
from tests.engine.drive import serve_all
from tests.engine.test_engine_golden import golden_request


@pytest.fixture(scope="module")
def compiled() -> Engine:
    """The golden model on the generic backend, steps of 64 rows (buckets of 16 and 64), every program compiled;
    24 slots: more possible draws than the least bucket has rows."""
    config = golden_server_config(backend="generic", slots=24, step_tokens=64)
    engine = build_engine(config, resolve(config))
    engine.compile()
    return engine


def test_row_buckets_are_the_ones_below_the_step_then_the_step() -> None:
    assert row_buckets(512) == (16, 64, 128, 256, 512)
    assert row_buckets(1024) == (16, 64, 128, 256, 512, 1024)
    assert row_buckets(64) == (16, 64)
    assert row_buckets(8) == (8,)
    assert row_buckets(100, (32, 8, 32)) == (8, 32, 100)
    with pytest.raises(ValueError, match="positive"):
        row_buckets(64, (0,))


def test_a_step_runs_the_least_bucket_holding_its_rows(compiled: Engine) -> None:
    assert compiled.one_program and compiled.buckets == (16, 64)
    assert [compiled.rows_for(n) for n in (1, 16, 17, 64)] == [16, 16, 64, 64]
    assert sorted(compiled._compiled) == [16, 64]  # every bucket compiled ahead of serving


def test_buckets_compile_on_the_threads_asked_for(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GROK_COMPILE_THREADS", raising=False)
    assert compile_threads() == len(os.sched_getaffinity(0))
    monkeypatch.setenv("GROK_COMPILE_THREADS", "1")
    assert compile_threads() == 1
    for bad in ("0", "two", "-3"):
        monkeypatch.setenv("GROK_COMPILE_THREADS", bad)
        with pytest.raises(ValueError, match="GROK_COMPILE_THREADS"):
            compile_threads()


def test_serving_after_compile_compiles_no_program(compiled: Engine, running: Runner,
                                                   compilations: list[str]) -> None:
    cases = golden_requests()
    results = serve_all(running(compiled), [golden_request(c, i) for i, c in enumerate(cases)])
    assert results == [c["output_ids"] for c in cases]
    assert compilations == [], f"{len(compilations)} programs compiled while serving"


def test_the_guard_sees_a_compilation(compilations: list[str]) -> None:
    jax.jit(lambda x: x * 3 + 1)(jax.numpy.arange(7))  # a program never compiled before in this process
    assert compilations


def chained_reference(token, used, chain, nxt):
    """accepted_draws by its definition, entry by entry: draw j of a chain counts if it was used and every
    earlier draw of its chain was used and equalled the draft after it."""
    accepted, previous, matched = [], False, False
    for j, u, t, n in zip(chain.tolist(), used.tolist(), token.tolist(), nxt.tolist()):
        ok = u and (j == 0 or (previous and matched))
        accepted.append(ok)
        previous, matched = ok, t == n
    return np.array(accepted)


def test_accepted_draws_follow_each_chain_to_its_first_miss() -> None:
    rng = np.random.default_rng(0)
    for _ in range(200):
        p = int(rng.integers(1, 24))
        chain = np.concatenate([np.arange(int(rng.integers(1, 6))) for _ in range(p)])[:p].astype(np.int32)
        chain[0] = int(rng.integers(0, 2))  # sometimes a first entry that starts no chain
        token = rng.integers(0, 3, p).astype(np.int32)
        nxt = np.where(rng.random(p) < 0.2, -1, rng.integers(0, 3, p)).astype(np.int32)
        used = rng.random(p) < 0.9
        accepted, final = (np.asarray(a) for a in accepted_draws(*(jnp.asarray(a) for a in (token, used, chain, nxt))))
        want = chained_reference(token, used, chain, nxt)
        np.testing.assert_array_equal(accepted, want)
        following = np.concatenate([want[1:] & (chain[1:] > 0), [False]])
        np.testing.assert_array_equal(final, want & ~following)


def served(scheduler: Any, requests: list[GenerationRequest]) -> list[list[tuple[int, float, tuple]]]:
    """Every request's sample-0 tokens as (id, probability, alternatives), through a running scheduler."""
    results: list[list[tuple[int, float, tuple]]] = [[] for _ in requests]
    done = [threading.Event() for _ in requests]

    def collector(i: int) -> Any:
        def emit(emission: Any) -> None:
            if emission.index == 0:
                results[i].extend((t.id, t.prob, t.top) for t in emission.tokens)
            assert emission.error is None
            if emission.finish_reason is not None and emission.index == 0:
                done[i].set()
        return emit

    for i, request in enumerate(requests):
        scheduler.submit(request, collector(i))
    assert all(event.wait(120) for event in done), "requests did not finish"
    return results


def test_a_step_of_few_rows_draws_only_as_many_entries_as_its_bucket_has_rows(compiled: Engine,
                                                                              running: Runner) -> None:
    """The accelerator's program for a bucket of R rows samples at most R entries (each draws from a row of its
    own), not one per possible draw: a request decoding alone (the 16-row program: 16 entries of 24) or beside
    20 others (the 64-row program) gets the reference's ids and its own probabilities. (Equal to float32's
    rounding, not bit for bit: on this backend XLA's reductions follow the program's row count, so a row's
    bits may differ between buckets, as they did before the draws were cut; the CPU backend's are invariant.)"""
    e = compiled
    assert e.max_samples == 24 and e.buckets == (16, 64)
    tables = np.full((e.slots, e.table_len), e.num_blocks, np.int32)
    for rows, want in ((1, 16), (16, 16), (17, 24), (64, 24)):
        (packed, _), (draws, pending, _) = e.run_args(dataclasses.replace(empty_batch(e.max_rows, e.max_samples,
                                                                                      tables), rows=rows))
        assert packed.shape[1] == e.rows_for(rows) and draws.shape == (4, want) and pending.shape == (want, 0)
    cases = golden_requests()
    alone = [served(running(e), [golden_request(c, i)])[0] for i, c in enumerate(cases)]
    assert [[t[0] for t in out] for out in alone] == [c["output_ids"] for c in cases]
    crowd = [golden_request(cases[i % len(cases)], 100 + i) for i in range(20)]
    together = served(running(e), [golden_request(c, i) for i, c in enumerate(cases)] + crowd)
    for got, want in zip(together[:len(cases)] + together[len(cases):], alone + [alone[i % len(cases)]
                                                                                 for i in range(20)]):
        assert [t[0] for t in got] == [t[0] for t in want]
        np.testing.assert_allclose([t[1] for t in got], [t[1] for t in want], rtol=1e-5)



def _vocab_products(jaxpr: Any, vocab: int, inside: bool = False) -> list[bool]:
    """For each dot_general in `jaxpr` (and the jaxprs nested in it) with a vocabulary-wide output: whether it lies
    inside a conditional's branch."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general" and vocab in eqn.outvars[0].aval.shape:
            found.append(inside)
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    found += _vocab_products(inner, vocab, inside or eqn.primitive.name == "cond")
    return found


def test_a_step_that_draws_nothing_skips_the_unembedding_and_the_sampler(compiled: Engine) -> None:
    """In a bucket's program every vocabulary-wide product (the draws' unembedding, the prompt scores') runs inside
    a conditional: a step that draws nothing (a prompt's chunks before its last) skips the table's read (Grok-1
    width: 1.6 GB, ~2 ms on a v5e). Its draws come back zero and the slots' state is the one before the step, while
    the rows' keys and values still reach the pools."""
    e = compiled
    state = e.init_state()
    tables = np.full((e.slots, e.table_len), e.num_blocks, np.int32)
    tables[0, 0] = 0
    base = empty_batch(e.max_rows, e.max_samples, tables)
    rows = 5
    base.tokens[:rows], base.positions[:rows], base.seq[:rows] = np.arange(3, 3 + rows), np.arange(rows), 0
    batch = dataclasses.replace(base, rows=rows)
    args, draws = e.run_args(batch)
    products = _vocab_products(jax.make_jaxpr(e._program_impl)(e.params, state, *args, *draws).jaxpr, e.vocab_size)
    assert products and all(products), products
    before = jax.device_get(state.slots)
    pools_before = jax.device_get(state.pools)
    state, pending = e.step(state, batch)
    out = pending.get()
    assert not out.token.any() and not out.prob.any() and not out.top_probs.any() and not out.accepted.any()
    for a, b in zip(jax.tree.leaves(jax.device_get(state.slots)), jax.tree.leaves(before)):
        np.testing.assert_array_equal(a, b)
    assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(jax.device_get(state.pools)),
                                                        jax.tree.leaves(pools_before)))
