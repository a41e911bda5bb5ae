"""The load generator's gRPC client spread over processes (benchmarks.layers --client-processes N).

One asyncio process receiving every stream's messages costs ~0.3 ms of CPU a token (the TPU host's run at 64
streams: benchmarks/measured/stack-uds-medium-tpu-v5e-engine-process.json), so at device speed the client can be
what limits the arm it measures. Here a point's requests are dealt round-robin to N worker processes (spawned
once, reused), each running the same closed-loop runner (loadgen.run_point) over its share with its share of the
concurrency and its own channel; the parent merges their results. Every timestamp is time.perf_counter, the
system-wide monotonic clock on Linux, so results from different processes compare directly; the point's
duration runs from the earliest send to the latest end. Each worker reports its own CPU seconds for the point.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import multiprocessing
import time
from collections.abc import Sequence
from dataclasses import dataclass

from benchmarks.loadgen import GatewaySender, LoadPoint, ModelSender, run_point
from benchmarks.metrics import RequestResult
from benchmarks.workload import BenchRequest


@dataclass(frozen=True)
class SenderSpec:
    """What a worker builds its sender from (a sender holds a channel, which cannot cross processes)."""

    kind: str  # "gateway" (loadgen.GatewaySender) or "model" (loadgen.ModelSender)
    address: str
    temperature: float = 0.0

    def sender(self) -> GatewaySender | ModelSender:
        if self.kind not in ("gateway", "model"):
            raise ValueError(f"sender kind must be gateway or model, got {self.kind!r}")
        return (GatewaySender if self.kind == "gateway" else ModelSender)(self.address, self.temperature)


def _share(spec: SenderSpec, requests: Sequence[BenchRequest], concurrency: int,
           seed: int) -> tuple[list[RequestResult], float]:
    """In a worker: its share of a point; the results and the CPU seconds it spent."""
    async def go() -> list[RequestResult]:
        send = spec.sender()
        try:
            served, _ = await run_point(send, requests, LoadPoint(concurrency), seed)
            return served
        finally:
            await send.close()

    cpu = time.process_time()
    served = asyncio.run(go())
    return served, time.process_time() - cpu


def shares(count: int, concurrency: int, processes: int) -> list[tuple[list[int], int]]:
    """Request indices and concurrency per worker: requests dealt round-robin, the concurrency split as evenly as
    it goes (no worker without at least one stream in flight, so at most `concurrency` workers)."""
    used = max(1, min(processes, concurrency, count))
    return [(list(range(i, count, used)), concurrency // used + (i < concurrency % used)) for i in range(used)]


class ClientPool:
    """`processes` spawned workers that run closed-loop points for the parent."""

    def __init__(self, processes: int) -> None:
        if processes < 1:
            raise ValueError(f"client processes must be at least 1, got {processes}")
        self.processes = processes
        self._pool = concurrent.futures.ProcessPoolExecutor(processes, mp_context=multiprocessing.get_context("spawn"))

    async def run_point(self, spec: SenderSpec, requests: Sequence[BenchRequest], point: LoadPoint,
                        seed: int = 0) -> tuple[list[RequestResult], float, float]:
        """A closed-loop point over the workers: every request's result (in request order), the duration from
        the earliest send to the latest end, and the workers' CPU seconds."""
        if not point.closed_loop or point.concurrency is None:
            raise ValueError("the client pool runs closed-loop points (a concurrency, every request at once)")
        loop = asyncio.get_running_loop()
        plan = shares(len(requests), point.concurrency, self.processes)
        futures = [loop.run_in_executor(self._pool, _share, spec, [requests[i] for i in indices], concurrency, seed)
                   for indices, concurrency in plan]
        done = await asyncio.gather(*futures)
        served: list[RequestResult | None] = [None] * len(requests)
        for (indices, _), (results, _) in zip(plan, done):
            for i, result in zip(indices, results):
                served[i] = result
        merged = [r for r in served if r is not None]
        duration = max(r.end for r in merged) - min(r.start for r in merged)
        return merged, duration, sum(cpu for _, cpu in done)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
