"""Assemble and run the gateway server: channels, health watch, servicer, metrics, SIGTERM drain."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc

from gateway.auth import ApiKeyInterceptor, ApiKeys
from gateway.chat_template import ChatTemplate
from gateway.clients import TokenizerClient
from gateway.model_pool import ModelPool
from gateway.config import GatewayConfig
from gateway.dependencies import DependencyWatch
from gateway.metrics import GatewayMetrics
from gateway.pipeline import Pipeline
from gateway.servicer import GatewayServicer
from grok.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from serving_common.grpc_server import HealthReporter
from serving_common.lifecycle import assemble, drain, freeze_startup_heap, serve_until_signal

if TYPE_CHECKING:
    from gateway.http.server import HttpServer

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
    http: HttpServer | None = None

    @property
    def http_port(self) -> int:
        return self.http.port if self.http is not None else 0

    async def close(self, grace: float | None = None) -> None:
        """Stop serving (finishing calls within `grace` seconds), then the watches and channels."""
        await drain(self.server, self.health, grace, self.begin_http_drain, self.release)

    async def begin_http_drain(self) -> None:
        """Stop accepting HTTP connections; requests in flight go on while gRPC drains too."""
        if self.http is not None:
            self.http.begin_shutdown()

    async def release(self) -> None:
        """After the servers stopped: wait for HTTP requests in flight, then close watches and channels
        (which those requests still need until then)."""
        if self.http is not None:
            await self.http.wait_stopped()
        await self.watch.stop()
        await self.tokenizer.close()
        await self.pool.close()


async def start_gateway(config: GatewayConfig) -> Gateway:
    """Build, bind and start the server and its dependency watches (call inside the event loop)."""
    keys = ApiKeys(config.api_keys)
    template = ChatTemplate.load(config.http.chat_template)  # a bad template stops the start, naming the flag
    tokenizer = TokenizerClient(config.tokenizer, config.tokenizer_retries, config.backend_tls,
                                prefetch_pieces=config.detokenize == "local")
    pool = ModelPool(config.models, config.backend_tls, config.model_streams, config.model_retry_seconds)
    metrics = GatewayMetrics(config.model_metrics, config.http.model_name)
    pipeline = Pipeline(tokenizer, pool, config.limits, metrics, local_detokenize=config.detokenize == "local",
                        stream_interval=config.stream_interval)
    servicer = GatewayServicer(pipeline, config, template)
    built = assemble("gateway", SERVICE_NAME,
                     lambda server: gateway_pb2_grpc.add_GatewayServiceServicer_to_server(servicer, server),
                     config.host, config.port, config.tls,
                     interceptors=[ApiKeyInterceptor(keys)] if keys.enabled else (), uds=config.uds)
    server, health, port = built.server, built.health, built.port
    http = None
    if config.http.port or config.http.uds:
        from gateway.http.app import HttpContext, create_app  # FastAPI and its models load only for the HTTP API
        from gateway.http.chat import ChatTemplate as HttpChatTemplate
        from gateway.http.server import HttpServer

        context = HttpContext(pipeline, health, keys, HttpChatTemplate.of(template), config.http.model_name,
                              config.http.timeout_seconds, int(time.time()))
        http = HttpServer(create_app(context), config.host, config.http.port, config.tls, config.grace_seconds,
                          uds=config.http.uds)
    await server.start()
    if http is not None:
        await http.start()
    watch = DependencyWatch(tokenizer, pool, health, config.health_retry_seconds)
    watch.start()
    metrics.serve(config.metrics_port, config.host)
    return Gateway(server, port, health, watch, tokenizer, pool, metrics, http)


async def serve(config: GatewayConfig) -> None:
    """Run until SIGTERM/SIGINT, then drain: NOT_SERVING, finish in-flight requests, close channels."""
    gateway = await start_gateway(config)
    frozen = freeze_startup_heap()
    where = {"uds": config.uds} if config.uds else {"port": gateway.port}
    where |= {"http_uds": config.http.uds} if config.http.uds else {"http_port": gateway.http_port}
    serving = {**where, "tokenizer": config.tokenizer, "models": list(config.models),
               "metrics_port": config.metrics_port, "frozen_objects": frozen, "tls": config.tls is not None,
               "backend_tls": config.backend_tls is not None, "api_keys": len(config.api_keys)}
    await serve_until_signal(gateway.server, gateway.health, config.grace_seconds,
                             before_stop=gateway.begin_http_drain, after_stop=gateway.release,
                             ready=lambda: log.info("serving", extra=serving))
