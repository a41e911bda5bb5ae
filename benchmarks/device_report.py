"""benchmarks.device's report: each point beside its own bound, the parity verdicts, the failures, before/after
ratios when several checkouts ran, and a short table for people."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from benchmarks import device_bounds
from model_service.config import load_model_config

DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


def judge_points(group: Mapping[str, Any], config_path: str, bandwidth: float, peak: float) -> list[dict[str, Any]]:
    """The group's points (one config, dtype and checkout) each with its bound and the measured time against it."""
    cfg = load_model_config(config_path)
    out = []
    for point in group["points"]:
        work = device_bounds.Work(point["rows"], point["draws"], point["kv_tokens"], point["keys_seen"])
        b = device_bounds.bound(cfg, work, DTYPE_BYTES[group["dtype"]], bandwidth, peak)
        tokens = point["streams"] if point["kind"] == "decode" else point["rows"]
        row = {**point, "bound": b, **device_bounds.judged(point["ms"], b, tokens)}
        if "pipelined_ms" in point:
            row["pipelined_over_bound"] = point["pipelined_ms"] / b["bound_ms"]
        out.append(row)
    return out


def table_key(config: str, dtype: str, name: str) -> str:
    """A point's key in the report's `table`: word characters only (docs/performance.md's rows name it)."""
    return re.sub(r"\W", "_", f"{config}_{dtype}_{name}")


TABLE_FIELDS = ("ms", "pipelined_ms", "over_bound", "pipelined_over_bound", "tokens_per_s", "peak_share",
                "bandwidth_share")


def table(report: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """The last arm's points and compile times by `table_key`: ms, bound, ratios, tokens/s (the page's rows)."""
    last = list(report["arms"])[-1]
    out: dict[str, dict[str, Any]] = {}
    for p in report["points"]:
        if p["arm"] == last:
            out[table_key(p["config"], p["dtype"], p["name"])] = {
                **{k: p[k] for k in TABLE_FIELDS if k in p}, "bound_ms": p["bound"]["bound_ms"],
                "bound_by": p["bound"]["bound_by"]}
    for g in report["groups"]:
        if g["arm"] == last:
            out[table_key(g["config"], g["dtype"], "compile")] = {"s": g["compile_total_s"]}
    return out


def merge(reports: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Several runs' reports (one point each, say, to stay within a call's time on the chip) as one: the first's
    date, versions and device, every run's settings, programs, parity, points and failures."""
    first = reports[0]
    # a report merged before brings its runs' settings and provenance, not itself as one run
    out: dict[str, Any] = {**first, "settings": [s for r in reports for s in (
                               r["settings"] if "merged_from" in r else [r["settings"]])],
                           "merged_from": [m for r in reports for m in r.get(
                               "merged_from", [{"date": r["date"], "git": r["git"]}])]}
    for key in ("notes", "parity", "groups", "points", "activation_error", "programs", "failures"):
        out[key] = [item for r in reports for item in r.get(key, [])]
    out["configs"] = {k: v for r in reports for k, v in r.get("configs", {}).items()}
    out["table"] = table(out)
    return out


def failures(programs: Sequence[Mapping[str, Any]]) -> list[str]:
    """What went wrong, one line each: programs that failed, parity cases that did not pass."""
    out = []
    for prog in programs:
        where = f"{prog['name']} ({prog['arm']})"
        if prog.get("error"):
            out.append(f"{where}: {prog['error']}")
        out += [f"{where}: {e}" for e in prog.get("result", {}).get("errors", [])]
        for case in prog.get("result", {}).get("cases", []):
            if case.get("pass") is False:
                out.append(f"{where}: parity {case['set']} {case['dtype']} failed: "
                           f"{case.get('error') or case.get('criterion')}")
    return out


def comparison(points: Sequence[Mapping[str, Any]], arms: Sequence[str]) -> list[dict[str, Any]]:
    """Per point measured by every arm: each arm's ms and the last arm's over the first's."""
    by_key: dict[tuple[str, str, str], dict[str, float]] = {}
    for p in points:
        by_key.setdefault((p["config"], p["dtype"], p["name"]), {})[p["arm"]] = p["ms"]
    rows = []
    for (config, dtype, name), ms in by_key.items():
        if all(a in ms for a in arms):
            rows.append({"config": config, "dtype": dtype, "point": name, "ms": ms,
                         "ratio": ms[arms[-1]] / ms[arms[0]], "ratio_is": f"{arms[-1]} / {arms[0]}"})
    return rows


def summary(report: Mapping[str, Any]) -> str:
    """The report as a few lines of text (the JSON holds everything)."""
    lines = []
    for case in report["parity"]:
        verdict = {True: "PASS", False: "FAIL", None: "measured"}[case.get("pass")]
        if "error" in case:
            lines.append(f"parity {case['set']:<12} {case['dtype']:<9} [{case['arm']}] FAIL {case['error']}")
            continue
        ids = sum(r["greedy_ids_equal"] for r in case["prompts"])
        worst = max(max(r["prefill_max_error"], r["steps_max_error"]) for r in case["prompts"])
        lines.append(f"parity {case['set']:<12} {case['dtype']:<9} [{case['arm']}] {verdict:<8} greedy ids equal "
                     f"{ids}/{len(case['prompts'])} prompts, max |logit error| {worst:.3g}")
    for p in report["points"]:
        lines.append(f"{p['config']:<13} {p['dtype']:<9} {p['name']:<14} [{p['arm']}] {p['ms']:9.3f} ms  bound "
                     f"{p['bound']['bound_ms']:8.3f} ms ({p['bound']['bound_by']}) {p['over_bound']:6.2f}x  "
                     f"{p['tokens_per_s']:10.1f} tok/s  first {p['first_s']:.2f} s")
    for g in report["groups"]:
        lines.append(f"compile {g['config']:<13} {g['dtype']:<9} [{g['arm']}] {g['compile_total_s']:.1f} s "
                     f"{g['compile_s']}")
    for run in report["activation_error"]:
        for result in run["results"]:
            for variant, rows in result.items():
                if not isinstance(rows, dict):
                    continue
                prompts = [r for r in rows.values() if isinstance(r, dict)]
                text = rows.get("skipped") or (
                    f"greedy agree {sum(r['greedy_agree'] for r in prompts)}/{sum(r['steps'] for r in prompts)}, "
                    f"max |logit error| {max(r['max_logit_error'] for r in prompts):.3g}, "
                    f"max KL {max(r['kl_max'] for r in prompts):.3g}")
                lines.append(f"activation_error {result['set']:<12} {variant:<12} [{run['arm']}] {text}")
    for row in report.get("comparison", []):
        lines.append(f"compare {row['config']:<13} {row['dtype']:<9} {row['point']:<14} "
                     + "  ".join(f"{a} {ms:.3f} ms" for a, ms in row["ms"].items())
                     + f"  {row['ratio_is']} {row['ratio']:.3f}")
    lines += [f"FAILED: {f}" for f in report["failures"]]
    return "\n".join(lines) + "\n"
