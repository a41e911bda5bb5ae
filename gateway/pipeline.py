"""One text request end to end: encode, model stream, incremental detokenization, stop sequences.

`Pipeline.stream` yields the GatewayService's GenerateResponse messages; Complete concatenates them.
Errors are raised as GatewayError (the shared interceptor turns them into statuses); whatever way the request
ends, the model call and the detokenizer stream are cancelled, which frees the model's slot. Ids become
text in-process over the tokenizer service's piece table (the default), or through its DecodeStream with
`--detokenize remote` (gateway.detokenize: the same detokenizer, the same text). Each stage is a span
of the request's trace (gateway.request_trace), and the calls carry its context to the services.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from opentelemetry import trace

from gateway.auth import cache_salt, tenant_var
from gateway.clients import Metadata, TokenizerClient
from gateway.model_pool import ModelPool
from gateway.config import Limits
from gateway.detokenize import LocalDetokenizer, TextStream, texts_in_context
from gateway.errors import down
from gateway.metrics import GatewayMetrics
from gateway.request_trace import RequestTrace
from gateway.stops import Release, StopMatcher
from gateway.validation import Plan, TextRequest, check_request, plan
from grok.gateway.v1 import gateway_pb2
from grok.model.v1 import model_pb2
from serving_common.detokenizer import PieceTable

log = logging.getLogger(__name__)

FINISH = {
    model_pb2.FINISH_REASON_LENGTH: gateway_pb2.FINISH_REASON_LENGTH,
    model_pb2.FINISH_REASON_EOS: gateway_pb2.FINISH_REASON_EOS,
    model_pb2.FINISH_REASON_CONTEXT_LENGTH: gateway_pb2.FINISH_REASON_CONTEXT_LENGTH,
    model_pb2.FINISH_REASON_STOP_TOKEN: gateway_pb2.FINISH_REASON_STOP,
}


def counted(prompt_tokens: int, completion_tokens: int) -> gateway_pb2.Usage:
    return gateway_pb2.Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                             total_tokens=prompt_tokens + completion_tokens)


@dataclass
class Progress:
    """What one request has seen so far (for usage, timings and latency metrics)."""

    arrival: float
    tokenize_seconds: float = 0.0
    prompt_tokens: int = 0
    first_token_at: float | None = None
    last_token_at: float | None = None
    model_timings: model_pb2.Timings = field(default_factory=model_pb2.Timings)
    queue_seconds: float = 0.0
    prefill_seconds: float = 0.0
    running_usage: bool = False  # every message carries the usage so far, not only each completion's last


@dataclass
class Completion:
    """One of the request's n completions: its own detokenizer stream, stop matching and finish."""

    index: int
    detokenizer: TextStream
    matcher: StopMatcher
    completion_tokens: int = 0
    release: Release = field(default_factory=Release)
    finish: int = gateway_pb2.FINISH_REASON_UNSPECIFIED
    model_finished: bool = False  # the model ended it (else a stop sequence did, and the model may still run it)
    echo: str = ""  # the prompt text, until the completion's first message carries it
    scored: list[gateway_pb2.PromptToken] = field(default_factory=list)  # the scored prompt, until it is sent
    separator: bool = False  # chat: the first text's leading space separates it from the prompt; not content
    echo_only: bool = False  # echo with max_tokens 0: the prompt alone, the model's token is not part of it
    stop_token: int | None = None  # the stop_token_ids entry the model ended the completion on
    held: list[gateway_pb2.Token] = field(default_factory=list)  # released, not yet sent (--stream-interval)
    sent: bool = False  # a message with tokens went out (the first is never held)

    def decorate(self, message: gateway_pb2.GenerateResponse) -> gateway_pb2.GenerateResponse:
        """Put the echoed prompt and the scored prompt (each once) in front of the completion's next message; drop
        a chat answer's separator space (its token keeps its text)."""
        if self.echo:
            message.text, self.echo = self.echo + message.text, ""
        if self.separator and message.text:
            message.text, self.separator = message.text.removeprefix(" "), False
        if self.scored:
            message.prompt_logprobs.extend(self.scored)
            self.scored = []
        return message

    @property
    def done(self) -> bool:
        return self.finish != gateway_pb2.FINISH_REASON_UNSPECIFIED


def model_request(request: TextRequest, planned: Plan, request_id: str) -> model_pb2.GenerateRequest:
    s = request.sampling
    out = model_pb2.GenerateRequest(
        token_ids=planned.prompt_ids, max_tokens=planned.max_tokens, temperature=s.temperature,
        ignore_eos=s.ignore_eos, top_logprobs=s.top_logprobs,
        allowed_token_ids=s.allowed_token_ids, blocked_token_ids=s.blocked_token_ids,
        request_id=request_id, n=planned.n, top_k=s.top_k, min_p=s.min_p, presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty, logit_bias=dict(s.logit_bias), stop_token_ids=s.stop_token_ids,
        min_tokens=s.min_tokens, ids_only=not s.logprobs)  # probabilities only where asked for
    for name in ("top_p", "seed", "repetition_penalty", "prompt_logprobs"):
        if s.HasField(name):
            setattr(out, name, getattr(s, name))
    which = s.WhichOneof("constraint")  # structured output: the model service compiles and checks it
    if which == "choice":
        out.choice.choices.extend(s.choice.choices)
    elif which is not None:
        setattr(out, which, getattr(s, which))
    # Prefix-cache isolation: the caller's API key (its digest) and its own cache_salt key the prompt's blocks.
    out.cache_salt = cache_salt(tenant_var.get(), s.cache_salt if s.HasField("cache_salt") else None)
    return out


def join_responses(first: gateway_pb2.GenerateResponse, then: gateway_pb2.GenerateResponse) -> bool:
    """Append `then` to `first` in place when both are the same completion's and `first` is not its last (True):
    the texts and tokens joined, `then`'s usage, finish and timings kept, as if the pipeline had held the first
    one's tokens until the next (what --stream-interval does). Used for messages that queued up while the one
    before them was being written (stream_buffer.bounded): a client stream that fell behind catches up in fewer
    messages instead of one gRPC write per token."""
    if then.index != first.index or first.finish_reason or then.prompt_logprobs:
        return False
    text = first.text + then.text
    first.MergeFrom(then)  # tokens appended; then's usage, timings, finish reason and stop over first's
    first.text = text
    return True


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

    def __init__(self, tokenizer: TokenizerClient, pool: ModelPool, limits: Limits, metrics: GatewayMetrics,
                 local_detokenize: bool = False, stream_interval: int = 1) -> None:
        self.tokenizer = tokenizer
        self.pool = pool
        self.limits = limits
        self.metrics = metrics
        self.local_detokenize = local_detokenize
        self.stream_interval = stream_interval
        # The latency histograms' children by method: looked up once, not per token.
        self._ttft: dict[str, Any] = {}
        self._itl: dict[str, Any] = {}

    async def stream(self, request: TextRequest, deadline: float | None, request_id: str, method: str,
                     chat: bool = False, running_usage: bool = False,
                     turn_starts: Sequence[str] = ()) -> AsyncIterator[gateway_pb2.GenerateResponse]:
        """The request's messages. `chat`: the prompt is a rendered conversation; an answer's first space, which
        the model writes to separate it from a prompt ending in "Assistant:", is not part of its text (as
        OpenAI's and vLLM's chat content starts at its first word). `running_usage`: every message carries the
        usage so far (the prompt, and the tokens its completion generated up to it), as vLLM's
        `continuous_usage_stats`; else only each completion's last one. `turn_starts`: the chat template's
        (ChatTemplate.turn_starts), which end each completion as stop sequences do, beside the request's."""
        loop = asyncio.get_running_loop()
        progress = Progress(arrival=loop.time(), running_usage=running_usage)
        spans = RequestTrace(trace.get_current_span(), request_id, method)  # the call's or the HTTP request's
        with spans.stage("validate"):
            check_request(request, self.limits)
        metadata: Metadata = (("x-request-id", request_id),)
        prompt_ids = list(request.prompt_token_ids)
        if not prompt_ids:
            with spans.stage("encode") as encode:
                prompt_ids = await self.tokenizer.encode(request.prompt, deadline, spans.metadata(metadata, encode))
        progress.tokenize_seconds = loop.time() - progress.arrival
        planned = plan(request, prompt_ids, await self.pool.info(deadline), self.limits)
        echo = ""
        if request.sampling.echo:  # a token prompt, or what truncation kept of a prompt, is echoed as its text
            echo = (await self.tokenizer.decode(planned.prompt_ids, deadline, metadata)
                    if request.prompt_token_ids or len(planned.prompt_ids) < len(prompt_ids) else request.prompt)
        progress.prompt_tokens = len(planned.prompt_ids)
        # Before the model call: a tokenizer that cannot give its table costs no model slot.
        table = await self.tokenizer.piece_table(deadline) if self.local_detokenize else None
        # Each completion's detokenizer is opened now, before the model call: a remote one is then a call in
        # flight at the tokenizer for the whole request (a draining tokenizer serves it to the end), even
        # while the request waits in a model's queue; opened at the first token, it could find the
        # tokenizer already stopped.
        # Each reads the prompt first: its tokens' texts are texts in context.
        spans.detokenize = spans.start("detokenize")
        detokenize = spans.metadata(metadata, spans.detokenize)
        completions = [Completion(index, LocalDetokenizer(table, planned.prompt_ids) if table is not None
                                  else self.tokenizer.detokenizer(deadline, detokenize, planned.prompt_ids),
                                  StopMatcher(request.sampling.stop, request.sampling.include_stop_str_in_output,
                                              request.sampling.min_tokens, turn_starts),
                                  echo=echo,
                                  separator=chat and not request.prompt[-1:].isspace(), echo_only=planned.echo_only)
                       for index in range(planned.n)]
        spans.model = spans.start("model")
        try:
            model_stream = await self.pool.generate(model_request(request, planned, request_id), deadline,
                                                    spans.metadata(metadata, spans.model))
        except BaseException:
            for completion in completions:
                completion.detokenizer.cancel()
            spans.close(progress.prompt_tokens, [], [])
            raise
        spans.model_started(model_stream.replica.address)
        # The model scores prompt tokens 1..end: a one-token prompt gets no score list, and its token is still
        # listed (with no logprob) on the first reply, as every longer prompt's first token is.
        unscored = request.sampling.HasField("prompt_logprobs") and len(planned.prompt_ids) == 1
        try:
            async for reply in model_stream.responses():
                spans.observe(reply)
                if not 0 <= reply.index < len(completions) or completions[reply.index].done:
                    continue  # a completion a stop sequence ended: the model's further tokens for it are dropped
                completion = completions[reply.index]
                if reply.prompt_logprobs or unscored:  # each completion's first message carries the scored prompt
                    unscored = False
                    scored = await self._scored_prompt(reply, planned.prompt_ids, table, deadline, detokenize)
                    for c in completions:
                        c.scored = list(scored)
                async for message in self._advance(completion, reply, request, progress, method, deadline,
                                                   detokenize):
                    yield message
                if all(c.done for c in completions):
                    break
            else:
                log.warning("model stream ended without a finish reason",
                            extra={"replica": model_stream.replica.address})
                raise down("model", "it ended the stream without a finish reason (restarting?)")
            if all(c.model_finished for c in completions):
                await model_stream.drain()  # every completion ended in the model: let the call complete OK
        finally:
            model_stream.close()
            for completion in completions:
                completion.detokenizer.cancel()
            spans.close(progress.prompt_tokens, [c.completion_tokens for c in completions],
                        [c.finish for c in completions])

    async def _advance(self, completion: Completion, reply: model_pb2.GenerateResponse, request: TextRequest,
                       progress: Progress, method: str, deadline: float | None,
                       metadata: Metadata) -> AsyncIterator[gateway_pb2.GenerateResponse]:
        """One model reply for `completion`: its text so far, or (when it ends) its last message."""
        self._observe(reply, progress, method)
        if completion.echo_only:  # the prompt (scored) is the whole answer
            completion.model_finished = reply.finish_reason != model_pb2.FINISH_REASON_UNSPECIFIED
            completion.finish = gateway_pb2.FINISH_REASON_LENGTH
            yield completion.decorate(self._last(completion, progress, asyncio.get_running_loop().time()))
            return
        before = completion.completion_tokens  # the model's count up to its previous message
        completion.completion_tokens = max(before, reply.completion_tokens)
        if reply.finish_reason == model_pb2.FINISH_REASON_STOP_TOKEN:
            completion.stop_token = reply.token_ids[-1] if reply.token_ids else None
            reply = without_stop_token(reply)
        tokens = await self._tokens(completion, reply, request.sampling, deadline, metadata)
        release = completion.matcher.feed(tokens)
        if release.stopped:  # the tokens after the one completing the stop (one message can carry several) are not counted
            completion.completion_tokens = before + release.used
            completion.release, completion.finish = release, gateway_pb2.FINISH_REASON_STOP
        elif reply.finish_reason != model_pb2.FINISH_REASON_UNSPECIFIED:
            completion.model_finished = True
            tail = completion.matcher.finish(await completion.detokenizer.finish())
            completion.release = Release(release.tokens + tail.tokens, tail.stopped, tail.extra)
            completion.finish = gateway_pb2.FINISH_REASON_STOP if tail.stopped else FINISH.get(
                reply.finish_reason, gateway_pb2.FINISH_REASON_LENGTH)
        elif release.tokens or completion.scored:
            completion.held += release.tokens
            if completion.sent and len(completion.held) < self.stream_interval and not completion.scored:
                return  # held: sent with the next ones (--stream-interval)
            completion.sent = bool(completion.held)
            held, completion.held = completion.held, []
            message = gateway_pb2.GenerateResponse(text=Release(held).text, tokens=held, index=completion.index)
            if progress.running_usage:
                message.usage.CopyFrom(counted(progress.prompt_tokens, completion.completion_tokens))
            yield completion.decorate(message)
            return
        if completion.done:
            yield completion.decorate(self._last(completion, progress, asyncio.get_running_loop().time()))

    async def _scored_prompt(self, reply: model_pb2.GenerateResponse, prompt_ids: list[int],
                             table: PieceTable | None, deadline: float | None,
                             metadata: Metadata) -> list[gateway_pb2.PromptToken]:
        """The model's scored prompt (tokens 1..end) as PromptTokens, after the unscored first token; every text
        in context (the prompt tokens' texts concatenate to the prompt's decode)."""
        scored = list(reply.prompt_logprobs)
        alternatives = [[]] + [[top.id for top in t.top_tokens] for t in scored]
        if table is not None:
            texts, others = texts_in_context(table, prompt_ids, alternatives)
        else:
            texts, others = await self.tokenizer.texts_in_context(prompt_ids, alternatives, deadline, metadata)
        return [gateway_pb2.PromptToken(id=prompt_ids[0], text=texts[0])] + [gateway_pb2.PromptToken(
            id=t.id, text=text, logprob=t.logprob,
            top_tokens=[gateway_pb2.TopToken(id=top.id, text=other, probability=top.probability,
                                             logprob=top.logprob) for top, other in zip(t.top_tokens, other_texts)])
            for t, text, other_texts in zip(scored, texts[1:], others[1:])]

    def _observe(self, reply: model_pb2.GenerateResponse, progress: Progress, method: str) -> None:
        now = asyncio.get_running_loop().time()
        progress.prompt_tokens = reply.prompt_tokens or progress.prompt_tokens
        if reply.HasField("timings"):
            if progress.first_token_at is None:
                progress.queue_seconds = reply.timings.queue_seconds
                progress.prefill_seconds = reply.timings.prefill_seconds
            progress.model_timings = reply.timings
        if not reply.token_ids:
            return
        if progress.first_token_at is None:
            progress.first_token_at = now
            ttft = self._ttft.get(method) or self._ttft.setdefault(
                method, self.metrics.time_to_first_token.labels(method))
            ttft.observe(now - progress.arrival)
        elif progress.last_token_at is not None:
            per_token = (now - progress.last_token_at) / len(reply.token_ids)
            itl = self._itl.get(method) or self._itl.setdefault(method, self.metrics.inter_token_latency.labels(method))
            for _ in reply.token_ids:
                itl.observe(per_token)
        progress.last_token_at = now

    async def _tokens(self, completion: Completion, reply: model_pb2.GenerateResponse,
                      sampling: gateway_pb2.SamplingParams, deadline: float | None,
                      metadata: Metadata) -> list[gateway_pb2.Token]:
        """The reply's tokens with their texts in context, their alternatives' texts in their place; probabilities
        only when the request asked for them (logprobs, top_logprobs)."""
        top_logprobs = sampling.top_logprobs
        asked_probabilities = sampling.logprobs or top_logprobs > 0
        if not reply.token_ids:
            return []
        details = list(reply.tokens) if len(reply.tokens) == len(reply.token_ids) else [None] * len(reply.token_ids)
        alternatives = [[top.id for top in d.top_tokens] if d is not None else [] for d in details]
        asked = alternatives if top_logprobs and any(alternatives) else []
        decoded = await completion.detokenizer.push(reply.token_ids, asked)
        others = decoded.alternative_texts
        if others is None:  # none asked for, or an older tokenizer service: each piece decoded alone
            alone = await self.tokenizer.piece_texts([i for a in asked for i in a], deadline, metadata) if asked else {}
            others = [[alone.get(i, "") for i in a] for a in alternatives]
        tokens = []
        for token_id, text, detail, other_texts in zip(reply.token_ids, decoded.token_texts, details, others):
            token = gateway_pb2.Token(id=token_id, text=text)
            if detail is not None and asked_probabilities:
                token.probability, token.logprob = detail.probability, detail.logprob
                token.top_tokens.extend(
                    gateway_pb2.TopToken(id=top.id, text=other, probability=top.probability, logprob=top.logprob)
                    for top, other in zip(detail.top_tokens, other_texts))
            tokens.append(token)
        return tokens

    def _last(self, completion: Completion, progress: Progress, now: float) -> gateway_pb2.GenerateResponse:
        """A completion's last message: its remaining text, finish reason, usage and timings."""
        completion_tokens = completion.completion_tokens
        if completion.index == 0:
            self.metrics.prompt_tokens.inc(progress.prompt_tokens)  # the prompt once per request
        self.metrics.completion_tokens.inc(completion_tokens)
        first = progress.first_token_at if progress.first_token_at is not None else now
        timings = gateway_pb2.Timings(
            tokenize_seconds=progress.tokenize_seconds, queue_seconds=progress.queue_seconds,
            prefill_seconds=progress.prefill_seconds, mean_step_seconds=progress.model_timings.mean_step_seconds,
            time_to_first_token_seconds=first - progress.arrival, total_seconds=now - progress.arrival)
        usage = counted(progress.prompt_tokens, completion_tokens)
        release = completion.release
        if completion.held:  # tokens --stream-interval held go out in front of the last ones
            release = Release(completion.held + release.tokens, release.stopped, release.extra, release.used)
            completion.held = []
        out = gateway_pb2.GenerateResponse(text=release.text, tokens=release.tokens, finish_reason=completion.finish,
                                           usage=usage, timings=timings, index=completion.index)
        if completion.matcher.stopped:
            out.stop_sequence = completion.matcher.matched
        elif completion.stop_token is not None:
            out.stop_token_id = completion.stop_token
        return out

