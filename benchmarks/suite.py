"""Everything docs/benchmarks.md reports, in one command; `--quick` is `make bench`.

    python -m benchmarks.suite --out benchmarks/measured --update-doc docs/benchmarks.md   # the docs (~1 h)
    python -m benchmarks.suite --quick --out benchmarks/measured/local/quick               # make bench (minutes)

Runs, in order: the serving sweep through the gateway (golden, then medium), the layer split
(golden, medium), the decode-step roofline (golden, medium), the tokenizer service (Grok-1
tokenizer) and the three-client cross-check (golden: ours over gRPC and HTTP, k6, AIPerf). Each writes its JSON into --out (summaries only: the
per-run files of the sweeps stay in the temporary work folder the suite prints), the sweeps their
PNG plots; `--update-doc` regenerates the
tables between the RESULTS markers of the given markdown file. The JSON records the git revision.
"""

from __future__ import annotations

import json
import pathlib
import shutil
import sys
import tempfile
from collections.abc import Callable, Sequence
from typing import Any

from benchmarks import crosscheck, layers, report, results, roofline, serve, tokenizer
from benchmarks.loadgen import LoadPoint
from benchmarks.metrics import Slo
from benchmarks.stack import SHARED, use_model_xla_flags
from benchmarks.workload import WorkloadSpec
from serving_common.flags import EnvArgumentParser

GOLDEN_CONFIG = str(SHARED / "golden" / "config.json")
MEDIUM_CONFIG = str(SHARED / "bench" / "medium.json")
# SLOs for goodput: a few decode steps of each config on this 2-core machine.
SLOS = {"golden": Slo(ttft_ms=100, tpot_ms=20), "medium": Slo(ttft_ms=2000, tpot_ms=250)}


def serve_config(stack: str, quick: bool, out: pathlib.Path, cache: str) -> serve.ServeConfig:
    if quick:
        return serve.ServeConfig(workloads=(WorkloadSpec("fixed", 32, 32, 16),),
                                 points=tuple(LoadPoint(c) for c in (1, 4, 8)), stack=stack, runs=3, warmup=4,
                                 slo=SLOS[stack], result_dir=str(out), label=f"{stack}-quick", compile_cache=cache)
    if stack == "golden":
        workloads = (WorkloadSpec("fixed", 32, 32, 32), WorkloadSpec("fixed", 64, 64, 32),
                     WorkloadSpec("random", 32, 32, 32, range_ratio=0.5))
        points = (*[LoadPoint(c) for c in (1, 2, 4, 8, 16)], LoadPoint(16, 8.0), LoadPoint(16, 8.0, 0.25))
    else:
        workloads = (WorkloadSpec("fixed", 32, 32, 16), WorkloadSpec("random", 32, 32, 16, range_ratio=0.5))
        points = (*[LoadPoint(c) for c in (1, 2, 4, 8)], LoadPoint(8, 0.5), LoadPoint(8, 0.5, 0.25))
    return serve.ServeConfig(workloads=workloads, points=points, stack=stack, runs=3, warmup=4, slo=SLOS[stack],
                             result_dir=str(out), label=stack, compile_cache=cache,
                             slots=16 if stack == "golden" else 8)


def steps(quick: bool, out: pathlib.Path, work: pathlib.Path) -> list[tuple[str, Callable[[], dict[str, Any]]]]:
    cache = str(work / "jax-cache")
    stacks = ["golden"] if quick else ["golden", "medium"]
    todo: list[tuple[str, Callable[[], dict[str, Any]]]] = []
    for stack in stacks:
        todo.append((f"serve-{stack}", lambda s=stack: serve.run(serve_config(s, quick, work / f"serve-{s}", cache))))
    for stack in stacks:
        todo.append((f"layers-{stack}", lambda s=stack: layers.run(layers.LayersConfig(
            stack=s, concurrency=(1, 8), num_prompts=16 if s == "golden" else 8, runs=3, compile_cache=cache))))
    for name, config in (("golden", GOLDEN_CONFIG), ("medium", MEDIUM_CONFIG)):
        todo.append((f"roofline-{name}", lambda c=config: roofline.run(c, [1, 8], 5 if quick else 10)))
    todo.append(("tokenizer", lambda: tokenizer.run(str(SHARED / "grok1-tokenizer" / "tokenizer.model"), 8, 256,
                                                    32 if quick else 64, 128 if quick else 256, 2 if quick else 3)))
    todo.append(("crosscheck-golden", lambda: crosscheck.run("golden", 4, 32 if quick else 64, 32, 32,
                                                             2 if quick else 3, 0.10)))
    return todo


def run(quick: bool, out: pathlib.Path, only: Sequence[str] = ()) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    work = pathlib.Path(tempfile.mkdtemp(prefix="bench-suite-"))
    print(f"suite: per-run files under {work}", file=sys.stderr, flush=True)
    done: dict[str, Any] = {}
    for name, step in steps(quick, out, work):
        if only and not any(name.startswith(o) for o in only):
            continue
        print(f"suite: {name} ...", file=sys.stderr, flush=True)
        result = step()
        if name.startswith("serve-"):
            result.pop("plots", None)
            for png in (work / name).glob("*.png"):
                shutil.copy(png, out / png.name)
        results.write_json(out / f"{name}.json", result)
        done[name] = result
    return done


def main(argv: Sequence[str] | None = None) -> int:
    p = EnvArgumentParser(env_prefix="GROK_BENCH", prog="python -m benchmarks.suite",
                          description=__doc__.split("\n\n")[0])
    p.add_env_argument("--quick", action="store_true", default=False, help="the short version (make bench)")
    p.add_env_argument("--out", default="benchmarks/measured/local/suite", help="directory for the JSON and PNG files")
    p.add_env_argument("--only", default="", help="comma-separated step name prefixes, e.g. serve-medium,roofline")
    p.add_env_argument("--update-doc", default=None, help="markdown file whose RESULTS section is regenerated")
    args = p.parse_args(argv)
    use_model_xla_flags()
    out = pathlib.Path(args.out)
    done = run(args.quick, out, [o for o in args.only.split(",") if o])
    if args.update_doc:
        report.update_doc(pathlib.Path(args.update_doc), out)
    print(json.dumps({name: report.headline(name, r) for name, r in done.items()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
