"""A load-generator `Sender` for the gateway's OpenAI-compatible HTTP API (streamed /v1/completions).

A plain asyncio HTTP/1.1 client (one connection per request, chunked server-sent events), so the client
adds as little as possible to what is measured. Besides what every sender records, it notes when the first
event arrived and when the first event with non-empty text arrived: clients such as AIPerf start the first
token's clock at the first non-empty text, which is later than the first token whenever that token's text
is held back (an incomplete UTF-8 sequence, a possible stop string) or empty.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass

from benchmarks.metrics import RequestResult
from benchmarks.workload import BenchRequest


@dataclass
class HttpResult(RequestResult):
    first_event: float = 0.0  # arrival of the first event with a choice


class HttpSender:
    """POST /v1/completions with `stream: true` and usage; records every event that carries a choice."""

    def __init__(self, host: str, port: int, temperature: float = 0.0, top_p: float = 1.0,
                 timeout: float = 3600.0, uds: str | None = None) -> None:
        self.host, self.port = host, port
        self.uds = uds  # the gateway's --http-uds socket file instead of host:port
        self.temperature, self.top_p, self.timeout = temperature, top_p, timeout

    def body(self, request: BenchRequest) -> bytes:
        return json.dumps({"model": "grok-1", "prompt": request.prompt, "max_tokens": request.output_len,
                           "ignore_eos": True, "temperature": self.temperature, "top_p": self.top_p,
                           "stream": True, "stream_options": {"include_usage": True}}).encode()

    async def __call__(self, request: BenchRequest) -> HttpResult:
        result = HttpResult(prompt_len=request.prompt_len, start=time.perf_counter())
        try:
            await asyncio.wait_for(self._stream(request, result), self.timeout)
        except (OSError, asyncio.TimeoutError, ValueError) as error:
            result.error = f"{type(error).__name__}: {error}"
        result.end = time.perf_counter()
        return result

    async def close(self) -> None:
        """Nothing to release: each request has its own connection."""

    async def _stream(self, request: BenchRequest, result: HttpResult) -> None:
        reader, writer = await (asyncio.open_unix_connection(self.uds) if self.uds
                                else asyncio.open_connection(self.host, self.port))
        try:
            body = self.body(request)
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (self.host.encode(), len(body), body))
            await writer.drain()
            status = await reader.readline()
            if b" 200 " not in status:
                raise ValueError(f"HTTP {status.decode(errors='replace').strip()}")
            chunked = False
            while (line := await reader.readline()) not in (b"\r\n", b""):
                chunked |= line.lower().startswith(b"transfer-encoding:") and b"chunked" in line.lower()
            buffer = b""
            async for piece in _body(reader, chunked):
                buffer += piece
                while b"\n\n" in buffer:
                    event, buffer = buffer.split(b"\n\n", 1)
                    self._event(event, result)
        finally:
            writer.close()

    @staticmethod
    def _event(event: bytes, result: HttpResult) -> None:
        for line in event.splitlines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            data = json.loads(line[6:])
            now = time.perf_counter()
            if data.get("choices"):
                text = data["choices"][0].get("text", "")
                result.first_event = result.first_event or now
                if text:  # the gateway sends a token without text only inside a later chunk
                    result.first_text = result.first_text or now
                    result.chunk_times.append(now)
                    result.chunk_tokens.append(1)
                    result.text += text
            usage = data.get("usage")
            if usage and result.chunk_tokens:
                # Text events are counted as one token each; the server's count settles the total.
                result.chunk_tokens[-1] += int(usage["completion_tokens"]) - sum(result.chunk_tokens)
                result.server_prompt_tokens = int(usage["prompt_tokens"])


async def _body(reader: asyncio.StreamReader, chunked: bool):  # type: ignore[no-untyped-def]
    """The response body as it arrives, de-chunked."""
    if not chunked:
        while piece := await reader.read(65536):
            yield piece
        return
    while True:
        size = int((await reader.readline()).split(b";")[0].strip() or b"0", 16)
        if size == 0:
            return
        yield await reader.readexactly(size)
        await reader.readexactly(2)
