"""Assemble and run the gateway server: channels, health watch, servicer, metrics, SIGTERM drain."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import grpc

from gateway.clients import ModelPool, TokenizerClient
from gateway.config import GatewayConfig
from gateway.dependencies import DependencyWatch
from gateway.metrics import GatewayMetrics
from gateway.pipeline import Pipeline
from gateway.servicer import GatewayServicer
from grok.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from serving_common.grpc_server import HealthReporter, add_health_and_reflection, bind, new_server, serve_until_signal

log = logging.getLogger(__name__)

SERVICE_NAME = gateway_pb2.DESCRIPTOR.services_by_name["GatewayService"].full_name


@dataclass
class Gateway:
    """A started gateway: its server and what must be closed with it."""

    server: grpc.aio.Server
    port: int
    health: HealthReporter
    watch: DependencyWatch
    tokenizer: TokenizerClient
    pool: ModelPool
    metrics: GatewayMetrics

    async def close(self, grace: float | None = None) -> None:
        """Stop serving (finishing calls within `grace` seconds), then the watches and channels."""
        await self.health.drain()
        await self.server.stop(grace)
        await self.release()

    async def release(self) -> None:
        await self.watch.stop()
        await self.tokenizer.close()
        await self.pool.close()


async def start_gateway(config: GatewayConfig) -> Gateway:
    """Build, bind and start the server and its dependency watches (call inside the event loop)."""
    tokenizer = TokenizerClient(config.tokenizer, config.tokenizer_retries)
    pool = ModelPool(config.models)
    metrics = GatewayMetrics()
    server = new_server("gateway")
    gateway_pb2_grpc.add_GatewayServiceServicer_to_server(
        GatewayServicer(Pipeline(tokenizer, pool, config.limits, metrics), config), server)
    health = add_health_and_reflection(server, [SERVICE_NAME])
    port = bind(server, config.host, config.port)
    await server.start()
    watch = DependencyWatch(tokenizer, pool, health, config.health_retry_seconds)
    watch.start()
    metrics.serve(config.metrics_port, config.host)
    return Gateway(server, port, health, watch, tokenizer, pool, metrics)


async def serve(config: GatewayConfig) -> None:
    """Run until SIGTERM/SIGINT, then drain: NOT_SERVING, finish in-flight requests, close channels."""
    gateway = await start_gateway(config)
    log.info("serving", extra={"port": gateway.port, "tokenizer": config.tokenizer, "models": list(config.models),
                               "metrics_port": config.metrics_port})
    await serve_until_signal(gateway.server, gateway.health, config.grace_seconds, after_stop=gateway.release)
