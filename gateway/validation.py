"""Boundary checks of a Generate/Complete request, before and after the prompt is encoded.

`check_request` needs only the gateway's limits; `plan` needs the prompt's token count and the
model's configuration (context length, vocabulary, longest prompt) and fixes max_tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

from gateway.config import Limits
from gateway.errors import invalid
from grok.model.v1 import model_pb2


class TextRequest(Protocol):
    """The fields GenerateRequest and CompleteRequest share."""

    prompt: str
    max_tokens: int
    temperature: float
    top_p: float
    seed: int
    stop: list[str]
    ignore_eos: bool
    top_logprobs: int
    allowed_token_ids: list[int]
    blocked_token_ids: list[int]

    def HasField(self, name: str) -> bool: ...  # noqa: N802 (protobuf's name)


def check_request(request: TextRequest, limits: Limits) -> None:
    """Raise INVALID_ARGUMENT naming the first bad field of `request`."""
    if not request.prompt:
        raise invalid("prompt", "must be non-empty")
    size = len(request.prompt.encode("utf-8"))
    if size > limits.max_prompt_bytes:
        raise invalid("prompt", f"{size} bytes is over the limit of {limits.max_prompt_bytes} bytes")
    if request.HasField("max_tokens") and request.max_tokens < 1:
        raise invalid("max_tokens", f"must be >= 1 (got {request.max_tokens}); leave it unset for the default")
    if not math.isfinite(request.temperature) or request.temperature < 0:
        raise invalid("temperature", f"must be finite and >= 0 (got {request.temperature}); 0 means greedy")
    if request.HasField("top_p") and not (math.isfinite(request.top_p) and 0 < request.top_p <= 1):
        raise invalid("top_p", f"must be in (0, 1] (got {request.top_p}); leave it unset for 1.0")
    if not 0 <= request.top_logprobs <= limits.max_top_logprobs:
        raise invalid("top_logprobs", f"must be in 0..{limits.max_top_logprobs} (got {request.top_logprobs})")
    check_stops(list(request.stop), limits)


def check_stops(stops: list[str], limits: Limits) -> None:
    if len(stops) > limits.max_stop:
        raise invalid("stop", f"{len(stops)} stop sequences is over the limit of {limits.max_stop}")
    for index, stop in enumerate(stops):
        if not stop:
            raise invalid(f"stop[{index}]", "must be non-empty")
        if len(stop) > limits.max_stop_chars:
            raise invalid(f"stop[{index}]", f"{len(stop)} characters is over the limit of {limits.max_stop_chars}")


@dataclass(frozen=True)
class Plan:
    """What the gateway asks of the model once the prompt is encoded."""

    prompt_ids: tuple[int, ...]
    max_tokens: int


def plan(request: TextRequest, prompt_ids: list[int], info: model_pb2.GetInfoResponse, limits: Limits) -> Plan:
    """Check the encoded prompt and token ids against the model; choose max_tokens."""
    config = info.config
    vocab, context = config.vocab_size, config.sequence_len
    for field in ("allowed_token_ids", "blocked_token_ids"):
        for token in getattr(request, field):
            if not 0 <= token < vocab:
                raise invalid(field, f"token id {token} is outside the vocabulary [0, {vocab})")
    count = len(prompt_ids)
    if count == 0:
        raise invalid("prompt", "encodes to no tokens")
    longest = max(info.prefill_buckets) if info.prefill_buckets else context
    if count > longest:
        raise invalid("prompt", f"{count} tokens is over the longest prompt the model accepts ({longest} tokens)")
    if count >= context:
        raise invalid("prompt", f"{count} tokens leave no room to generate in the model's context of {context}")
    if request.HasField("max_tokens"):
        if count + request.max_tokens > context:
            raise invalid("max_tokens", f"prompt ({count} tokens) + max_tokens ({request.max_tokens}) is over the "
                          f"model's context of {context} tokens; lower max_tokens to at most {context - count}")
        return Plan(tuple(prompt_ids), request.max_tokens)
    return Plan(tuple(prompt_ids), min(limits.default_max_tokens, context - count))
