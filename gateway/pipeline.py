"""One text request end to end: encode, model stream, incremental detokenization, stop sequences.

`Pipeline.stream` yields the GatewayService's GenerateResponse messages; Complete concatenates them.
Errors are raised as GatewayError (the shared interceptor turns them into statuses); whatever way the request
ends, the model call and the detokenizer stream are cancelled, which frees the model's slot.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from gateway.clients import Metadata, ModelPool, TokenizerClient
from gateway.config import Limits
from gateway.errors import down
from gateway.metrics import GatewayMetrics
from gateway.stops import Release, StopMatcher
from gateway.validation import Plan, TextRequest, check_request, plan
from grok.gateway.v1 import gateway_pb2
from grok.model.v1 import model_pb2

log = logging.getLogger(__name__)

FINISH = {
    model_pb2.FINISH_REASON_LENGTH: gateway_pb2.FINISH_REASON_LENGTH,
    model_pb2.FINISH_REASON_EOS: gateway_pb2.FINISH_REASON_EOS,
    model_pb2.FINISH_REASON_CONTEXT_LENGTH: gateway_pb2.FINISH_REASON_CONTEXT_LENGTH,
    model_pb2.FINISH_REASON_STOP_TOKEN: gateway_pb2.FINISH_REASON_STOP,
}


@dataclass
class Progress:
    """What one request has seen so far (for usage, timings and latency metrics)."""

    arrival: float
    tokenize_seconds: float = 0.0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    first_token_at: float | None = None
    last_token_at: float | None = None
    model_timings: model_pb2.Timings = field(default_factory=model_pb2.Timings)
    queue_seconds: float = 0.0
    prefill_seconds: float = 0.0


def model_request(request: TextRequest, planned: Plan, request_id: str) -> model_pb2.GenerateRequest:
    s = request.sampling
    out = model_pb2.GenerateRequest(
        token_ids=planned.prompt_ids, max_tokens=planned.max_tokens, temperature=s.temperature,
        ignore_eos=s.ignore_eos, top_logprobs=s.top_logprobs,
        allowed_token_ids=s.allowed_token_ids, blocked_token_ids=s.blocked_token_ids,
        request_id=request_id, top_k=s.top_k, min_p=s.min_p, presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty, logit_bias=dict(s.logit_bias), stop_token_ids=s.stop_token_ids)
    for name in ("top_p", "seed", "repetition_penalty"):
        if s.HasField(name):
            setattr(out, name, getattr(s, name))
    return out


def without_stop_token(reply: model_pb2.GenerateResponse) -> model_pb2.GenerateResponse:
    """A reply that ended on one of the request's stop_token_ids, less that token: its text is not returned (as
    vLLM does); usage still counts it."""
    out = model_pb2.GenerateResponse()
    out.CopyFrom(reply)
    del out.token_ids[-1:]
    if len(out.tokens) == len(reply.token_ids):
        del out.tokens[-1:]
    return out


class Pipeline:
    """Runs requests against the tokenizer service and the model pool."""

    def __init__(self, tokenizer: TokenizerClient, pool: ModelPool, limits: Limits, metrics: GatewayMetrics) -> None:
        self.tokenizer = tokenizer
        self.pool = pool
        self.limits = limits
        self.metrics = metrics

    async def stream(self, request: TextRequest, deadline: float | None, request_id: str,
                     method: str) -> AsyncIterator[gateway_pb2.GenerateResponse]:
        loop = asyncio.get_running_loop()
        progress = Progress(arrival=loop.time())
        check_request(request, self.limits)
        metadata: Metadata = (("x-request-id", request_id),)
        prompt_ids = await self.tokenizer.encode(request.prompt, deadline, metadata)
        progress.tokenize_seconds = loop.time() - progress.arrival
        planned = plan(request, prompt_ids, await self.pool.info(deadline), self.limits)
        progress.prompt_tokens = len(planned.prompt_ids)
        model_stream = await self.pool.generate(model_request(request, planned, request_id), deadline, metadata)
        detokenizer = None
        try:
            detokenizer = self.tokenizer.detokenizer(deadline, metadata)
            matcher = StopMatcher(request.sampling.stop)
            finish = gateway_pb2.FINISH_REASON_UNSPECIFIED
            release = Release()
            async for reply in model_stream.responses():
                self._observe(reply, progress, method)
                if reply.finish_reason == model_pb2.FINISH_REASON_STOP_TOKEN:
                    reply = without_stop_token(reply)
                _, token_texts = await detokenizer.push(reply.token_ids) if reply.token_ids else ("", [])
                tokens = await self._tokens(reply, token_texts, request.sampling.top_logprobs, deadline, metadata)
                release = matcher.feed(tokens)
                if release.stopped:
                    finish = gateway_pb2.FINISH_REASON_STOP
                    break
                if reply.finish_reason != model_pb2.FINISH_REASON_UNSPECIFIED:
                    finish = FINISH.get(reply.finish_reason, gateway_pb2.FINISH_REASON_LENGTH)
                    break
                if release.tokens:
                    yield gateway_pb2.GenerateResponse(text=release.text, tokens=release.tokens)
            else:
                log.warning("model stream ended without a finish reason",
                            extra={"replica": model_stream.replica.address})
                raise down("model", "it ended the stream without a finish reason (restarting?)")
            if finish != gateway_pb2.FINISH_REASON_STOP:
                await model_stream.drain()
                tail = matcher.finish(await detokenizer.finish())
                release = Release(release.tokens + tail.tokens, tail.stopped, tail.extra)
                finish = gateway_pb2.FINISH_REASON_STOP if tail.stopped else finish
            yield self._last(release, finish, progress, loop.time())
        finally:
            model_stream.close()
            if detokenizer is not None:
                detokenizer.cancel()

    def _observe(self, reply: model_pb2.GenerateResponse, progress: Progress, method: str) -> None:
        now = asyncio.get_running_loop().time()
        progress.prompt_tokens = reply.prompt_tokens or progress.prompt_tokens
        progress.completion_tokens = max(progress.completion_tokens, reply.completion_tokens)
        if reply.HasField("timings"):
            if progress.first_token_at is None:
                progress.queue_seconds = reply.timings.queue_seconds
                progress.prefill_seconds = reply.timings.prefill_seconds
            progress.model_timings = reply.timings
        if not reply.token_ids:
            return
        if progress.first_token_at is None:
            progress.first_token_at = now
            self.metrics.time_to_first_token.labels(method).observe(now - progress.arrival)
        elif progress.last_token_at is not None:
            per_token = (now - progress.last_token_at) / len(reply.token_ids)
            for _ in reply.token_ids:
                self.metrics.inter_token_latency.labels(method).observe(per_token)
        progress.last_token_at = now

    async def _tokens(self, reply: model_pb2.GenerateResponse, texts: list[str], top_logprobs: int,
                      deadline: float | None, metadata: Metadata) -> list[gateway_pb2.Token]:
        details = list(reply.tokens) if len(reply.tokens) == len(reply.token_ids) else [None] * len(reply.token_ids)
        alternatives: dict[int, str] = {}
        if top_logprobs:
            ids = [top.id for d in details if d is not None for top in d.top_tokens]
            alternatives = await self.tokenizer.piece_texts(ids, deadline, metadata)
        tokens = []
        for token_id, text, detail in zip(reply.token_ids, texts, details):
            token = gateway_pb2.Token(id=token_id, text=text)
            if detail is not None:
                token.probability, token.logprob = detail.probability, detail.logprob
                token.top_tokens.extend(
                    gateway_pb2.TopToken(id=top.id, text=alternatives.get(top.id, ""), probability=top.probability,
                                         logprob=top.logprob) for top in detail.top_tokens)
            tokens.append(token)
        return tokens

    def _last(self, release: Release, finish: int, progress: Progress, now: float) -> gateway_pb2.GenerateResponse:
        completion = progress.completion_tokens
        self.metrics.prompt_tokens.inc(progress.prompt_tokens)
        self.metrics.completion_tokens.inc(completion)
        first = progress.first_token_at if progress.first_token_at is not None else now
        timings = gateway_pb2.Timings(
            tokenize_seconds=progress.tokenize_seconds, queue_seconds=progress.queue_seconds,
            prefill_seconds=progress.prefill_seconds, mean_step_seconds=progress.model_timings.mean_step_seconds,
            time_to_first_token_seconds=first - progress.arrival, total_seconds=now - progress.arrival)
        usage = gateway_pb2.Usage(prompt_tokens=progress.prompt_tokens, completion_tokens=completion,
                                  total_tokens=progress.prompt_tokens + completion)
        return gateway_pb2.GenerateResponse(text=release.text, tokens=release.tokens, finish_reason=finish,
                                            usage=usage, timings=timings)
