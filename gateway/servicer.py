"""GatewayService: protobuf in and out (Generate, Complete, Chat, GetInfo); request metrics and logs.

Errors are raised (GatewayError, a ServiceError) and the shared interceptor ends the call with their
status; GetInfo answers what a public client needs, never file paths or backend addresses.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

import grpc
from opentelemetry import trace

from gateway.chat_template import ChatTemplate
from gateway.clients import remaining
from gateway.config import GatewayConfig, prompt_byte_limit
from gateway.errors import GatewayError
from gateway.pipeline import Pipeline, join_responses
from gateway.stream_buffer import bounded
from gateway.validation import TextRequest
from grok.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from grok.model.v1 import model_pb2
from grok.tokenizer.v1 import tokenizer_pb2
from serving_common.logs import request_id_var

log = logging.getLogger(__name__)

# grpc.aio reports "no deadline" as a remaining time of centuries.
NO_DEADLINE_SECONDS = 1e8
# gRPC cancels a call at its deadline by its own timer: the handler, cancelled then, may still read a hair of time
# remaining (measured: 1,002 ms into a 1 s call, logged as CANCELLED).
DEADLINE_SLACK_SECONDS = 0.05


def cancellation_code(left: float | None) -> str:
    """How a call whose handler was cancelled ended, from its time remaining then: its deadline, or the client."""
    return "DEADLINE_EXCEEDED" if left is not None and left <= DEADLINE_SLACK_SECONDS else "CANCELLED"


def deadline_of(context: grpc.aio.ServicerContext) -> float | None:
    """The call's deadline on the event loop's clock, or None."""
    left = context.time_remaining()
    if left is None or left > NO_DEADLINE_SECONDS:
        return None
    return asyncio.get_running_loop().time() + left


def complete_response(choices: list[gateway_pb2.Completion],
                      last: dict[int, gateway_pb2.GenerateResponse]) -> gateway_pb2.CompleteResponse:
    """Completion 0 in the top-level fields, every completion in `choices` when there are several (n = 1: the
    top-level fields are the completion, not repeated); usage counts the prompt once."""
    out = gateway_pb2.CompleteResponse(choices=choices if len(choices) > 1 else [])
    if not choices:
        return out
    first = choices[0]
    out.text, out.finish_reason = first.text, first.finish_reason
    out.tokens.extend(first.tokens)
    if first.index in last:
        out.timings.CopyFrom(last[first.index].timings)
        prompt = last[first.index].usage.prompt_tokens
        generated = sum(c.completion_tokens for c in choices)
        out.usage.CopyFrom(gateway_pb2.Usage(prompt_tokens=prompt, completion_tokens=generated,
                                             total_tokens=prompt + generated))
    return out


class GatewayServicer(gateway_pb2_grpc.GatewayServiceServicer):
    """Generate, Complete and GetInfo over a Pipeline."""

    def __init__(self, pipeline: Pipeline, config: GatewayConfig, template: ChatTemplate | None = None) -> None:
        self.pipeline = pipeline
        self.config = config
        self.template = template or ChatTemplate.load(config.http.chat_template)
        self.metrics = pipeline.metrics

    async def Generate(self, request: gateway_pb2.GenerateRequest,  # noqa: N802 (gRPC's name)
                       context: grpc.aio.ServicerContext) -> AsyncIterator[gateway_pb2.GenerateResponse]:
        async with contextlib.aclosing(self._run(request, context, "Generate")) as messages:
            async for message in messages:
                yield message

    async def Chat(self, request: gateway_pb2.ChatRequest,  # noqa: N802
                   context: grpc.aio.ServicerContext) -> AsyncIterator[gateway_pb2.ChatResponse]:
        """The conversation rendered by the chat template, generated as Generate does (its answer without the
        separator space)."""
        turns = [{"role": m.role, "content": m.content, **({"name": m.name} if m.name else {})}
                 for m in request.messages]
        generation = request.add_generation_prompt if request.HasField("add_generation_prompt") else True
        prompt = self.template.render_turns(turns, generation)
        generate = gateway_pb2.GenerateRequest(prompt=prompt, sampling=request.sampling)
        async with contextlib.aclosing(self._run(generate, context, "Chat", chat=True,
                                                 turn_starts=self.template.turn_starts)) as messages:
            async for message in messages:
                yield gateway_pb2.ChatResponse(text=message.text, tokens=message.tokens,
                                               finish_reason=message.finish_reason, usage=message.usage,
                                               timings=message.timings, index=message.index)

    async def Complete(self, request: gateway_pb2.CompleteRequest,  # noqa: N802
                       context: grpc.aio.ServicerContext) -> gateway_pb2.CompleteResponse:
        choices: dict[int, gateway_pb2.Completion] = {}
        last: dict[int, gateway_pb2.GenerateResponse] = {}
        scored: list[gateway_pb2.PromptToken] = []
        async for message in self._run(request, context, "Complete"):
            if message.index == 0:  # every completion's first message carries the same scored prompt
                scored.extend(message.prompt_logprobs)
            choice = choices.setdefault(message.index, gateway_pb2.Completion(index=message.index))
            choice.text += message.text
            choice.tokens.extend(message.tokens)
            if message.finish_reason:
                choice.finish_reason = message.finish_reason
                choice.completion_tokens = message.usage.completion_tokens
                last[message.index] = message
        out = complete_response([choices[i] for i in sorted(choices)], last)
        out.prompt_logprobs.extend(scored)
        return out

    async def GetInfo(self, request: gateway_pb2.GetInfoRequest,  # noqa: N802
                      context: grpc.aio.ServicerContext) -> gateway_pb2.GetInfoResponse:
        deadline = deadline_of(context)
        model_info = model_pb2.GetInfoResponse()
        model_info.CopyFrom(await self.pipeline.pool.info(deadline))  # a copy: the pool caches its answer
        tokenizer_info = tokenizer_pb2.GetInfoResponse()
        tokenizer_info.CopyFrom(await self.pipeline.tokenizer.info(deadline))
        # Internal details stay internal: the services' own GetInfo (and the logs) have them.
        model_info.ClearField("checkpoint")
        tokenizer_info.ClearField("model_path")
        limits = self.config.limits
        return gateway_pb2.GetInfoResponse(
            model=model_info, tokenizer=tokenizer_info,
            limits=gateway_pb2.GatewayLimits(
                max_prompt_bytes=prompt_byte_limit(limits, model_info.config.sequence_len), max_stop_sequences=limits.max_stop,
                max_stop_chars=limits.max_stop_chars, default_max_tokens=limits.default_max_tokens))

    async def _run(self, request: TextRequest, context: grpc.aio.ServicerContext, method: str,
                   chat: bool = False, turn_starts: tuple[str, ...] = ()
                   ) -> AsyncIterator[gateway_pb2.GenerateResponse]:
        """Stream the pipeline's messages; end with the mapped status; count the request in metrics."""
        request_id = request_id_var.get()  # set by the shared interceptor
        span = trace.get_current_span()  # the call's, opened by the shared interceptor (tracing on)
        if span.is_recording():
            span.set_attribute("gen_ai.request.model", self.config.http.model_name)
        loop = asyncio.get_running_loop()
        start = loop.time()
        code, finish = "OK", "NONE"
        tokens = {"prompt_tokens": 0, "completion_tokens": 0}
        try:
            remaining(deadline_of(context))
            # aclosing: a handler closed early cancels its model call now, not at garbage collection.
            # bounded: a client that stops reading ends the request instead of the gateway holding its responses.
            async with contextlib.aclosing(bounded(self.pipeline.stream(
                    request, deadline_of(context), request_id, method, chat, turn_starts=turn_starts),
                    join=join_responses)) as messages:
                async for message in messages:
                    if message.finish_reason:
                        finish = gateway_pb2.FinishReason.Name(message.finish_reason).removeprefix("FINISH_REASON_")
                        tokens["prompt_tokens"] = message.usage.prompt_tokens
                        tokens["completion_tokens"] += message.usage.completion_tokens
                    yield message
        except GatewayError as error:
            code = error.code.name
            raise
        except (asyncio.CancelledError, GeneratorExit):
            # GeneratorExit: the client's cancel reached gRPC while it was sending a message; it closes the
            # handler's generator instead of cancelling the handler.
            code = cancellation_code(context.time_remaining())
            raise
        except Exception:
            code = "INTERNAL"  # the interceptor logs it with its traceback
            raise
        finally:
            seconds = loop.time() - start
            self.metrics.finished(method, code, finish, seconds)
            # The request's one access line (a failed call's message is logged by the shared interceptor).
            log.info("request", extra={"method": method, "code": code, "finish_reason": finish,
                                       **{k: v for k, v in tokens.items() if v}, "ms": round(seconds * 1000, 3)})
