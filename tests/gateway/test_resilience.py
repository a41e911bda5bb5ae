"""Cancellation, deadlines, replicas going away, the tokenizer going away, SIGTERM drain (fake backends)."""

from __future__ import annotations

import pathlib
import signal
import threading
import time

import grpc
import pytest

from gateway.client import GatewayClient
from grok.gateway.v1 import gateway_pb2
from serving_common.healthcheck import check
from grok.model.v1 import model_pb2, model_pb2_grpc
from tests.gateway.conftest import Stack, fake_stack, start_fake, start_gateway
from tests.gateway.test_gateway import outcome_of, outcomes
from tests.procs import Service, free_port, grpcurl
from tests.waiting import wait_until


def test_cancelling_mid_stream_frees_the_model_slot(slow_stack: Stack) -> None:
    with GatewayClient(slow_stack.address, timeout=30) as client:
        stream = client.generate("p|abc", max_tokens=100, ignore_eos=True, request_id="cancel-test")
        assert next(stream).text
        # The only slot is busy: a second request is refused (RESOURCE_EXHAUSTED passes through).
        with pytest.raises(grpc.RpcError) as caught:
            client.complete("p|abc", max_tokens=1)
        assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "retry" in caught.value.details()
        stream.close()  # cancels the call
        assert outcome_of(slow_stack, "cancel-test") == "cancelled"
        assert client.complete("p|abc", max_tokens=2, ignore_eos=True).text == "abc"


def test_deadline_is_deadline_exceeded_and_reaches_the_model(slow_stack: Stack) -> None:
    with GatewayClient(slow_stack.address) as client:
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as caught:
            client.complete("p|abc", max_tokens=100, ignore_eos=True, timeout=0.5, request_id="deadline-test")
        assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        full_run = 100 * 0.05  # the fake model's 100 tokens at 50 ms: the call must end well before them
        assert time.monotonic() - started < full_run / 2
        # Freed long before its 100 tokens were done.
        assert outcome_of(slow_stack, "deadline-test", timeout=2) == "cancelled"


def test_killed_replica_is_skipped_while_another_serves(tmp_path: pathlib.Path) -> None:
    stack = fake_stack(tmp_path, [[], []], "--model-retry-seconds", "0")
    try:
        with GatewayClient(stack.address, timeout=10) as client:
            def both_used() -> bool:  # requests are spread once both replicas are connected and SERVING
                assert client.complete("p|ab", max_tokens=2, ignore_eos=True).text == "abab"
                return bool(outcomes(stack, 0) and outcomes(stack, 1))
            wait_until(both_used, timeout=10)
            stack.models[0].kill()
            for i in range(6):
                reply = client.complete("p|ab", max_tokens=2, ignore_eos=True, request_id=f"after-kill-{i}")
                assert reply.text == "abab"
                assert outcome_of(stack, f"after-kill-{i}", index=1) == "finished"
            assert check(stack.address)  # one replica is enough to serve
            stack.models[1].kill()
            with pytest.raises(grpc.RpcError) as caught:
                client.complete("p|ab", max_tokens=2)
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
            wait_until(lambda: not check(stack.address))
    finally:
        stack.stop()


def test_a_request_no_replica_started_is_retried_until_one_comes_back(tmp_path: pathlib.Path) -> None:
    """Issue 64.5: the only replica dies; a request sent while it is down (nothing reached its client) waits
    for the replica to come back within its deadline, as a load balancer would, instead of UNAVAILABLE at once;
    with --model-retry-seconds 0 it is UNAVAILABLE at once."""
    stack = fake_stack(tmp_path, [[]])
    quick = start_gateway(stack.tokenizer.address, [stack.models[0].address], tmp_path, "--model-retry-seconds", "0")
    port = stack.models[0].port
    try:
        quick.wait_serving(60)
        stack.models[0].kill()
        with GatewayClient(quick.address, timeout=20) as client:
            started = time.monotonic()
            with pytest.raises(grpc.RpcError) as caught:
                client.complete("p|ab", max_tokens=2, ignore_eos=True)
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE and time.monotonic() - started < 5
        result: dict[str, object] = {}

        def ask() -> None:
            with GatewayClient(stack.address, timeout=30) as client:
                try:
                    result["text"] = client.complete("p|ab", max_tokens=2, ignore_eos=True,
                                                     request_id="retried").text
                except grpc.RpcError as error:
                    result["error"] = error.code()

        asker = threading.Thread(target=ask)
        asker.start()
        wait_until(lambda: any(r.get("msg") == "no model replica available: retrying the request"
                               for r in stack.gateway.log_records()), timeout=20,
                   message=lambda: f"{result} {[r.get('msg') for r in stack.gateway.log_records()][-8:]}")
        stack.models[0] = start_fake("model", tmp_path, port=port)
        asker.join(40)
        assert result == {"text": "abab"}
    finally:
        quick.terminate()
        stack.stop()


def test_tokenizer_down_is_unavailable_then_recovers(tmp_path: pathlib.Path) -> None:
    stack = fake_stack(tmp_path, [[]])
    try:
        with GatewayClient(stack.address, timeout=10) as client:
            assert client.complete("p|ab", max_tokens=1).text == "ab"
            stack.tokenizer.kill()
            with pytest.raises(grpc.RpcError) as caught:
                client.complete("p|ab", max_tokens=1)
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "tokenizer service" in caught.value.details()
            wait_until(lambda: not check(stack.address))
            stack.tokenizer = start_fake("tokenizer", tmp_path, port=stack.tokenizer.port).wait_serving(30)
            wait_until(lambda: check(stack.address), timeout=10)
            assert client.complete("p|ab", max_tokens=1).text == "ab"
    finally:
        stack.stop()


def test_sigterm_drains_in_flight_streams_then_exits_cleanly(tmp_path: pathlib.Path) -> None:
    stack = fake_stack(tmp_path, [["--delay", "0.05"]])
    try:
        with GatewayClient(stack.address, timeout=30) as client:
            stream = client.generate("p|ab", max_tokens=20, ignore_eos=True)
            first = next(stream)
            stack.gateway.proc.send_signal(signal.SIGTERM)
            rest = list(stream)
            assert first.text + "".join(m.text for m in rest) == "ab" * 20
            assert rest[-1].finish_reason == gateway_pb2.FINISH_REASON_LENGTH
        assert stack.gateway.proc.wait(15) == 0
        assert any(r.get("msg") == "stopped" for r in stack.gateway.log_records())
    finally:
        stack.stop()


def test_health_reports_not_serving_while_draining(tmp_path: pathlib.Path) -> None:
    stack = fake_stack(tmp_path, [["--delay", "0.05"]], "--grace-seconds", "5")
    try:
        with GatewayClient(stack.address, timeout=30) as client:
            stream = client.generate("p|ab", max_tokens=40, ignore_eos=True)
            next(stream)
            stack.gateway.proc.send_signal(signal.SIGTERM)
            seen: list[bool] = []
            reader = threading.Thread(target=lambda: seen.append(len(list(stream)) > 0))
            reader.start()
            wait_until(lambda: not check(stack.address), timeout=3)
            reader.join(10)
            assert seen == [True]
    finally:
        stack.stop()


def occupy(model: Service) -> tuple[grpc.Channel, grpc.Call]:
    """Take a fake model's only slot with a direct, long call (keep the call: dropping it cancels it)."""
    channel = grpc.insecure_channel(model.address)
    call = model_pb2_grpc.ModelServiceStub(channel).Generate(
        model_pb2.GenerateRequest(token_ids=[5, 6], max_tokens=100, ignore_eos=True), timeout=30)
    next(call)
    return channel, call


def test_busy_replica_is_skipped_and_all_busy_is_resource_exhausted(tmp_path: pathlib.Path) -> None:
    stack = fake_stack(tmp_path, [["--slots", "1", "--delay", "0.05"]] * 2)
    try:
        with GatewayClient(stack.address, timeout=10) as client:
            first = occupy(stack.models[0])
            for _ in range(4):  # the gateway does not know replica 0 is busy: it moves on when refused
                assert client.complete("p|ab", max_tokens=2, ignore_eos=True).text == "abab"
            second = occupy(stack.models[1])
            with pytest.raises(grpc.RpcError) as caught:
                client.complete("p|ab", max_tokens=2)
            assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            for channel, call in (first, second):
                call.cancel()
                channel.close()
    finally:
        stack.stop()


def test_without_dependencies_gateway_is_not_serving_and_requests_are_unavailable(tmp_path: pathlib.Path) -> None:
    gateway = start_gateway(f"127.0.0.1:{free_port()}", [f"127.0.0.1:{free_port()}"], tmp_path)
    try:
        wait_until(lambda: any(r.get("msg") == "serving" for r in gateway.log_records()))
        assert not check(gateway.address)
        with GatewayClient(gateway.address, timeout=10) as client:
            with pytest.raises(grpc.RpcError) as caught:
                client.complete("p|ab", max_tokens=1)
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "tokenizer service is unavailable" in caught.value.details()
        health = grpcurl("-plaintext", "-d", '{"service": "grok.gateway.v1.GatewayService"}', gateway.address,
                         "grpc.health.v1.Health/Check")
        assert '"NOT_SERVING"' in health.stdout
    finally:
        gateway.terminate()


def test_one_ipv4_target_with_several_addresses_is_balanced_round_robin(tmp_path: pathlib.Path) -> None:
    tokenizer = start_fake("tokenizer", tmp_path)
    models = [start_fake("model", tmp_path) for _ in range(2)]
    target = "ipv4:" + ",".join(m.address for m in models)
    gateway = start_gateway(tokenizer.address, [target], tmp_path)
    stack = Stack(tokenizer, models, gateway)
    try:
        for service in (tokenizer, *models, gateway):
            service.wait_serving(60)
        with GatewayClient(gateway.address, timeout=10) as client:

            def both_used() -> bool:  # round_robin uses an address once its connection is up
                assert client.complete("p|ab", max_tokens=1).text == "ab"
                return bool(outcomes(stack, 0) and outcomes(stack, 1))
            wait_until(both_used, timeout=10)
    finally:
        stack.stop()
