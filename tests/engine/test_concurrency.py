"""Over gRPC against the in-process golden service: batch invariance, cancellation, deadlines."""

from __future__ import annotations

import itertools
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import pytest

from grok.model.v1 import model_pb2, model_pb2_grpc
from model_service.server import ModelServer
from tests.engine.conftest import collect, golden_message, golden_requests
from tests.waiting import wait_until


def varied_requests(n: int) -> list[model_pb2.GenerateRequest]:
    """Different lengths, sampling settings and masks; every prompt fits the 64 bucket."""
    rng = random.Random(7)
    out = []
    for i in range(n):
        prompt = [rng.randrange(3, 512) for _ in range(rng.randrange(1, 60))]
        msg = model_pb2.GenerateRequest(token_ids=prompt, max_tokens=rng.randrange(1, 40),
                                        temperature=[0.0, 0.7, 1.0, 1.5][i % 4], seed=1000 + i,
                                        top_logprobs=i % 9, ignore_eos=i % 3 == 0)
        if i % 2:
            msg.top_p = [0.5, 0.9, 0.95][i % 3]
        if i % 5 == 1:
            msg.blocked_token_ids.extend(rng.sample(range(1, 512), 100))
        if i % 7 == 3:
            msg.allowed_token_ids.extend(rng.sample(range(1, 512), 30))
        out.append(msg)
    return out


def summary(responses: list[model_pb2.GenerateResponse]) -> tuple[Any, ...]:
    tokens = [(t.id, round(t.probability, 6), tuple(a.id for a in t.top_tokens)) for r in responses for t in r.tokens]
    return tuple(tokens), responses[-1].finish_reason


def test_16_concurrent_streams_each_equal_their_solo_run(golden_stub: model_pb2_grpc.ModelServiceStub) -> None:
    requests = varied_requests(16)
    solo = [summary(collect(golden_stub.Generate(r, timeout=60))[1]) for r in requests]
    results: list[Any] = [None] * len(requests)
    delays = random.Random(3).choices([0.0, 0.01, 0.03, 0.08, 0.15], k=len(requests))

    def run(i: int) -> None:
        time.sleep(delays[i])
        results[i] = summary(collect(golden_stub.Generate(requests[i], timeout=60))[1])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(requests))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert results == solo
    for r, (tokens, _) in zip(requests, solo):
        banned = set(r.blocked_token_ids) | {0}
        assert not banned & {t[0] for t in tokens}
        if r.allowed_token_ids:
            assert {t[0] for t in tokens} <= set(r.allowed_token_ids)


def test_golden_seeded_requests_over_grpc_return_reference_ids(golden_stub: model_pb2_grpc.ModelServiceStub) -> None:
    for case in golden_requests():
        ids, responses = collect(golden_stub.Generate(golden_message(case), timeout=60))
        assert ids == case["output_ids"]
        assert responses[-1].finish_reason == model_pb2.FINISH_REASON_LENGTH
        assert responses[-1].completion_tokens == len(case["output_ids"])
        # Streamed as produced: one message per step, fewer only when the client falls behind.
        assert 1 < len(responses) <= len(ids)
        running_totals = list(itertools.accumulate(len(r.token_ids) for r in responses))
        assert [r.completion_tokens for r in responses] == running_totals


def wait_all_free(server: ModelServer, timeout: float = 10.0) -> dict[str, int]:
    scheduler = server.scheduler
    assert scheduler is not None
    idle = {"active": 0, "free": server.config.slots, "queued": 0}
    return wait_until(lambda: idle if scheduler.stats() == idle else {}, timeout,
                      message=lambda: f"the scheduler never went idle: {scheduler.stats()}")


def sample(server: ModelServer, name: str, **labels: str) -> float:
    return server.metrics.registry.get_sample_value(name, labels) or 0.0


def test_cancel_50_streams_midway_frees_each_slot_within_one_step_of_its_cancel(
        golden_service: ModelServer, golden_stub: model_pb2_grpc.ModelServiceStub) -> None:
    # 125 tokens each (the whole context): a stream the server kept decoding would run far past the
    # 3 tokens read here, and its slot would be freed by finishing, not by the cancel.
    reclaimed = sample(golden_service, "grok_model_slot_reclaim_seconds_count", reason="cancelled")
    within_one_step = sample(golden_service, "grok_model_steps_after_cancel_bucket", le="1.0")
    generated = sample(golden_service, "grok_model_generated_tokens_total")

    def cancel_midway(i: int) -> int:
        call = golden_stub.Generate(model_pb2.GenerateRequest(token_ids=[5 + i, 9, 11], max_tokens=125,
                                                              temperature=1.0, seed=i, ignore_eos=True), timeout=60)
        got = 0
        for response in call:
            got += len(response.token_ids)
            if got >= 3:
                call.cancel()
                break
        return got

    with ThreadPoolExecutor(max_workers=50) as pool:
        seen = list(pool.map(cancel_midway, range(50)))
    assert wait_all_free(golden_service) == {"active": 0, "free": golden_service.config.slots, "queued": 0}
    assert golden_service.metrics.active_slots._value.get() == 0
    # Every one of the 50 slots was freed because of its cancel, at most one decode step after it.
    assert sample(golden_service, "grok_model_slot_reclaim_seconds_count", reason="cancelled") - reclaimed == 50
    assert sample(golden_service, "grok_model_steps_after_cancel_bucket", le="1.0") - within_one_step == 50
    assert sample(golden_service, "grok_model_generated_tokens_total") - generated < 50 * 125 / 4
    assert min(seen) >= 3
    case = golden_requests()[0]
    assert collect(golden_stub.Generate(golden_message(case), timeout=60))[0] == case["output_ids"]


def test_an_expired_deadline_reaches_the_model_and_frees_the_slot_early(
        golden_service: ModelServer, golden_stub: model_pb2_grpc.ModelServiceStub) -> None:
    request = model_pb2.GenerateRequest(token_ids=[7, 8], max_tokens=125, ignore_eos=True)
    start = time.monotonic()
    assert len(collect(golden_stub.Generate(request, timeout=60))[0]) == 125
    whole = time.monotonic() - start  # the deadline below is half of what this machine needs for the request
    reclaimed = sample(golden_service, "grok_model_slot_reclaim_seconds_count", reason="deadline")
    generated = sample(golden_service, "grok_model_generated_tokens_total")
    call = golden_stub.Generate(request, timeout=whole / 2)
    got = 0
    with pytest.raises(grpc.RpcError) as err:
        for response in call:
            got += len(response.token_ids)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert got > 0  # it was decoding in a slot when the deadline passed
    # The scheduler itself knew the deadline (a mere cancel would count as "cancelled") and freed the slot.
    wait_until(lambda: sample(golden_service, "grok_model_slot_reclaim_seconds_count", reason="deadline") != reclaimed,
               10, message="the model never reclaimed the slot for the deadline")
    assert sample(golden_service, "grok_model_generated_tokens_total") - generated < 125
    assert wait_all_free(golden_service)["free"] == golden_service.config.slots


@pytest.mark.parametrize("fields, name", [
    (dict(token_ids=[]), "token_ids"),
    (dict(token_ids=[512]), "token_ids"),
    (dict(token_ids=[5] * 128), "token_ids"),  # fills the 128-token context
    (dict(token_ids=[5] * 60, max_tokens=69), "max_tokens"),
    (dict(token_ids=[5], max_tokens=0), "max_tokens"),
    (dict(token_ids=[5], temperature=-1), "temperature"),
    (dict(token_ids=[5], top_p=0), "top_p"),
    (dict(token_ids=[5], top_logprobs=21), "top_logprobs"),
    (dict(token_ids=[5], blocked_token_ids=[600]), "blocked_token_ids"),
    (dict(token_ids=[5], allowed_token_ids=[0]), "allowed_token_ids"),
])
def test_bad_requests_are_invalid_argument_naming_the_field(golden_stub: model_pb2_grpc.ModelServiceStub,
                                                            fields: dict[str, Any], name: str) -> None:
    with pytest.raises(grpc.RpcError) as err:
        collect(golden_stub.Generate(model_pb2.GenerateRequest(**fields), timeout=10))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert name in (err.value.details() or "")


def test_get_info_describes_the_service(golden_stub: model_pb2_grpc.ModelServiceStub) -> None:
    info = golden_stub.GetInfo(model_pb2.GetInfoRequest(), timeout=10)
    assert (info.config.vocab_size, info.config.sequence_len, info.config.num_experts) == (512, 128, 8)
    assert list(info.prefill_buckets) == [] and info.slots == 8 and info.dtype == "float32"
    assert info.platform == "cpu" and info.device_count == 1 and not info.random_weights
    assert info.checkpoint.endswith("checkpoint") and info.max_queue == 64
