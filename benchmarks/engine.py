"""Model-service benchmark over gRPC at the points of the decode-speed issue; prints JSON.

Each point starts the real service (`python -m model_service`, random int8 weights, float32, one
device) as a subprocess and streams from it over gRPC, so the numbers include the scheduler, the
servicer and streaming. The points (32-token prompts, 128 generated tokens, EOS ignored; sampled =
temperature 0.7 top_p 0.9, greedy = temperature 0):

    slots1_stream1    one stream on a 1-slot service: decode tokens/s after its first token
    slots8_streams8   8 simultaneous streams on an 8-slot service: aggregate decode tokens/s, and the
                      time to first token of those 8 simultaneous prompts (p50, max)
    slots16_stream1   one stream on a 16-slot service (idle slots should cost next to nothing)

each sampled and greedy (and with --constraint-json a third mode, `json`: sampled as above and constrained
to JSON_SCHEMA, a JSON object with a 64-item array of strings, so the constrained rate comes beside the
plain one), repeated --runs times (medians reported, every run kept with the machine's load).
--repo runs the same points against other checkouts too (e.g. the code before a change, in a worktree of
its own): their services run side by side and the measurements alternate between them, all with this
interpreter:

    .venv/bin/python -m benchmarks.engine --runs 3 --repo before=/tmp/grok-before --repo after=. \\
        --out benchmarks/measured/engine.json

--arm LABEL=FLAGS adds this checkout with other model-service flags (e.g. `--arm xla='--products xla'
--arm native='--products native'`), and --llamacpp DIR runs llama.cpp on the same shapes (the CPU anchor in
../shared/bench/llamacpp: Q8_0 weights, 2 threads; the GGUF that run.sh DIR CONFIG wrote for --config) after
each round of the 1-stream and 8-stream points, and reports ours / llama.cpp per arm and mode. Every
measurement records the box (benchmarks.box), and every service its memory: resident at SERVING and its
peak (VmHWM) at SERVING and at the end, with the seconds it took to reach SERVING.

--grok1-width is the Grok-1-width point: ../shared/bench/grok1-width-1layer.json (every dimension of Grok-1,
one layer, ~8 GB of int8 experts), the 1-stream and 8-stream points, greedy (llama.cpp's mode), e.g.

    .venv/bin/python -m benchmarks.engine --grok1-width --runs 1 --repo before=WORKTREE --repo after=. \
        --llamacpp /work/llamacpp --out benchmarks/measured/engine-grok1-width.json

(each service is started alone, each round: one takes ~7-13 GB; run it alone on the box). --checkpoint DIR serves a checkpoint on disk instead of
random weights (`python -m demo_build.random_checkpoint --config CONFIG --out DIR` writes one).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import grpc

ROOT = pathlib.Path(__file__).resolve().parent.parent

from benchmarks import box
from grok.model.v1 import model_pb2, model_pb2_grpc
from serving_common.cpus import cpu_quota
from serving_common.healthcheck import check
from serving_common.processes import terminate
from tests.procs import SHARED, free_port

MEDIUM = SHARED / "bench" / "medium.json"
GROK1_WIDTH = SHARED / "bench" / "grok1-width-1layer.json"
GROK1_TOKENIZER = SHARED / "grok1-tokenizer" / "tokenizer.model"
# The --constraint-json mode's schema: long enough that a 128-token request stays inside it.
JSON_SCHEMA = json.dumps({"type": "object", "required": ["items"], "properties": {"items": {
    "type": "array", "minItems": 64, "items": {"type": "string", "maxLength": 16}}}})
# name: (slots, streams, extra service flags)
POINTS: dict[str, tuple[int, int, list[str]]] = {
    "slots1_stream1": (1, 1, []), "slots8_streams8": (8, 8, []), "slots16_stream1": (16, 1, [])}


def wait_started(proc: subprocess.Popen, address: str, repo: pathlib.Path, log: pathlib.Path) -> float:
    """Seconds until the model service `proc` at `address` reports SERVING (RuntimeError if it exits or takes
    over 30 minutes)."""
    begin = time.monotonic()
    while not check(address, "", timeout=1.0):
        if proc.poll() is not None or time.monotonic() - begin > 1800:
            raise RuntimeError(f"model service from {repo} did not start: see {log}")
        time.sleep(0.2)
    return time.monotonic() - begin


def print_report(report: Any, out: pathlib.Path | None) -> None:
    """The report as indented JSON on stdout, and in `out` when given."""
    text = json.dumps(report, indent=1)
    if out:
        out.write_text(text + "\n")
    print(text)


class ModelService:
    """`python -m model_service` from checkout `repo`, on a free port, with a shared compile cache."""

    def __init__(self, repo: pathlib.Path, config: pathlib.Path, slots: int, prompt_len: int, cache: str,
                 log: pathlib.Path, extra: list[str], checkpoint: pathlib.Path | None = None) -> None:
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self._log = open(log, "wb")
        weights = ["--checkpoint", str(checkpoint)] if checkpoint else ["--random-init"]
        args = ["--config", str(config), *weights, "--host", "127.0.0.1", "--port", str(self.port),
                "--slots", str(slots), "--mesh", "1,1", "--compile-cache", cache,
                "--max-queue", "64", *extra]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "XLA_FLAGS": os.environ.get("BENCH_XLA_FLAGS", ""),
               "PYTHONPATH": str(repo)}
        self.proc = subprocess.Popen([sys.executable, "-m", "model_service", *args], cwd=repo, env=env,
                                     stdout=self._log, stderr=subprocess.STDOUT)
        self.start_seconds = wait_started(self.proc, self.address, repo, log)
        self.memory_at_serving = self.memory()

    def memory(self) -> dict[str, float]:
        """The service's resident memory now and its peak so far (VmRSS, VmHWM), in GB."""
        fields = {}
        with open(f"/proc/{self.proc.pid}/status") as status:
            for line in status:
                name, _, value = line.partition(":")
                if name in ("VmRSS", "VmHWM"):
                    fields[name] = round(int(value.split()[0]) / 1e6, 3)  # kB -> GB
        return {"rss_gb": fields.get("VmRSS", 0.0), "peak_rss_gb": fields.get("VmHWM", 0.0)}

    def close(self) -> None:
        terminate(self.proc, 30.0)
        self._log.close()


def stream(stub: Any, prompt: list[int], tokens: int, seed: int, mode: str) -> dict[str, float]:
    request = model_pb2.GenerateRequest(token_ids=prompt, max_tokens=tokens, seed=seed, ignore_eos=True,
                                        temperature=0.0 if mode == "greedy" else 0.7)
    if mode != "greedy":
        request.top_p = 0.9
    if mode == "json":
        request.json_schema = JSON_SCHEMA
    begin = time.monotonic()
    stamps, count = [], 0
    for response in stub.Generate(request, timeout=3600):
        count += len(response.token_ids)
        stamps.append(time.monotonic())
    return {"start": begin, "first": stamps[0], "end": stamps[-1], "tokens": count}


def measure(address: str, streams: int, args: argparse.Namespace, vocab: int, mode: str, run: int) -> dict:
    """`streams` simultaneous requests (started together by a barrier); their decode rate and first tokens.

    Every request (the warm-up's too) has prompts of its own, drawn from the run, the stream count and the mode:
    the service's prefix cache (on by default) would otherwise serve a repeated prompt's first blocks, and its
    time to first token would be that of the prompt's tail, not of a whole prompt as llama.cpp's is."""
    rng = random.Random(f"{run}/{streams}/{mode}")
    warm, *prompts = [[rng.randrange(3, vocab) for _ in range(args.prompt_len)] for _ in range(streams + 1)]
    results: list[dict[str, float]] = [{} for _ in range(streams)]
    barrier = threading.Barrier(streams)
    with grpc.insecure_channel(address) as channel:
        stub = model_pb2_grpc.ModelServiceStub(channel)
        stream(stub, warm, 2, 0, mode)  # connect (and compile the constraint) outside the measurement

        def run_one(i: int) -> None:
            barrier.wait()
            results[i] = stream(stub, prompts[i], args.tokens, 7 * run + i, mode)

        watch = box.CpuWatch()
        watch.start()
        threads = [threading.Thread(target=run_one, args=(i,)) for i in range(streams)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    shared = watch.stop()
    box.warn_if_busy(shared, f"{streams} streams, run {run}")
    decoded = sum(r["tokens"] - 1 for r in results)
    span = max(r["end"] for r in results) - min(r["first"] for r in results)
    ttft = sorted(r["first"] - r["start"] for r in results)
    return {"decode_tokens_per_s": round(decoded / span, 2), "ttft_p50_s": round(statistics.median(ttft), 4),
            "ttft_max_s": round(ttft[-1], 4), "tokens": int(sum(r["tokens"] for r in results)),
            "load_avg_1m": round(os.getloadavg()[0], 2), "box": shared.as_dict() if shared else None}


def supports(repo: pathlib.Path, flags: list[str]) -> bool:
    if not flags:
        return True
    help_text = subprocess.run([sys.executable, "-m", "model_service", "--help"], cwd=repo, capture_output=True,
                               text=True, env={**os.environ, "PYTHONPATH": str(repo)}).stdout
    return flags[0] in help_text


def bench_point(name: str, arms: dict[str, tuple[pathlib.Path, list[str]]], args: argparse.Namespace, vocab: int,
                cache_dir: pathlib.Path) -> dict[str, Any]:
    """Every arm's service is started (an idle one costs no CPU), then the runs alternate between them (and
    llama.cpp's matching mode, with --llamacpp), so a change in the machine's load hits all of them alike.
    With --one-service each round starts each arm's service alone, measures it and stops it (for configs
    whose services do not fit in memory together); every start is then measured too."""
    slots, streams, extra = POINTS[name]
    modes = tuple(args.modes) + (("json",) if args.constraint_json else ())
    service_flags = extra + (["--tokenizer", str(args.tokenizer)] if args.constraint_json else [])
    out: dict[str, Any] = {"slots": slots, "streams": streams, "flags": extra}
    runnable = {}
    for label, (repo, flags) in arms.items():
        if supports(repo, extra + flags):
            runnable[label] = (repo, flags)
        else:
            out[label] = {"skipped": f"{repo} has no {(extra + flags)[0]} flag"}
    anchor_mode = ANCHOR_MODES.get(name) if args.llamacpp else None
    anchor: list[dict[str, Any]] = []
    runs: dict[tuple[str, str], list[dict]] = {(label, mode): [] for label in runnable for mode in modes}
    starts: dict[str, list[dict[str, Any]]] = {label: [] for label in runnable}

    def start(label: str) -> ModelService:
        repo, flags = runnable[label]
        (cache_dir / label).mkdir(exist_ok=True)
        return ModelService(repo, args.config, slots, args.prompt_len, str(cache_dir / label),
                            cache_dir / f"{label}_{name}.log", service_flags + flags, args.checkpoint)

    def measured(label: str, service: ModelService, r: int) -> None:
        for mode in modes:
            runs[label, mode].append(measure(service.address, streams, args, vocab, mode, r))

    def stopped(label: str, service: ModelService) -> None:
        starts[label].append({"start_seconds": round(service.start_seconds, 1),
                              "memory_at_serving": service.memory_at_serving, "memory_at_end": service.memory()})
        service.close()

    services: dict[str, ModelService] = {}
    try:
        if not args.one_service:
            services = {label: start(label) for label in runnable}
        for r in range(args.runs):
            for label in runnable:
                if args.one_service:
                    services = {label: start(label)}
                measured(label, services[label], r)
                if args.one_service:
                    stopped(label, services.pop(label))
            if anchor_mode:
                anchor.append(llamacpp_run(args.llamacpp, anchor_mode, args.config))
    finally:
        for label, service in services.items():
            stopped(label, service)
    for label in runnable:
        out[label] = _summary(runs, label, modes, starts[label])
        print(json.dumps({name: {label: {m: out[label][m]["median_decode_tokens_per_s"] for m in modes}}}),
              file=sys.stderr, flush=True)
    if anchor:
        out["llamacpp"] = beside_llamacpp(anchor, {label: out[label] for label in runnable}, args.modes)
        print(json.dumps({name: {"llamacpp": out["llamacpp"]["ratios"]}}), file=sys.stderr, flush=True)
    return out


def _summary(runs: dict[tuple[str, str], list[dict]], label: str, modes: tuple[str, ...],
             starts: list[dict[str, Any]]) -> dict[str, Any]:
    """One arm's medians per mode, with its starts (seconds to SERVING and memory of each service)."""
    result: dict[str, Any] = {"start_seconds": statistics.median(s["start_seconds"] for s in starts),
                              "peak_rss_gb": max(s["memory_at_end"]["peak_rss_gb"] for s in starts),
                              "rss_at_serving_gb": statistics.median(s["memory_at_serving"]["rss_gb"] for s in starts),
                              "starts": starts}
    for mode in modes:
        rs = runs[label, mode]
        result[mode] = {"median_decode_tokens_per_s": statistics.median(x["decode_tokens_per_s"] for x in rs),
                        "median_ttft_p50_s": statistics.median(x["ttft_p50_s"] for x in rs), "runs": rs}
    if "sampled" in modes and "greedy" in modes:
        result["sampled_over_greedy"] = round(result["sampled"]["median_decode_tokens_per_s"]
                                              / result["greedy"]["median_decode_tokens_per_s"], 3)
    if "json" in modes:
        result["json_over_sampled"] = round(result["json"]["median_decode_tokens_per_s"]
                                            / result["sampled"]["median_decode_tokens_per_s"], 3)
    return result


# Our point -> llama.cpp's bench.py mode with the same shapes (../shared/bench/llamacpp: S sequences, 32-token
# prompts, 128 tokens, 2 threads).
ANCHOR_MODES = {"slots1_stream1": "ll1", "slots8_streams8": "ll8"}


def llamacpp_gguf(directory: pathlib.Path, config: pathlib.Path) -> pathlib.Path:
    """The GGUF ../shared/bench/llamacpp/run.sh DIR [CONFIG] writes for `config` (medium: the pad32 one)."""
    if config.resolve() == MEDIUM.resolve():
        return directory / "grok-medium-pad32.gguf"
    return directory / f"{config.stem}.gguf"


def llamacpp_script(directory: pathlib.Path, config: pathlib.Path, script: pathlib.Path, args: list[str],
                    prefix: str = "") -> dict[str, Any]:
    """Run `script args` with the llama.cpp build's interpreter in `directory` (../shared/bench/llamacpp, no AMX
    buffers) on the GGUF of `config` (inserted before `args`), with the box's load around it: the JSON of its last
    output line starting with `prefix`."""
    python, model = directory / "venv" / "bin" / "python", llamacpp_gguf(directory, config)
    if not python.exists() or not model.exists():
        extra = "" if config.resolve() == MEDIUM.resolve() else f" {config}"
        raise FileNotFoundError(f"no llama.cpp build or GGUF in {directory}: run `bash {SHARED}/bench/llamacpp/run.sh "
                                f"{directory}{extra}` once (~7 min)")
    watch = box.CpuWatch()
    watch.start()
    run = subprocess.run([str(python), str(script), str(model), *args], capture_output=True, text=True, timeout=3600,
                         env={**os.environ, "NO_EXTRA": "1"})
    shared = watch.stop()
    lines = [line for line in run.stdout.splitlines() if line.startswith(prefix)]
    if run.returncode != 0 or not lines:
        raise RuntimeError(f"llama.cpp {script.name} {' '.join(args)} failed ({run.returncode}): {run.stderr[-2000:]}")
    return {**json.loads(lines[-1][len(prefix):]), "box": shared.as_dict() if shared else None}


def llamacpp_run(directory: pathlib.Path, mode: str, config: pathlib.Path = MEDIUM) -> dict[str, Any]:
    """One llama.cpp measurement (a warm-up repetition, then one) of `mode`, as ../shared/bench/llamacpp runs it."""
    return llamacpp_script(directory, config, SHARED / "bench" / "llamacpp" / "bench.py", ["2", mode, "1"], "MEDIAN ")


def beside_llamacpp(anchor: list[dict[str, Any]], ours: dict[str, Any],
                    modes: tuple[str, ...] = ("sampled", "greedy")) -> dict[str, Any]:
    """llama.cpp's medians and, per arm and mode, ours / llama.cpp for decode tok/s and first-token time."""
    decode = statistics.median(a["step_tok_s"] for a in anchor)  # llama_decode + batch fill + argmax
    prompt_s = statistics.median(a["prompt_ms"] for a in anchor) / 1e3
    ratios = {f"{label}_{mode}": {
        "decode_tokens_per_s_over_llamacpp": round(r[mode]["median_decode_tokens_per_s"] / decode, 3),
        "ttft_p50_over_llamacpp_prompt": round(r[mode]["median_ttft_p50_s"] / prompt_s, 3)}
        for label, r in ours.items() for mode in modes}
    return {"decode_tokens_per_s": decode, "prompt_s": prompt_s, "runs": anchor, "ratios": ratios}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", type=pathlib.Path, default=None, help="model config JSON (default: medium)")
    p.add_argument("--points", default=None, help=f"comma-separated subset of {list(POINTS)} (default: all)")
    p.add_argument("--modes", type=lambda v: tuple(v.split(",")), default=None,
                   help="comma-separated of sampled,greedy (default: both)")
    p.add_argument("--grok1-width", action="store_true",
                   help="the Grok-1-width point: its config, slots1_stream1,slots8_streams8, greedy (unless given)")
    p.add_argument("--one-service", action="store_true",
                   help="start one arm's service at a time, each round (default with --grok1-width)")
    p.add_argument("--checkpoint", type=pathlib.Path, default=None,
                   help="serve this checkpoint directory (ckpt-0/ inside) instead of random weights")
    p.add_argument("--runs", type=int, default=3, help="measurements per point and mode (medians reported)")
    p.add_argument("--tokens", type=int, default=128, help="tokens generated per request")
    p.add_argument("--prompt-len", type=int, default=32, help="prompt tokens per request")
    p.add_argument("--repo", action="append", default=[], metavar="LABEL=DIR",
                   help="checkout to benchmark (repeatable; default: this one, labelled 'current')")
    p.add_argument("--arm", action="append", default=[], metavar="LABEL=FLAGS",
                   help="this checkout with extra model-service flags, e.g. native='--products native' (repeatable)")
    p.add_argument("--llamacpp", type=pathlib.Path, default=None, metavar="DIR",
                   help="also run llama.cpp on the same shapes beside ours, alternating (DIR as "
                        "../shared/bench/llamacpp/run.sh DIR builds it)")
    p.add_argument("--out", type=pathlib.Path, default=None, help="also write the JSON report here")
    p.add_argument("--constraint-json", action="store_true",
                   help="also measure a JSON-schema-constrained mode (`json`; structured output)")
    p.add_argument("--tokenizer", type=pathlib.Path, default=GROK1_TOKENIZER,
                   help="SentencePiece file given to the service with --constraint-json (default: Grok-1's)")
    args = p.parse_args()
    wide = args.grok1_width
    args.config = args.config or (GROK1_WIDTH if wide else MEDIUM)
    args.points = args.points or ("slots1_stream1,slots8_streams8" if wide else ",".join(POINTS))
    args.modes = args.modes or (("greedy",) if wide else ("sampled", "greedy"))
    args.one_service = args.one_service or wide
    arms: dict[str, tuple[pathlib.Path, list[str]]] = {
        label: (pathlib.Path(d).resolve(), []) for label, d in (r.split("=", 1) for r in args.repo)}
    arms.update({label: (ROOT, shlex.split(flags)) for label, flags in (a.split("=", 1) for a in args.arm)})
    arms = arms or {"current": (ROOT, [])}
    vocab = json.loads(args.config.read_text())["vocab_size"]
    report: dict[str, Any] = {
        "machine": {"cpus": os.cpu_count(), "cgroup_cpu_limit": cpu_quota(),
                    "load_avg_at_start": [round(x, 2) for x in os.getloadavg()]},
        "settings": {"config": str(args.config), "tokens": args.tokens, "prompt_len": args.prompt_len,
                     "runs": args.runs, "modes": list(args.modes), "sampled": {"temperature": 0.7, "top_p": 0.9},
                     "checkpoint": str(args.checkpoint) if args.checkpoint else None,
                     "arms": {k: [str(repo), *flags] for k, (repo, flags) in arms.items()}},
        "points": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.points.split(","):
            report["points"][name] = bench_point(name, arms, args, vocab, pathlib.Path(tmp))
    report["machine"]["load_avg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    text = json.dumps(report, indent=1)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
