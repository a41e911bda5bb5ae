"""KV memory benchmark: what a configured context costs, how many sequences a pool holds, and what a cached
prefix saves; prints JSON.

Each point starts the real model service (`python -m model_service`, random int8 weights, float32, one
device, the medium config with `sequence_len` set per point) and streams from it over gRPC, 32-token
prompts and 128 generated tokens unless said otherwise (sampled: temperature 0.7, top_p 0.9, EOS ignored):

    streams8_ctx256     8 simultaneous streams, 8 slots, context 256
    streams8_ctx8192    the same at context 8192 (Grok-1's): the paged step reads what the sequences hold
    streams64_ctx8192   64 simultaneous streams on 64 slots with a pool of 8 full contexts (--kv-tokens
                        65536): aggregate tokens/s, whether all 64 decoded at once (every first token before
                        any stream's last) and the preemptions counted
    prefix1024_ctx8192  one request after another, each a 1,024-token prefix + a 32-token suffix: first
                        token time with the prefix new (uncached) and with it computed before (cached)

--repo LABEL=DIR adds another checkout (e.g. the code before paging, in a worktree) for the points it can
run; measurements alternate between the arms in rounds. Ratios are computed within this one invocation.

    .venv/bin/python -m benchmarks.paged --repo before=/work/before --out benchmarks/measured/paged.json
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import re
import statistics
import sys
import tempfile
import time
import urllib.request
from typing import Any

import grpc

from benchmarks import box
from benchmarks.engine import MEDIUM, ModelService, measure, stream
from grok.model.v1 import model_pb2_grpc
from tests.procs import free_port

ROOT = pathlib.Path(__file__).resolve().parent.parent
# name: (context, slots, streams, service flags, only on this checkout)
POINTS: dict[str, tuple[int, int, int, list[str], bool]] = {
    "streams8_ctx256": (256, 8, 8, [], False),
    "streams8_ctx8192": (8192, 8, 8, [], False),
    "streams64_ctx8192": (8192, 64, 64, ["--kv-tokens", "65536"], True),
    "prefix1024_ctx8192": (8192, 8, 1, [], True),
}


def config_for(context: int, directory: pathlib.Path) -> pathlib.Path:
    path = directory / f"medium_ctx{context}.json"
    path.write_text(json.dumps({**json.loads(MEDIUM.read_text()), "sequence_len": context}))
    return path


def metric(port: int, name: str) -> float:
    """A counter's value from the service's /metrics (0 when absent)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    found = re.findall(rf"^{name}(?:_total)? ([0-9.e+]+)$", text, re.M)
    return float(found[0]) if found else 0.0


def all_at_once(address: str, streams: int, args: argparse.Namespace, run: int) -> dict[str, Any]:
    """`measure` for many streams, plus whether they all decoded at the same time."""
    stamps: list[dict[str, float]] = []
    original = stream

    def recording(*a: Any, **k: Any) -> dict[str, float]:
        out = original(*a, **k)
        stamps.append(out)
        return out

    import benchmarks.engine as engine_bench

    engine_bench.stream = recording
    try:
        result = measure(address, streams, args, 131072, "sampled", run)
    finally:
        engine_bench.stream = original
    measured = [s for s in stamps if s["tokens"] > 2]
    result["all_decoding_at_once"] = max(s["first"] for s in measured) < min(s["end"] for s in measured)
    return result


def prefix_ttft(address: str, args: argparse.Namespace, run: int) -> dict[str, Any]:
    """First-token times of a request with a new 1,024-token prefix, then of one sharing it (cached)."""
    rng = random.Random(77 + run)
    prefix = [rng.randrange(3, 131072) for _ in range(1024)]
    suffix = lambda: [rng.randrange(3, 131072) for _ in range(32)]  # noqa: E731
    watch = box.CpuWatch()
    watch.start()
    with grpc.insecure_channel(address) as channel:
        stub = model_pb2_grpc.ModelServiceStub(channel)
        stream(stub, suffix(), 2, 0, "sampled")  # connect outside the measurement
        first = stream(stub, prefix + suffix(), 8, 1, "sampled")
        again = stream(stub, prefix + suffix(), 8, 2, "sampled")
    shared = watch.stop()
    uncached, cached = first["first"] - first["start"], again["first"] - again["start"]
    return {"ttft_uncached_s": round(uncached, 4), "ttft_cached_s": round(cached, 4),
            "cached_over_uncached": round(cached / uncached, 3), "load_avg_1m": round(os.getloadavg()[0], 2),
            "box": shared.as_dict() if shared else None}


def run_point(name: str, arms: dict[str, pathlib.Path], args: argparse.Namespace, tmp: pathlib.Path) -> dict:
    context, slots, streams, flags, ours_only = POINTS[name]
    config = config_for(context, tmp)
    services: dict[str, tuple[ModelService, int]] = {}
    runs: dict[str, list[dict]] = {}
    try:
        for label, repo in arms.items():
            if ours_only and repo != ROOT:
                continue
            metrics_port = free_port()
            extra = flags + (["--metrics-port", str(metrics_port)] if repo == ROOT else [])
            services[label] = (ModelService(repo, config, slots, args.prompt_len, str(tmp / f"cache_{label}"),
                                            tmp / f"{label}_{name}.log", extra), metrics_port)
            runs[label] = []
        for r in range(args.runs):
            for label, (service, _) in services.items():
                if name.startswith("prefix"):
                    runs[label].append(prefix_ttft(service.address, args, r))
                elif streams > 8:
                    runs[label].append(all_at_once(service.address, streams, args, r))
                else:
                    runs[label].append(measure(service.address, streams, args, 131072, "sampled", r))
        out: dict[str, Any] = {"context": context, "slots": slots, "streams": streams, "flags": flags}
        for label, (service, port) in services.items():
            rs = runs[label]
            result: dict[str, Any] = {"start_seconds": round(service.start_seconds, 1), "runs": rs}
            if name.startswith("prefix"):
                result["median_cached_over_uncached"] = statistics.median(x["cached_over_uncached"] for x in rs)
            else:
                result["median_decode_tokens_per_s"] = statistics.median(x["decode_tokens_per_s"] for x in rs)
            if arms[label] == ROOT:
                result["preemptions"] = metric(port, "grok_model_num_preemptions")
                result["prefix_cache_hits"] = metric(port, "grok_model_prefix_cache_hits")
            out[label] = result
    finally:
        for service, _ in services.values():
            service.close()
    print(json.dumps({name: {k: v.get("median_decode_tokens_per_s", v.get("median_cached_over_uncached"))
                             for k, v in out.items() if isinstance(v, dict)}}), file=sys.stderr, flush=True)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--points", default=",".join(POINTS), help=f"comma-separated subset of {list(POINTS)}")
    p.add_argument("--runs", type=int, default=2, help="measurements per point and arm (medians reported)")
    p.add_argument("--tokens", type=int, default=128, help="tokens generated per request")
    p.add_argument("--prompt-len", type=int, default=32, help="prompt tokens per request")
    p.add_argument("--repo", action="append", default=[], metavar="LABEL=DIR", help="another checkout to compare")
    p.add_argument("--out", type=pathlib.Path, default=None, help="also write the JSON report here")
    args = p.parse_args()
    arms = {"paged": ROOT, **{r.split("=", 1)[0]: pathlib.Path(r.split("=", 1)[1]).resolve() for r in args.repo}}
    report: dict[str, Any] = {
        "machine": {"cpus": os.cpu_count(), "load_avg_at_start": [round(x, 2) for x in os.getloadavg()]},
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "settings": {"config": str(MEDIUM), "tokens": args.tokens, "prompt_len": args.prompt_len, "runs": args.runs,
                     "sampled": {"temperature": 0.7, "top_p": 0.9}},
        "arms": {k: str(v) for k, v in arms.items()}, "points": {}}
    with tempfile.TemporaryDirectory(prefix="paged-bench-") as tmp:
        for name in args.points.split(","):
            report["points"][name] = run_point(name, arms, args, pathlib.Path(tmp))
    pts = report["points"]
    summary: dict[str, Any] = {}
    for label in arms:
        short, long_ = pts.get("streams8_ctx256", {}).get(label), pts.get("streams8_ctx8192", {}).get(label)
        if short and long_:
            summary[f"{label}_ctx8192_over_ctx256"] = round(long_["median_decode_tokens_per_s"]
                                                            / short["median_decode_tokens_per_s"], 3)
    if "before" in arms and "streams8_ctx256" in pts and "before" in pts["streams8_ctx256"]:
        summary["ctx256_paged_over_before"] = round(pts["streams8_ctx256"]["paged"]["median_decode_tokens_per_s"]
                                                    / pts["streams8_ctx256"]["before"]["median_decode_tokens_per_s"], 3)
    report["summary"] = summary
    report["machine"]["load_avg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
