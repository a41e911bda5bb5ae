"""One command for a GPU machine: the medium config's roofline, layer split and serving sweep -> one JSON.

    .venv/bin/pip install 'jax[cuda12]==0.10.2'      # once, on the GPU machine
    .venv/bin/python scripts/gpu_bench.py --out gpu-bench.json

Stays under 8 minutes: each step gets a share of --budget-s and the remaining steps are skipped (and
listed as skipped) once the budget is spent. Same tools and definitions as on CPU (benchmarks/), at
GPU-sized loads: batch 1/8/32 decode steps, concurrency 1/8/32 through the gateway.
"""

from __future__ import annotations

import json
import os
import pathlib
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
# The model service and the in-process engine of benchmarks.layers share the GPU: no process may
# grab most of its memory up front (JAX's default). Children inherit this.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # run as a script: make the repo's packages importable

from benchmarks import layers, results, roofline, serve  # noqa: E402
from benchmarks.loadgen import LoadPoint  # noqa: E402
from benchmarks.metrics import Slo  # noqa: E402
from benchmarks.stack import SHARED  # noqa: E402
from benchmarks.workload import WorkloadSpec  # noqa: E402
from serving_common.flags import EnvArgumentParser  # noqa: E402

MEDIUM = str(SHARED / "bench" / "medium.json")


def steps(work: pathlib.Path) -> list[tuple[str, float, Callable[[], dict[str, Any]]]]:
    """(name, latest start as a share of the budget, what it runs)."""
    cache = str(work / "jax-cache")
    sweep = serve.ServeConfig(
        workloads=(WorkloadSpec("fixed", 32, 64, 64),), points=tuple(LoadPoint(c) for c in (1, 8, 32)),
        stack="medium", slots=32, runs=3, warmup=8, slo=Slo(ttft_ms=200, tpot_ms=50), result_dir=str(work / "serve"),
        label="medium-gpu", compile_cache=cache)
    return [
        ("roofline-medium", 1.0, lambda: roofline.run(MEDIUM, [1, 8, 32], 20)),
        ("layers-medium", 0.3, lambda: layers.run(layers.LayersConfig(
            stack="medium", concurrency=(1, 8), num_prompts=32, runs=3, compile_cache=cache))),
        ("serve-medium", 0.55, lambda: serve.run(sweep)),
    ]


def main() -> int:
    p = EnvArgumentParser(env_prefix="GROK_BENCH", prog="scripts/gpu_bench.py", description=__doc__.split("\n\n")[0])
    p.add_env_argument("--out", default="gpu-bench.json", help="the JSON report")
    p.add_env_argument("--budget-s", type=float, default=420.0,
                       help="wall-clock budget: a step starts only before its share of it has passed")
    args = p.parse_args()
    import jax

    platform = jax.devices()[0].platform
    if platform != "gpu":
        print(f"gpu_bench: JAX sees {platform}, not a GPU: pip install 'jax[cuda12]==0.10.2' into .venv",
              file=sys.stderr)
        return 2
    begin = time.monotonic()
    report: dict[str, Any] = {"benchmark": "gpu", "devices": [str(d) for d in jax.devices()], **results.provenance(),
                              "steps": {}, "skipped": [], "errors": {}}
    work = pathlib.Path(tempfile.mkdtemp(prefix="gpu-bench-"))
    for name, start_by, step in steps(work):
        if time.monotonic() - begin > start_by * args.budget_s:
            report["skipped"].append(name)
            continue
        try:
            report["steps"][name] = step()
        except Exception:  # report what failed and keep the other steps' numbers
            report["errors"][name] = traceback.format_exc()[-4000:]
        report["elapsed_s"] = time.monotonic() - begin
        results.write_json(pathlib.Path(args.out), report)  # partial results survive a kill
    print(json.dumps({k: report[k] for k in ("elapsed_s", "skipped")} | {"errors": list(report["errors"])}))
    return 1 if report["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
