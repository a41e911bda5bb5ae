"""Assembles the tokenizer gRPC server: model loading, servicer, health, reflection, SIGTERM drain."""

from __future__ import annotations

import dataclasses
import logging

import grpc

from grok.tokenizer.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from serving_common.grpc_server import HealthReporter
from serving_common.lifecycle import assemble, freeze_startup_heap, serve_until_signal
from serving_common.tls import ServerTLS
from tokenizer_service.servicer import Limits, TokenizerServicer
from tokenizer_service.tokenizer import Tokenizer

log = logging.getLogger(__name__)

SERVICE_NAME: str = tokenizer_pb2.DESCRIPTOR.services_by_name["TokenizerService"].full_name
DEFAULT_PORT = 50052


@dataclasses.dataclass(frozen=True)
class TokenizerConfig:
    """Everything the service is started with; parsed once from flags/environment in __main__."""

    model_path: str
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    uds: str | None = None  # listen on this unix socket file instead of host:port
    grace_seconds: float = 10.0
    max_text_bytes: int = 1 << 20
    max_batch: int = 256
    max_tokens: int = 1 << 20
    log_level: str = "info"
    log_format: str = "auto"  # serving_common.logs: text on a terminal, else JSON
    tls: ServerTLS | None = None  # TLS, and mutual TLS when it names a client CA
    otlp_endpoint: str | None = None  # OTLP/gRPC collector for traces (serving_common.tracing); None: off

    @property
    def limits(self) -> Limits:
        return Limits(self.max_text_bytes, self.max_batch, self.max_tokens)

    def max_message_bytes(self) -> int:
        """Largest request gRPC may accept: room for the biggest allowed id list or batch of texts.

        Anything larger is refused by gRPC itself with RESOURCE_EXHAUSTED before reaching us.
        """
        ids = 10 * self.max_tokens  # worst-case varint bytes per id plus framing
        texts = self.max_batch * (self.max_text_bytes + 16)
        return min(max(4 << 20, ids, texts), (1 << 31) - 1)


@dataclasses.dataclass(frozen=True)
class BuiltServer:
    """A bound, not yet started server with its health reporter (still NOT_SERVING)."""

    server: grpc.aio.Server
    port: int
    health: HealthReporter
    servicer: TokenizerServicer


def build(config: TokenizerConfig) -> BuiltServer:
    """Load the model and assemble a bound server. Must be called with an event loop running."""
    tokenizer = Tokenizer(config.model_path)
    limit = config.max_message_bytes()
    servicer = TokenizerServicer(tokenizer, config.limits)
    built = assemble("tokenizer", SERVICE_NAME,
                     lambda server: tokenizer_pb2_grpc.add_TokenizerServiceServicer_to_server(servicer, server),
                     config.host, config.port, config.tls, options=[("grpc.max_receive_message_length", limit)],
                     uds=config.uds)
    log.info("tokenizer loaded", extra={"model_path": tokenizer.path, "vocab_size": tokenizer.vocab_size,
                                        "model_sha256": tokenizer.sha256})
    return BuiltServer(built.server, built.port, built.health, servicer)


async def build_server(config: TokenizerConfig) -> tuple[grpc.aio.Server, int]:
    """A bound server whose health already reports SERVING (the model is loaded); the caller starts it."""
    built = build(config)
    await built.health.set(True)
    return built.server, built.port


async def serve(config: TokenizerConfig) -> None:
    """Serve until SIGTERM/SIGINT, then drain for up to grace_seconds: no new Encode, every call in flight
    (and every DecodeStream of a request already encoded here) to its end (servicer.Workload)."""
    built = build(config)
    await built.server.start()
    frozen = freeze_startup_heap()
    await built.health.set(True)
    where = {"uds": config.uds} if config.uds else {"port": built.port, "host": config.host}
    log.info("serving", extra={**where, "frozen_objects": frozen})
    await serve_until_signal(built.server, built.health, config.grace_seconds,
                             before_stop=lambda: built.servicer.work.drain(config.grace_seconds))
