"""A multi-process replica's decode step on CPU and what each process waits for in it; prints JSON.

    .venv/bin/python -m benchmarks.group [--model DIR] [--layouts 4:1,8 1:1,2] [--rounds 2] [--tokens 40]
        [--repo LABEL=DIR ...]

Each layout `D:MESH` starts a two-process group as a user would (`python -m model_service --num-processes 2
--process-id 0|1 --mesh MESH`, each process given D CPU devices with XLA_FLAGS), waits for SERVING, and
times one greedy stream: milliseconds per token between an 8-token and a --tokens request of the same prompt
(the prompt and the first tokens cancel out). Each process runs under benchmarks/group_probe.py, which times
the lockstep machinery of whatever checkout it runs; over the long request it gives, per step:
  leader.wait_ms     the scheduler thread blocked in the engine: Engine.step calls plus waits for tokens
  leader.plan_ms     of which sending the step's plan (median)
  follower.wait_ms   the follower blocked: waiting for the next plan plus waiting for its dispatched step
  follower.plan_ms   of which waiting for and reading the plan (median)
With --repo the same runs are made against other checkouts (e.g. --repo before=/path/to/main), alternating
with this one (label "now") in every round, so a before/after comparison shares the box's load. The greedy
tokens of every run must be the same. The golden checkpoint of ../shared is the default model.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import grpc

from benchmarks import box
from grok.model.v1 import model_pb2, model_pb2_grpc
from serving_common.processes import free_port, terminate, wait_serving

ROOT = pathlib.Path(__file__).resolve().parent.parent
GOLDEN = ROOT.parent / "shared" / "golden"
PROBE = pathlib.Path(__file__).resolve().parent / "group_probe.py"
PROMPT = [1, 17, 92, 305, 44, 7, 260, 31]
FLUSHED = 0.3  # the probe writes its records every 50 ms; a follower finishes its last step just after


def _generate(stub: Any, tokens: int) -> list[int]:
    request = model_pb2.GenerateRequest(token_ids=PROMPT, temperature=0.0, max_tokens=tokens, ignore_eos=True)
    return [t for reply in stub.Generate(request, timeout=600) for t in reply.token_ids]


def _start(repo: pathlib.Path, args: list[str], env: dict[str, str], log: pathlib.Path) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:
        return subprocess.Popen([sys.executable, str(PROBE), "model_service", *args], cwd=repo, stdout=out,
                                stderr=subprocess.STDOUT, env={**env, "PYTHONPATH": str(repo)})


def waits(records: list[dict[str, Any]], began: float, ended: float) -> dict[str, Any]:
    """The steps of the window [began, ended] (one `engine` record each) and the median of each kind of wait."""
    inside = [r for r in records if began <= r["t"] <= ended]
    kinds: dict[str, list[float]] = {}
    for r in inside:
        kinds.setdefault(r["kind"], []).append(r["s"])
    out: dict[str, Any] = {"steps": len(kinds.get("engine", []))}
    for kind, seconds in sorted(kinds.items()):
        out[f"{kind}_ms"] = round(1000 * statistics.median(seconds), 3)
    return out


def _read(path: pathlib.Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def _per_step(records: list[dict[str, Any]], began: float, ended: float, blocked: tuple[str, ...]) -> dict[str, Any]:
    """`waits`, and `wait_ms`: the mean per step of the waits of the `blocked` kinds summed."""
    out = waits(records, began, ended)
    total = sum(r["s"] for r in records if began <= r["t"] <= ended and r["kind"] in blocked)
    out["wait_ms"] = round(1000 * total / out["steps"], 3) if out["steps"] else None
    return out


def run_layout(repo: pathlib.Path, devices: int, mesh: str, model: pathlib.Path, logs: pathlib.Path,
               tokens: int) -> dict[str, Any]:
    port, coordinator = free_port(), free_port()
    probes = pathlib.Path(tempfile.mkdtemp(prefix="probe-", dir=logs))
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "JAX_PLATFORMS": "cpu", "GROUP_PROBE_DIR": str(probes),
           "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}",
           "GROK_MODEL_CONFIG": str(model / "config.json"), "GROK_MODEL_CHECKPOINT": str(model / "checkpoint"),
           "GROK_MODEL_TOKENIZER": str(model / "tokenizer.model"), "GROK_MODEL_MESH": mesh,
           "GROK_MODEL_COORDINATOR": f"127.0.0.1:{coordinator}", "GROK_MODEL_NUM_PROCESSES": "2"}
    procs = []
    for pid, args in ((0, ["--host", "127.0.0.1", "--port", str(port)]), (1, [])):
        log = logs / f"group-{repo.name}-{devices}-{pid}-{port}.log"
        procs.append(_start(repo, [*args, "--process-id", str(pid)], env, log))
    try:
        wait_serving(procs[0], f"127.0.0.1:{port}", 900, name="model_service")
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = model_pb2_grpc.ModelServiceStub(channel)
            _generate(stub, 4)  # the first request's own costs stay out of the timing
            began = time.monotonic()
            _generate(stub, 8)
            short = time.monotonic() - began
            began = time.monotonic()
            out = _generate(stub, tokens)
            ended = time.monotonic()
        time.sleep(FLUSHED)
        leader = _per_step(_read(probes / "0.jsonl"), began, ended, ("engine", "results"))
        follower = _per_step(_read(probes / "1.jsonl"), began, ended + FLUSHED, ("plan", "results"))
        return {"devices_per_process": devices, "mesh": mesh,
                "ms_per_token": round(1000 * (ended - began - short) / (tokens - 8), 2),
                "leader": leader, "follower": follower, "tokens": out}
    finally:
        for proc in procs:
            terminate(proc, 30)


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over the rounds, per checkout and layout."""
    points: dict[str, dict[str, list[float]]] = {}
    for run in runs:
        point = points.setdefault(f"{run['repo']} {run['devices_per_process']}:{run['mesh']}", {})
        values = {"ms_per_token": run["ms_per_token"],
                  **{f"{side}.{k}": v for side in ("leader", "follower") for k, v in run[side].items()
                     if k.endswith("_ms") and v is not None}}
        for key, value in values.items():
            point.setdefault(key, []).append(value)
    return {name: {k: {"runs": v, "median": round(statistics.median(v), 3)} for k, v in point.items()}
            for name, point in points.items()}


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.group", description=__doc__.splitlines()[0])
    p.add_argument("--model", type=pathlib.Path, default=GOLDEN, help="a folder with config.json, checkpoint/ "
                   "and tokenizer.model (default: ../shared/golden)")
    p.add_argument("--layouts", nargs="+", default=["4:1,8", "1:1,2"], help="DEVICES_PER_PROCESS:MESH each")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--tokens", type=int, default=40, help="tokens of the timed request (> 8)")
    p.add_argument("--repo", action="append", default=[], help="LABEL=DIR: another checkout to run too")
    args = p.parse_args()
    if args.tokens <= 8:
        p.error("--tokens must be more than 8 (the short request's tokens are subtracted)")
    repos = {"now": ROOT, **{r.split("=", 1)[0]: pathlib.Path(r.split("=", 1)[1]).resolve() for r in args.repo}}
    logs = pathlib.Path(tempfile.mkdtemp(prefix="bench-group-"))
    watch = box.CpuWatch()
    watch.start()
    runs = []
    for _ in range(args.rounds):
        for layout in args.layouts:
            devices, mesh = layout.split(":")
            for label, repo in repos.items():
                runs.append({"repo": label, **run_layout(repo, int(devices), mesh, args.model, logs, args.tokens)})
    report = watch.stop()
    box.warn_if_busy(report, "benchmarks.group")
    print(json.dumps({"model": str(args.model), "logs": str(logs), "points": summary(runs),
                      "same_tokens": len({tuple(r["tokens"]) for r in runs}) == 1,
                      "box": report.as_dict() if report else None}, indent=1))


if __name__ == "__main__":
    main()
