"""The load generator: closed-loop concurrency and open-loop (Poisson / gamma) arrivals over grpc.aio.

A `Sender` performs one request and returns what the client saw (`metrics.RequestResult`); the
runner decides when each request is sent. Senders exist for the public API
(grok.gateway.v1.GatewayService/Generate) and for the model service (grok.model.v1 token ids), and
`benchmarks.layers` adds one for the engine in-process, so every layer is measured by the same
runner and the same arithmetic. Failed requests are recorded with their status, never retried.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import grpc

from benchmarks.metrics import RequestResult
from benchmarks.workload import BenchRequest, arrival_offsets
from gateway.client import generate_request
from grok.gateway.v1 import gateway_pb2_grpc
from grok.model.v1 import model_pb2, model_pb2_grpc

Sender = Callable[[BenchRequest], Awaitable[RequestResult]]


@dataclass(frozen=True)
class LoadPoint:
    """How requests are offered: at most `concurrency` in flight (None: unlimited) and `request_rate`
    new requests per second (inf: all at once, so with a concurrency limit a closed loop)."""

    concurrency: int | None
    request_rate: float = float("inf")
    burstiness: float = 1.0

    @property
    def closed_loop(self) -> bool:
        return self.request_rate == float("inf")

    @property
    def label(self) -> str:
        parts = [] if self.closed_loop else [f"rate{self.request_rate:g}"]
        if not self.closed_loop and self.burstiness != 1.0:
            parts.append(f"b{self.burstiness:g}")
        if self.concurrency is not None:
            parts.append(f"c{self.concurrency}")
        return "-".join(parts) or "unbounded"

    def as_dict(self) -> dict[str, object]:
        return {"max_concurrency": self.concurrency,
                "request_rate": "inf" if self.closed_loop else self.request_rate, "burstiness": self.burstiness}


async def run_point(send: Sender, requests: Sequence[BenchRequest], point: LoadPoint,
                    seed: int = 0) -> tuple[list[RequestResult], float]:
    """Send every request as `point` says; return the results (in request order) and the duration
    from the first send to the end of the last request."""
    offsets = arrival_offsets(len(requests), point.request_rate, point.burstiness, seed)
    limit = asyncio.Semaphore(point.concurrency) if point.concurrency else None
    start = time.perf_counter()

    async def one(offset: float, request: BenchRequest) -> RequestResult:
        delay = start + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        if limit is None:
            return await send(request)
        async with limit:
            return await send(request)

    results = await asyncio.gather(*(one(o, r) for o, r in zip(offsets, requests)))
    return list(results), time.perf_counter() - start


async def warm_up(send: Sender, requests: Sequence[BenchRequest], concurrency: int) -> list[RequestResult]:
    """Requests whose results are discarded: connections, compiled programs and caches get warm."""
    if not requests:
        return []
    results, _ = await run_point(send, requests, LoadPoint(max(1, concurrency)))
    return results


def _error(error: grpc.aio.AioRpcError) -> str:
    return f"{error.code().name}: {error.details()}"


CHANNEL_OPTIONS = (("grpc.max_receive_message_length", 64 << 20),)


class GatewaySender:
    """Generate through the public gateway: text in, streamed text and tokens out."""

    def __init__(self, address: str, temperature: float = 0.0, timeout: float = 3600.0, top_p: float = 1.0) -> None:
        self.address = address
        self.channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        self.stub = gateway_pb2_grpc.GatewayServiceStub(self.channel)
        self.temperature = temperature
        self.top_p = top_p
        self.timeout = timeout

    async def __call__(self, request: BenchRequest) -> RequestResult:
        message = generate_request(request.prompt, max_tokens=request.output_len, ignore_eos=True,
                                   temperature=self.temperature, top_p=self.top_p)
        result = RequestResult(prompt_len=request.prompt_len, start=time.perf_counter())
        texts: list[str] = []
        try:
            async for reply in self.stub.Generate(message, timeout=self.timeout):
                if reply.tokens:
                    result.chunk_times.append(time.perf_counter())
                    result.chunk_tokens.append(len(reply.tokens))
                if reply.text and not result.first_text:
                    result.first_text = time.perf_counter()
                texts.append(reply.text)
                if reply.HasField("usage"):
                    result.server_prompt_tokens = reply.usage.prompt_tokens
                if reply.HasField("timings"):
                    result.server_queue = reply.timings.queue_seconds
                    result.server_prefill = reply.timings.prefill_seconds
        except grpc.aio.AioRpcError as error:
            result.error = _error(error)
        result.end = time.perf_counter()
        result.text = "".join(texts)
        return result

    async def close(self) -> None:
        await self.channel.close()


class ModelSender:
    """Generate on the model service directly: token ids in, token ids out (no tokenizer, no gateway)."""

    def __init__(self, address: str, temperature: float = 0.0, timeout: float = 3600.0, top_p: float = 1.0) -> None:
        self.address = address
        self.channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        self.stub = model_pb2_grpc.ModelServiceStub(self.channel)
        self.temperature = temperature
        self.top_p = top_p
        self.timeout = timeout

    async def __call__(self, request: BenchRequest) -> RequestResult:
        message = model_pb2.GenerateRequest(token_ids=request.prompt_ids, max_tokens=request.output_len,
                                            ignore_eos=True, temperature=self.temperature, top_p=self.top_p)
        result = RequestResult(prompt_len=request.prompt_len, start=time.perf_counter())
        try:
            async for reply in self.stub.Generate(message, timeout=self.timeout):
                if reply.token_ids:
                    result.chunk_times.append(time.perf_counter())
                    result.chunk_tokens.append(len(reply.token_ids))
                result.server_prompt_tokens = reply.prompt_tokens
                if reply.HasField("timings"):
                    result.server_queue = reply.timings.queue_seconds
                    result.server_prefill = reply.timings.prefill_seconds
        except grpc.aio.AioRpcError as error:
            result.error = _error(error)
        result.end = time.perf_counter()
        return result

    async def close(self) -> None:
        await self.channel.close()
