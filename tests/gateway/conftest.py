"""Fixtures: fake backends and real gateway processes on 127.0.0.1 (one fast stack per session)."""

from __future__ import annotations

import pathlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import pytest

from gateway.client import GatewayClient
from tests.procs import Service, free_port


def start_fake(kind: str, log_dir: pathlib.Path, *args: str, port: int | None = None) -> Service:
    port = port or free_port()
    return Service("tests.gateway.fakes", [kind, "--port", str(port), *args], port, log_dir=log_dir)


def start_gateway(tokenizer: str, models: Sequence[str], log_dir: pathlib.Path, *args: str,
                  http_port: int = 0) -> Service:
    """The gateway process; its HTTP API only when `http_port` is given (the default 8000 may be taken)."""
    port = free_port()
    return Service("gateway", ["--tokenizer", tokenizer, "--model", ",".join(models), "--host", "127.0.0.1",
                               "--port", str(port), "--http-port", str(http_port), *args], port, log_dir=log_dir)


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
def jax_cache(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A JAX compilation cache shared by the model services the session starts."""
    return str(tmp_path_factory.mktemp("jax_cache"))


@pytest.fixture
def client(fast_stack: Stack) -> Iterator[GatewayClient]:
    with GatewayClient(fast_stack.address, timeout=30) as c:
        yield c
