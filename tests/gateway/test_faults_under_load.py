"""Faults under load against a real stack (golden tiny model, two replicas of 2 slots + 4 queue):
a cancel storm, a burst of twice the capacity, kill -9 of the tokenizer, of one replica and of every
replica, SIGTERM of each service. The gateway is never restarted by a test that kills a backend; the
seeded requests must keep returning the answer they gave on the calm stack whenever they succeed. A test that
fails with a service down leaves the stack whole again for the next one."""

from __future__ import annotations

import collections
import random
import threading
import time
from collections.abc import Iterator

import grpc
import pytest

from benchmarks.chaos_faults import good_answer, scrape, sigterm_tokenizer_with_streams_in_flight, slots_free
from benchmarks.chaos_load import EXPECTED, Seeded, Traffic, baseline, burst
from benchmarks.chaos_stack import LocalStack, StackConfig
from gateway.client import generate_request
from grok.gateway.v1 import gateway_pb2_grpc
from serving_common.errors import details_of
from tests.procs import GOLDEN
from tests.waiting import wait_until

pytestmark = pytest.mark.slow

LONG = 100  # tokens: several hundred ms of decoding on the golden model
CAPACITY = 2 * (2 + 4)  # replicas x (slots + queue)
CANCEL_STORM_CALLS = 120  # each cancelled within 0.3 s of its start, most of them before their 100 tokens
SETTLE_CALLS = 6  # OK completions to wait for: about two per "complete" worker, past the calls in flight at a kill
# While no replica is up, the gateway keeps a request that none started for this long (default 30 s: a restart's
# length), then answers UNAVAILABLE. A call in flight at a kill may not have had its first token yet (100 tokens
# of the golden model take ~0.1 s, its prompt a good part of that); it is one of those.
RETRY_SECONDS = 2.0


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, jax_cache: str) -> Iterator[LocalStack]:
    config = StackConfig(config=str(GOLDEN / "config.json"), checkpoint=str(GOLDEN / "checkpoint"),
                         tokenizer=str(GOLDEN / "tokenizer.model"), replicas=2, slots=2, max_queue=4,
                         compile_cache=jax_cache, grace_seconds=5.0,
                         gateway_flags=("--model-retry-seconds", str(RETRY_SECONDS)))
    local = LocalStack(config, tmp_path_factory.mktemp("faults")).start()
    yield local
    local.stop()


@pytest.fixture(autouse=True)
def whole_stack_after(request: pytest.FixtureRequest) -> Iterator[None]:
    """Every service running and serving after each test, whatever it killed and however it ended: a test that
    failed before starting again what it killed used to fail every later one in the module."""
    yield
    if "stack" not in request.fixturenames:
        return
    local: LocalStack = request.getfixturevalue("stack")
    for proc in local.services:
        if not proc.alive():
            proc.start()
    for proc in local.services:
        proc.wait_serving(600)


@pytest.fixture(scope="module")
def seeded(stack: LocalStack) -> list[Seeded]:
    return baseline(stack.gateway.address)


def generated(stack: LocalStack, replica: int) -> float:
    return scrape(stack.metrics_port(stack.models[replica])).get("grok_model_generated_tokens_total", 0.0)


def completed(traffic: Traffic, calls: int, timeout: float = 60.0) -> None:
    """Wait until `calls` more "complete" calls ended with OK."""
    before = traffic.outcomes.snapshot()[("complete", "OK")]
    wait_until(lambda: traffic.outcomes.snapshot()[("complete", "OK")] >= before + calls, timeout, interval=0.05,
               message=lambda: f"{calls} more calls did not complete: {traffic.outcomes.table()}")


def flowing(traffic: Traffic) -> None:
    """Wait until the traffic runs: a call completed, so the next ones are in flight."""
    completed(traffic, 1)


def only_expected(traffic: Traffic) -> None:
    assert not traffic.outcomes.unexpected(), traffic.outcomes.table()


def test_cancel_storm_frees_every_slot_and_refuses_no_live_request(stack: LocalStack, seeded: list[Seeded]) -> None:
    outcomes: collections.Counter[str] = collections.Counter()
    lock = threading.Lock()
    calls = iter(range(CANCEL_STORM_CALLS))

    def worker(rng: random.Random) -> None:  # fewer callers than the capacity: no live request may be refused
        with grpc.insecure_channel(stack.gateway.address) as channel:
            stub = gateway_pb2_grpc.GatewayServiceStub(channel)
            for _ in calls:
                call = stub.Generate(generate_request("In the beginning", max_tokens=LONG,
                                                                  ignore_eos=True), timeout=60)
                timer = threading.Timer(rng.uniform(0, 0.3), call.cancel)
                timer.start()
                try:
                    for _ in call:
                        pass
                    outcome = "OK"
                except grpc.RpcError as error:
                    outcome = error.code().name
                timer.cancel()
                with lock:
                    outcomes[outcome] += 1

    # Two thirds of the capacity: a cancel takes a moment to reach the model (the gateway relays it), and
    # the next call of the same caller may arrive first.
    threads = [threading.Thread(target=worker, args=(random.Random(i),)) for i in range(CAPACITY * 2 // 3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert sum(outcomes.values()) == CANCEL_STORM_CALLS and set(outcomes) <= {"CANCELLED", "OK"}, outcomes
    assert outcomes["CANCELLED"] > CANCEL_STORM_CALLS * 3 // 4
    assert slots_free(stack, timeout=10)["all_free"]
    assert good_answer(stack.gateway.address, seeded)


def test_twice_the_capacity_at_once_is_resource_exhausted_with_retry_info_and_the_rest_complete(
        stack: LocalStack) -> None:
    errors: list[grpc.RpcError] = []
    outcomes = burst(stack.gateway.address, 2 * CAPACITY, LONG, errors)
    assert set(outcomes) <= {"OK", "RESOURCE_EXHAUSTED"}, outcomes
    assert outcomes["OK"] >= CAPACITY - 2 and outcomes["RESOURCE_EXHAUSTED"] >= 1
    for error in errors:
        assert "retry" in error.details() and details_of(error).retry_after is not None
    assert slots_free(stack, timeout=10)["all_free"]


def test_killed_tokenizer_is_unavailable_and_not_serving_then_recovers_without_restarting_the_gateway(
        stack: LocalStack, seeded: list[Seeded]) -> None:
    gateway_pid = stack.gateway.pid
    with Traffic(stack.gateway.address, seeded, {"complete": 3}, LONG) as traffic:
        flowing(traffic)
        stack.tokenizer.kill()
        wait_until(lambda: not stack.gateway.serving(), 5, interval=0.05)
        wait_until(lambda: traffic.outcomes.snapshot()[("complete", "UNAVAILABLE")] > 0, 10, interval=0.05)
        stack.tokenizer.start().wait_serving(60)
        wait_until(lambda: good_answer(stack.gateway.address, seeded), 30, interval=0.05)
        wait_until(stack.gateway.serving, 10, interval=0.05)  # its health watch reconnected too
    only_expected(traffic)
    assert stack.gateway.pid == gateway_pid and stack.gateway.alive()


def test_one_of_two_replicas_killed_traffic_moves_to_the_other(stack: LocalStack, seeded: list[Seeded]) -> None:
    with Traffic(stack.gateway.address, seeded, {"complete": 3, "cancel": 1}, LONG) as traffic:
        flowing(traffic)
        stack.models[0].kill()
        # Calls in flight on the killed replica end (UNAVAILABLE) while these complete; later ones go to the other.
        completed(traffic, SETTLE_CALLS)
        before, survivor = traffic.outcomes.snapshot(), generated(stack, 1)
        completed(traffic, SETTLE_CALLS)
        during = traffic.outcomes.snapshot() - before
        assert stack.gateway.serving()
        assert during[("complete", "OK")] > 0 and during[("complete", "UNAVAILABLE")] == 0, during
        assert generated(stack, 1) > survivor
        stack.models[0].start().wait_serving(600)
        back = generated(stack, 0)
        wait_until(lambda: generated(stack, 0) > back, 30, interval=0.05)  # it gets traffic again
    only_expected(traffic)


def test_every_replica_killed_is_unavailable_and_not_serving_then_recovers(stack: LocalStack,
                                                                          seeded: list[Seeded]) -> None:
    with Traffic(stack.gateway.address, seeded, {"complete": 3}, LONG) as traffic:
        flowing(traffic)
        for model in stack.models:
            model.kill()
        wait_until(lambda: not stack.gateway.serving(), 5, interval=0.05)
        # A call in flight past its first token ends at once; one not started yet after RETRY_SECONDS.
        wait_until(lambda: traffic.outcomes.snapshot()[("complete", "UNAVAILABLE")] > 0, RETRY_SECONDS + 10,
                   interval=0.05)
        began = time.monotonic()
        with grpc.insecure_channel(stack.gateway.address) as channel, pytest.raises(grpc.RpcError) as refused:
            gateway_pb2_grpc.GatewayServiceStub(channel).Complete(seeded[0].request(), timeout=60)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, refused.value
        assert "model service is unavailable" in refused.value.details(), refused.value.details()
        assert RETRY_SECONDS - 0.5 < time.monotonic() - began < RETRY_SECONDS + 10  # kept, then refused
        for model in stack.models:
            model.start()
        for model in stack.models:
            model.wait_serving(600)
        wait_until(lambda: good_answer(stack.gateway.address, seeded), 30, interval=0.05)
    only_expected(traffic)


def long_streams(address: str, count: int) -> tuple[list[threading.Thread], list[str]]:
    """`count` streams already producing tokens; each appends its outcome when it ends."""
    ended: list[str] = []
    started = threading.Barrier(count + 1)

    def one() -> None:
        with grpc.insecure_channel(address) as channel:
            stream = gateway_pb2_grpc.GatewayServiceStub(channel).Generate(
                generate_request("In the beginning", max_tokens=LONG, ignore_eos=True), timeout=60)
            try:
                next(stream)
                started.wait(30)
                last = list(stream)[-1]
                ended.append("OK" if last.usage.completion_tokens == LONG else "SHORT")
            except grpc.RpcError as error:
                ended.append(error.code().name)
            except threading.BrokenBarrierError:
                ended.append("NEVER_STARTED")

    threads = [threading.Thread(target=one) for _ in range(count)]
    for t in threads:
        t.start()
    started.wait(60)
    return threads, ended


@pytest.mark.parametrize("name", ["model0", "tokenizer"])
def test_sigterm_under_load_finishes_the_calls_in_flight_then_the_service_exits_cleanly(
        stack: LocalStack, seeded: list[Seeded], name: str) -> None:
    proc = stack.models[0] if name == "model0" else stack.tokenizer
    with Traffic(stack.gateway.address, seeded, {"complete": 2, "cancel": 1}, LONG) as traffic:
        threads, ended = long_streams(stack.gateway.address, 2)
        began = time.monotonic()
        assert proc.terminate(timeout=30) == 0
        assert time.monotonic() - began < stack.config.grace_seconds + 3
        for t in threads:
            t.join(60)
        proc.start().wait_serving(600)
        wait_until(lambda: good_answer(stack.gateway.address, seeded), 30, interval=0.05)
    # A stream in flight on the stopped service finished: the model drains its slots, the tokenizer
    # its DecodeStreams. (A stream on the other replica finishes anyway.)
    assert ended == ["OK", "OK"], ended
    only_expected(traffic)


def test_sigterm_of_the_tokenizer_loses_no_stream_the_gateway_already_admitted(stack: LocalStack,
                                                                              seeded: list[Seeded]) -> None:
    """More streams than slots (the rest wait in the models' queues, already encoded) when the tokenizer gets
    SIGTERM (remote detokenization, the default): every one of them finishes. The waiting ones used to open
    their DecodeStream only at their first token, after the tokenizer had stopped listening: UNAVAILABLE."""
    report = sigterm_tokenizer_with_streams_in_flight(stack, seeded, streams=8, tokens=120)
    assert report["running_at_signal"] > report["decoding_at_signal"], report  # some waited in a queue
    assert report["exit_code"] == 0
    assert report["in_flight"] == 8, report
    assert report["in_flight_lost"] == 0, report


def test_sigterm_of_the_gateway_under_load_finishes_its_streams_and_exits_cleanly(stack: LocalStack,
                                                                                 seeded: list[Seeded]) -> None:
    threads, ended = long_streams(stack.gateway.address, 3)
    assert stack.gateway.terminate(timeout=30) == 0
    for t in threads:
        t.join(60)
    assert ended == ["OK", "OK", "OK"], ended
    stack.gateway.start().wait_serving(60)
    assert good_answer(stack.gateway.address, seeded)


def test_every_kind_of_call_has_a_documented_outcome_set() -> None:
    assert set(EXPECTED) == {"complete", "cancel", "deadline", "fuzz", "burst"}
    assert all("INTERNAL" not in outcomes and "UNKNOWN" not in outcomes for outcomes in EXPECTED.values())
