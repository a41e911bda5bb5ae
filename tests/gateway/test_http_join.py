"""The HTTP API's streams join what queued up while an event was being written, as the gRPC API's do: a completion
whose tokens all arrived at once streams in fewer events than tokens, with the same text as one event each."""

from __future__ import annotations

import asyncio
import json
import pathlib

from benchmarks.pipeline_cost import DEFAULT_TOKENIZER, LocalTokenizer, ReplayPool
from gateway.auth import ApiKeys
from gateway.chat_template import ChatTemplate as BaseTemplate
from gateway.config import Limits
from gateway.http.app import create_app
from gateway.http.chat import ChatTemplate
from gateway.http.context import HttpContext
from gateway.metrics import GatewayMetrics
from gateway.pipeline import Pipeline

TOKENS = 40


class AtOnce:
    """Every reply is ready as soon as it is asked for: they queue up faster than events are written."""

    async def next(self) -> None:
        return None


def scope(body: bytes) -> dict:
    """An ASGI request scope: POST /v1/completions with a JSON body of that length."""
    return {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
            "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"", "root_path": "",
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
            "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}


def streamed(ids: list[int], tokenizer: LocalTokenizer) -> list[dict]:
    pipeline = Pipeline(tokenizer, ReplayPool(ids, tokenizer.table.vocab_size, AtOnce(), 0),  # type: ignore[arg-type]
                        Limits(), GatewayMetrics(), local_detokenize=True)
    context = HttpContext(pipeline, None, ApiKeys([]), ChatTemplate.of(BaseTemplate.load()), "grok-1", 0.0, 0)  # type: ignore[arg-type]

    async def go() -> str:
        body = json.dumps({"model": "grok-1", "prompt": "In the beginning", "max_tokens": TOKENS, "stream": True,
                           "ignore_eos": True}).encode()
        sent = [{"type": "http.request", "body": body, "more_body": False}]
        out: list[dict] = []

        async def receive() -> dict:
            if sent:
                return sent.pop()
            await asyncio.Event().wait()  # the client never goes away
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            out.append(message)

        await create_app(context)(scope(body), receive, send)
        assert out[0]["status"] == 200, out
        return b"".join(m.get("body", b"") for m in out[1:]).decode()

    events = [line.removeprefix("data: ") for line in asyncio.run(go()).splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_tokens_that_arrived_together_stream_as_fewer_events_with_the_same_text() -> None:
    tokenizer = LocalTokenizer(DEFAULT_TOKENIZER)
    ids = list(tokenizer.tokenizer.encode("The gateway is the only part that clients see. " * 8))[:TOKENS]
    chunks = streamed(ids, tokenizer)
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert text.lstrip() == tokenizer.tokenizer.decode(ids)  # after the prompt: its first word with a space
    assert len(chunks) < TOKENS, len(chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"



class Watched(ReplayPool):
    """A replay replica that records how many replies its request took, and when its model stream was closed."""

    taken = 0
    closed: asyncio.Event

    async def generate(self, request, deadline, metadata=()):  # type: ignore[no-untyped-def]
        stream = await super().generate(request, deadline, metadata)
        pool, replies = self, stream.responses

        async def counted():  # type: ignore[no-untyped-def]
            async for reply in replies():
                pool.taken += 1
                yield reply

        def close() -> None:
            pool.closed.set()

        stream.responses, stream.close = counted, close  # type: ignore[method-assign]
        return stream


def test_a_client_that_stops_reading_ends_its_model_request_past_the_read_ahead_bound() -> None:
    """Its events wait behind the unread ones while its responses are read ahead, up to stream_buffer's bound:
    then the model request ends (its slot freed), long before its 3,000 tokens of ~1 KB each (20 alternatives)
    and before the 30 s stall abort. Before, the request went on with its responses held in the gateway."""
    tokenizer = LocalTokenizer(DEFAULT_TOKENIZER)
    ids = list(tokenizer.tokenizer.encode(pathlib.Path(__file__).read_text() * 60))[:3000]
    assert len(ids) == 3000
    pool = Watched(ids, tokenizer.table.vocab_size, AtOnce(), 20)
    pipeline = Pipeline(tokenizer, pool, Limits(), GatewayMetrics(), local_detokenize=True)  # type: ignore[arg-type]
    context = HttpContext(pipeline, None, ApiKeys([]), ChatTemplate.of(BaseTemplate.load()), "grok-1", 0.0, 0)  # type: ignore[arg-type]
    body = json.dumps({"model": "grok-1", "prompt": "In", "max_tokens": len(ids), "stream": True, "ignore_eos": True,
                       "logprobs": 5}).encode()

    async def go() -> bool:
        stalled = asyncio.Event()
        requests = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive() -> dict:
            if requests:
                return requests.pop()
            await asyncio.Event().wait()
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            if message.get("body"):  # the client takes its first event, then nothing more
                stalled.set()
                await asyncio.Event().wait()

        pool.closed = asyncio.Event()
        app = asyncio.create_task(create_app(context)(scope(body), receive, send))
        await asyncio.wait_for(stalled.wait(), 10)
        try:
            await asyncio.wait_for(pool.closed.wait(), 5)  # the model stream is closed while the client reads nothing
        except asyncio.TimeoutError:
            pass
        ended_while_stalled = pool.closed.is_set()
        app.cancel()
        await asyncio.gather(app, return_exceptions=True)
        return ended_while_stalled

    assert asyncio.run(go()), f"the model request was not ended while its client read nothing ({pool.taken} replies taken)"
    assert pool.taken < len(ids) // 2, pool.taken
