"""Engine benchmark: decode tokens/s at 1, 4, 8, 16 concurrent requests, time to first token, and
time to SERVING cold and with a warm compile cache, for the golden and the medium configs -> JSON.

Each configuration runs the real service (`python -m model_service`) as a subprocess and drives it
over gRPC, so the numbers include the scheduler, the servicer and streaming:

    .venv/bin/python bench/bench_engine.py --matched 1,8 --out /tmp/engine_results.json
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import statistics
import sys
import tempfile
import threading
import time
from typing import Any

import grpc

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from grok.model.v1 import model_pb2, model_pb2_grpc  # noqa: E402
from tests.procs import GOLDEN, SHARED, Service, free_port  # noqa: E402

CONFIGS = {
    "golden": {"config": str(GOLDEN / "config.json"), "weights": ["--checkpoint", str(GOLDEN / "checkpoint")]},
    "medium": {"config": str(SHARED / "bench" / "medium.json"), "weights": ["--random-init"]},
}


def start(name: str, slots: int, cache: str, extra: list[str]) -> tuple[Service, float]:
    """Start the service and return it with its seconds from launch to SERVING."""
    port = free_port()
    spec = CONFIGS[name]
    begin = time.monotonic()
    svc = Service("model_service", ["--config", spec["config"], *spec["weights"], "--host", "127.0.0.1",
                                    "--port", str(port), "--slots", str(slots), "--mesh", "1,1",
                                    "--compile-cache", cache, "--max-queue", "256", *extra], port,
                  env={"XLA_FLAGS": os.environ.get("BENCH_XLA_FLAGS", "")})
    svc.wait_serving(timeout=1800)
    return svc, time.monotonic() - begin


def startup_phases(svc: Service) -> dict[str, float]:
    out = {}
    for r in svc.log_records():
        if r.get("msg") == "weights ready":
            out["weights_seconds"] = r["seconds"]
        if r.get("msg") == "compiled all programs":
            out["compile_seconds"] = r["seconds"]
    return out


def one_request(stub: Any, prompt: list[int], tokens: int, seed: int, sampled: bool) -> dict[str, Any]:
    request = model_pb2.GenerateRequest(token_ids=prompt, max_tokens=tokens, seed=seed, ignore_eos=True,
                                        temperature=0.7 if sampled else 0.0)
    if sampled:
        request.top_p = 0.9
    begin = time.monotonic()
    stamps, count = [], 0
    for response in stub.Generate(request, timeout=3600):
        count += len(response.token_ids)
        stamps.append(time.monotonic())
    return {"start": begin, "first": stamps[0], "end": stamps[-1], "tokens": count}


def load_test(address: str, concurrency: int, tokens: int, prompt_len: int, vocab: int, sampled: bool) -> dict:
    rng = random.Random(concurrency)
    prompts = [[rng.randrange(3, vocab) for _ in range(prompt_len)] for _ in range(concurrency)]
    results: list[dict[str, Any]] = [{}] * concurrency
    with grpc.insecure_channel(address) as channel:
        stub = model_pb2_grpc.ModelServiceStub(channel)
        one_request(stub, prompts[0], 4, 0, sampled)  # warm the connection

        def run(i: int) -> None:
            results[i] = one_request(stub, prompts[i], tokens, i, sampled)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(concurrency)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    first = min(r["first"] for r in results)
    last = max(r["end"] for r in results)
    decoded = sum(r["tokens"] - 1 for r in results)
    ttft = [r["first"] - r["start"] for r in results]
    per_request = [(r["tokens"] - 1) / (r["end"] - r["first"]) for r in results if r["end"] > r["first"]]
    return {"concurrency": concurrency, "tokens_per_request": tokens, "sampled": sampled,
            "aggregate_decode_tokens_per_s": round(decoded / (last - first), 2),
            "mean_per_request_decode_tokens_per_s": round(statistics.mean(per_request), 2),
            "ttft_mean_s": round(statistics.mean(ttft), 4), "ttft_max_s": round(max(ttft), 4)}


def bench_config(name: str, args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {"config": name}
    vocab = json.loads(pathlib.Path(CONFIGS[name]["config"]).read_text())["vocab_size"]
    with tempfile.TemporaryDirectory() as cache:
        svc, cold = start(name, args.slots, cache, [])
        out["slots"] = args.slots
        out["time_to_serving_cold_s"] = round(cold, 2)
        out["cold_phases"] = startup_phases(svc)
        try:
            out["runs"] = [load_test(svc.address, c, args.tokens, args.prompt_len, vocab, s)
                           for s in (True, False) for c in args.concurrency]
        finally:
            svc.terminate()
        svc, warm = start(name, args.slots, cache, [])
        out["time_to_serving_warm_cache_s"] = round(warm, 2)
        out["warm_phases"] = startup_phases(svc)
        svc.terminate()
        out["matched_slot_runs"] = []
        for n in args.matched:  # an n-slot service at n concurrent requests: no idle slots computed
            svc, _ = start(name, n, cache, [])
            try:
                out["matched_slot_runs"] += [dict(load_test(svc.address, n, args.tokens, args.prompt_len, vocab, s),
                                                  slots=n) for s in (True, False)]
            finally:
                svc.terminate()
    print(json.dumps(out), file=sys.stderr, flush=True)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default="golden,medium", help="comma-separated: golden, medium")
    p.add_argument("--slots", type=int, default=16, help="service slots (>= the largest concurrency)")
    p.add_argument("--concurrency", default="1,4,8,16", help="concurrent requests per measurement")
    p.add_argument("--tokens", type=int, default=32, help="tokens generated per request")
    p.add_argument("--prompt-len", type=int, default=16, help="prompt tokens per request")
    p.add_argument("--matched", default="", help="also measure N requests on an N-slot service, e.g. 1,8")
    p.add_argument("--out", default=None, help="also write the JSON report to this path")
    args = p.parse_args()
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    args.matched = [int(c) for c in args.matched.split(",") if c]
    report = {"machine": {"cpus": os.cpu_count(), "load_avg_at_start": os.getloadavg()},
              "results": [bench_config(n, args) for n in args.configs.split(",")]}
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
