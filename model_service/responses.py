"""Domain emissions -> GenerateResponse messages: what the model servicer sends for a request's tokens.

A Generate call's response is built per message (`to_response`); a GenerateMany request's decode-step news is
written in place inside the stream's next message (`fill_response`, `Straight`), with no response built and then
copied into it. No JAX here.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

from grok.model.v1 import model_pb2
from model_service.requests import Emission, FinishReason, Timings, TokenOut

FINISH = {
    FinishReason.LENGTH: model_pb2.FINISH_REASON_LENGTH,
    FinishReason.EOS: model_pb2.FINISH_REASON_EOS,
    FinishReason.CONTEXT_LENGTH: model_pb2.FINISH_REASON_CONTEXT_LENGTH,
    FinishReason.STOP_TOKEN: model_pb2.FINISH_REASON_STOP_TOKEN,
}


def _token(t: TokenOut) -> model_pb2.Token:
    if not t.top:  # the common case: no alternatives asked for, no list to build
        return model_pb2.Token(id=t.id, probability=t.prob, logprob=_log(t.prob))
    return model_pb2.Token(
        id=t.id, probability=t.prob, logprob=_log(t.prob),
        top_tokens=[model_pb2.TopToken(id=i, probability=p, logprob=_log(p)) for i, p in t.top])


def _log(p: float) -> float:
    return math.log(p) if p > 0 else -math.inf


def _timings(t: Timings) -> model_pb2.Timings:
    return model_pb2.Timings(queue_seconds=t.queue_seconds, prefill_seconds=t.prefill_seconds,
                             draft_tokens=t.draft_tokens, accepted_draft_tokens=t.accepted_draft_tokens,
                             draft_acceptance_rate=t.draft_acceptance_rate,
                             mean_step_seconds=t.mean_step_seconds)


def to_response(batch: list[Emission], details: bool = True) -> model_pb2.GenerateResponse:
    """One response for consecutive emissions of one sample (tokens concatenated, last state wins); `details`:
    each token's probability and alternatives too (a Token message each), else its id alone."""
    response = model_pb2.GenerateResponse()
    fill_response(response, batch, details)
    return response


def fill_response(response: model_pb2.GenerateResponse, batch: list[Emission], details: bool = True) -> None:
    """`to_response` written into `response` in place: a GenerateMany request's decode-step news is built inside
    the stream's outgoing message (no response built, then copied into it)."""
    if len(batch) > 1:  # several steps' news of one sample: their tokens and scored prompt joined, the last state
        batch = [dataclasses.replace(
            batch[-1], tokens=tuple(t for e in batch for t in e.tokens),
            timings=next((e.timings for e in reversed(batch) if e.timings is not None), None),
            prompt=tuple(t for e in batch if e.prompt for t in e.prompt) or None)]
    _fill(response, batch[0], details)


def _fill(response: model_pb2.GenerateResponse, emission: Emission, details: bool) -> None:
    """One emission's response, field by field: per token and per step, no generator and no message built
    beyond the one Token per token that `details` asks for."""
    tokens = emission.tokens
    response.token_ids.extend([t.id for t in tokens])
    if details:
        response.tokens.extend([_token(t) for t in tokens])
    if emission.finish_reason is not None:
        response.finish_reason = FINISH[emission.finish_reason]
    response.prompt_tokens = emission.prompt_tokens
    response.completion_tokens = emission.completion_tokens
    if emission.index:
        response.index = emission.index
    if emission.timings is not None:
        response.timings.CopyFrom(_timings(emission.timings))
    if emission.prompt:
        response.prompt_logprobs.extend([_token(t) for t in emission.prompt])


def to_responses(batch: list[Emission], details: bool = True) -> list[model_pb2.GenerateResponse]:
    """Responses for consecutive emissions of a request: one per sample, in the order the samples appear."""
    if len(batch) == 1:  # the common case: one step's news of one sample
        return [to_response(batch, details)]
    by_index: dict[int, list[Emission]] = {}
    for emission in batch:
        by_index.setdefault(emission.index, []).append(emission)
    return [to_response(run, details) for run in by_index.values()]


class Straight:
    """A GenerateMany request's decode-step emissions (one sample's each), written as its responses straight into
    the stream's outgoing message from the relay's delivery: one call per request per step."""

    __slots__ = ("details", "observe", "outbox")

    def __init__(self, details: bool, observe: Callable[[model_pb2.GenerateResponse], None] | None,
                 outbox: Callable[[], model_pb2.GenerateResponse]) -> None:
        self.details = details
        self.observe = observe  # None: the call's span is not recorded
        self.outbox = outbox

    def __call__(self, emission: Emission) -> None:
        response = self.outbox()
        _fill(response, emission, self.details)
        if self.observe is not None:
            self.observe(response)
