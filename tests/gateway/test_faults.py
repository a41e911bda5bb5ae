"""Faults found by attacking the gateway (issue 11): each test failed before its fix.

- A tokenizer killed mid-stream ended decoding streams with INTERNAL (the detokenizer wrote to a call
  that had already finished); it must be UNAVAILABLE.
- Public answers leaked internals: file paths and replica addresses in GetInfo, backend addresses in
  UNAVAILABLE messages.
"""

from __future__ import annotations

import pathlib

import grpc
import pytest

from gateway.client import GatewayClient
from tests.gateway.conftest import fake_stack, start_gateway
from tests.procs import free_port
from tests.waiting import wait_until


def test_killing_the_tokenizer_mid_stream_is_unavailable_not_internal(tmp_path: pathlib.Path) -> None:
    # 0.1 s between tokens: killed right after a message arrives, the tokenizer dies while the gateway waits
    # for the model's next token, so its next write goes to a DecodeStream call that already ended (the case
    # that crashed with INTERNAL).
    stack = fake_stack(tmp_path, [["--delay", "0.1"]])
    try:
        with GatewayClient(stack.address, timeout=30) as client:
            stream = client.generate("p|ab", max_tokens=120, ignore_eos=True)
            assert next(stream).text
            next(stream)
            stack.tokenizer.kill()
            with pytest.raises(grpc.RpcError) as caught:
                for _ in stream:
                    pass
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE, caught.value.details()
        assert "tokenizer service" in caught.value.details() and "retry" in caught.value.details()
        assert not [r for r in stack.gateway.log_records() if r.get("level") == "error"]
    finally:
        stack.stop()


def test_public_answers_name_no_backend_address_or_file_path(tmp_path: pathlib.Path) -> None:
    stack = fake_stack(tmp_path, [[]])
    try:
        with GatewayClient(stack.address, timeout=30) as client:
            info = client.info()
            assert info.model.config.vocab_size and info.tokenizer.vocab_size  # what clients need stays
            assert not info.model_addresses and not info.model.checkpoint and not info.tokenizer.model_path
            stack.tokenizer.kill()
            with pytest.raises(grpc.RpcError) as caught:
                client.complete("p|ab", max_tokens=1)
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
        assert stack.tokenizer.address not in caught.value.details()
        assert "127.0.0.1" not in caught.value.details() and "ipv4" not in caught.value.details()
        # The operator still finds the address in the gateway's log.
        assert any(stack.tokenizer.address in str(r) for r in stack.gateway.log_records())
    finally:
        stack.stop()


def test_no_model_replica_reachable_names_no_address(tmp_path: pathlib.Path) -> None:
    stack = fake_stack(tmp_path, [[]])
    dead = f"127.0.0.1:{free_port()}"
    gateway = start_gateway(stack.tokenizer.address, [dead], tmp_path, "--model-retry-seconds", "0")
    try:
        # Never SERVING (its only replica is down), so wait for it to listen.
        wait_until(lambda: any(r.get("msg") == "serving" for r in gateway.log_records()), timeout=30)
        with GatewayClient(gateway.address, timeout=30) as client:
            with pytest.raises(grpc.RpcError) as caught:
                client.complete("p|ab", max_tokens=1)
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
        assert dead not in caught.value.details() and "127.0.0.1" not in caught.value.details()
        assert "model" in caught.value.details() and "retry" in caught.value.details()
    finally:
        gateway.terminate()
        stack.stop()
