"""The scheduler's structured-output part (guided.py) against a fake engine that honours the masks: the first
draw may only start as the grammar allows, every later step's mask follows the grammar, a request ends when its
grammar is complete, a plain neighbour is untouched, and a constraint the service cannot serve is refused
before it is queued."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import pytest

from model_service.constraint import Constraint, ConstraintKind
from model_service.requests import ErrorKind, FinishReason, SchedulerError
from model_service.sampling_settings import GREEDY, SamplingSettings
from model_service.structured import GrammarCompiler, Guide, StepLimit, Vocabulary
from tests.engine.conftest import Runner
from tests.engine.fake_engine import FakeEngine, FakeOutput, FakePending, FakeState
from tests.engine.test_scheduler import Collector, req
from tests.procs import ROOT


@dataclass
class MaskingFake(FakeEngine):
    """FakeEngine over the demo vocabulary (its draws honour the step's masks)."""

    vocab_size: int = 2048  # demo/config.json
    sequence_len: int = 64


@pytest.fixture(scope="module")
def vocabulary() -> Vocabulary:
    return Vocabulary(str(ROOT / "demo" / "tokenizer.model"))


@pytest.fixture(scope="module")
def grammars(vocabulary: Vocabulary) -> Iterator[GrammarCompiler]:
    """One compiler (one worker process) for the module: MaskingFake's vocabulary is the demo tokenizer's."""
    compiler = GrammarCompiler(vocabulary, MaskingFake.vocab_size, workers=1)
    yield compiler
    compiler.close()


def text(vocabulary: Vocabulary, ids: list[int]) -> bytes:
    return b"".join(vocabulary.tokens[i] for i in ids if i != vocabulary.eos_token_id)


def test_a_regex_request_follows_its_grammar_and_ends_when_complete(running: Runner, vocabulary: Vocabulary,
                                                                   grammars: GrammarCompiler) -> None:
    engine = MaskingFake()
    sched = running(engine, grammars=grammars)
    out = Collector()
    sched.submit(req((5, 6, 7), max_tokens=40, constraint=Constraint(ConstraintKind.REGEX, "[0-9]{3}x")), out)
    out.wait()
    assert out.last.finish_reason is FinishReason.EOS
    produced = text(vocabulary, out.ids)
    assert len(produced) == 4 and produced[:3].isdigit() and produced.endswith(b"x"), produced
    assert sum(len(b.masks) for b in engine.steps) == len(out.ids)  # every draw of it had its mask


def test_a_plain_neighbour_is_untouched_by_a_constrained_one(running: Runner, vocabulary: Vocabulary,
                                                            grammars: GrammarCompiler) -> None:
    engine = MaskingFake(step_delay=0.01)  # the plain request is still decoding when the other arrives
    sched = running(engine, grammars=grammars)
    constrained_req = req((5,), max_tokens=12, constraint=Constraint(ConstraintKind.CHOICE, choices=("gateway",)))
    compiled = sched.guidance.compile(constrained_req)  # compiled before, as the servicer does: submit is instant
    plain, constrained = Collector(), Collector()
    sched.submit(req((40,), max_tokens=12, ignore_eos=True), plain)
    sched.submit(constrained_req, constrained, grammar=compiled)
    plain.wait()
    constrained.wait()
    assert plain.ids == list(range(41, 53))  # the fake's plain rule: t + 1
    assert text(vocabulary, constrained.ids) == b"gateway"
    started = [st.slot for b in engine.steps for st in b.starts]
    masked = {slot for b in engine.steps for slot, _ in b.masks}
    assert started == [0, 1] and masked == {1}  # side by side; only the constrained slot masked


def test_a_constraint_without_a_tokenizer_is_invalid_argument_naming_it(running: Runner) -> None:
    sched = running(FakeEngine())
    with pytest.raises(SchedulerError) as caught:
        sched.submit(req((5,), constraint=Constraint(ConstraintKind.REGEX, "a+")), Collector())
    assert caught.value.kind is ErrorKind.INVALID_ARGUMENT
    assert caught.value.message.startswith("constraint.regex: ") and "--tokenizer" in caught.value.message


def test_a_constraint_no_allowed_token_can_start_is_refused(running: Runner, vocabulary: Vocabulary,
                                                           grammars: GrammarCompiler) -> None:
    engine = MaskingFake()
    sched = running(engine, grammars=grammars)
    digits = [i for i, t in enumerate(vocabulary.tokens) if t[:1].isdigit()]
    with pytest.raises(SchedulerError, match="^constraint.regex: no token can start"):
        sched.submit(req((5,), blocked=tuple(digits), constraint=Constraint(ConstraintKind.REGEX, "[0-9]+")),
                     Collector())
    assert not engine.steps


def test_a_grammar_failing_mid_stream_ends_only_its_request(running: Runner, grammars: GrammarCompiler,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    engine = MaskingFake(step_delay=0.01)
    constraint = Constraint(ConstraintKind.REGEX, "[a-z]+")
    grammars.compile(constraint)  # cached with its first mask before the library "fails"

    def fail(self: Guide) -> np.ndarray:
        raise StepLimit("step fuel exhausted")

    monkeypatch.setattr(Guide, "mask", fail)
    sched = running(engine, grammars=grammars)
    plain, constrained = Collector(), Collector()
    sched.submit(req((40,), max_tokens=12, ignore_eos=True), plain)
    sched.submit(req((5,), max_tokens=12, constraint=constraint), constrained)
    constrained.wait()
    plain.wait()
    error = constrained.last.error
    assert error is not None and error.kind is ErrorKind.INVALID_ARGUMENT
    assert error.message.startswith("constraint.regex: too complex")
    assert plain.ids == list(range(41, 53)) and plain.last.finish_reason is FinishReason.LENGTH
