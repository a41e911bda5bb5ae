"""Three independent clients against one running stack: do they agree on what it serves?

    python -m benchmarks.crosscheck --stack golden --concurrency 4 --num-prompts 64 --rounds 3

Starts one preset stack with the gateway's HTTP API on, then runs the same closed-loop workload (the same
prompts, fixed lengths, ignore_eos, greedy) with, in turn and interleaved round after round:
- `ours-grpc`: this package's load generator over gRPC (GatewayService/Generate), what `python -m
  benchmarks` reports;
- `ours-http`: this package's minimal HTTP client over /v1/completions (streamed), to separate what HTTP
  costs from what another client costs;
- `k6`: k6's `k6/net/grpc` streams (benchmarks/k6/generate.js);
- `aiperf`: AIPerf over HTTP (/v1/completions, streamed, server token counts), from its own virtualenv
  (`make .venv-aiperf/.installed`; skipped with a note when it is missing).
Compared with `ours-grpc` (medians over rounds): output token throughput and the inter-token latency in
AIPerf's sense, (E2E - TTFT) / (tokens - 1) per request (vLLM's TPOT), within --tolerance; TTFT is
reported with where the HTTP first token goes (first event vs first non-empty text). Each run records the
box's load and the CPU the stack and the client used (benchmarks.box): on 2 cores a client's own CPU is
taken from the stack, so a heavier client measures a slower stack.
"""

from __future__ import annotations

import asyncio
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from typing import Any

from benchmarks import box, k6check, metrics, results
from benchmarks.http_sender import HttpResult, HttpSender
from benchmarks.loadgen import GatewaySender, LoadPoint, Sender, run_point, warm_up
from benchmarks.stack import ROOT, RunningStack, preset, start_stack
from benchmarks.workload import BenchRequest, PromptCutter, WorkloadSpec, build
from serving_common.flags import EnvArgumentParser, positive_int

AIPERF_VENV = ROOT / ".venv-aiperf"
COMPARED = ("output_throughput", "mean_tpot_ms")


def ms_after_start(results_: Sequence[Any], attribute: str) -> float:
    """Mean milliseconds from send to `attribute` (a perf_counter time) over the requests that have it."""
    values = [(getattr(r, attribute) - r.start) * 1e3 for r in results_ if r.success and getattr(r, attribute)]
    return statistics.fmean(values) if values else 0.0


def ours(sender_factory: Callable[[], Sender], requests: Sequence[BenchRequest], concurrency: int) -> dict[str, Any]:
    async def go() -> dict[str, Any]:
        send = sender_factory()
        try:
            served, duration = await run_point(send, requests, LoadPoint(concurrency))
        finally:
            await send.close()  # type: ignore[attr-defined]
        m = metrics.compute(served, duration)
        out = {k: m[k] for k in ("completed", "failed", "duration", "total_output_tokens", "output_throughput",
                                 "mean_tpot_ms", "mean_itl_ms", "mean_ttft_ms", "median_ttft_ms", "mean_e2el_ms")}
        out["mean_first_text_ms"] = ms_after_start(served, "first_text")
        if served and isinstance(served[0], HttpResult):
            out["mean_first_event_ms"] = ms_after_start(served, "first_event")
        return out
    return asyncio.run(go())


def hf_tokenizer(spec_tokenizer: str, work: pathlib.Path) -> pathlib.Path:
    """AIPerf counts tokens with a Hugging Face tokenizer: build one from the SentencePiece file, offline."""
    out = work / "hf-tokenizer"
    subprocess.run([str(AIPERF_VENV / "bin" / "python"), str(ROOT / "scripts" / "hf_tokenizer.py"), "--model",
                    spec_tokenizer, "--out", str(out)], check=True, capture_output=True, text=True, timeout=600)
    return out


def run_aiperf(port: int, requests: Sequence[BenchRequest], concurrency: int, tokenizer: pathlib.Path,
               work: pathlib.Path, index: int) -> dict[str, Any]:
    """One AIPerf run over the same prompts (a single-turn custom dataset); its JSON export, reduced."""
    dataset = work / "prompts.jsonl"
    dataset.write_text("".join(json.dumps({"text": r.prompt, "output_length": r.output_len}) + "\n"
                               for r in requests))
    out = work / f"aiperf-{index}"
    cmd = [str(AIPERF_VENV / "bin" / "aiperf"), "profile", "--model", "grok-1", "--url", f"http://127.0.0.1:{port}",
           "--endpoint-type", "completions", "--streaming", "--tokenizer", str(tokenizer), "--use-server-token-count",
           "--concurrency", str(concurrency), "--request-count", str(len(requests)),
           "--input-file", str(dataset), "--custom-dataset-type", "single_turn",
           "--extra-inputs", "ignore_eos:true", "--extra-inputs", "temperature:0", "--random-seed", "7",
           "--ui-type", "none", "--artifact-dir", str(out)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, env={**os.environ, "NO_COLOR": "1"})
    export = out / "profile_export_aiperf.json"
    if run.returncode != 0 or not export.exists():
        raise RuntimeError(f"aiperf failed ({run.returncode}):\n{(run.stdout + run.stderr)[-3000:]}")
    data = json.loads(export.read_text())
    return {"completed": int(data["request_count"]["avg"]) if isinstance(data["request_count"], dict)
            else int(data["request_count"]), "total_output_tokens": _value(data.get("total_output_tokens")),
            "output_throughput": data["output_token_throughput"]["avg"],
            "mean_tpot_ms": data["inter_token_latency"]["avg"], "mean_ttft_ms": data["time_to_first_token"]["avg"],
            "median_ttft_ms": data["time_to_first_token"]["p50"], "mean_e2el_ms": data["request_latency"]["avg"]}


def _value(metric: Any) -> float:
    """AIPerf exports scalars as {"avg": x, ...} (older versions: plain numbers)."""
    return float(metric["avg"]) if isinstance(metric, dict) else float(metric or 0)


def run_k6(address: str, requests: Sequence[BenchRequest], concurrency: int, work: pathlib.Path) -> dict[str, Any]:
    m = k6check.run_k6(address, requests, concurrency, work)
    return {"completed": m["completed"], "failed": m["failed"], "duration": m["duration"],
            "total_output_tokens": m["output_tokens"], "output_throughput": m["output_throughput"], "mean_tpot_ms": m["mean_tpot_ms"],
            "mean_ttft_ms": m["mean_ttft_ms"], "median_ttft_ms": m["median_ttft_ms"], "mean_e2el_ms": m["mean_e2el_ms"]}


def tools(stack: RunningStack, requests: Sequence[BenchRequest], concurrency: int, work: pathlib.Path,
          with_aiperf: bool) -> dict[str, Callable[[int], dict[str, Any]]]:
    out: dict[str, Callable[[int], dict[str, Any]]] = {
        "ours-grpc": lambda i: ours(lambda: GatewaySender(stack.address), requests, concurrency),
        "ours-http": lambda i: ours(lambda: HttpSender("127.0.0.1", stack.http_port), requests, concurrency),
        "k6": lambda i: run_k6(stack.address, requests, concurrency, work),
    }
    if with_aiperf:
        tokenizer = hf_tokenizer(stack.spec.tokenizer, work)
        out["aiperf"] = lambda i: run_aiperf(stack.http_port, requests, concurrency, tokenizer, work, i)
    return out


def agreement(medians: dict[str, dict[str, float]], tolerance: float) -> dict[str, Any]:
    base = medians["ours-grpc"]
    table: dict[str, Any] = {}
    for tool, m in medians.items():
        if tool == "ours-grpc":
            continue
        table[tool] = {key: {"ratio": m[key] / base[key], "agree": abs(m[key] / base[key] - 1) <= tolerance}
                       for key in COMPARED if base.get(key)}
        table[tool]["ttft_minus_ours_ms"] = m["mean_ttft_ms"] - base["mean_ttft_ms"]
    table["all_agree"] = all(v["agree"] for t in table.values() if isinstance(t, dict)
                             for v in t.values() if isinstance(v, dict))
    return table


def run(stack_name: str, concurrency: int, num_prompts: int, input_len: int, output_len: int, rounds: int,
        tolerance: float, with_aiperf: bool = True) -> dict[str, Any]:
    spec = preset(stack_name, concurrency)
    work = pathlib.Path(tempfile.mkdtemp(prefix="bench-crosscheck-"))
    with_aiperf = with_aiperf and (AIPERF_VENV / "bin" / "aiperf").exists()
    stack = start_stack(spec, work / "logs", http=True)
    runs: dict[str, list[dict[str, Any]]] = {}
    try:
        requests = build(WorkloadSpec("fixed", input_len, output_len, num_prompts), PromptCutter(spec.tokenizer))
        asyncio.run(_warm(stack.address, requests[:2 * concurrency], concurrency))
        todo = tools(stack, requests, concurrency, work, with_aiperf)
        for index in range(rounds):
            for tool, measure in todo.items():
                watch = box.CpuWatch(stack_pids=stack.pids)
                watch.start()
                result = measure(index)
                shared = watch.stop()
                result["box"] = shared.as_dict() if shared is not None else None
                if shared is not None and shared.stack_cpu_cores is not None:  # what each client costs the box
                    result["stack_cpu_cores"] = shared.stack_cpu_cores
                    result["client_cpu_cores"] = shared.own_cpu_cores - shared.stack_cpu_cores
                box.warn_if_busy(shared, f"crosscheck {tool} round {index}")
                runs.setdefault(tool, []).append(result)
                print(f"crosscheck {tool} round {index}: {result['output_throughput']:.1f} tok/s, TPOT "
                      f"{result['mean_tpot_ms']:.2f} ms, TTFT {result['mean_ttft_ms']:.1f} ms", file=sys.stderr,
                      flush=True)
    finally:
        stack.close()
    medians = {tool: {k: statistics.median(r[k] for r in rs) for k in rs[0] if isinstance(rs[0][k], (int, float))}
               for tool, rs in runs.items()}
    return {"benchmark": "crosscheck", "stack": stack_name, "concurrency": concurrency, "num_prompts": num_prompts,
            "input_len": input_len, "output_len": output_len, "rounds": rounds, "tolerance": tolerance,
            "aiperf": with_aiperf or f"skipped: no {AIPERF_VENV / 'bin' / 'aiperf'} (make .venv-aiperf/.installed)",
            "median": medians, "agreement": agreement(medians, tolerance), "runs": runs, **results.provenance()}


async def _warm(address: str, requests: Sequence[BenchRequest], concurrency: int) -> None:
    send = GatewaySender(address)
    try:
        await warm_up(send, requests, concurrency)
    finally:
        await send.close()


def main(argv: Sequence[str] | None = None) -> int:
    p = EnvArgumentParser(env_prefix="GROK_BENCH", prog="python -m benchmarks.crosscheck",
                          description=__doc__.split("\n\n")[0])
    p.add_env_argument("--stack", default="golden", choices=["golden", "medium"], help="preset stack")
    p.add_env_argument("--concurrency", type=positive_int, default=4, help="requests in flight")
    p.add_env_argument("--num-prompts", type=positive_int, default=64, help="requests per run")
    p.add_env_argument("--input-len", type=positive_int, default=32, help="prompt tokens")
    p.add_env_argument("--output-len", type=positive_int, default=32, help="generated tokens (ignore_eos)")
    p.add_env_argument("--rounds", type=positive_int, default=3, help="interleaved rounds (medians compared)")
    p.add_env_argument("--tolerance", type=float, default=0.10, help="relative difference that still agrees")
    p.add_env_argument("--no-aiperf", action="store_true", default=False, help="leave AIPerf out")
    p.add_env_argument("--out", default=None, help="also write the JSON here")
    args = p.parse_args(argv)
    report = run(args.stack, args.concurrency, args.num_prompts, args.input_len, args.output_len, args.rounds,
                 args.tolerance, not args.no_aiperf)
    if args.out:
        results.write_json(pathlib.Path(args.out), report)
    print(json.dumps({k: v for k, v in report.items() if k != "runs"}, indent=1))
    return 0 if report["agreement"]["all_agree"] else 1


if __name__ == "__main__":
    sys.exit(main())
