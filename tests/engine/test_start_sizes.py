"""A step's starting slots travel as [N] / [N, V] host arrays, N the least of the engine's start sizes holding them
(a step that starts one request moves 8 vocabulary-wide rows, not one per slot): the slots' state is the same bits
whichever size carried them, and after compile() no size compiles while serving."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from model_service.engine import START_ROWS, Engine
from model_service.loading import build_engine, resolve
from model_service.sampling_settings import SamplingSettings
from model_service.step_batch import SlotStart
from tests.engine.conftest import golden_server_config

SLOTS = 2 * START_ROWS


@pytest.fixture(scope="module")
def engine() -> Engine:
    config = golden_server_config(slots=SLOTS)
    built = build_engine(config, resolve(config))
    built.compile()
    return built


def starts(count: int, first: int = 0) -> tuple[SlotStart, ...]:
    settings = SamplingSettings(temperature=0.7, top_p=0.9, top_k=5, repetition_penalty=1.2, logit_bias=((7, 2.0),),
                                blocked=(9,), min_tokens=2, ends=(2,))
    return tuple(SlotStart(first + i, 100 + i, settings, (5 + i, 6, 7, 5 + i), (11,) * (i % 2))
                 for i in range(count))


def test_the_least_size_holding_the_starts_carries_them(engine: Engine) -> None:
    assert engine.start_sizes == (START_ROWS, SLOTS)
    assert [engine.start_size(n) for n in (0, 1, START_ROWS, START_ROWS + 1, SLOTS)] == [
        START_ROWS, START_ROWS, START_ROWS, SLOTS, SLOTS]
    assert engine._starts(starts(1))[0].shape == (START_ROWS,)
    assert engine._starts(starts(START_ROWS + 1))[0].shape == (SLOTS,)


def test_a_starts_state_is_the_same_bits_whichever_size_carried_it(engine: Engine) -> None:
    def started(size: int) -> list[np.ndarray]:
        state = engine.init_state()
        state = engine._start(state, *engine._starts(starts(3, first=4), size))
        state = engine._mask(state, *engine._masks(((5, np.arange(engine.vocab_size) % 3 == 0),), size))
        return [np.asarray(leaf) for leaf in jax.tree.leaves(state.slots)]

    small, full = started(START_ROWS), started(SLOTS)
    assert len(small) == len(full)
    for a, b in zip(small, full):
        assert a.dtype == b.dtype and np.array_equal(a, b)


def test_starting_few_or_many_slots_compiles_nothing_after_compile(engine: Engine,
                                                                   compilations: list[str]) -> None:
    state = engine.init_state()
    for count in (1, START_ROWS, START_ROWS + 1, SLOTS):
        state = engine._start(state, *engine._starts(starts(count)))
        state = engine._mask(state, *engine._masks(tuple((s, np.ones(engine.vocab_size, bool))
                                                         for s in range(count))))
    jax.block_until_ready(state)
    assert compilations == [], f"{len(compilations)} programs compiled after compile()"
