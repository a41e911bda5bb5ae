"""The attack command in CI: `python -m benchmarks.attack --quick` on the golden model, every case as
expected (the 254 of the first two rounds, the third round's classes: structured-output abuse, KV pressure,
tracing headers, HTTP streaming faults, tenants; and the fourth's: absolute-form targets, n beyond the slots, a
burst's first tokens, the prompt byte limit; over the three services and both gateway APIs), every
service alive, serving and exiting 0 afterwards."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

from tests.procs import GOLDEN, ROOT

pytestmark = pytest.mark.slow


def test_quick_attack_run_finds_every_case_as_expected(tmp_path: pathlib.Path, jax_cache: str) -> None:
    out = tmp_path / "attack.json"
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.attack", "--quick", "--config", str(GOLDEN / "config.json"),
         "--checkpoint", str(GOLDEN / "checkpoint"), "--tokenizer", str(GOLDEN / "tokenizer.model"),
         "--compile-cache", jax_cache, "--log-dir", str(tmp_path / "logs"), "--json-out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert out.exists(), result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(out.read_text())
    wrong = [r for r in report["results"] if not r["passed"]]
    assert not wrong, json.dumps(wrong, indent=1)[:4000]
    assert result.returncode == 0 and report["passed"], report["exit_codes"]
    assert report["cases"] >= 254 + 150
    classes = {prefix: sum(r["case"].startswith(prefix) for r in report["results"])
               for prefix in ("so-", "kv-", "trace-", "stream-", "tenant-", "r4-")}
    assert min(classes.values()) >= 4 and sum(classes.values()) >= 150, classes
    assert {"gateway", "tokenizer", "model", "gateway-http"} <= set(report["by_service"])
    assert all(report["serving_after"].values()) and set(report["exit_codes"].values()) == {0}
