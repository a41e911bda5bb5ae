"""PNG plots of a sweep summary (matplotlib, no display needed): throughput vs load, latency
percentiles vs load, and the ITL distribution. Load is the concurrency of closed-loop points and the
request rate of open-loop points; error bars span the min..max over the runs."""

from __future__ import annotations

import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only; must precede pyplot's import
import matplotlib.pyplot as plt  # noqa: E402

DPI = 80  # small committed PNGs


def _load_axis(points: Sequence[Mapping[str, Any]]) -> tuple[str, list[Mapping[str, Any]]]:
    closed = [p for p in points if p["load"]["request_rate"] == "inf"]
    if closed:
        return "concurrency", sorted(closed, key=lambda p: p["load"]["max_concurrency"] or 0)
    return "request rate (req/s)", sorted(points, key=lambda p: float(p["load"]["request_rate"]))


def _x(point: Mapping[str, Any], axis: str) -> float:
    load = point["load"]
    return float(load["max_concurrency"] or 0) if axis == "concurrency" else float(load["request_rate"])


def _by_workload(points: Sequence[Mapping[str, Any]]) -> dict[str, list[Mapping[str, Any]]]:
    out: dict[str, list[Mapping[str, Any]]] = {}
    for p in points:
        out.setdefault(p["workload"]["name"], []).append(p)
    return out


def _series(ax: Any, points: Sequence[Mapping[str, Any]], axis: str, metric: str, label: str, style: str) -> None:
    xs = [_x(p, axis) for p in points]
    med = [p["median"][metric] for p in points]
    low = [m - p["min"][metric] for m, p in zip(med, points)]
    high = [p["max"][metric] - m for m, p in zip(med, points)]
    ax.errorbar(xs, med, yerr=[low, high], fmt=style, capsize=3, label=label, markersize=4)


def throughput(summary: Mapping[str, Any], path: pathlib.Path) -> pathlib.Path:
    axis, points = _load_axis(summary["points"])
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.6))
    for name, group in _by_workload(points).items():
        _series(left, group, axis, "output_throughput", name, "o-")
        _series(right, group, axis, "request_throughput", name, "o-")
    left.set(xlabel=axis, ylabel="output tokens/s", title="Output token throughput")
    right.set(xlabel=axis, ylabel="requests/s", title="Request throughput")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.set_ylim(bottom=0)
    left.legend(fontsize=7)
    fig.suptitle(summary.get("label", ""), fontsize=9)
    fig.tight_layout()
    return _save(fig, path)


def latency(summary: Mapping[str, Any], path: pathlib.Path) -> pathlib.Path:
    axis, points = _load_axis(summary["points"])
    fig, axes = plt.subplots(1, 4, figsize=(12, 3.4))
    percentiles = [k.split("_")[0] for k in points[0]["median"]
                   if k.endswith("_ttft_ms") and k.startswith("p") and k != "p50_ttft_ms"]  # p50 is the median
    for ax, metric, title in zip(axes, ("ttft", "tpot", "itl", "e2el"), ("TTFT", "TPOT", "ITL", "E2E latency")):
        for name, group in _by_workload(points).items():
            for pct, style in zip(["median", *percentiles], ["o-", "s--", "^:", "v-."]):
                key = f"{pct}_{metric}_ms"
                if key in group[0]["median"]:
                    _series(ax, group, axis, key, f"{name} {pct}", style)
        ax.set(xlabel=axis, ylabel="ms", title=title)
        ax.grid(alpha=0.3)
        ax.set_ylim(bottom=0)
    axes[0].legend(fontsize=6)
    fig.suptitle(summary.get("label", ""), fontsize=9)
    fig.tight_layout()
    return _save(fig, path)


def itl_distribution(summary: Mapping[str, Any], path: pathlib.Path) -> pathlib.Path:
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for p in summary["points"]:
        qs = p.get("itl_quantiles_ms") or []
        if qs:
            ax.plot(qs, [(i + 1) / (len(qs) + 1) for i in range(len(qs))], label=p["key"])
    ax.set(xlabel="inter-token latency (ms)", ylabel="fraction of gaps", title="ITL distribution (CDF, pooled runs)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6)
    fig.tight_layout()
    return _save(fig, path)


def _save(fig: Any, path: pathlib.Path) -> pathlib.Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def all_plots(summary: Mapping[str, Any], directory: pathlib.Path, prefix: str) -> list[pathlib.Path]:
    """The three plots as DIRECTORY/PREFIX-{throughput,latency,itl}.png."""
    return [throughput(summary, directory / f"{prefix}-throughput.png"),
            latency(summary, directory / f"{prefix}-latency.png"),
            itl_distribution(summary, directory / f"{prefix}-itl.png")]
