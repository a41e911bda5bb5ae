"""Watch the health of the tokenizer service and every model replica; report the gateway's own health.

The gateway is SERVING while the tokenizer and at least one model replica are SERVING. Each dependency
has a grpc.health.v1 Watch stream that is reopened after the dependency goes away.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.clients import TokenizerClient
from gateway.model_pool import ModelPool, Replica
from serving_common.grpc_server import HealthReporter

log = logging.getLogger(__name__)


class DependencyWatch:
    """Background Watch streams keeping `tokenizer_serving` and each replica's `serving` current."""

    def __init__(self, tokenizer: TokenizerClient, pool: ModelPool, reporter: HealthReporter,
                 retry_seconds: float = 0.5) -> None:
        self.tokenizer = tokenizer
        self.pool = pool
        self.reporter = reporter
        self.retry_seconds = retry_seconds
        self.tokenizer_serving = False
        self.tasks: list[asyncio.Task[None]] = []

    @property
    def serving(self) -> bool:
        return self.tokenizer_serving and any(r.serving for r in self.pool.replicas)

    def start(self) -> None:
        self.tasks.append(asyncio.create_task(self._watch(self.tokenizer.channel, "tokenizer", self._set_tokenizer)))
        for replica in self.pool.replicas:
            setter = functools.partial(self._set_replica, replica)
            self.tasks.append(asyncio.create_task(self._watch(replica.channel, f"model {replica.address}", setter)))

    def _set_tokenizer(self, up: bool) -> None:
        if up and not self.tokenizer_serving:
            self.tokenizer.forget_piece_table()  # it (re)started: it may serve another model now
        self.tokenizer_serving = up

    def _set_replica(self, replica: Replica, up: bool) -> None:
        if up and not replica.serving:
            self.pool.forget_info()  # a replica (re)started: its GetInfo may have changed
            replica.serves_many = None  # and its version: ask again whether it serves GenerateMany
        replica.serving = up

    async def _watch(self, channel: grpc.aio.Channel, name: str, set_status: Callable[[bool], None]) -> None:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            try:
                async for reply in stub.Watch(health_pb2.HealthCheckRequest(service="")):
                    await self._report(name, set_status, reply.status == health_pb2.HealthCheckResponse.SERVING)
            except grpc.aio.AioRpcError as error:
                log.debug("health watch ended", extra={"dependency": name, "code": error.code().name})
            await self._report(name, set_status, False)
            await asyncio.sleep(self.retry_seconds)

    async def _report(self, name: str, set_status: Callable[[bool], None], up: bool) -> None:
        before = self.serving
        set_status(up)
        if self.serving != before:
            log.info("dependencies changed", extra={"dependency": name, "up": up, "gateway_serving": self.serving})
        await self.reporter.set(self.serving)  # ignored once the gateway drains

    async def stop(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        self.tasks.clear()
