"""The chip measured from the repository: golden parity and the step's points, each point beside its own bound
computed from the config; JSON into benchmarks/measured/ and printed.

    python -m benchmarks.device [--points parity,medium,grok1-1layer,grok1-2layer,activation_error] [--quick]
        [--dtype bfloat16[,float32]] [--repo before=DIR --repo after=.] [--out PATH]
On the TPU host (../shared/device/README.md; WIDE=1 for golden_wide):
    bash .device/on-device.sh python -m benchmarks.device

Every program runs in its own process, one after another (one process holds the chip at a time):
  parity            per golden set (../shared/golden, ../shared/golden_wide; a set that is not there is skipped
                    with a note), float32 and bfloat16: benchmarks/device_parity.py;
  CONFIG            per config and dtype, on one engine as the model service builds it: prompts (8 x 32 rows),
                    decode steps (1, 8 and 64 streams), one long prompt (2,048 tokens; the config's context is raised
                    to hold it): benchmarks/device_points.py. Configs: medium (../shared/bench/medium.json),
                    grok1-1layer (../shared/bench/grok1-width-1layer.json) and grok1-2layer (the same with
                    num_layers 2, written to a temporary file); --config NAME=PATH[,num_layers=N] adds or replaces one;
  activation_error  benchmarks.activation_error on this platform (float32, bfloat16; native-int8 on CPU).
Each point gets its bound (benchmarks/device_bounds.py: bytes at --bandwidth, FLOPs at --peak-flops) and the
ratio; each group the seconds of Engine.compile per program and each point its first run. With --repo, each
program runs from each checkout in turn (PYTHONPATH=DIR: its model, engine and parity helpers; these scripts from
this checkout), program by program, so one invocation gives before and after.
Exit status 1 when a parity case fails or a program fails (the JSON is written either way), 2 for bad flags.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.metadata
import json
import os
import pathlib
import platform
import subprocess
import sys
import tempfile
import time
from typing import Any

from benchmarks import device_bounds, device_report, results

ROOT = pathlib.Path(__file__).resolve().parent.parent
HERE = pathlib.Path(__file__).resolve().parent
DEFAULT_SHARED = ROOT.parent / "shared"
DEFAULT_CONFIGS = {"medium": "bench/medium.json", "grok1-1layer": "bench/grok1-width-1layer.json",
                   "grok1-2layer": "bench/grok1-width-1layer.json,num_layers=2"}
PARITY_SETS = ("golden", "golden_wide")
# Runs a script by path with the measured checkout first on sys.path (its cwd): `python -c RUNNER SCRIPT ARGS...`.
RUNNER = "import runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
# The parity tests' setting (tests/conftest.py, golden/README.md): bfloat16 roundings are not skipped.
PARITY_XLA_FLAGS = "--xla_allow_excess_precision=false"
CONTEXT_ROUND = 128


@dataclasses.dataclass(frozen=True)
class Program:
    """One process: `script` (in this checkout) with `args`, and what it measures."""

    name: str
    kind: str  # parity | points | activation_error
    script: pathlib.Path
    args: tuple[str, ...]
    xla_flags: str = ""
    meta: tuple[tuple[str, str], ...] = ()


def config_spec(spec: str, shared: pathlib.Path) -> tuple[pathlib.Path, dict[str, int]]:
    """'PATH[,key=N...]' -> (path, model overrides); a relative PATH is under `shared`."""
    path, *overrides = spec.split(",")
    p = pathlib.Path(path)
    return (p if p.is_absolute() or p.exists() else shared / p).resolve(), {
        k: int(v) for k, v in (o.split("=", 1) for o in overrides)}


def derived_config(source: pathlib.Path, overrides: dict[str, int], long_prompt: int,
                   tmp: pathlib.Path, name: str) -> pathlib.Path:
    """The config as the points run it: `overrides` in its model section, and a context that holds `long_prompt`
    tokens and a draw (rounded up to CONTEXT_ROUND) where the config's holds fewer."""
    data = json.loads(source.read_text())
    data["model"].update(overrides)
    if long_prompt:
        need = -(-(long_prompt + 1) // CONTEXT_ROUND) * CONTEXT_ROUND
        data["sequence_len"] = max(data["sequence_len"], need)
    if not overrides and data["sequence_len"] == json.loads(source.read_text())["sequence_len"]:
        return source
    out = tmp / f"{name}.json"
    out.write_text(json.dumps(data, indent=1))
    return out


def plan(args: argparse.Namespace, tmp: pathlib.Path) -> tuple[list[Program], list[str], dict[str, Any]]:
    """The programs to run, notes on what was left out, and each config's source and the file it ran from."""
    programs, notes, configs = [], [], {}
    specs = {**DEFAULT_CONFIGS, **dict(c.split("=", 1) for c in args.config)}
    for point in args.points:
        if point == "parity":
            for name in args.sets:
                folder = args.shared / name
                if not (folder / "config.json").exists():
                    notes.append(f"parity {name}: skipped, {folder} is not there (WIDE=1 bash "
                                 "../shared/device/prepare.sh carries golden_wide to the TPU host)")
                    continue
                programs.append(Program(f"parity/{name}", "parity", HERE / "device_parity.py",
                                        ("--set", str(folder), "--dtypes", ",".join(args.parity_dtypes),
                                         "--moe", args.moe, "--layers", args.layers,
                                         "--f32-atol", str(args.f32_atol)), PARITY_XLA_FLAGS))
        elif point == "activation_error":
            sets = ",".join(s for s in args.sets if (args.shared / s / "config.json").exists())
            if not sets:
                notes.append(f"activation_error: skipped, none of {args.sets} is under {args.shared}")
                continue
            programs.append(Program("activation_error", "activation_error", HERE / "activation_error.py",
                                    ("--sets", sets, "--shared", str(args.shared))))
        else:
            source, overrides = config_spec(specs[point], args.shared)
            # the context holds the long prompt, and each decoding slot's prompt with its decode steps after it
            # (each point's timed and overlapped runs and their first step)
            decoded = args.decode_prompt + len(args.streams) * (2 * args.runs + 2)
            context = max(args.long_prompt, decoded)
            path = derived_config(source, overrides, context, tmp, point)
            configs[point] = {"source": str(source), "overrides": overrides, "ran_from": str(path),
                              "sequence_len": json.loads(path.read_text())["sequence_len"],
                              "config": json.loads(path.read_text())}
            for dtype in args.dtype:
                programs.append(Program(f"points/{point}/{dtype}", "points", HERE / "device_points.py", (
                    "--config", str(path), "--dtype", dtype, "--streams", ",".join(map(str, args.streams)),
                    "--prompt-rows", args.prompt_rows, "--long-prompt", str(args.long_prompt),
                    "--decode-prompt", str(args.decode_prompt), "--runs", str(args.runs),
                    "--prompt-runs", str(args.prompt_runs), "--long-runs", str(args.long_runs),
                    "--backend", args.backend, "--moe", args.moe, "--layers", args.layers,
                    *(("--attention", args.attention) if args.attention != "auto" else ()),
                    *(("--products", args.products) if args.products != "auto" else ())),
                    meta=(("config", point), ("dtype", dtype))))
    return programs, notes, configs


def last_json(stdout: str) -> dict[str, Any]:
    """The program's result: its last line as JSON, or (a pretty-printed report) everything from the first line
    that opens an object."""
    lines = stdout.strip().splitlines()
    try:
        return json.loads(lines[-1])
    except (ValueError, IndexError):
        first = next(i for i, line in enumerate(lines) if line.startswith("{"))
        return json.loads("\n".join(lines[first:]))


def run_program(program: Program, arm: str, repo: pathlib.Path, timeout: float) -> dict[str, Any]:
    """Run `program` from checkout `repo`; its result, seconds, and an error line if it failed."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(repo), *filter(None, [os.environ.get("PYTHONPATH")])]),
           "PYTHONUNBUFFERED": "1"}
    if program.xla_flags:
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {program.xla_flags}".strip()
    out: dict[str, Any] = {"name": program.name, "kind": program.kind, "arm": arm, **dict(program.meta)}
    start = time.monotonic()
    try:
        run = subprocess.run([sys.executable, "-c", RUNNER, str(program.script), *program.args], cwd=repo, env=env,
                             capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:  # run() killed it
        tail = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        out.update(seconds=round(time.monotonic() - start, 1), error=f"timed out after {timeout:.0f} s",
                   stderr_tail=tail[-3000:])
        return out
    out["seconds"] = round(time.monotonic() - start, 1)
    if run.returncode != 0:
        out.update(error=f"exit status {run.returncode}", stderr_tail=run.stderr[-3000:])
        return out
    try:
        out["result"] = last_json(run.stdout)
    except (ValueError, StopIteration):
        out.update(error="printed no JSON result", stderr_tail=run.stderr[-3000:], stdout_tail=run.stdout[-1000:])
    return out


def versions() -> dict[str, Any]:
    """Library versions, read without starting a JAX backend (this process must not hold the chip)."""
    def version(name: str) -> str | None:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return None
    return {"python": platform.python_version(), "jax": version("jax"), "jaxlib": version("jaxlib"),
            "libtpu": version("libtpu") or version("libtpu-nightly"), "numpy": version("numpy"),
            "dm-haiku": version("dm-haiku")}


def assemble(args: argparse.Namespace, arms: dict[str, pathlib.Path], runs: list[dict[str, Any]],
             notes: list[str], configs: dict[str, Any]) -> dict[str, Any]:
    device = next((r["result"]["device"] for r in runs if "device" in r.get("result", {})), None)
    report: dict[str, Any] = {
        "benchmark": "device", "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "git": results.git_info(), "versions": versions(), "device": device,
        "arms": {a: {"dir": str(d), "git": results.git_info(d)} for a, d in arms.items()},
        "settings": {"points": args.points, "dtypes": args.dtype, "streams": args.streams,
                     "prompt_rows": args.prompt_rows, "long_prompt": args.long_prompt, "runs": args.runs,
                     "backend": args.backend, "moe": args.moe, "layers": args.layers, "attention": args.attention,
                     "products": args.products,
                     "bandwidth_bytes_per_s": args.bandwidth, "peak_flops": args.peak_flops,
                     "peak_note": device_bounds.PEAK_NOTE, "f32_atol": args.f32_atol,
                     "jax_platforms": os.environ.get("JAX_PLATFORMS", ""),
                     "jax_default_matmul_precision": os.environ.get("JAX_DEFAULT_MATMUL_PRECISION", "")},
        "configs": configs, "notes": notes, "parity": [], "groups": [], "points": [], "activation_error": [],
        "programs": [{k: v for k, v in r.items() if k != "result"} for r in runs]}
    for r in runs:
        res = r.get("result")
        if res is None:
            continue
        if r["kind"] == "parity":
            report["parity"] += [{**c, "arm": r["arm"]} for c in res["cases"]]
        elif r["kind"] == "activation_error":
            report["activation_error"].append({**res, "arm": r["arm"]})
        else:
            tag = {"config": r["config"], "dtype": r["dtype"], "arm": r["arm"]}
            report["groups"].append({**{k: v for k, v in res.items() if k != "points"}, "config_file": res["config"],
                                     **tag})
            report["points"] += [{**tag, **p} for p in device_report.judge_points(
                res, configs[r["config"]]["ran_from"], args.bandwidth, args.peak_flops)]
    if len(arms) > 1:
        report["comparison"] = device_report.comparison(report["points"], list(arms))
    report["failures"] = device_report.failures(runs)
    report["table"] = device_report.table(report)
    return report


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.device", description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--points", default=None,
                   help="comma-separated: parity, activation_error and config names (default: parity and every "
                        "config: medium, grok1-1layer, grok1-2layer and those --config adds)")
    p.add_argument("--quick", action="store_true",
                   help="a short run: parity on golden only, medium and grok1-1layer at 1 and 8 streams, no long "
                        "prompt, 5 runs a point (flags given explicitly still win)")
    p.add_argument("--config", action="append", default=[], metavar="NAME=PATH[,num_layers=N]",
                   help="a config to measure (a path relative to --shared, or any path)")
    p.add_argument("--dtype", default="bfloat16", help="the points' compute dtypes, comma-separated")
    p.add_argument("--sets", default=None, help="golden sets for parity (default golden,golden_wide)")
    p.add_argument("--parity-dtypes", default="float32,bfloat16", help="parity's dtypes, comma-separated")
    p.add_argument("--shared", type=pathlib.Path, default=DEFAULT_SHARED)
    p.add_argument("--streams", default=None, help="decode points (default 1,8,64)")
    p.add_argument("--prompt-rows", default="8x32", help="the prompts point: PROMPTSxTOKENS ('' for none)")
    p.add_argument("--long-prompt", type=int, default=None, help="tokens of the long prompt (default 2048; 0: none)")
    p.add_argument("--decode-prompt", type=int, default=32, help="tokens in each decoding slot before decode")
    p.add_argument("--runs", type=int, default=None, help="timed decode steps a point (default 10)")
    p.add_argument("--prompt-runs", type=int, default=5)
    p.add_argument("--long-runs", type=int, default=3)
    p.add_argument("--moe", default="auto", help="the points' experts, as the model service's --moe")
    p.add_argument("--attention", default="auto", help="the points' attention, as the model service's --attention "
                   "(pallas: decode rows through the Pallas kernel, one TPU device)")
    p.add_argument("--products", default="auto", help="the points' products, as the model service's --products "
                   "(int8: rows rounded to int8 on the matrix unit; changes results)")
    p.add_argument("--layers", default="auto", help="the points' and parity's layers, as the model service's "
                   "--layers (scan or unroll)")
    p.add_argument("--backend", default="auto", help="the points' engine backend, as the model service's "
                   "--backend (auto: the platform's; generic on CPU runs the accelerators' step)")
    p.add_argument("--f32-atol", type=float, default=1e-4, help="float32 parity's logit bound (the tests' 1e-4)")
    p.add_argument("--bandwidth", type=float, default=device_bounds.HBM_BYTES_PER_S, help="bytes/s of the bound")
    p.add_argument("--peak-flops", type=float, default=device_bounds.PEAK_FLOPS, help="FLOP/s of the bound")
    p.add_argument("--repo", action="append", default=[], metavar="NAME=DIR",
                   help="measure this checkout's code too (repeatable; default: this checkout, as 'now')")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds a program may run")
    p.add_argument("--merge", nargs="+", type=pathlib.Path, default=None, metavar="JSON",
                   help="measure nothing: merge these runs' reports into one (--out), e.g. a point per call")
    p.add_argument("--out", type=pathlib.Path, default=None,
                   help="the JSON's path (default benchmarks/measured/device-PLATFORM-DATE.json)")
    return p


def parse(argv: list[str] | None) -> tuple[argparse.Namespace, dict[str, pathlib.Path]]:
    p = parser()
    args = p.parse_args(argv)
    quick = args.quick
    names = [*DEFAULT_CONFIGS, *(c.split("=", 1)[0] for c in args.config if "=" in c)]
    default_points = "parity,medium,grok1-1layer" if quick else ",".join(["parity", *dict.fromkeys(names)])
    args.points = (args.points or default_points).split(",")
    args.sets = (args.sets or ("golden" if quick else ",".join(PARITY_SETS))).split(",")
    args.streams = [int(s) for s in (args.streams or ("1,8" if quick else "1,8,64")).split(",")]
    args.long_prompt = args.long_prompt if args.long_prompt is not None else (0 if quick else 2048)
    args.runs = args.runs or (5 if quick else 10)
    args.dtype = args.dtype.split(",")
    args.shared = args.shared.resolve()  # the programs run in each checkout's folder
    args.parity_dtypes = args.parity_dtypes.split(",")
    if bad := [c for c in args.config if "=" not in c]:
        p.error(f"--config takes NAME=PATH, got {bad[0]!r}")
    if unknown := [x for x in args.points if x not in ("parity", "activation_error", *names)]:
        p.error(f"unknown point(s) {', '.join(unknown)}: choose from parity, activation_error, {', '.join(names)}")
    if bad := [d for d in args.dtype + args.parity_dtypes if d not in device_report.DTYPE_BYTES]:
        p.error(f"--dtype and --parity-dtypes take float32 and/or bfloat16, got {bad[0]!r}")
    if args.prompt_rows and not all(x.isdigit() for x in args.prompt_rows.split("x", 1)):
        p.error(f"--prompt-rows takes PROMPTSxTOKENS (e.g. 8x32), got {args.prompt_rows!r}")
    arms = {"now": ROOT}
    if args.repo:
        if bad := [r for r in args.repo if "=" not in r]:
            p.error(f"--repo takes NAME=DIR, got {bad[0]!r}")
        arms = {name: pathlib.Path(d).resolve() for name, d in (r.split("=", 1) for r in args.repo)}
        if missing := [f"{n}={d}" for n, d in arms.items() if not (d / "model_service").is_dir()]:
            p.error(f"--repo {missing[0]}: no model_service/ there (give a checkout of this project)")
    return args, arms


def main(argv: list[str] | None = None) -> int:
    args, arms = parse(argv)
    if args.merge:
        report = device_report.merge([json.loads(f.read_text()) for f in args.merge])
        out = args.out or args.merge[0]
        results.write_json(out, report)
        print(device_report.summary(report) + f"written to {out}", file=sys.stderr)
        return 1 if report["failures"] else 0
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="device-bench-") as tmp:
        programs, notes, configs = plan(args, pathlib.Path(tmp))
        total = len(programs) * len(arms)
        for program in programs:
            for arm, repo in arms.items():  # alternating: a change of the machine's state hits every arm alike
                print(f"[{len(runs) + 1}/{total}] {program.name} ({arm}) ...", file=sys.stderr, flush=True)
                runs.append(run_program(program, arm, repo, args.timeout))
                r = runs[-1]
                print(f"[{len(runs)}/{total}] {program.name} ({arm}): {r['seconds']} s"
                      + (f" FAILED: {r['error']}\n{r.get('stderr_tail', '')[-1500:]}" if "error" in r else ""),
                      file=sys.stderr, flush=True)
        report = assemble(args, arms, runs, notes, configs)  # reads the derived configs: before they go
    plat = (report["device"] or {}).get("platform", "unknown")
    out = args.out or ROOT / "benchmarks" / "measured" / f"device-{plat}-{datetime.datetime.now():%Y%m%d-%H%M%S}.json"
    results.write_json(out, report)
    print(json.dumps(report, indent=1))
    print(device_report.summary(report) + f"written to {out}", file=sys.stderr)
    return 1 if report["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
