"""benchmarks.client_pool: a closed-loop point sent from several processes, merged as one process would have."""

from __future__ import annotations

import asyncio
import pathlib

import pytest

from benchmarks.client_pool import ClientPool, SenderSpec, shares
from benchmarks.loadgen import LoadPoint
from benchmarks.workload import BenchRequest
from tests.gateway.conftest import start_fake


def test_requests_are_dealt_round_robin_and_the_concurrency_split_evenly() -> None:
    assert shares(7, 5, 2) == [([0, 2, 4, 6], 3), ([1, 3, 5], 2)]
    assert shares(3, 64, 4) == [([0], 22), ([1], 21), ([2], 21)]  # no worker without a request
    assert shares(10, 2, 4) == [([0, 2, 4, 6, 8], 1), ([1, 3, 5, 7, 9], 1)]  # none without a stream in flight
    for count, concurrency, processes in [(256, 64, 3), (5, 8, 8), (1, 1, 2)]:
        plan = shares(count, concurrency, processes)
        assert sorted(i for indices, _ in plan for i in indices) == list(range(count))
        assert sum(c for _, c in plan) == concurrency
        assert all(c >= 1 for _, c in plan)


def test_a_point_over_two_processes_serves_every_request_in_order(tmp_path: pathlib.Path) -> None:
    model = start_fake("model", tmp_path, "--slots", "8", "--delay", "0.002").wait_serving(60)
    requests = [BenchRequest(f"p{i}", (5, 6, 7 + i), 4 + i % 3) for i in range(9)]
    pool = ClientPool(2)
    try:
        served, duration, cpu = asyncio.run(pool.run_point(SenderSpec("model", model.address), requests,
                                                           LoadPoint(4)))
    finally:
        pool.close()
        model.terminate()
    assert all(r.success for r in served), [r.error for r in served]
    assert [r.prompt_len for r in served] == [3] * 9
    assert [sum(r.chunk_tokens) for r in served] == [r.output_len for r in requests]
    assert duration == max(r.end for r in served) - min(r.start for r in served)  # the merge's definition
    assert cpu >= 0


def test_it_refuses_what_it_cannot_run() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        ClientPool(0)
    with pytest.raises(ValueError, match="gateway or model"):
        SenderSpec("http", "x").sender()
