"""The shared health reporter: starts NOT_SERVING, and stays NOT_SERVING once draining."""

from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from serving_common.grpc_server import add_health_and_reflection, bind


async def _status(port: int, service: str = "") -> int:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service))
    return reply.status


def test_serving_is_ignored_after_drain() -> None:
    async def scenario() -> list[int]:
        server = grpc.aio.server()
        reporter = add_health_and_reflection(server, ["demo.v1.DemoService"])
        port = bind(server, "127.0.0.1", 0)
        await server.start()
        try:
            seen = [await _status(port)]
            await reporter.set(True)
            seen += [await _status(port), await _status(port, "demo.v1.DemoService")]
            await reporter.drain()
            await reporter.set(True)  # e.g. a load or a dependency finishing during shutdown
            seen += [await _status(port), await _status(port, "demo.v1.DemoService")]
            return seen
        finally:
            await server.stop(0)

    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    assert asyncio.run(scenario()) == [not_serving, serving, serving, not_serving, not_serving]
