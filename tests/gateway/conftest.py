"""Fixtures: fake backends and real gateway processes on 127.0.0.1 (one fast stack per session)."""

from __future__ import annotations

import pathlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import pytest

import grpc

from gateway.client import GatewayClient
from grok.gateway.v1 import gateway_pb2_grpc
from grok.model.v1 import model_pb2_grpc
from grok.tokenizer.v1 import tokenizer_pb2_grpc
from tests.procs import GOLDEN, Service, free_port


def start_fake(kind: str, log_dir: pathlib.Path, *args: str, port: int | None = None) -> Service:
    port = port or free_port()
    return Service("tests.gateway.fakes", [kind, "--port", str(port), *args], port, log_dir=log_dir)


def start_gateway(tokenizer: str, models: Sequence[str], log_dir: pathlib.Path, *args: str,
                  http_port: int = 0, env: dict[str, str] | None = None, detokenize: str | None = "remote") -> Service:
    """The gateway process; its HTTP API only when `http_port` is given (the default 8000 may be taken).

    `detokenize`: remote unless told, as the fake tokenizer (fakes.py) serves no piece table for the gateway's
    default, local (and tests of the remote path say so); None: the gateway's default. `args` may override it."""
    port = free_port()
    mode = ["--detokenize", detokenize] if detokenize else []
    return Service("gateway", ["--tokenizer", tokenizer, "--model", ",".join(models), "--host", "127.0.0.1",
                               "--port", str(port), "--http-port", str(http_port), *mode, *args], port,
                   log_dir=log_dir, env=env)


@dataclass
class Stack:
    tokenizer: Service
    models: list[Service]
    gateway: Service
    http_port: int = 0

    @property
    def address(self) -> str:
        return self.gateway.address

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def stop(self) -> None:
        for service in (self.gateway, *self.models, self.tokenizer):
            service.terminate()


def fake_stack(log_dir: pathlib.Path, model_args: Sequence[Sequence[str]], *gateway_args: str) -> Stack:
    tokenizer = start_fake("tokenizer", log_dir)
    models = [start_fake("model", log_dir, *args) for args in model_args]
    http_port = free_port()
    gateway = start_gateway(tokenizer.address, [m.address for m in models], log_dir, *gateway_args,
                            http_port=http_port)
    stack = Stack(tokenizer, models, gateway, http_port)
    try:
        for service in (tokenizer, *models, gateway):
            service.wait_serving(60)
    except Exception:
        stack.stop()
        raise
    return stack


@pytest.fixture(scope="session")
def fast_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """Fake tokenizer + one fast fake model (8 slots) + the real gateway with a metrics endpoint."""
    stack = fake_stack(tmp_path_factory.mktemp("fast"), [["--slots", "8"]], "--metrics-port", str(free_port()),
                       "--max-stop", "3", "--max-stop-chars", "10", "--max-prompt-bytes", "200",
                       "--default-max-tokens", "20")
    yield stack
    stack.stop()


@pytest.fixture(scope="session")
def slow_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """A fake model with one slot and 50 ms per token (busy -> RESOURCE_EXHAUSTED)."""
    stack = fake_stack(tmp_path_factory.mktemp("slow"), [["--slots", "1", "--delay", "0.05"]])
    yield stack
    stack.stop()


@pytest.fixture(scope="session")
def grouped_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """A fake model that sends four tokens per message, as a speculative step can."""
    stack = fake_stack(tmp_path_factory.mktemp("grouped"), [["--group", "4"]])
    yield stack
    stack.stop()


@pytest.fixture
def client(fast_stack: Stack) -> Iterator[GatewayClient]:
    with GatewayClient(fast_stack.address, timeout=30) as c:
        yield c


def model_args(port: int, metrics_port: int, cache: str) -> list[str]:
    """Flags of a model service on the golden tiny Grok-1 (float32, 2 slots, one 64-token bucket)."""
    return ["--config", str(GOLDEN / "config.json"), "--checkpoint", str(GOLDEN / "checkpoint"), "--dtype", "float32",
            "--host", "127.0.0.1", "--port", str(port), "--slots", "2",
            "--metrics-port", str(metrics_port), "--compile-cache", cache]


def golden_model(log_dir: pathlib.Path, cache: str, *args: str, port: int | None = None) -> Service:
    """A real model service on the golden tiny Grok-1 (metrics on a free port)."""
    port = port or free_port()
    return Service("model_service", [*model_args(port, free_port(), cache), *args], port, log_dir=log_dir)


def golden_tokenizer(log_dir: pathlib.Path, *args: str, port: int | None = None) -> Service:
    """A real tokenizer service with the golden model's SentencePiece file."""
    port = port or free_port()
    return Service("tokenizer_service", ["--model", str(GOLDEN / "tokenizer.model"), "--host", "127.0.0.1",
                                         "--port", str(port), *args], port, log_dir=log_dir)


# The golden stack's tokenizer limits (tests/gateway/test_bad_input.py runs into them).
TOKENIZER_LIMITS = ("--max-text-bytes", "4096", "--max-batch", "4", "--max-tokens", "256")


def start_golden_stack(log_dir: pathlib.Path, cache: str, replica_args: Sequence[Sequence[str]] = ((),),
                       gateway_args: Sequence[str] = ()) -> Stack:
    """Real tokenizer, real golden model replicas (one per `replica_args`), real gateway; SERVING when returned."""
    tokenizer = golden_tokenizer(log_dir, *TOKENIZER_LIMITS)
    models = [golden_model(log_dir, cache, *args) for args in replica_args]
    gateway = start_gateway(tokenizer.address, [m.address for m in models], log_dir, *gateway_args, detokenize=None)
    stack = Stack(tokenizer, models, gateway)
    try:
        for service in (tokenizer, *models, gateway):
            service.wait_serving(600)
    except Exception:
        stack.stop()
        raise
    return stack


@pytest.fixture(scope="session")
def golden_stack(tmp_path_factory: pytest.TempPathFactory, jax_cache: str) -> Iterator[Stack]:
    """One real stack on the golden model for the session (metrics on); tests must leave it running."""
    stack = start_golden_stack(tmp_path_factory.mktemp("golden"), jax_cache)
    yield stack
    stack.stop()


@dataclass
class Stubs:
    """Stubs (and raw channels) to every service of a stack."""

    gateway: gateway_pb2_grpc.GatewayServiceStub
    tokenizer: tokenizer_pb2_grpc.TokenizerServiceStub
    model: model_pb2_grpc.ModelServiceStub
    channels: dict[str, grpc.Channel]


@pytest.fixture(scope="session")
def golden_http_url(golden_stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A second gateway on the golden stack's backends with the HTTP API on; its base URL."""
    port = free_port()
    gateway = start_gateway(golden_stack.tokenizer.address, [m.address for m in golden_stack.models],
                            tmp_path_factory.mktemp("golden_http"), http_port=port, detokenize=None)
    try:
        gateway.wait_serving(120)
        yield f"http://127.0.0.1:{port}"
    finally:
        gateway.terminate()


@pytest.fixture(scope="session")
def golden_stubs(golden_stack: Stack) -> Iterator[Stubs]:
    channels = {name: grpc.insecure_channel(service.address) for name, service in
                (("gateway", golden_stack.gateway), ("tokenizer", golden_stack.tokenizer),
                 ("model", golden_stack.models[0]))}
    yield Stubs(gateway_pb2_grpc.GatewayServiceStub(channels["gateway"]),
                tokenizer_pb2_grpc.TokenizerServiceStub(channels["tokenizer"]),
                model_pb2_grpc.ModelServiceStub(channels["model"]), channels)
    for channel in channels.values():
        channel.close()
