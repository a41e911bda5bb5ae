"""Loading a checkpoint in the released format at Grok-1's widths onto an expert-parallel CPU mesh; prints JSON.

    .venv/bin/python -m benchmarks.load [--layers 2] [--dir /tmp/grok1-width-2layers] [--mesh 1,2,4]
        [--processes 1 2] [--serving] [--repo LABEL=DIR ...] [--out benchmarks/measured/load-grok1-width-2layers.json]

Writes (once; reused while its manifest is there) a random checkpoint with the widths of
../shared/bench/grok1-width-1layer.json and --layers layers (`python -m demo_build.random_checkpoint`: int8
experts of 6,144 x 32,768, 604 MB per expert per layer), after checking the disk has room. Then, for each count
in --processes, loads it with load_params as the service would (bfloat16, experts stacked), 8 CPU devices in all
(XLA_FLAGS=--xla_force_host_platform_device_count=8 / processes), every process of a group a separate
`jax.distributed` process. Each process reports:
  bytes_read / read_calls      the array reads of the checkpoint's files (file_arrays' preadv calls, counted)
  rchar / syscr                the kernel's count of everything this process read (/proc/self/io), pickle
                               opcodes included
  seconds                      load_params, to every array ready (cpu_seconds: this process's CPU time in it,
                               user and system, less sensitive to other work on the box)
  peak_over_baseline           peak RSS (VmHWM, reset just before loading) minus the RSS before loading
  kept                         bytes of every array shard the process's devices hold
  kept_distinct                the same counting each host buffer once (JAX's CPU client aliases the host
                               memory it is given, so the CPU devices holding one shard's replicas may share
                               it); ratio = peak_over_baseline / kept_distinct
With --repo the same loads run against other checkouts' model_service (e.g. --repo before=/tmp/old), labelled
runs beside this one's ("now").
--serving starts `python -m model_service` (one process, the same mesh) and adds the seconds from its start to
SERVING on its health service (load and compile) and its peak RSS by then.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import shutil
import subprocess
import sys
import time
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parent.parent
WIDTHS = ROOT.parent / "shared" / "bench" / "grok1-width-1layer.json"
PROCESS = pathlib.Path(__file__).resolve().with_name("load_process.py")
DEVICES = 8


def write_config(layers: int, directory: pathlib.Path) -> pathlib.Path:
    config = json.loads(WIDTHS.read_text())
    config["model"]["num_layers"] = layers
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "config.json"
    path.write_text(json.dumps(config, indent=1))
    return path


def checkpoint_bytes(config: pathlib.Path) -> int:
    from model_service.config import load_model_config
    from model_service.model.params import tensor_specs

    specs = tensor_specs(load_model_config(str(config)))
    return sum(math.prod(s.shape) * (1 if s.quantized else 2 if "in_out_embed" in s.module else 4)
               + (math.prod(s.scales_shape) * 2 if s.quantized else 0) for s in specs)


def ensure_checkpoint(config: pathlib.Path, directory: pathlib.Path) -> dict[str, Any]:
    """Write the random checkpoint unless a complete one is there; its size and the seconds writing took."""
    size = checkpoint_bytes(config)
    written = 0.0
    if not (directory / "manifest.json").is_file():
        free = shutil.disk_usage(directory).free
        if free < size * 1.1:
            raise SystemExit(f"{directory}: {free / 1e9:.1f} GB free, the checkpoint needs {size / 1e9:.1f} GB")
        began = time.monotonic()
        subprocess.run([sys.executable, "-m", "demo_build.random_checkpoint", "--config", str(config), "--out",
                        str(directory)], cwd=ROOT, check=True)
        written = time.monotonic() - began
    return {"dir": str(directory), "bytes": size, "write_seconds": round(written, 1)}


def run_group(config: pathlib.Path, directory: pathlib.Path, mesh: str, processes: int,
              repo: pathlib.Path = ROOT) -> list[dict[str, Any]]:
    """Load in `processes` processes at once, with `repo`'s model_service; each one's report."""
    from serving_common.processes import free_port

    coordinator = f"127.0.0.1:{free_port()}"
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": f"--xla_force_host_platform_device_count={DEVICES // processes}"}
    # run as a file from `repo` (sys.path[0] is then `repo`, not benchmarks/), so `repo`'s model_service loads
    run = f"import runpy; runpy.run_path({str(PROCESS)!r}, run_name='__main__')"
    procs = [subprocess.Popen([sys.executable, "-c", run, "--config", str(config), "--checkpoint", str(directory),
                               "--mesh", mesh, "--processes", str(processes), "--process-id", str(p),
                               "--coordinator", coordinator],
                              cwd=repo, env=env, stdout=subprocess.PIPE, text=True) for p in range(processes)]
    reports = []
    for proc in procs:
        out, _ = proc.communicate(timeout=1800)
        if proc.returncode:
            raise SystemExit(f"a loading process exited with {proc.returncode}")
        reports.append(json.loads(out.strip().splitlines()[-1]))
    return reports


def time_to_serving(config: pathlib.Path, directory: pathlib.Path, mesh: str, log: pathlib.Path) -> dict[str, Any]:
    """Seconds from starting the service to SERVING, and its peak RSS by then (weights, compiled programs)."""
    from serving_common.processes import free_port, start_module, terminate, wait_serving

    port = free_port()
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": f"--xla_force_host_platform_device_count={DEVICES}"}
    with open(log, "wb") as out:
        began = time.monotonic()
        proc = start_module("model_service", ["--config", str(config), "--checkpoint", str(directory), "--mesh", mesh,
                                              "--dtype", "bfloat16", "--port", str(port)], stdout=out, cwd=ROOT,
                            env=env)
        try:
            wait_serving(proc, f"127.0.0.1:{port}", 1800, name="model_service",
                         log_tail=lambda: log.read_text(errors="replace")[-4000:])
            seconds = time.monotonic() - began
            from benchmarks.load_process import proc_fields

            peak = proc_fields(f"/proc/{proc.pid}/status", ("VmHWM",))["VmHWM"]
            return {"seconds_to_serving": round(seconds, 1), "peak_rss": peak}
        finally:
            terminate(proc, 60)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--dir", type=pathlib.Path, default=None, help="default /tmp/grok1-width-<layers>layers")
    parser.add_argument("--mesh", default="1,2,4", help="DATA,EXPERT,MODEL over 8 CPU devices")
    parser.add_argument("--processes", type=int, nargs="*", default=[1, 2],
                        help="the group sizes to load with (none: only --serving)")
    parser.add_argument("--serving", action="store_true", help="also time `python -m model_service` to SERVING")
    parser.add_argument("--repo", nargs="*", default=[], help="LABEL=DIR: also load with that checkout's code")
    parser.add_argument("--out", type=pathlib.Path, default=None, help="also write the JSON here")
    args = parser.parse_args(argv)
    directory = args.dir or pathlib.Path(f"/tmp/grok1-width-{args.layers}layers")
    config = write_config(args.layers, directory)
    result: dict[str, Any] = {"config": json.loads(config.read_text())["model"], "mesh": args.mesh,
                              "dtype": "bfloat16", "checkpoint": ensure_checkpoint(config, directory), "runs": []}
    repos = [("now", ROOT)] + [(label, pathlib.Path(d).resolve()) for label, _, d in
                               (r.partition("=") for r in args.repo)]
    for processes in args.processes:
        for label, repo in repos:
            reports = run_group(config, directory, args.mesh, processes, repo)
            result["runs"].append({"code": label, "processes": processes, "per_process": reports})
            print(json.dumps(result["runs"][-1]), file=sys.stderr)
    if args.serving:
        try:
            result["serving"] = {"processes": 1, **time_to_serving(config, directory, args.mesh,
                                                                     directory / "model_service.log")}
        except (RuntimeError, TimeoutError) as e:  # e.g. killed for memory: the loads' numbers still count
            result["serving"] = {"processes": 1, "error": str(e).splitlines()[0]}
    result["load_average"] = os.getloadavg()
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
