"""Running one HTTP request through the gateway's Pipeline: accounting and client disconnects.

`tracked` is the HTTP twin of GatewayServicer._run: it counts the request in the same metrics (method
label `http_completions` / `http_chat_completions`), fills the request's access record (gateway.http.access logs it)
and turns an unexpected exception into INTERNAL with the request id, and records the outcome on the request's span
(`request_span`). `guarded` stops the pipeline as soon as the
HTTP client goes away, which cancels the model call and frees its slot, also while the client waits
for a non-streaming response. `merged` joins the streams of a completion request's several prompts.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Sequence
from typing import TypeVar

import grpc
from opentelemetry import trace
from starlette.requests import Request

from gateway.errors import GatewayError
from gateway.http.access import Access
from gateway.pipeline import Pipeline
from grok.gateway.v1 import gateway_pb2

log = logging.getLogger(__name__)

T = TypeVar("T")


class ClientGone(Exception):
    """The HTTP client disconnected before the response was complete."""


def request_span(request_id: str, model: str) -> trace.Span:
    """The HTTP request's span: FastAPI's own (a server span under the client's `traceparent`, current for
    the whole request and ended with the response), named after the request here. With tracing off,
    a non-recording one."""
    span = trace.get_current_span()
    if span.is_recording():
        span.set_attributes({"grok.request_id": request_id, "gen_ai.request.model": model})
    return span


async def tracked(pipeline: Pipeline, request: gateway_pb2.GenerateRequest, deadline: float | None,
                  request_id: str, method: str, span: trace.Span = trace.INVALID_SPAN, chat: bool = False,
                  access: Access | None = None, running_usage: bool = False, turn_starts: tuple[str, ...] = ()
                  ) -> AsyncIterator[gateway_pb2.GenerateResponse]:
    """The pipeline's messages (`running_usage`: each with the usage so far); errors raised as GatewayError;
    metrics, the outcome in the request's access record (its one log line) and on its `span` whatever
    happens."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    code, finish, detail = "OK", "NONE", ""
    prompt_tokens, completion_tokens = 0, 0
    try:
        # aclosing: a consumer that stops early must cancel the model call now, not at garbage collection.
        async with contextlib.aclosing(pipeline.stream(request, deadline, request_id, method, chat,
                                                          running_usage, turn_starts)) as stream:
            async for message in stream:
                if message.finish_reason:
                    finish = gateway_pb2.FinishReason.Name(message.finish_reason).removeprefix("FINISH_REASON_")
                    prompt_tokens = message.usage.prompt_tokens
                    completion_tokens += message.usage.completion_tokens
                yield message
    except GatewayError as error:
        code, detail = error.code.name, error.message
        raise
    except (asyncio.CancelledError, GeneratorExit, ClientGone):
        code = "DEADLINE_EXCEEDED" if deadline is not None and loop.time() >= deadline else "CANCELLED"
        raise
    except Exception:
        code = "INTERNAL"
        log.exception("unexpected error")
        raise GatewayError(grpc.StatusCode.INTERNAL,
                           f"internal error (request id {request_id}); see gateway logs") from None
    finally:
        seconds = loop.time() - start
        pipeline.metrics.finished(method, code, finish, seconds)
        if access is not None:
            access.generated(request_id, code, detail, finish if finish != "NONE" else "", prompt_tokens,
                             completion_tokens)
        if span.is_recording():  # a stream that fails after its 200 still shows as failed
            span.set_attribute("grok.code", code)
            if code != "OK":
                span.set_status(trace.Status(trace.StatusCode.ERROR, code))


async def _disconnected(request: Request) -> None:
    """Return once the client has disconnected (the request body was already read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def guarded(request: Request, source: AsyncIterator[T]) -> AsyncIterator[T]:
    """Items of `source`; if the client disconnects while one is awaited, `source` is cancelled
    at once and ClientGone raised. `source` is closed however this ends."""
    watcher = asyncio.ensure_future(_disconnected(request))
    step: asyncio.Future[T] | None = None
    try:
        while True:
            step = asyncio.ensure_future(anext(source))  # type: ignore[arg-type]
            await asyncio.wait({step, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if not step.done():
                raise ClientGone()
            try:
                item = step.result()
            except StopAsyncIteration:
                return
            yield item
    finally:
        # Also reached when the response itself is cancelled (Starlette saw the disconnect first):
        # the pending step must end before the generator can be closed.
        pending = [task for task in (step, watcher) if task is not None and not task.done()]
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        await source.aclose()  # type: ignore[attr-defined]


def merged(streams: Sequence[AsyncIterator[gateway_pb2.GenerateResponse]],
           per_prompt: int) -> AsyncIterator[gateway_pb2.GenerateResponse]:
    """The messages of a request's prompts (one stream each) as they come, prompt i's completion j renumbered
    i * per_prompt + j (OpenAI's order of choices). The first error ends every stream and is raised; closing the
    result closes them all."""
    if len(streams) == 1:
        return streams[0]
    return _merged(streams, per_prompt)


async def _merged(streams: Sequence[AsyncIterator[gateway_pb2.GenerateResponse]],
                  per_prompt: int) -> AsyncIterator[gateway_pb2.GenerateResponse]:
    queue: asyncio.Queue[gateway_pb2.GenerateResponse | BaseException | None] = asyncio.Queue()

    async def pump(offset: int, stream: AsyncIterator[gateway_pb2.GenerateResponse]) -> None:
        try:
            async for message in stream:
                message.index += offset
                queue.put_nowait(message)
            queue.put_nowait(None)
        except asyncio.CancelledError:
            raise
        except BaseException as error:  # noqa: BLE001 - handed to the consumer, which raises it
            queue.put_nowait(error)

    tasks = [asyncio.ensure_future(pump(i * per_prompt, stream)) for i, stream in enumerate(streams)]
    try:
        running = len(tasks)
        while running:
            item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for stream in streams:
            await stream.aclose()  # type: ignore[attr-defined]
