"""The metric arithmetic on synthetic timestamps (vLLM's definitions), goodput and run aggregation."""

from __future__ import annotations

import pytest

from benchmarks import metrics
from benchmarks.metrics import RequestResult, Slo, parse_slo


def request(start: float, chunks: list[tuple[float, int]], end: float, prompt_len: int = 10,
            error: str = "") -> RequestResult:
    return RequestResult(prompt_len=prompt_len, start=start, chunk_times=[t for t, _ in chunks],
                         chunk_tokens=[n for _, n in chunks], end=end, error=error)


def test_ttft_tpot_itl_and_e2e_follow_vllms_definitions() -> None:
    # Sent at 1.0; first token at 1.2; then chunks at 1.3 (1 token), 1.6 (2 tokens); stream ends at 1.7.
    r = request(1.0, [(1.2, 1), (1.3, 1), (1.6, 2)], 1.7)
    assert r.ttft == pytest.approx(0.2)
    assert r.latency == pytest.approx(0.7)
    assert r.output_tokens == 4
    assert r.itl == pytest.approx([0.1, 0.3])  # one gap per chunk, however many tokens it carries
    assert r.tpot == pytest.approx((0.7 - 0.2) / 3)  # the first token excluded


def test_single_token_request_has_no_tpot_and_counts_as_zero_for_goodput() -> None:
    r = request(0.0, [(0.05, 1)], 0.06)
    assert r.tpot is None
    assert Slo(tpot_ms=0.0, ttft_ms=100).met_by(r)


def test_compute_throughputs_divide_by_the_duration_and_skip_failed_requests() -> None:
    ok1 = request(0.0, [(0.1, 1), (0.2, 1), (0.3, 1)], 0.3, prompt_len=5)
    ok2 = request(0.5, [(0.7, 2), (0.9, 2)], 1.0, prompt_len=7)
    failed = request(0.2, [], 0.4, prompt_len=100, error="RESOURCE_EXHAUSTED: queue full")
    m = metrics.compute([ok1, ok2, failed], duration=2.0, percentiles=[50, 99])
    assert (m["completed"], m["failed"]) == (2, 1)
    assert m["total_input_tokens"] == 12 and m["total_output_tokens"] == 7
    assert m["request_throughput"] == pytest.approx(1.0)
    assert m["output_throughput"] == pytest.approx(3.5)
    assert m["total_token_throughput"] == pytest.approx(9.5)
    assert m["request_goodput"] is None  # no SLO stated
    assert m["mean_ttft_ms"] == pytest.approx((100 + 200) / 2)
    assert m["median_e2el_ms"] == pytest.approx((300 + 500) / 2)
    # TPOT per request: (0.3-0.1)/2 = 100 ms and (0.5-0.2)/3 = 100 ms.
    assert m["mean_tpot_ms"] == pytest.approx(100)
    # ITL pooled over requests: 100, 100 (ok1) and 200 (ok2).
    assert m["mean_itl_ms"] == pytest.approx(400 / 3)
    assert m["p99_itl_ms"] == pytest.approx(198)  # numpy's linear interpolation between 100 and 200
    assert m["errors"] == ["", "", "RESOURCE_EXHAUSTED: queue full"]
    assert m["output_lens"] == [3, 4, 0]


def test_goodput_counts_only_requests_meeting_every_slo() -> None:
    fast = request(0.0, [(0.05, 1), (0.10, 1)], 0.10)  # TTFT 50 ms, TPOT 50 ms
    slow_first = request(0.0, [(0.30, 1), (0.35, 1)], 0.35)  # TTFT 300 ms
    slow_decode = request(0.0, [(0.05, 1), (0.50, 1)], 0.50)  # TPOT 450 ms
    m = metrics.compute([fast, slow_first, slow_decode], duration=1.0, slo=parse_slo(["ttft:100", "tpot:100"]))
    assert m["request_goodput"] == pytest.approx(1.0)
    m = metrics.compute([fast, slow_first, slow_decode], duration=1.0, slo=parse_slo(["e2el:400"]))
    assert m["request_goodput"] == pytest.approx(2.0)


def test_peak_output_rate_buckets_by_second_and_peak_concurrency_is_exact() -> None:
    a = request(0.0, [(0.5, 3), (1.2, 4)], 1.5)
    b = request(1.5, [(1.9, 5)], 2.0)  # starts exactly when a ends: not concurrent
    c = request(0.2, [(0.8, 1)], 0.9)
    rate, peak = metrics.peak_output_rate([a, b, c])
    assert rate == 9.0  # second 1 holds 4 + 5 tokens
    assert peak == 2


def test_no_successful_request_gives_zero_stats_not_an_error() -> None:
    m = metrics.compute([request(0.0, [], 1.0, error="UNAVAILABLE: down")], duration=1.0)
    assert m["completed"] == 0 and m["failed"] == 1
    assert m["median_ttft_ms"] == 0.0 and m["output_throughput"] == 0.0


def test_aggregate_reports_the_median_and_the_spread_over_runs() -> None:
    runs = [{"request_throughput": x, "median_ttft_ms": 10 * x, "failed": 0, "itls": [[1.0]]} for x in (3.0, 1.0, 2.0)]
    agg = metrics.aggregate(runs)
    assert agg["median"]["request_throughput"] == 2.0
    assert (agg["min"]["median_ttft_ms"], agg["max"]["median_ttft_ms"]) == (10.0, 30.0)
    assert "itls" not in agg["median"]


def test_itl_quantiles_describe_the_pooled_gap_distribution() -> None:
    r = request(0.0, [(0.001 * i, 1) for i in range(1, 102)], 0.102)  # 100 gaps of 1 ms
    qs = metrics.itl_quantiles([r], points=9)
    assert len(qs) == 9 and all(q == pytest.approx(1.0) for q in qs)


@pytest.mark.parametrize("bad", ["ttft", "ttft:x", "speed:10", "tpot:-1"])
def test_bad_goodput_objectives_are_rejected_with_the_expected_form(bad: str) -> None:
    with pytest.raises(ValueError, match="goodput objective"):
        parse_slo([bad])


def test_non_positive_duration_is_rejected() -> None:
    with pytest.raises(ValueError, match="duration"):
        metrics.compute([], duration=0.0)
