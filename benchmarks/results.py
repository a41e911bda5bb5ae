"""Result files: provenance (git revision, machine, load), one JSON per run, the sweep summary, and the
`--compare A.json B.json` ratio table.

A run file is `vllm bench serve`'s result layout (same key names and units) plus `config`, `git`,
`machine` and `workload`. A summary holds, per point, the median of every scalar metric over the
runs and the min/max spread, plus a compact ITL distribution for the plots.
"""

from __future__ import annotations

import datetime
import json
import os
import pathlib
import platform
import subprocess
from collections.abc import Mapping, Sequence
from typing import Any

from serving_common.cpus import cpu_quota

ROOT = pathlib.Path(__file__).resolve().parent.parent


def git_info(root: pathlib.Path = ROOT) -> dict[str, Any]:
    """The measured revision: commit, branch and whether the tree had uncommitted changes."""
    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            return ""
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": git("rev-parse", "HEAD"), "branch": git("rev-parse", "--abbrev-ref", "HEAD"),
            "dirty": bool(status), "describe": git("log", "-1", "--format=%h %s")}


def cpu_model() -> str:
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def machine_info() -> dict[str, Any]:
    """Cores, CPU, memory, load average now, and library versions that change the numbers."""
    import grpc
    import jax
    import numpy

    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        mem = 0
    return {"cpus": os.cpu_count(), "cgroup_cpu_limit": cpu_quota(), "cpu_model": cpu_model(),
            "memory_gib": round(mem / 2**30, 1),
            "load_avg": [round(x, 2) for x in os.getloadavg()], "platform": platform.platform(),
            "python": platform.python_version(), "jax": jax.__version__, "grpcio": grpc.__version__,
            "numpy": numpy.__version__, "jax_backend": os.environ.get("JAX_PLATFORMS", "") or "default"}


def provenance() -> dict[str, Any]:
    return {"date": datetime.datetime.now().strftime("%Y%m%d-%H%M%S"), "git": git_info(), "machine": machine_info()}


def write_json(path: pathlib.Path, data: Mapping[str, Any]) -> pathlib.Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, default=_jsonable) + "\n")
    return path


def emit(report: Mapping[str, Any], out: str | None) -> None:
    """A tool's JSON report on stdout, and also into `out` when given."""
    text = json.dumps(report, indent=1)
    print(text)
    if out:
        pathlib.Path(out).write_text(text + "\n")


def _jsonable(value: Any) -> Any:
    if hasattr(value, "item"):
        return value.item()
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


def load(path: str | pathlib.Path) -> dict[str, Any]:
    return json.loads(pathlib.Path(path).read_text())


def points_of(result: Mapping[str, Any]) -> dict[str, Mapping[str, float]]:
    """Point key -> median metrics, for a summary (many points) or a single run file (one point)."""
    if "points" in result:
        return {p["key"]: p["median"] for p in result["points"]}
    key = f"{result.get('workload', {}).get('name', 'run')}/{result.get('point_label', 'point')}"
    return {key: {k: v for k, v in result.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}}


COMPARE_METRICS = ("request_throughput", "output_throughput", "request_goodput", "median_ttft_ms", "p99_ttft_ms",
                   "median_tpot_ms", "p99_tpot_ms", "median_itl_ms", "p99_itl_ms", "median_e2el_ms", "p99_e2el_ms",
                   "failed")


def compare(a: Mapping[str, Any], b: Mapping[str, Any],
            metrics: Sequence[str] = COMPARE_METRICS) -> list[dict[str, Any]]:
    """Rows (point, metric, A, B, B/A) for the points both results share."""
    pa, pb = points_of(a), points_of(b)
    rows = []
    for key in [k for k in pa if k in pb]:
        for metric in metrics:
            va, vb = pa[key].get(metric), pb[key].get(metric)
            if va is None or vb is None:
                continue
            ratio = vb / va if va else (1.0 if vb == va else float("inf"))
            rows.append({"point": key, "metric": metric, "a": va, "b": vb, "ratio": ratio})
    return rows


def format_compare(rows: Sequence[Mapping[str, Any]], a_name: str, b_name: str) -> str:
    """The ratio table as text (throughputs: higher is better; latencies: lower is better)."""
    if not rows:
        return "no common points to compare (the two results measured different workloads or loads)\n"
    width = max(len(r["point"]) for r in rows)
    lines = [f"A = {a_name}", f"B = {b_name}",
             f"{'point':<{width}}  {'metric':<20} {'A':>12} {'B':>12} {'B/A':>8}"]
    for r in rows:
        lines.append(f"{r['point']:<{width}}  {r['metric']:<20} {r['a']:>12.3f} {r['b']:>12.3f} {r['ratio']:>8.3f}")
    return "\n".join(lines) + "\n"
