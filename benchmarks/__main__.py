"""`python -m benchmarks`: the serving benchmark through grok.gateway.v1.GatewayService/Generate.

    python -m benchmarks --stack golden --concurrency 1,2,4,8 --runs 3          # closed loop
    python -m benchmarks --stack medium --request-rate 0.5,1 --burstiness 0.5  # open loop, bursty
    python -m benchmarks --address 127.0.0.1:50051 --tokenizer tok.model ...   # a running gateway
    python -m benchmarks --compare before/summary.json after/summary.json      # ratio table B/A

Writes RESULT_DIR/runs/*.json (one per run, `vllm bench serve`'s layout plus config, git revision
and machine), RESULT_DIR/summary.json (median and min..max over runs per point) and PNG plots, and
prints the summary as JSON. Other tools of the package: benchmarks.layers (engine in-process vs
model service vs gateway), benchmarks.roofline, benchmarks.tokenizer, benchmarks.crosscheck, benchmarks.stackcheck,
benchmarks.suite (everything docs/benchmarks.md reports). Every flag also reads GROK_BENCH_<FLAG>.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from benchmarks import results
from benchmarks.metrics import parse_slo
from benchmarks.serve import ServeConfig, load_points, run
from benchmarks.workload import grid
from serving_common.flags import EnvArgumentParser, positive_int


def floats(raw: str) -> list[float]:
    try:
        return [float(x) for x in raw.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{raw!r} is not a comma-separated list of numbers") from None


def ints(raw: str) -> list[int]:
    try:
        values = [int(x) for x in raw.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{raw!r} is not a comma-separated list of integers") from None
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"{raw!r}: values must be >= 1")
    return values


def parser() -> EnvArgumentParser:
    p = EnvArgumentParser(env_prefix="GROK_BENCH", prog="python -m benchmarks",
                          description=__doc__.split("\n\n")[0],
                          epilog="Metric definitions are vLLM's (see docs/benchmarks.md).")
    p.add_env_argument("--stack", default="golden", choices=["golden", "medium", "none"],
                            help="start this preset stack (tokenizer + model + gateway) on 127.0.0.1 for the "
                                 "benchmark; 'none' uses --address")
    p.add_env_argument("--address", default=None, help="HOST:PORT of a running gateway (with --stack none)")
    p.add_env_argument("--tokenizer", default=None,
                            help="SentencePiece model the served model uses (counts prompt tokens; presets know "
                                 "theirs)")
    p.add_env_argument("--slots", type=positive_int, default=None,
                            help="model slots of a started stack (default: the largest --concurrency)")
    p.add_env_argument("--compile-cache", default=None, help="JAX compilation cache of a started model service")
    p.add_env_argument("--dataset", default="fixed", choices=["fixed", "random"],
                          help="fixed: exact lengths; random: lengths uniform within +-range-ratio")
    p.add_env_argument("--input-len", type=ints, default=[32], help="prompt tokens; a list makes a grid")
    p.add_env_argument("--output-len", type=ints, default=[32],
                       help="generated tokens (ignore_eos); a list makes a grid")
    p.add_env_argument("--range-ratio", type=float, default=0.5, help="random dataset: relative length spread")
    p.add_env_argument("--num-prompts", type=positive_int, default=16, help="requests per run of a point")
    p.add_env_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_env_argument("--top-p", type=float, default=1.0, help="nucleus mass (1 = off)")
    p.add_env_argument("--concurrency", type=ints, default=[1, 2, 4, 8],
                          help="closed-loop points: requests kept in flight")
    p.add_env_argument("--request-rate", type=floats, default=[],
                          help="open-loop points: requests/s (gamma arrivals)")
    p.add_env_argument("--burstiness", type=float, default=1.0,
                          help="gamma shape of open-loop gaps: 1 Poisson, <1 burstier, >1 more regular")
    p.add_env_argument("--max-concurrency", type=positive_int, default=None,
                          help="cap on requests in flight for open-loop points")
    p.add_env_argument("--runs", type=positive_int, default=3, help="runs per point (median and spread reported)")
    p.add_env_argument("--warmup", type=int, default=4, help="warm-up requests per workload, excluded")
    p.add_env_argument("--seed", type=int, default=0, help="seed of prompts and arrival times")
    p.add_env_argument("--percentiles", type=floats, default=[50, 90, 99], help="latency percentiles")
    p.add_argument("--goodput", nargs="*", default=[], metavar="NAME:MS",
                     help="SLOs for goodput, e.g. ttft:500 tpot:100 (names: ttft, tpot, e2el)")
    p.add_env_argument("--result-dir", default="benchmarks/measured/local", help="where runs, summary and plots go")
    p.add_env_argument("--label", default="serve", help="names the summary and the plot files")
    p.add_env_argument("--no-plots", action="store_true", default=False, help="skip the PNG plots")
    p.add_argument("--compare", nargs=2, metavar=("A.json", "B.json"),
                   help="print the B/A ratio table of two results (summaries or run files) and exit")
    return p


def config_from(args: argparse.Namespace, p: argparse.ArgumentParser) -> ServeConfig:
    try:
        workloads = grid(args.dataset, args.input_len, args.output_len, args.num_prompts, args.range_ratio, args.seed)
        points = load_points(args.concurrency, args.request_rate, args.burstiness, args.max_concurrency)
        slo = parse_slo(args.goodput)
    except ValueError as error:
        p.error(str(error))
    return ServeConfig(
        workloads=tuple(workloads), points=points, stack=None if args.stack == "none" else args.stack,
        address=args.address, tokenizer=args.tokenizer, slots=args.slots, runs=args.runs, warmup=args.warmup,
        seed=args.seed, percentiles=tuple(args.percentiles), slo=slo, temperature=args.temperature, top_p=args.top_p,
        result_dir=args.result_dir, label=args.label, plots=not args.no_plots, compile_cache=args.compile_cache)


def main(argv: Sequence[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if args.compare:
        a, b = (results.load(x) for x in args.compare)
        sys.stdout.write(results.format_compare(results.compare(a, b), *args.compare))
        return 0
    summary = run(config_from(args, p))
    print(json.dumps(summary, indent=1))
    failed = sum(pt["max"].get("failed", 0) for pt in summary["points"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
