"""The extremes of every float control through the real golden engine: every probability it reports is
finite and in [0, 1] and every token is in the vocabulary. repetition_penalty=1e-38 (documented as any
value > 0, as vLLM's) divided positive logits into infinities and every probability became NaN; a
temperature of 1e-38 did the same through the reference's own division."""

from __future__ import annotations

import numpy as np
import pytest

from tests.engine.drive import generate

from model_service.sampling_settings import SamplingSettings
from model_service.validation import controls_problem, reference_problem
from model_service.engine import Engine
from tests.engine.test_controls_service import PROMPT

F32_MAX = float(np.finfo(np.float32).max)
TINY = 1e-38

EXTREMES = [
    ("temperature tiny", TINY, 1.0, dict()),
    ("temperature subnormal", 1e-45, 1.0, dict()),
    ("temperature huge", F32_MAX, 1.0, dict()),
    ("top_p tiny", 1.0, 1e-45, dict()),
    ("min_p 1", 1.0, 1.0, dict(min_p=1.0)),
    ("min_p tiny", 1.0, 1.0, dict(min_p=1e-45)),
    ("repetition tiny", 1.0, 1.0, dict(repetition_penalty=TINY)),
    ("repetition subnormal", 1.0, 1.0, dict(repetition_penalty=1e-45)),
    ("repetition huge", 1.0, 1.0, dict(repetition_penalty=F32_MAX)),
    ("repetition tiny, temperature tiny", TINY, 0.5, dict(repetition_penalty=TINY, min_p=0.5)),
    ("penalties -2", 1.0, 1.0, dict(presence_penalty=-2.0, frequency_penalty=-2.0)),
    ("penalties 2", 1.0, 1.0, dict(presence_penalty=2.0, frequency_penalty=2.0)),
    ("logit_bias +-100", TINY, 1.0, dict(logit_bias=tuple((t, 100.0 if t % 2 else -100.0)
                                                                      for t in range(0, 300)))),
    ("everything at once", TINY, 1e-45, dict(top_k=1, min_p=1.0, repetition_penalty=TINY,
                                                          presence_penalty=2.0, frequency_penalty=-2.0,
                                                          logit_bias=((5, 100.0), (6, -100.0)))),
]


def settings(temperature: float, top_p: float, controls: dict) -> SamplingSettings:
    return SamplingSettings(temperature=temperature, top_p=top_p, top_logprobs=8, **controls)


@pytest.mark.parametrize(("temperature", "top_p", "controls"), [e[1:] for e in EXTREMES], ids=[e[0] for e in EXTREMES])
def test_extreme_controls_report_finite_probabilities(golden_engine: Engine, temperature: float, top_p: float,
                                                      controls: dict) -> None:
    sampling = settings(temperature, top_p, controls)
    # every one of them is accepted
    assert reference_problem(sampling) == "" and controls_problem(sampling, golden_engine.vocab_size) == ""
    drawn = generate(golden_engine, PROMPT, sampling, 5, 4)  # later draws read the drawn tokens' history too
    steps = [(np.asarray([t]), np.asarray([p]), top[None]) for t, p, top in zip(drawn.tokens, drawn.probs, drawn.tops)]
    for token, prob, top in steps:
        assert 0 <= int(token[0]) < golden_engine.vocab_size
        assert np.all(np.isfinite(prob)) and np.all((prob > 0) & (prob <= 1)), prob
        assert np.all(np.isfinite(top)) and np.all((top >= 0) & (top <= 1)), top
