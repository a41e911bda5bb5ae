"""The spans of one gateway request, so that a trace UI shows where its time went.

The request span is the one the request already has: its gRPC call's (the shared interceptor opens it)
or its HTTP request's (gateway/http/flow.py). Pipeline.stream adds child spans for its stages:

- `validate`: the request checked against the gateway's limits;
- `encode`: the tokenizer call (the tokenizer service's Encode span is its child);
- `detokenize`: from opening the detokenizer streams to their end (the tokenizer's DecodeStream spans
  are its children; with --detokenize local the work is the gateway's own);
- `model`: the model call (the model service's Generate span, with its queue, prefill and decode spans,
  is its child), carrying the model's own timings (queue, prefill, mean step) as attributes, a
  `first token` event, and a `decode` child span from the first token to the last.

At the end the request span gets the token counts and finish reasons. With tracing off the request
span does not record and every method returns at once: no span, no clock read, no metadata.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Sequence

from opentelemetry import trace

from grok.gateway.v1 import gateway_pb2
from grok.model.v1 import model_pb2
from serving_common import tracing

Metadata = Sequence[tuple[str, str]]


class RequestTrace:
    """The stage spans of one request under its request span `span`."""

    def __init__(self, span: trace.Span, request_id: str, route: str) -> None:
        self.span = span
        self.on = span.is_recording()
        self.model: trace.Span = trace.INVALID_SPAN
        self.detokenize: trace.Span = trace.INVALID_SPAN
        self._first_token_ns: int | None = None
        self._last_token_ns: int | None = None
        self._timed = False
        self._closed = False
        if self.on:
            span.set_attributes({"grok.request_id": request_id, "grok.route": route})

    def start(self, name: str, parent: trace.Span | None = None) -> trace.Span:
        """A child span of the request span (or of `parent`), started now; the caller ends it."""
        if not self.on:
            return trace.INVALID_SPAN
        context = trace.set_span_in_context(parent if parent is not None else self.span)
        return tracing.tracer().start_span(name, context=context)

    def stage(self, name: str) -> contextlib.AbstractContextManager[trace.Span]:
        """A child span around a block; an exception leaving the block is recorded on it."""
        return _Stage(self.start(name)) if self.on else _OFF

    def metadata(self, metadata: Metadata, span: trace.Span) -> Metadata:
        """`metadata` for a call whose server spans are to be children of `span`."""
        return tracing.with_context(metadata, span) if self.on else metadata

    def model_started(self, replica: str) -> None:
        if self.on:
            self.model.set_attribute("grok.model.replica", replica)

    def observe(self, reply: model_pb2.GenerateResponse) -> None:
        """A model reply arrived: the model's timings (first ones) and the first and last tokens' times."""
        if not self.on:
            return
        if reply.HasField("timings") and not self._timed:
            self._timed = True
            self.model.set_attributes({"grok.model.queue_seconds": reply.timings.queue_seconds,
                                       "grok.model.prefill_seconds": reply.timings.prefill_seconds})
        if reply.timings.mean_step_seconds:
            self.model.set_attribute("grok.model.mean_step_seconds", reply.timings.mean_step_seconds)
        if reply.token_ids:
            now = time.time_ns()
            if self._first_token_ns is None:
                self._first_token_ns = now
                self.model.add_event("first token", timestamp=now)
            self._last_token_ns = now

    def close(self, prompt_tokens: int, completion_tokens: Sequence[int], finishes: Iterable[int]) -> None:
        """The request is over: end the stage spans still open; usage and finish reasons on the request span."""
        if not self.on or self._closed:
            return
        self._closed = True
        if self._first_token_ns is not None and self._last_token_ns is not None:
            decode = tracing.tracer().start_span("decode", context=trace.set_span_in_context(self.model),
                                                 start_time=self._first_token_ns)
            decode.end(end_time=self._last_token_ns)
        self.model.end()
        self.detokenize.end()
        reasons = [gateway_pb2.FinishReason.Name(f).removeprefix("FINISH_REASON_").lower() for f in finishes if f]
        self.span.set_attributes({"gen_ai.usage.input_tokens": prompt_tokens,
                                  "gen_ai.usage.output_tokens": sum(completion_tokens),
                                  "gen_ai.response.finish_reasons": reasons})


class _Stage(contextlib.AbstractContextManager[trace.Span]):
    """A recording child span around a block, ended when the block is left."""

    def __init__(self, span: trace.Span) -> None:
        self.span = span

    def __enter__(self) -> trace.Span:
        return self.span

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, _tb: object) -> None:
        if isinstance(error, Exception):
            self.span.record_exception(error)
            self.span.set_status(trace.Status(trace.StatusCode.ERROR, str(error)))
        self.span.end()


_OFF = contextlib.nullcontext(trace.INVALID_SPAN)  # tracing off: a block with no span (reusable)
