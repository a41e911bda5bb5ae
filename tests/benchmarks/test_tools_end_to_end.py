"""The benchmark tools run end to end against the tiny golden stack (real processes on 127.0.0.1).

Only shapes, counts and consistency are asserted: numbers are measured and printed, never asserted
as timings.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from tests.procs import ROOT
from tests.benchmarks.recorded import recorded

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", autouse=True)
def tools_temp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[pathlib.Path]:
    """The tools leave their logs and work folders in the temporary folder for a user to read; run by the tests
    they leave them in pytest's, which pytest cleans, instead of /tmp."""
    folder = tmp_path_factory.mktemp("tools-temp")
    before = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = str(folder)
    yield folder
    if before is None:
        del os.environ["TMPDIR"]
    else:
        os.environ["TMPDIR"] = before


def run_tool(args: list[str], timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def serve_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[pathlib.Path, dict[str, Any]]:
    out = tmp_path_factory.mktemp("serve")
    run = run_tool(["benchmarks", "--stack", "golden", "--concurrency", "1,2", "--request-rate", "20",
                    "--max-concurrency", "4", "--input-len", "12", "--output-len", "6,9", "--num-prompts", "4",
                    "--runs", "2", "--warmup", "1", "--goodput", "ttft:60000", "tpot:60000",
                    "--result-dir", str(out), "--label", "golden-test", "--slots", "4"])
    assert run.returncode == 0, run.stderr[-3000:]
    return out, json.loads(run.stdout)


def test_serve_writes_one_vllm_layout_file_per_run_and_point(serve_run: tuple[pathlib.Path, dict]) -> None:
    out, _ = serve_run
    files = sorted((out / "runs").glob("*.json"))
    assert len(files) == 2 * 3 * 2  # workloads (6 and 9 output tokens) x points x runs
    run = json.loads(files[0].read_text())
    for key in ("date", "backend", "model_id", "tokenizer_id", "num_prompts", "request_rate", "burstiness",
                "max_concurrency", "duration", "completed", "failed", "total_input_tokens", "total_output_tokens",
                "request_throughput", "request_goodput", "output_throughput", "total_token_throughput",
                "input_lens", "output_lens", "ttfts", "itls", "latencies", "errors", "mean_ttft_ms", "median_ttft_ms",
                "std_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p90_tpot_ms", "median_itl_ms", "p99_e2el_ms"):
        assert key in run, key
    assert len(run["git"]["commit"]) == 40 and run["machine"]["cpus"] >= 1
    assert run["config"]["runs"] == 2
    assert {"load_avg_1m", "own_cpu_cores", "others_cpu_cores", "quiet"} <= set(run["box"])  # the box, per run


def test_every_request_got_exactly_its_lengths_through_the_gateway(serve_run: tuple[pathlib.Path, dict]) -> None:
    out, summary = serve_run
    for path in (out / "runs").glob("*.json"):
        run = json.loads(path.read_text())
        assert run["failed"] == 0 and run["completed"] == 4
        assert run["input_lens"] == [12] * 4
        assert run["output_lens"] == [run["workload"]["output_len"]] * 4  # ignore_eos: exact
        assert run["prompt_len_mismatches"] == 0  # the gateway counted the same prompt tokens
        # One gap per chunk after the first; a busy box may deliver several tokens (even all) in one chunk.
        for itl, ttft, latency, n in zip(run["itls"], run["ttfts"], run["latencies"], run["output_lens"]):
            assert len(itl) <= n - 1 and all(gap >= 0 for gap in itl)
            assert ttft + sum(itl) <= latency + 1e-6
        assert run["request_goodput"] == pytest.approx(run["request_throughput"])  # generous SLOs: all good
    assert all(p["prompt_len_mismatches"] == 0 for p in summary["points"])
    assert any(itl for path in (out / "runs").glob("*.json") for itl in json.loads(path.read_text())["itls"])


def test_summary_has_a_median_and_spread_per_point_and_the_plots_exist(serve_run: tuple[pathlib.Path, dict]) -> None:
    out, summary = serve_run
    keys = {p["key"] for p in summary["points"]}
    assert keys == {f"fixed-in12-out{o}/{p}" for o in (6, 9) for p in ("c1", "c2", "rate20-c4")}
    for point in summary["points"]:
        assert point["runs"] == 2
        for metric in ("output_throughput", "median_ttft_ms", "p99_itl_ms"):
            assert point["min"][metric] <= point["median"][metric] <= point["max"][metric]
        assert len(point["itl_quantiles_ms"]) == 99
    for name in ("throughput", "latency", "itl"):
        png = out / f"golden-test-{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size < 200_000
    assert json.loads((out / "summary.json").read_text())["git"] == summary["git"]


def test_compare_of_a_summary_with_itself_is_all_ones(serve_run: tuple[pathlib.Path, dict]) -> None:
    out, _ = serve_run
    run = run_tool(["benchmarks", "--compare", str(out / "summary.json"), str(out / "summary.json")], timeout=60)
    assert run.returncode == 0, run.stderr
    ratios = [line.split()[-1] for line in run.stdout.splitlines() if "/c" in line or "/rate" in line]
    assert ratios and set(ratios) <= {"1.000"}


def test_layers_measures_the_same_workload_in_process_on_the_model_service_and_through_the_gateway(
        tmp_path: pathlib.Path, jax_cache: str) -> None:
    out = tmp_path / "layers.json"
    run = run_tool(["benchmarks.layers", "--stack", "golden", "--concurrency", "1,2", "--input-len", "8",
                    "--output-len", "5", "--num-prompts", "3", "--runs", "1", "--warmup", "1", "--out", str(out),
                    "--compile-cache", jax_cache])
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(out.read_text())
    for arm in ("in_process", "model_service", "gateway"):
        for point in ("c1", "c2"):
            median = report["arms"][arm][point]["median"]
            assert median["completed"] == 3 and median["failed"] == 0
            assert median["total_output_tokens"] == 15
    ratio = report["ratios"]["c1"]
    assert ratio["gateway_throughput_ratio"] == pytest.approx(
        report["arms"]["gateway"]["c1"]["median"]["output_throughput"]
        / report["arms"]["in_process"]["c1"]["median"]["output_throughput"])
    assert "note" in report["targets"]  # concurrency 8 was not measured
    assert set(report["startup"]) == {"stack_to_serving_s", "in_process_engine_warm_cache_s"}
    assert report["stack"]["dtype"] == report["config"]["dtype"] == "float32"  # --dtype's default, as the service's
    costs = report["arms"]["gateway"]["c1"]["median"]  # CPU ms per token by process (a 10 ms clock tick: may be 0)
    assert {f"cpu_ms_per_token_{p}" for p in ("benchmark", "model_service", "tokenizer_service", "gateway",
                                              "total")} <= set(costs)
    for arm in ("model_service", "gateway"):  # the TTFT taken apart by the model's own timings
        median = report["arms"][arm]["c1"]["median"]
        # each request's TTFT is its part in the engine plus the rest, so their means add up
        assert median["mean_ttft_engine_ms"] + median["mean_ttft_outside_ms"] == pytest.approx(median["mean_ttft_ms"])
    assert "median_ttft_engine_ms" not in report["arms"]["in_process"]["c1"]["median"]


def test_layers_on_unix_sockets_with_the_per_call_gateway_and_the_engine_apart(
        tmp_path: pathlib.Path, jax_cache: str) -> None:
    """Issue 63's measurement on a tiny case: the demo stack on socket files, the earlier-protocol gateway as an
    arm, the in-process engine after the stack stopped, and the targets computed per point."""
    out = tmp_path / "layers_uds.json"
    run = run_tool(["benchmarks.layers", "--stack", "demo", "--uds", "--per-call-gateway", "--in-process-apart",
                    "--concurrency", "2", "--input-len", "8", "--output-len", "4", "--num-prompts", "2", "--runs", "1",
                    "--warmup", "1", "--out", str(out), "--compile-cache", jax_cache])
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["transport"] == "unix sockets"
    for arm in ("in_process", "model_service", "gateway", "gateway_per_call"):
        median = report["arms"][arm]["c2"]["median"]
        assert median["completed"] == 2 and median["failed"] == 0 and median["total_output_tokens"] == 8, arm
    targets = report["stack_targets"]["c2"]
    assert targets["throughput_ratio"] == report["ratios"]["c2"]["gateway_throughput_ratio"]
    assert recorded(targets["services_cpu_ms_per_token"]) and isinstance(targets["cpu_met"], bool)
    gateway = report["arms"]["gateway"]["c2"]["median"]
    assert 0 <= gateway["cpu_ms_per_token_model_service_loop"] <= gateway["cpu_ms_per_token_model_service"]
    assert "cpu_ms_per_token_model_service_loop" not in report["arms"]["in_process"]["c2"]["median"]  # apart
    assert targets["services_loops_cpu_ms_per_token"] == pytest.approx(
        gateway["cpu_ms_per_token_model_service_loop"] + gateway["cpu_ms_per_token_gateway"]
        + gateway["cpu_ms_per_token_tokenizer_service"])
    assert targets["services_overhead_cpu_ms_per_token"] == pytest.approx(
        targets["services_cpu_ms_per_token"] - report["arms"]["in_process"]["c2"]["median"]["cpu_ms_per_token_benchmark"])


def test_crosscheck_runs_the_same_workload_with_every_client_against_one_stack(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "crosscheck.json"
    run = run_tool(["benchmarks.crosscheck", "--stack", "golden", "--concurrency", "2", "--num-prompts", "4",
                    "--input-len", "8", "--output-len", "6", "--rounds", "1", "--no-aiperf", "--out", str(out)])
    assert run.returncode in (0, 1), run.stderr[-3000:]  # 1: the clients disagreed (timing), still a result
    report = json.loads(out.read_text())
    assert set(report["runs"]) == {"ours-grpc", "ours-http", "k6"}
    for tool, (result,) in report["runs"].items():
        assert result["completed"] == 4 and result["failed"] == 0, tool
        assert result["total_output_tokens"] == 24, tool  # ignore_eos: exact, counted by each client
        assert result["box"]["seconds"] > 0 and "others_cpu_cores" in result["box"]
    http = report["runs"]["ours-http"][0]
    assert 0 < http["mean_first_event_ms"] <= http["mean_ttft_ms"]  # a token's first text comes with or after it
    assert {"ours-http", "k6", "all_agree"} == set(report["agreement"])


def test_layers_with_a_baseline_stack_on_a_host_without_tcp(tmp_path: pathlib.Path, jax_cache: str) -> None:
    """What step 1 of issue 63 runs on the TPU host: every process (both stacks, the benchmark) with TCP made
    impossible (scripts/no_tcp.py), the baseline stack on socket files beside this tree's."""
    from scripts.no_tcp import ShimUnavailable, environment, shim

    try:
        library = shim()
    except ShimUnavailable as error:
        pytest.skip(f"cannot build the no-TCP shim here: {error}")
    out = tmp_path / "layers_no_tcp.json"
    run = subprocess.run([sys.executable, "-m", "benchmarks.layers", "--stack", "demo", "--uds", "--in-process-apart",
                          "--baseline-stack", str(ROOT), "--concurrency", "2", "--input-len", "8", "--output-len",
                          "4", "--num-prompts", "2", "--runs", "1", "--warmup", "1", "--out", str(out),
                          "--compile-cache", jax_cache], cwd=ROOT, capture_output=True, text=True, timeout=600,
                         env=environment(library))
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(out.read_text())
    for arm in ("in_process", "model_service", "gateway", "model_service_baseline", "gateway_baseline"):
        median = report["arms"][arm]["c2"]["median"]
        assert median["completed"] == 2 and median["failed"] == 0 and median["total_output_tokens"] == 8, arm
    assert "cpu_ms_per_token_tokenizer_service_baseline" in report["arms"]["gateway_baseline"]["c2"]["median"]
