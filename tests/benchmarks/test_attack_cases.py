"""The attack command's KV-pressure cases that must succeed ask for what fits the context, whatever the prompt's
length in tokens (the demo model, `python -m benchmarks.attack`'s default, once got INVALID_ARGUMENT for the
repeated prompt: its prompt filled the context and left no room for the 8 tokens)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from benchmarks.attack_cases import Facts
from benchmarks.attack_pressure import pressure_cases

SEQUENCE_CALLS = ("kv-model-prefix-cache-same-tokens",)


class FittingModel:
    """A model stub that refuses, as the model service does, a prompt plus max_tokens beyond the context."""

    def __init__(self, context: int) -> None:
        self.context = context
        self.requests: list[Any] = []

    def Generate(self, request: Any, timeout: float) -> list[Any]:  # noqa: N802 - the gRPC method's name
        self.requests.append(request)
        assert len(request.token_ids) + request.max_tokens <= self.context, \
            f"{len(request.token_ids)} prompt tokens + {request.max_tokens} do not fit {self.context}"
        return []


@pytest.mark.parametrize("context", [64, 128, 256])
@pytest.mark.parametrize("prompt_len", range(1, 9))
def test_the_repeated_prompt_case_fits_the_context(context: int, prompt_len: int) -> None:
    facts = Facts(vocab=1024, context=context, bucket=context - 1, prompt="p", prompt_ids=tuple(range(3, 3 + prompt_len)),
                  slots=2, pieces=())
    case = next(c for c in pressure_cases(facts) if c.name in SEQUENCE_CALLS)
    model = FittingModel(context)
    case.call(SimpleNamespace(model=model))
    assert model.requests and len(model.requests[0].token_ids) > context // 2  # still a long prompt to cache
