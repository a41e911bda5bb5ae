"""Does a stack the benchmark starts serve like the one a user starts? Both side by side, measured alternately.

    python -m benchmarks.stackcheck --stack golden --concurrency 4 --num-prompts 64 --rounds 2

Starts the preset stack exactly as `python -m benchmarks --stack NAME` does (benchmarks.stack) and the same
model, tokenizer and slots through the launcher users run (`scripts/run_stack.py`, with its own defaults
for everything else: prefill buckets, log level, HTTP port, ...), then runs the same closed-loop workload
against each gateway in turn, round after round, and reports the benchmark's stack over the launcher's
for output throughput, TPOT and TTFT. They should agree within --tolerance: a difference means the
benchmark measures a deployment nobody runs.
"""

from __future__ import annotations

import json
import pathlib
import signal
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from typing import Any

from benchmarks import box, results
from benchmarks.crosscheck import ours
from benchmarks.loadgen import GatewaySender
from benchmarks.stack import ROOT, StackSpec, preset, start_stack
from benchmarks.workload import PromptCutter, WorkloadSpec, build
from serving_common.flags import EnvArgumentParser, positive_int
from serving_common.processes import free_port, wait_serving

KEYS = ("output_throughput", "mean_tpot_ms", "mean_ttft_ms")


def start_launcher(spec: StackSpec, log: pathlib.Path) -> tuple[subprocess.Popen[bytes], str]:
    """scripts/run_stack.py serving `spec`'s model, tokenizer and slots on free ports; (process, gateway)."""
    ports = {name: free_port() for name in ("gateway", "http", "tokenizer", "model")}
    weights = ["--checkpoint", spec.checkpoint] if spec.checkpoint else []
    if not weights:
        raise ValueError("the launcher serves checkpoints only: use a preset with one (golden)")
    cmd = [sys.executable, str(ROOT / "scripts" / "run_stack.py"), "--config", spec.config, *weights,
           "--tokenizer", spec.tokenizer, "--slots", str(spec.slots), "--gateway-port", str(ports["gateway"]),
           "--http-port", str(ports["http"]), "--tokenizer-port", str(ports["tokenizer"]),
           "--model-port", str(ports["model"]), "--metrics-port", "0", "--model-metrics-port", "0",
           "--compile-cache", spec.compile_cache or ""]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log.open("wb"), stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL)
    address = f"127.0.0.1:{ports['gateway']}"
    try:
        for name in ("model", "tokenizer", "gateway"):
            wait_serving(proc, f"127.0.0.1:{ports[name]}", 1800.0, name=f"the launcher's {name}",
                         log_tail=lambda: "; log " + str(log))
    except BaseException:
        proc.send_signal(signal.SIGINT)
        proc.wait(60)
        raise
    return proc, address


def run(stack_name: str, concurrency: int, num_prompts: int, input_len: int, output_len: int, rounds: int,
        tolerance: float) -> dict[str, Any]:
    spec = preset(stack_name, concurrency)
    work = pathlib.Path(tempfile.mkdtemp(prefix="bench-stackcheck-"))
    stack = start_stack(spec, work / "logs")
    launcher, launcher_address = None, ""
    runs: dict[str, list[dict[str, Any]]] = {"benchmark": [], "launcher": []}
    try:
        launcher, launcher_address = start_launcher(spec, work / "launcher.log")
        requests = build(WorkloadSpec("fixed", input_len, output_len, num_prompts), PromptCutter(spec.tokenizer))
        addresses = {"benchmark": stack.address, "launcher": launcher_address}
        for address in addresses.values():  # warm both: connections, first-call paths
            ours(lambda a=address: GatewaySender(a), requests[:2 * concurrency], concurrency)
        for index in range(rounds):
            for name, address in addresses.items():
                watch = box.CpuWatch()
                watch.start()
                result = ours(lambda a=address: GatewaySender(a), requests, concurrency)
                shared = watch.stop()
                result["box"] = shared.as_dict() if shared is not None else None
                box.warn_if_busy(shared, f"stackcheck {name} round {index}")
                runs[name].append(result)
                print(f"stackcheck {name} round {index}: {result['output_throughput']:.1f} tok/s, TPOT "
                      f"{result['mean_tpot_ms']:.2f} ms, TTFT {result['mean_ttft_ms']:.1f} ms", file=sys.stderr,
                      flush=True)
    finally:
        if launcher is not None:
            launcher.send_signal(signal.SIGINT)
            launcher.wait(60)
        stack.close()
    medians = {name: {k: statistics.median(r[k] for r in rs) for k in KEYS} for name, rs in runs.items()}
    ratios = {k: medians["benchmark"][k] / medians["launcher"][k] for k in KEYS}
    return {"benchmark": "stackcheck", "stack": stack_name, "concurrency": concurrency, "num_prompts": num_prompts,
            "input_len": input_len, "output_len": output_len, "rounds": rounds, "median": medians,
            "benchmark_over_launcher": ratios, "tolerance": tolerance,
            "agree": all(abs(r - 1) <= tolerance for r in (ratios["output_throughput"], ratios["mean_tpot_ms"])),
            "runs": runs, **results.provenance()}


def main(argv: Sequence[str] | None = None) -> int:
    p = EnvArgumentParser(env_prefix="GROK_BENCH", prog="python -m benchmarks.stackcheck",
                          description=__doc__.split("\n\n")[0])
    p.add_env_argument("--stack", default="golden", choices=["golden"], help="preset stack (with a checkpoint)")
    p.add_env_argument("--concurrency", type=positive_int, default=4, help="requests in flight (and slots)")
    p.add_env_argument("--num-prompts", type=positive_int, default=64, help="requests per run")
    p.add_env_argument("--input-len", type=positive_int, default=32, help="prompt tokens")
    p.add_env_argument("--output-len", type=positive_int, default=32, help="generated tokens (ignore_eos)")
    p.add_env_argument("--rounds", type=positive_int, default=2, help="alternating rounds (medians compared)")
    p.add_env_argument("--tolerance", type=float, default=0.10, help="relative difference that still agrees")
    p.add_env_argument("--out", default=None, help="also write the JSON here")
    args = p.parse_args(argv)
    report = run(args.stack, args.concurrency, args.num_prompts, args.input_len, args.output_len, args.rounds,
                 args.tolerance)
    if args.out:
        results.write_json(pathlib.Path(args.out), report)
    print(json.dumps({k: v for k, v in report.items() if k != "runs"}, indent=1))
    return 0 if report["agree"] else 1


if __name__ == "__main__":
    sys.exit(main())
