"""A multi-process replica's decode step on CPU, by how many devices each process holds; prints JSON.

    .venv/bin/python -m benchmarks.group [--config DIR_OR_FILE] [--layouts 4:1,8 1:1,2] [--rounds 2]

Each layout `D:MESH` starts a two-process group as a user would (`python -m model_service --num-processes 2
--process-id 0|1 --mesh MESH`, each process given D CPU devices with XLA_FLAGS), waits for SERVING, and
times one greedy stream: milliseconds per token between an 8-token and a 40-token request of the same prompt
(the prompt and the first tokens cancel out). The layouts alternate for --rounds rounds; the greedy tokens
of every run must be the same. The golden checkpoint of ../shared is the default model.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import tempfile
import time
from typing import Any

import grpc

from benchmarks import box
from grok.model.v1 import model_pb2, model_pb2_grpc
from serving_common.processes import free_port, start_module, terminate, wait_serving

ROOT = pathlib.Path(__file__).resolve().parent.parent
GOLDEN = ROOT.parent / "shared" / "golden"
PROMPT = [1, 17, 92, 305, 44, 7, 260, 31]


def _generate(stub: Any, tokens: int) -> list[int]:
    request = model_pb2.GenerateRequest(token_ids=PROMPT, temperature=0.0, max_tokens=tokens, ignore_eos=True)
    return [t for reply in stub.Generate(request, timeout=600) for t in reply.token_ids]


def run_layout(devices: int, mesh: str, model: pathlib.Path, logs: pathlib.Path) -> dict[str, Any]:
    port, coordinator = free_port(), free_port()
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}",
           "GROK_MODEL_CONFIG": str(model / "config.json"), "GROK_MODEL_CHECKPOINT": str(model / "checkpoint"),
           "GROK_MODEL_TOKENIZER": str(model / "tokenizer.model"), "GROK_MODEL_MESH": mesh,
           "GROK_MODEL_COORDINATOR": f"127.0.0.1:{coordinator}", "GROK_MODEL_NUM_PROCESSES": "2"}
    procs = []
    for pid, args in ((0, ["--host", "127.0.0.1", "--port", str(port)]), (1, [])):
        log = open(logs / f"group-{devices}-{pid}-{port}.log", "wb")
        procs.append(start_module("model_service", [*args, "--process-id", str(pid)], stdout=log, cwd=ROOT, env=env))
    try:
        wait_serving(procs[0], f"127.0.0.1:{port}", 900, name="model_service")
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = model_pb2_grpc.ModelServiceStub(channel)
            _generate(stub, 4)  # the first request's own costs stay out of the timing
            began = time.monotonic()
            _generate(stub, 8)
            short = time.monotonic() - began
            began = time.monotonic()
            tokens = _generate(stub, 40)
            long = time.monotonic() - began
        return {"devices_per_process": devices, "mesh": mesh, "ms_per_token": round(1000 * (long - short) / 32, 1),
                "tokens": tokens}
    finally:
        for proc in procs:
            terminate(proc, 30)


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.group", description=__doc__.splitlines()[0])
    p.add_argument("--model", type=pathlib.Path, default=GOLDEN, help="a folder with config.json, checkpoint/ "
                   "and tokenizer.model (default: ../shared/golden)")
    p.add_argument("--layouts", nargs="+", default=["4:1,8", "1:1,2"], help="DEVICES_PER_PROCESS:MESH each")
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    logs = pathlib.Path(tempfile.mkdtemp(prefix="bench-group-"))
    watch = box.CpuWatch()
    watch.start()
    runs = []
    for _ in range(args.rounds):
        for layout in args.layouts:
            devices, mesh = layout.split(":")
            runs.append(run_layout(int(devices), mesh, args.model, logs))
    report = watch.stop()
    box.warn_if_busy(report, "benchmarks.group")
    points = {}
    for run in runs:
        points.setdefault(f"{run['devices_per_process']}:{run['mesh']}", []).append(run["ms_per_token"])
    print(json.dumps({"model": str(args.model), "logs": str(logs),
                      "ms_per_token": {k: {"runs": v, "median": round(statistics.median(v), 1)} for k, v in points.items()},
                      "same_tokens": len({tuple(r["tokens"]) for r in runs}) == 1,
                      "box": report.as_dict() if report else None}, indent=1))


if __name__ == "__main__":
    main()
