"""`python -m benchmarks.chaos`: attack a local stack for a few minutes and print what happened.

Starts tokenizer, two model replicas and the gateway on 127.0.0.1 (the embedded demo by default;
--config/--checkpoint/--tokenizer select another model), records seeded answers on the calm stack,
then runs mixed traffic (seeded completions checked against those answers, streams cancelled after
0-300 ms, deadlines shorter than the request, invalid fields) while it injects: a burst of twice the
admission capacity, kill -9 of the tokenizer, kill -9 of a model replica, SIGTERM of a model replica
(each restarted on its port; the gateway is never restarted). Then it checks that every slot is free
and prints a JSON report: calls by kind and outcome, unexpected outcomes, per fault the recovery time
and the calls meanwhile, slot-reclaim times, RSS before/after. Exit status 1 when anything unexpected
happened (a status a kind may not have, a wrong seeded answer, no recovery, a leaked slot).

`--short` is the CI version (about a minute with a warm compile cache); --markdown prints the report
as the tables in docs/reliability.md.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

from benchmarks.chaos_faults import kill_and_restart, overload, reclaim_stats, sigterm_and_restart, \
    sigterm_tokenizer_with_streams_in_flight, slots_free
from benchmarks.chaos_load import Traffic, baseline
from benchmarks.chaos_stack import LocalStack, StackConfig, rss_bytes

WORKERS = {"complete": 2, "cancel": 2, "deadline": 1, "fuzz": 1}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.chaos", description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--config", default="configs/demo.json", help="model preset or config JSON")
    p.add_argument("--checkpoint", default="demo/checkpoint", help="directory holding ckpt-0/")
    p.add_argument("--tokenizer", default="demo/tokenizer.model", help="SentencePiece model file")
    p.add_argument("--duration", type=float, default=180.0, help="seconds of traffic")
    p.add_argument("--short", action="store_true", help="CI version: 15 s of traffic, shorter outages")
    p.add_argument("--slots", type=int, default=2, help="slots per model replica")
    p.add_argument("--max-queue", type=int, default=4, help="waiting queue per model replica")
    p.add_argument("--compile-cache", default=".jax_cache", help="JAX compilation cache shared by the replicas")
    p.add_argument("--log-dir", default=None, help="where the services' logs go (default: a temporary folder)")
    p.add_argument("--model-flag", action="append", default=[], metavar="FLAG",
                   help="one more flag for every model replica, repeatable (e.g. --model-flag=--speculative-config "
                        "--model-flag='{\"num_speculative_tokens\": 4}')")
    p.add_argument("--seed", type=int, default=0, help="seed of the traffic's random choices")
    p.add_argument("--markdown", action="store_true", help="print the report as markdown tables")
    p.add_argument("--json-out", default=None, help="also write the JSON report to this file")
    return p.parse_args(argv)


def rss(stack: LocalStack) -> dict[str, dict[str, int]]:
    return {p.name: {"pid": p.pid, "rss_mib": round(rss_bytes(p.pid) / 2**20, 1)} for p in stack.services}


def in_flight_streams(stack: LocalStack) -> int:
    """Streams held through the tokenizer SIGTERM: every slot busy and two more waiting in queues."""
    return stack.config.replicas * stack.config.slots + 2


def attack(stack: LocalStack, args: argparse.Namespace) -> dict[str, Any]:
    """Traffic for `args.duration` seconds with the faults spread over it; the report."""
    started = time.monotonic()
    seeded = baseline(stack.gateway.address)
    long_tokens = 100
    report: dict[str, Any] = {"rss_before": rss(stack)}
    down = 2.0 if args.short else 5.0
    faults: list[dict[str, Any]] = []
    with Traffic(stack.gateway.address, seeded, WORKERS, long_tokens, seed=args.seed) as traffic:
        steps = [(0.10, lambda: overload(stack, long_tokens)),
                 (0.25, lambda: kill_and_restart(stack, stack.tokenizer, traffic, seeded, down)),
                 (0.45, lambda: kill_and_restart(stack, stack.models[0], traffic, seeded, down)),
                 (0.65, lambda: sigterm_and_restart(stack, stack.models[0], traffic, seeded)),
                 (0.85, lambda: sigterm_tokenizer_with_streams_in_flight(
                     stack, seeded, in_flight_streams(stack), long_tokens, traffic))]
        for at, fault in steps:
            time.sleep(max(0.0, started + at * args.duration - time.monotonic()))
            faults.append(fault())
        time.sleep(max(0.0, started + args.duration - time.monotonic()))
    report.update(traffic_seconds=round(time.monotonic() - started, 1), calls=traffic.outcomes.table(),
                  unexpected=traffic.outcomes.unexpected(), faults=faults, slots_after=slots_free(stack),
                  slot_reclaim=reclaim_stats(stack), rss_after=rss(stack))
    return report


def verdict(report: dict[str, Any]) -> list[str]:
    """What went wrong (empty: the run passed)."""
    problems = [f"unexpected outcome {k} x{n}" for k, n in report["unexpected"].items()]
    problems += [f"{f['fault']}: no recovery" for f in report["faults"] if f.get("recovery_seconds", 0) is None]
    problems += [f"{f['fault']}: exit code {f['exit_code']}" for f in report["faults"] if f.get("exit_code")]
    problems += [f"{f['fault']}: {f['in_flight_lost']} of {f['in_flight']} streams in flight lost"
                 for f in report["faults"] if f.get("in_flight_lost")]
    if not report["slots_after"]["all_free"]:
        problems.append("slots still busy after the traffic stopped (leak)")
    burst = next(f for f in report["faults"] if f["fault"].startswith("burst"))
    if burst["accepted"] < burst["capacity"] // 2:
        problems.append(f"the burst got only {burst['accepted']} answers for a capacity of {burst['capacity']}")
    return problems


def markdown(report: dict[str, Any]) -> str:
    lines = ["| kind | calls by outcome |", "|---|---|"]
    for kind, outcomes in report["calls"].items():
        lines.append(f"| {kind} | " + ", ".join(f"{o}: {n}" for o, n in outcomes.items()) + " |")
    lines += ["", "| fault | down (s) | drain (s) | restart to SERVING (s) | then first correct answer (s) | "
              "fault to correct answer (s) | calls meanwhile, by outcome |", "|---|---|---|---|---|---|---|"]
    for f in report["faults"]:
        during = f.get("calls_during", f.get("outcomes", {}))
        cells = [f.get(k, "-") for k in ("down_seconds", "drain_seconds", "restart_to_serving_seconds",
                                         "answered_after_serving_seconds", "recovery_seconds")]
        lost = f" (streams in flight lost: {f['in_flight_lost']} of {f['in_flight']})" if "in_flight" in f else ""
        lines.append(f"| {f['fault']}{lost} | " + " | ".join(str(c) for c in cells) +
                     f" | {', '.join(f'{o}: {n}' for o, n in during.items())} |")
    lines += ["", "| slot reclaim | slots | mean (s) | p99 at most (s) |", "|---|---|---|---|"]
    for reason in ("cancelled", "deadline"):
        r = report["slot_reclaim"][reason]
        lines.append(f"| {reason} | {r['slots_reclaimed']} | {r['mean_seconds']} | {r['p99_at_most_seconds']} |")
    lines.append(f"\nDecode steps run after a cancel reached the model: at most "
                 f"{report['slot_reclaim']['decode_steps_after_cancel_at_most']}.")
    lines += ["", "| service | RSS before (MiB) | RSS after (MiB) | restarted |", "|---|---|---|---|"]
    for name, before in report["rss_before"].items():
        after = report["rss_after"][name]
        lines.append(f"| {name} | {before['rss_mib']} | {after['rss_mib']} | {before['pid'] != after['pid']} |")
    return "\n".join(lines)


def _path(value: str) -> str:
    """An absolute path when `value` names a file here (the services run from the repo root), else a preset."""
    path = pathlib.Path(value)
    return str(path.resolve()) if path.exists() else value


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.short:
        args.duration = min(args.duration, 15.0)
    config = StackConfig(config=_path(args.config), checkpoint=_path(args.checkpoint), tokenizer=_path(args.tokenizer),
                         slots=args.slots, max_queue=args.max_queue,
                         compile_cache=args.compile_cache, grace_seconds=5.0, model_flags=tuple(args.model_flag))
    log_dir = pathlib.Path(args.log_dir or tempfile.mkdtemp(prefix="chaos-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    began = time.monotonic()
    stack = LocalStack(config, log_dir).start()
    startup = time.monotonic() - began
    try:
        report = attack(stack, args)
    finally:
        exit_codes = stack.stop()
    problems = verdict(report)
    report = {"machine": platform.machine(), "python": platform.python_version(), "config": args.config,
              "replicas": config.replicas, "slots": config.slots, "max_queue": config.max_queue,
              "startup_seconds": round(startup, 1), **report, "exit_codes": exit_codes,
              "log_dir": str(log_dir), "problems": problems, "passed": not problems}
    if args.json_out:
        pathlib.Path(args.json_out).write_text(json.dumps(report, indent=1) + "\n")
    print(markdown(report) if args.markdown else json.dumps(report, indent=1))
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
