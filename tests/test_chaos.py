"""The short chaos run (what CI runs of `python -m benchmarks.chaos`): mixed traffic, a burst of twice
the capacity, kill -9 of the tokenizer and of a model replica, SIGTERM of a replica; it must pass."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

from tests.procs import GOLDEN, ROOT

pytestmark = pytest.mark.slow


def test_short_chaos_run_passes_and_reports_every_measure(tmp_path: pathlib.Path, jax_cache: str) -> None:
    out = tmp_path / "report.json"
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.chaos", "--short", "--config", str(GOLDEN / "config.json"),
         "--checkpoint", str(GOLDEN / "checkpoint"), "--tokenizer", str(GOLDEN / "tokenizer.model"),
         "--compile-cache", jax_cache, "--log-dir", str(tmp_path / "logs"), "--json-out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert out.exists(), result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert result.returncode == 0 and report["passed"], report["problems"]
    assert {"complete", "cancel", "deadline", "fuzz"} <= set(report["calls"])
    assert report["calls"]["complete"].get("OK", 0) > 0 and not report["unexpected"]
    faults = {f["fault"].split(" (")[0]: f for f in report["faults"]}
    assert faults["kill -9 tokenizer"]["recovery_seconds"] is not None
    assert faults["kill -9 model0"]["seeded_request_answered_while_down"]  # the other replica served it
    assert faults["SIGTERM model0"]["exit_code"] == 0
    drained = next(f for name, f in faults.items() if name.startswith("SIGTERM tokenizer"))
    assert drained["exit_code"] == 0 and drained["in_flight"] > 0 and drained["in_flight_lost"] == 0, drained
    assert report["slots_after"]["all_free"]
    assert report["slot_reclaim"]["cancelled"]["slots_reclaimed"] > 0
    assert report["slot_reclaim"]["decode_steps_after_cancel_at_most"] <= 1
    assert set(report["rss_after"]) == {"tokenizer", "model0", "model1", "gateway"}
    assert set(report["exit_codes"].values()) == {0}
