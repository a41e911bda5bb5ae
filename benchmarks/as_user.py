"""The model service as a user starts it, measured with the acceptance checks' own client; prints JSON.

    .venv/bin/python -m benchmarks.as_user [--repo before=WORKTREE] [--repo now=.] [--config PATH]
        [--streams 1,8] [--tokens 128] [--runs 2] [--llamacpp DIR] [--greedy] [--flags '...'] [--cgroup DIR]

Each arm is `python -m model_service --config CONFIG --random-init --host 127.0.0.1 --port P` from its checkout
with no other flag (the defaults a user gets: slots, tiles, step size, pacing), and each measurement is one run of
../shared/bench/speed.py (the black-box client: 32-token prompts, sampled at temperature 0.7 / top_p 0.9 unless
--greedy, EOS ignored) with that many simultaneous streams. The arms' services run side by side and the
measurements alternate between them; with --llamacpp DIR, llama.cpp (../shared/bench/llamacpp, Q8_0, 2 threads;
the GGUF that `run.sh DIR [CONFIG]` wrote) runs its 1- and 8-sequence points after each round, and the report
gives ours / llama.cpp for one stream (its per-stream rate) and for 8 (the aggregate). Run it alone on the box.
Each run records the prompt tokens the service's prefix cache served (`prompt_tokens_from_cache`, read from its
/metrics): speed.py sends the same prompts every invocation, so after the first the cache serves their first
16-token block and a TTFT is that of the prompt's tail. benchmarks.engine's prompts never repeat: its TTFTs are
whole prompts', as llama.cpp's are.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shlex
import statistics
import subprocess
import sys
import tempfile
import urllib.request
from typing import Any

from benchmarks import box
from benchmarks.engine import MEDIUM, llamacpp_run, print_report, wait_started
from serving_common.cpus import cpu_quota
from serving_common.processes import terminate
from tests.procs import SHARED, free_port

ROOT = pathlib.Path(__file__).resolve().parent.parent
SPEED = SHARED / "bench" / "speed.py"
CACHE_HITS = "grok_model_prefix_cache_hits_total"


class Service:
    """`python -m model_service` from `repo` with default flags (and `extra`), on a free port."""

    def __init__(self, repo: pathlib.Path, config: pathlib.Path, log: pathlib.Path, extra: list[str],
                 cgroup: pathlib.Path | None = None) -> None:
        self.repo = repo
        self.address = f"127.0.0.1:{free_port()}"
        metrics_port = free_port()
        self.metrics = f"http://127.0.0.1:{metrics_port}/metrics"  # observes only: what the prefix cache served
        self._log = open(log, "wb")
        host, port = self.address.split(":")
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(repo)}
        env.pop("XLA_FLAGS", None)
        self.proc = subprocess.Popen([sys.executable, "-m", "model_service", "--config", str(config), "--random-init",
                                      "--host", host, "--port", port, "--metrics-port",
                                      str(metrics_port), *extra], cwd=repo, env=env,
                                     stdout=self._log, stderr=subprocess.STDOUT,
                                     preexec_fn=None if cgroup is None else lambda: join_cgroup(cgroup))
        self.start_seconds = round(wait_started(self.proc, self.address, repo, log), 1)

    def cached_tokens(self) -> int:
        """Prompt tokens the service's prefix cache has served so far."""
        with urllib.request.urlopen(self.metrics, timeout=10) as page:
            for line in page.read().decode().splitlines():
                if line.startswith(CACHE_HITS + " "):
                    return int(float(line.split()[1]))
        return 0

    def close(self) -> None:
        terminate(self.proc, 30.0)
        self._log.close()


def join_cgroup(directory: pathlib.Path) -> None:
    """Move the calling process into the cgroup `directory` (v2 cgroup.procs, v1 tasks)."""
    procs = directory / "cgroup.procs"
    (procs if procs.exists() else directory / "tasks").write_text(str(os.getpid()))


def speed(service: Service, streams: int, tokens: int, greedy: bool) -> dict[str, Any]:
    """One run of the acceptance client against `service`, with the box's load around it and the prompt tokens
    the prefix cache served (speed.py's prompts repeat from one invocation to the next, so from the second on the
    cache serves each prompt's first block: a time to first token is then that of the prompt's tail)."""
    cached = service.cached_tokens()
    watch = box.CpuWatch()
    watch.start()
    run = subprocess.run([sys.executable, str(SPEED), service.address, str(streams), str(tokens)]
                         + (["greedy"] if greedy else []), capture_output=True, text=True, timeout=3600,
                         env={**os.environ, "PYTHONPATH": str(service.repo)})
    shared = watch.stop()
    if run.returncode != 0:
        raise RuntimeError(f"speed.py failed: {run.stderr[-2000:]}")
    return {**json.loads(run.stdout.strip().splitlines()[-1]), "prompt_tokens_from_cache":
            service.cached_tokens() - cached, "box": shared.as_dict() if shared else None}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.as_user", description=__doc__.splitlines()[0])
    p.add_argument("--repo", action="append", default=[], metavar="LABEL=DIR")
    p.add_argument("--config", type=pathlib.Path, default=MEDIUM)
    p.add_argument("--streams", default="1,8")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--greedy", action="store_true")
    p.add_argument("--flags", default="", help="extra model-service flags for every arm (default: none)")
    p.add_argument("--llamacpp", type=pathlib.Path, default=None, metavar="DIR")
    p.add_argument("--cgroup", type=pathlib.Path, default=None, metavar="DIR",
                   help="start each arm's service in this cgroup (e.g. one with a CPU limit, as a container's --cpus "
                        "sets; needs write access to it); llama.cpp and the client stay outside")
    p.add_argument("--out", type=pathlib.Path, default=None)
    args = p.parse_args(argv)
    arms = dict(spec.split("=", 1) for spec in args.repo) or {"now": str(ROOT)}
    streams = [int(s) for s in args.streams.split(",")]
    runs: dict[str, dict[int, list[dict[str, Any]]]] = {label: {s: [] for s in streams} for label in arms}
    anchor: dict[str, list[dict[str, Any]]] = {"ll1": [], "ll8": []}
    machine = {"cpus": os.cpu_count(), "cgroup_cpu_limit": cpu_quota(),
               "load_avg_at_start": [round(x, 2) for x in os.getloadavg()]}
    report: dict[str, Any] = {"machine": machine, "config": str(args.config), "tokens": args.tokens,
                              "mode": "greedy" if args.greedy else "sampled", "flags": args.flags,
                              "cgroup": None if args.cgroup is None else str(args.cgroup),
                              "arms": {label: str(pathlib.Path(d).resolve()) for label, d in arms.items()}}
    services: dict[str, Service] = {}
    with tempfile.TemporaryDirectory() as tmp:
        try:
            for label, repo in arms.items():
                services[label] = Service(pathlib.Path(repo).resolve(), args.config, pathlib.Path(tmp) / f"{label}.log",
                                          shlex.split(args.flags), args.cgroup)
            for service in services.values():
                speed(service, 1, 4, args.greedy)  # the first request's connection and warm-up, unmeasured
            for _ in range(args.runs):
                for s in streams:
                    for label, service in services.items():  # alternating: a change of load hits both alike
                        runs[label][s].append(speed(service, s, args.tokens, args.greedy))
                if args.llamacpp is not None:
                    for mode in anchor:
                        anchor[mode].append(llamacpp_run(args.llamacpp, mode, args.config))
        finally:
            for service in services.values():
                service.close()
    report["machine"]["load_avg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    report["start_seconds"] = {label: s.start_seconds for label, s in services.items()}
    report["points"] = {}
    for s in streams:
        point: dict[str, Any] = {}
        for label in arms:
            rs = runs[label][s]
            point[label] = {"aggregate_tok_s": statistics.median(r["aggregate_tok_s"] for r in rs),
                            "per_stream_tok_s_median": statistics.median(r["per_stream_tok_s_median"] for r in rs),
                            "ttft_p50_s": statistics.median(r["ttft_p50_s"] for r in rs), "runs": rs}
        mode = "ll1" if s == 1 else "ll8"
        if anchor[mode]:
            ll = statistics.median(a["step_tok_s"] for a in anchor[mode])
            prompt_s = statistics.median(a["prompt_ms"] for a in anchor[mode]) / 1e3
            point["llamacpp"] = {"decode_tok_s": ll, "prompt_s": prompt_s, "runs": anchor[mode]}
            for label in arms:
                point[label]["over_llamacpp"] = round(point[label]["aggregate_tok_s"] / ll, 3)
                point[label]["ttft_over_llamacpp_prompt"] = round(point[label]["ttft_p50_s"] / prompt_s, 3)
        report["points"][f"streams{s}"] = point
    print_report(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
