"""The scheduler's structured-output part (guided.py) against a fake engine that honours the masks: the first
draw may only start as the grammar allows, every later step's mask follows the grammar, a request ends when its
grammar is complete, a plain neighbour is untouched, and a constraint the service cannot serve is refused
before it is queued."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import pytest

from model_service.constraint import Constraint, ConstraintKind
from model_service.requests import ErrorKind, FinishReason, SchedulerError
from model_service.sampling_settings import GREEDY, SamplingSettings
from model_service.structured import GrammarCompiler, Guide, Vocabulary
from tests.engine.conftest import Runner
from tests.engine.fake_engine import FakeEngine, FakeOutput, FakePending, FakeState
from tests.engine.test_scheduler import Collector, req
from tests.procs import ROOT


@dataclass
class MaskingFake(FakeEngine):
    """FakeEngine over the demo vocabulary whose draw is the first allowed id after the slot's last token
    (cyclically): t + 1 when the mask allows it, as the plain fake."""

    vocab_size: int = 1024
    sequence_len: int = 64
    buckets: tuple[int, ...] = (8,)
    masks: dict[int, np.ndarray] = field(default_factory=dict)

    def _next(self, last: int, mask: np.ndarray | None) -> int:
        for step in range(1, self.vocab_size + 1):
            t = (last + step) % self.vocab_size
            if mask is None or mask[t]:
                return t
        raise AssertionError("empty mask")

    def prefill(self, tokens: Sequence[int], sampling: SamplingSettings = GREEDY, *, seed: int,
                prompt_logprobs: int | None = None) -> tuple[int, FakeOutput]:
        self._log("prefill", tuple(tokens))
        mask = None
        if sampling.allowed:
            mask = np.zeros((self.vocab_size,), bool)
            mask[list(sampling.allowed)] = True
        first = self._next(tokens[-1], mask)
        return first, self._out(np.array([first]))

    def generate(self, state: FakeState) -> tuple[FakeState, FakePending]:
        self._log("generate")
        time.sleep(self.step_delay)
        nxt = np.array([self._next(int(t), self.masks.get(s)) for s, t in enumerate(state.last)])
        return FakeState(nxt), FakePending(self._out(nxt))

    def set_slot_mask(self, state: FakeState, slot: int, mask: np.ndarray) -> FakeState:
        self._log("mask", slot)
        self.masks[slot] = mask
        return state

    def free_slot(self, state: FakeState, slot: int) -> FakeState:
        self.masks.pop(slot, None)
        return super().free_slot(state, slot)


@pytest.fixture(scope="module")
def vocabulary() -> Vocabulary:
    return Vocabulary(str(ROOT / "demo" / "tokenizer.model"))


def text(vocabulary: Vocabulary, ids: list[int]) -> bytes:
    return b"".join(vocabulary.tokens[i] for i in ids if i != vocabulary.eos_token_id)


def test_a_regex_request_follows_its_grammar_and_ends_when_complete(running: Runner, vocabulary: Vocabulary) -> None:
    engine = MaskingFake()
    sched = running(engine, grammars=GrammarCompiler(vocabulary, engine.vocab_size))
    out = Collector()
    sched.submit(req((5, 6, 7), max_tokens=40, constraint=Constraint(ConstraintKind.REGEX, "[0-9]{3}x")), out)
    out.wait()
    assert out.last.finish_reason is FinishReason.EOS
    produced = text(vocabulary, out.ids)
    assert len(produced) == 4 and produced[:3].isdigit() and produced.endswith(b"x"), produced
    assert engine.count("mask") >= 1


def test_a_plain_neighbour_is_untouched_by_a_constrained_one(running: Runner, vocabulary: Vocabulary) -> None:
    engine = MaskingFake(step_delay=0.01)  # the plain request is still decoding when the other arrives
    sched = running(engine, grammars=GrammarCompiler(vocabulary, engine.vocab_size))
    plain, constrained = Collector(), Collector()
    sched.submit(req((40,), max_tokens=12, ignore_eos=True), plain)
    sched.submit(req((5,), max_tokens=12, constraint=Constraint(ConstraintKind.CHOICE, choices=("gateway",))),
                 constrained)
    plain.wait()
    constrained.wait()
    assert plain.ids == list(range(41, 53))  # the fake's plain rule: t + 1
    assert text(vocabulary, constrained.ids) == b"gateway"
    inserted = [c[1] for c in engine.calls if c[0] == "insert"]
    masked = {c[1] for c in engine.calls if c[0] == "mask"}
    assert inserted == [0, 1] and masked == {1}, engine.calls  # side by side; only the constrained slot masked


def test_a_constraint_without_a_tokenizer_is_invalid_argument_naming_it(running: Runner) -> None:
    sched = running(FakeEngine())
    with pytest.raises(SchedulerError) as caught:
        sched.submit(req((5,), constraint=Constraint(ConstraintKind.REGEX, "a+")), Collector())
    assert caught.value.kind is ErrorKind.INVALID_ARGUMENT
    assert caught.value.message.startswith("constraint.regex: ") and "--tokenizer" in caught.value.message


def test_a_constraint_no_allowed_token_can_start_is_refused(running: Runner, vocabulary: Vocabulary) -> None:
    engine = MaskingFake()
    sched = running(engine, grammars=GrammarCompiler(vocabulary, engine.vocab_size))
    digits = [i for i, t in enumerate(vocabulary.tokens) if t[:1].isdigit()]
    with pytest.raises(SchedulerError, match="^constraint.regex: no token can start"):
        sched.submit(req((5,), blocked=tuple(digits), constraint=Constraint(ConstraintKind.REGEX, "[0-9]+")),
                     Collector())
    assert engine.count("prefill") == 0


def test_a_grammar_failing_mid_stream_ends_only_its_request(running: Runner, vocabulary: Vocabulary,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    engine = MaskingFake(step_delay=0.01)
    grammars = GrammarCompiler(vocabulary, engine.vocab_size)
    constraint = Constraint(ConstraintKind.REGEX, "[a-z]+")
    grammars.compile(constraint)  # cached with its first mask before the library "fails"

    def fail(self: Guide) -> np.ndarray:
        raise RuntimeError("step fuel exhausted")

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
