"""The load generator's scheduling with a fake sender, the layer ratios, and the generated tables."""

from __future__ import annotations

import asyncio
import json
import pathlib
import time

import pytest

from benchmarks import layers, report
from benchmarks.loadgen import LoadPoint, run_point
from benchmarks.metrics import RequestResult
from benchmarks.workload import BenchRequest, arrival_offsets

REQUESTS = [BenchRequest(f"p{i}", (5, 6, 7), 2) for i in range(12)]


class FakeSender:
    """Answers each request after `delay` seconds with two one-token chunks; records concurrency."""

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.in_flight = 0
        self.peak = 0
        self.sent: list[tuple[float, str]] = []

    async def __call__(self, request: BenchRequest) -> RequestResult:
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        start = time.perf_counter()
        self.sent.append((start, request.prompt))
        await asyncio.sleep(self.delay)
        first = time.perf_counter()
        await asyncio.sleep(self.delay)
        end = time.perf_counter()
        self.in_flight -= 1
        return RequestResult(request.prompt_len, start, [first, end], [1, 1], end)


@pytest.mark.parametrize("concurrency", [1, 3, 5])
def test_closed_loop_keeps_exactly_the_concurrency_in_flight_and_sends_every_request(concurrency: int) -> None:
    sender = FakeSender(0.005)
    results, duration = asyncio.run(run_point(sender, REQUESTS, LoadPoint(concurrency)))
    assert sender.peak == concurrency
    assert [r.prompt_len for r in results] == [3] * 12 and all(r.success for r in results)
    assert sorted(p for _, p in sender.sent) == sorted(r.prompt for r in REQUESTS)
    assert duration >= max(r.end for r in results) - min(r.start for r in results)


def test_open_loop_sends_no_request_before_its_arrival_time() -> None:
    sender = FakeSender(0.001)
    begin = time.perf_counter()
    asyncio.run(run_point(sender, REQUESTS, LoadPoint(None, request_rate=200.0, burstiness=0.5), seed=7))
    offsets = arrival_offsets(len(REQUESTS), 200.0, 0.5, 7)
    by_prompt = {p: t for t, p in sender.sent}
    for request, offset in zip(REQUESTS, offsets):
        assert by_prompt[request.prompt] - begin >= offset
    assert len(by_prompt) == len(REQUESTS)


def test_layer_ratios_compare_every_arm_with_in_process_and_check_the_targets_at_concurrency_8() -> None:
    def arm(tok: float, ttft: float) -> dict:
        return {"c8": {"median": {"output_throughput": tok, "median_ttft_ms": ttft, "median_tpot_ms": 1.0}}}

    arms = {"in_process": arm(100.0, 10.0), "model_service": arm(98.0, 11.0), "gateway": arm(97.5, 11.5)}
    table = layers.ratios(arms)
    assert table["c8"]["gateway_throughput_ratio"] == pytest.approx(0.975)
    assert table["c8"]["model_service_ttft_p50_extra_ms"] == pytest.approx(1.0)
    met = layers.targets(table)
    assert met["throughput_met"] and met["ttft_met"]
    arms["gateway"] = arm(96.0, 12.5)
    missed = layers.targets(layers.ratios(arms))
    assert not missed["throughput_met"] and not missed["ttft_met"]


def serve_summary() -> dict:
    """A serve-golden.json with one point whose every statistic is the same."""
    point = {"key": "fixed-in32-out32/c1", "median": {}, "min": {}, "max": {}}
    for stat in ("median", "min", "max"):
        point[stat] = {"request_throughput": 2.0, "output_throughput": 64.0, "median_ttft_ms": 10.0,
                       "p99_ttft_ms": 20.0, "median_tpot_ms": 3.0, "p99_tpot_ms": 4.0, "median_itl_ms": 3.0,
                       "p99_itl_ms": 5.0, "median_e2el_ms": 100.0, "request_goodput": 1.5, "failed": 0.0}
    return {"config": {"runs": 3, "slo": {"ttft_ms": 100, "tpot_ms": 20, "e2el_ms": None}}, "points": [point],
            "git": {"commit": "a" * 40, "dirty": False}, "machine_at_start": {"cpus": 2, "load_avg": [1, 1, 1]},
            "date": "20261130-120000"}


def test_report_renders_the_tables_between_the_markers_and_keeps_the_rest(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "results"
    out.mkdir()
    (out / "serve-golden.json").write_text(json.dumps(serve_summary()))
    doc = tmp_path / "doc.md"
    doc.write_text(f"intro\n\n{report.BEGIN}\nold table\n{report.END}\n\noutro\n")
    report.update_doc(doc, out)
    text = doc.read_text()
    assert text.startswith("intro") and text.rstrip().endswith("outro") and "old table" not in text
    assert "fixed-in32-out32/c1 | 2.00 | 64.0 (64.0–64.0) | 10.0 / 20.0 |" in text
    assert "TTFT ≤ 100 ms, TPOT ≤ 20 ms" in text and "`aaaaaaaaaaaa`" in text


def test_report_links_the_plots_relative_to_the_document(tmp_path: pathlib.Path) -> None:
    # The results live in benchmarks/measured/, the page in docs/: a link must climb out of docs/.
    out = tmp_path / "benchmarks" / "measured"
    out.mkdir(parents=True)
    (out / "serve-golden.json").write_text(json.dumps(serve_summary()))
    doc = tmp_path / "docs" / "benchmarks.md"
    doc.parent.mkdir()
    doc.write_text(f"{report.BEGIN}\n{report.END}\n")
    report.update_doc(doc, out)
    links = [line for line in doc.read_text().splitlines() if line.startswith("![")]
    assert links == ["![throughput](../benchmarks/measured/golden-throughput.png)",
                     "![latency](../benchmarks/measured/golden-latency.png)",
                     "![ITL](../benchmarks/measured/golden-itl.png)"]


def test_report_refuses_a_document_without_markers(tmp_path: pathlib.Path) -> None:
    doc = tmp_path / "doc.md"
    doc.write_text("no markers")
    with pytest.raises(ValueError, match="RESULTS markers"):
        report.update_doc(doc, tmp_path)


def test_cpu_per_token_divides_each_process_cpu_delta_by_the_output_tokens() -> None:
    per = layers.cpu_per_token({"gateway": 1.0, "model_service": 10.0}, {"gateway": 1.2, "model_service": 10.5}, 100)
    assert per["cpu_ms_per_token_gateway"] == pytest.approx(2.0)
    assert per["cpu_ms_per_token_model_service"] == pytest.approx(5.0)
    assert per["cpu_ms_per_token_total"] == pytest.approx(7.0)


def test_cpu_seconds_of_this_process_grow_when_it_computes() -> None:
    import os

    before = layers.cpu_seconds(os.getpid())
    deadline = time.process_time() + 0.05
    while time.process_time() < deadline:
        pass
    assert layers.cpu_seconds(os.getpid()) > before


def test_the_ttft_is_taken_apart_by_the_servers_timings_only_when_every_request_has_them() -> None:
    from benchmarks import metrics

    # TTFTs of 30 and 50 ms; the server queued them 5 / 10 ms and drew their first tokens 15 / 20 ms after that
    timed = [RequestResult(3, 1.0, [1.030, 1.040], [1, 1], 1.040, server_queue=0.005, server_prefill=0.015),
             RequestResult(3, 1.0, [1.050, 1.060], [1, 1], 1.060, server_queue=0.010, server_prefill=0.020)]
    out = metrics.compute(timed, 1.0)
    assert out["mean_ttft_engine_ms"] == pytest.approx(25.0)
    assert out["mean_ttft_outside_ms"] == pytest.approx(15.0)  # (30 - 20 + 50 - 30) / 2
    assert out["mean_ttft_queue_ms"] == pytest.approx(7.5)
    untimed = timed[:1] + [RequestResult(3, 1.0, [1.050, 1.060], [1, 1], 1.060)]
    assert "mean_ttft_engine_ms" not in metrics.compute(untimed, 1.0)


def test_layers_runs_the_stack_and_the_engine_in_the_dtype_asked_for(monkeypatch: pytest.MonkeyPatch) -> None:
    started = []

    def start_stack(spec, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003
        started.append(spec)
        raise RuntimeError("stop here")

    monkeypatch.setattr(layers, "start_stack", start_stack)
    with pytest.raises(RuntimeError, match="stop here"):
        layers.run(layers.LayersConfig(stack="golden", concurrency=(2,), dtype="bfloat16", compile_cache="/tmp/x"))
    assert started[0].dtype == "bfloat16" and "bfloat16" in started[0].model_args()
