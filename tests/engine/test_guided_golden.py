"""Structured output on the real golden engine: a step's mask for a slot decides its draw, and a
constrained request's tokens are the same alone and beside other requests (batch-invariant)."""

from __future__ import annotations

import re
import threading

import numpy as np
import pytest

from model_service.constraint import Constraint, ConstraintKind
from model_service.engine import Engine
from model_service.requests import Emission, GenerationRequest
from model_service.sampling_settings import SamplingSettings
from model_service.scheduler import Scheduler
from model_service.step_batch import SlotStart
from model_service.structured import GrammarCompiler, Vocabulary
from tests.engine.conftest import Runner
from tests.engine.drive import Driver
from tests.procs import GOLDEN

REGEX = r"[a-z]{2,6}( [0-9]{1,3})?"


@pytest.fixture(scope="module")
def grammars(golden_engine: Engine) -> GrammarCompiler:
    return GrammarCompiler(Vocabulary(str(GOLDEN / "tokenizer.model")), golden_engine.vocab_size)


def test_a_step_mask_decides_the_slots_draw(golden_engine: Engine) -> None:
    d = Driver(golden_engine)
    only = np.zeros((golden_engine.vocab_size,), bool)
    only[77] = True
    start = SlotStart(2, 3, SamplingSettings(temperature=1.0), (5, 6, 7))
    out = d.step([(2, p, t) for p, t in enumerate((5, 6, 7))], [(2, 2)], [start], [(2, only)])
    assert int(out.token[0]) == 77
    for i in range(3):
        assert int(d.step([(2, 3 + i, None)], [(0, 2)], masks=[(2, only)]).token[0]) == 77


def collect(scheduler: Scheduler, request: GenerationRequest) -> tuple[list[int], threading.Event]:
    ids: list[int] = []
    done = threading.Event()

    def emit(e: Emission) -> None:
        ids.extend(t.id for t in e.tokens)
        if e.finish_reason is not None or e.error is not None:
            done.set()

    scheduler.submit(request, emit)
    return ids, done


def test_a_constrained_request_is_the_same_alone_and_in_a_batch(golden_engine: Engine, grammars: GrammarCompiler,
                                                              running: Runner) -> None:
    scheduler = running(golden_engine, grammars=grammars)
    constrained = GenerationRequest("c", (5, 6, 7, 8), SamplingSettings(temperature=1.0), seed=9, max_tokens=24,
                                    constraint=Constraint(ConstraintKind.REGEX, REGEX))
    alone, done = collect(scheduler, constrained)
    assert done.wait(120)
    others = [collect(scheduler, GenerationRequest(f"p{i}", (9, 10 + i), SamplingSettings(temperature=0.8),
                                                   seed=i, max_tokens=24, ignore_eos=True)) for i in range(3)]
    beside, done = collect(scheduler, constrained)
    assert done.wait(120) and all(d.wait(120) for _, d in others)
    assert beside == alone
    text = grammars.vocabulary.lltokenizer.decode_str([t for t in alone if t != golden_engine.eos_id])
    assert re.fullmatch(REGEX, text), text


def test_n_constrained_samples_each_follow_the_grammar_and_equal_their_seeds(
        golden_engine: Engine, grammars: GrammarCompiler, running: Runner) -> None:
    scheduler = running(golden_engine, grammars=grammars)
    request = GenerationRequest("n", (5, 6, 7, 8), SamplingSettings(temperature=1.0), seed=20, max_tokens=24, n=2,
                                constraint=Constraint(ConstraintKind.REGEX, REGEX))
    samples: dict[int, list[int]] = {0: [], 1: []}
    finished = threading.Event()
    ended: set[int] = set()

    def emit(e: Emission) -> None:
        samples[e.index].extend(t.id for t in e.tokens)
        if e.finish_reason is not None:
            ended.add(e.index)
        if len(ended) == 2 or e.error is not None:
            finished.set()

    scheduler.submit(request, emit)
    assert finished.wait(120)
    second, done = collect(scheduler, GenerationRequest("s", request.prompt, request.sampling, seed=21, max_tokens=24,
                                                        constraint=request.constraint))
    assert done.wait(120)
    assert samples[1] == second
    for ids in samples.values():
        text = grammars.vocabulary.lltokenizer.decode_str([t for t in ids if t != golden_engine.eos_id])
        assert re.fullmatch(REGEX, text), text
