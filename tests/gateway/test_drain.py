"""SIGTERM while a gateway watches a backend's health: the drain ends as soon as the real calls end
(issue 11, fault 4: an open Health/Watch stream made every drain last the whole grace period)."""

from __future__ import annotations

import pathlib
import signal

import pytest

from gateway.client import GatewayClient
from tests.gateway.conftest import Stack, golden_model, golden_tokenizer, start_fake, start_gateway
from tests.procs import Service

pytestmark = pytest.mark.slow

# Far longer than the exit is waited for: an idle service that waited out its grace would never be seen to exit.
GRACE = "600"


def sigterm_exit_code(service: Service) -> int:
    """SIGTERM, then the exit code; the wait fails (subprocess.TimeoutExpired) if the service lingers."""
    service.proc.send_signal(signal.SIGTERM)
    return service.proc.wait(30)


def watched(backend: Service, kind: str, tmp_path: pathlib.Path) -> Stack:
    """A gateway whose health watch is connected to `backend` (the other dependency is a fake)."""
    if kind == "model":
        tokenizer = start_fake("tokenizer", tmp_path)
        stack = Stack(tokenizer, [backend], start_gateway(tokenizer.address, [backend.address], tmp_path))
    else:
        model = start_fake("model", tmp_path)
        stack = Stack(backend, [model], start_gateway(backend.address, [model.address], tmp_path))
    for service in (stack.tokenizer, *stack.models, stack.gateway):
        service.wait_serving(600)
    return stack


def test_idle_model_service_drains_at_once_while_the_gateway_watches_it(tmp_path: pathlib.Path,
                                                                       jax_cache: str) -> None:
    stack = watched(golden_model(tmp_path, jax_cache, "--grace-seconds", GRACE), "model", tmp_path)
    try:
        with GatewayClient(stack.address, timeout=60) as client:  # a real call finished before the signal
            assert client.complete("In the beginning", max_tokens=3).usage.completion_tokens == 3
        assert sigterm_exit_code(stack.models[0]) == 0
    finally:
        stack.stop()


def test_idle_tokenizer_service_drains_at_once_while_the_gateway_watches_it(tmp_path: pathlib.Path) -> None:
    stack = watched(golden_tokenizer(tmp_path, "--grace-seconds", GRACE), "tokenizer", tmp_path)
    try:
        assert sigterm_exit_code(stack.tokenizer) == 0
    finally:
        stack.stop()
