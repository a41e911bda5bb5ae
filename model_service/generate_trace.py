"""The model service's spans of one Generate call: queue, prefill and decode under the call's span.

The decode loop runs on the scheduler's thread and is never slowed for traces: it already measures each
request's queue and prefill time (the timings of its first emission). The servicer notes when it
submitted the request and when tokens arrived, and once the call is over builds the three spans with
explicit start and end times under the call's span (opened by the shared interceptor,
serving_common.tracing). With tracing off that span does not record and nothing is noted.
"""

from __future__ import annotations

import time

from opentelemetry import trace

from grok.model.v1 import model_pb2
from serving_common import tracing


class GenerateTrace:
    """What one Generate call's spans need, noted as its responses go out."""

    def __init__(self, span: trace.Span) -> None:
        self.span = span
        self.on = span.is_recording()
        self.submitted_ns = time.time_ns() if self.on else 0
        self.timings: model_pb2.Timings | None = None
        self.last_token_ns: int | None = None
        self.mean_step_seconds = 0.0
        self.completion_tokens: dict[int, int] = {}  # per sample
        self.finishes: list[str] = []

    def observe(self, response: model_pb2.GenerateResponse) -> None:
        if not self.on:
            return
        if response.HasField("timings"):
            if self.timings is None:  # the first token's: queue and prefill
                self.timings = model_pb2.Timings()
                self.timings.CopyFrom(response.timings)
            self.mean_step_seconds = response.timings.mean_step_seconds  # the last token's: every step
        if response.token_ids:
            self.last_token_ns = time.time_ns()
        self.completion_tokens[response.index] = response.completion_tokens
        if response.finish_reason:
            self.finishes.append(model_pb2.FinishReason.Name(response.finish_reason)
                                 .removeprefix("FINISH_REASON_").lower())

    def close(self, prompt_tokens: int) -> None:
        """The call is over: usage on the call's span, and its queue, prefill and decode spans."""
        if not self.on:
            return
        self.span.set_attributes({"gen_ai.usage.input_tokens": prompt_tokens,
                                  "gen_ai.usage.output_tokens": sum(self.completion_tokens.values()),
                                  "gen_ai.response.finish_reasons": self.finishes})
        if self.timings is None:
            return  # it never reached a slot: refused, cancelled or failed while waiting
        queued = self.submitted_ns + int(self.timings.queue_seconds * 1e9)
        prefilled = queued + int(self.timings.prefill_seconds * 1e9)
        self._child("queue", self.submitted_ns, queued)
        self._child("prefill", queued, prefilled, {"gen_ai.usage.input_tokens": prompt_tokens})
        if self.last_token_ns is not None:
            self._child("decode", prefilled, max(prefilled, self.last_token_ns),
                        {"grok.model.mean_step_seconds": self.mean_step_seconds})

    def _child(self, name: str, start_ns: int, end_ns: int, attributes: dict[str, object] | None = None) -> None:
        span = tracing.tracer().start_span(name, context=trace.set_span_in_context(self.span),
                                           start_time=start_ns, attributes=attributes)
        span.end(end_time=end_ns)
