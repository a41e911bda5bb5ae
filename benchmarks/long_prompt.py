"""A long prompt entering beside running streams, on a model service started with default flags; prints JSON.

    .venv/bin/python -m benchmarks.long_prompt [--config ../shared/bench/medium.json] [--context 8192]
        [--prompt 6000] [--streams 7] [--repo LABEL=DIR ...]

The config is the given one with its context set to --context (random int8 weights, float32). --streams
streams (32-token prompts, greedy) decode on the default 8 slots; once each has 16 tokens, a --prompt-token
prompt is sent. Reported: the streams' inter-token gaps before it arrived (median) and while it was computed
(p50, p99, max, and p99 over the median before: the promise is <= 2), its time to first token and the prompt rows
a step took (its tokens over the steps, one gap of each stream a step); then, unless
--no-control, the same streams again without the long prompt over the same tokens of each (their gaps grow
with their length: the control's median is the fair denominator, `p99_over_control_median`); and whether a
prompt of exactly context - 1 tokens gets its token and one of context tokens a clear INVALID_ARGUMENT; last, a
new prompt of --prompt tokens on the idle service (`ttft_alone_s`). With --repo the same runs against other
checkouts (e.g. the code before a change; one that refuses the long prompt says so). With --llamacpp DIR,
llama.cpp (../shared/bench/llamacpp's build and GGUF, 2 threads, batches of 512) computes a prompt of that
length alone at the same context, after the arms: `alone_over_llamacpp` is ours over its time.
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

from benchmarks import box
from benchmarks.engine import MEDIUM, ModelService, llamacpp_script, print_report
from grok.model.v1 import model_pb2, model_pb2_grpc

ROOT = pathlib.Path(__file__).resolve().parent.parent


def generate(stub: Any, prompt: list[int], tokens: int, stamps: list[float] | None = None) -> list[int]:
    out: list[int] = []
    for response in stub.Generate(model_pb2.GenerateRequest(token_ids=prompt, max_tokens=tokens, ignore_eos=True),
                                  timeout=3600):
        out += response.token_ids
        if stamps is not None:
            stamps += [time.monotonic()] * len(response.token_ids)
    return out


def streams(stub: Any, prompts: list[list[int]], max_tokens: int, stamps: list[list[float]], stop: threading.Event,
            upto: list[int] | None = None) -> list[threading.Thread]:
    """One thread per prompt streaming its tokens' arrival times into `stamps`, until `stop` (or `upto[i]` tokens)."""
    def stream(i: int) -> None:
        request = model_pb2.GenerateRequest(token_ids=prompts[i], max_tokens=max_tokens, ignore_eos=True)
        call = stub.Generate(request, timeout=3600)
        for response in call:
            stamps[i] += [time.monotonic()] * len(response.token_ids)
            if stop.is_set() or (upto is not None and len(stamps[i]) >= upto[i]):
                call.cancel()
                return

    return [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(len(prompts))]


def control(stub: Any, prompts: list[list[int]], max_tokens: int, ranges: list[tuple[int, int]]) -> list[float]:
    """The same streams again with no long prompt, each up to the end of its range: the gaps between tokens
    lo..hi of stream i (what the streams' own length costs, without the prompt)."""
    stamps: list[list[float]] = [[] for _ in prompts]
    threads = streams(stub, prompts, max_tokens, stamps, threading.Event(), [hi + 1 for _, hi in ranges])
    for t in threads:
        t.start()
    for t in threads:
        t.join(3600)
    return [s[k + 1] - s[k] for s, (lo, hi) in zip(stamps, ranges) for k in range(lo, min(hi, len(s) - 1))]


def run(address: str, args: argparse.Namespace, vocab: int) -> dict[str, Any]:
    rng = random.Random(5)
    prompts = [[rng.randrange(3, vocab) for _ in range(32)] for _ in range(args.streams)]
    stamps: list[list[float]] = [[] for _ in range(args.streams)]
    stop = threading.Event()
    with grpc.insecure_channel(address) as channel:
        stub = model_pb2_grpc.ModelServiceStub(channel)
        generate(stub, [5] * 32, 2)  # warm the connection
        threads = streams(stub, prompts, args.context - 40, stamps, stop)
        for t in threads:
            t.start()
        while min(len(s) for s in stamps) < 16:
            time.sleep(0.05)
        long_prompt = [rng.randrange(3, vocab) for _ in range(args.prompt)]
        watch = box.CpuWatch()
        watch.start()
        sent = time.monotonic()
        try:
            first: list[float] = []
            generate(stub, long_prompt, 4, first)
        except grpc.RpcError as e:
            stop.set()
            return {"long_prompt": {"error": e.code().name, "details": e.details()}}
        shared = watch.stop()
        stop.set()
        for t in threads:
            t.join(60)
        # Which tokens of each stream arrived while the prompt was computed: the control run covers the same ones.
        ranges = [(next((k for k in range(len(s) - 1) if s[k] >= sent), 0),
                   max((k for k in range(len(s) - 1) if s[k + 1] <= first[0]), default=0)) for s in stamps]
        alone = control(stub, prompts, args.context - 40, ranges) if args.control else []
        edge = limits(stub, args.context, vocab)
        by_itself: list[float] = []  # a new prompt of the same length on the idle service (nothing cached)
        sent_alone = time.monotonic()
        generate(stub, [rng.randrange(3, vocab) for _ in range(args.prompt)], 1, by_itself)
    before = [b - a for s in stamps for a, b in zip(s, s[1:]) if b < sent]
    during = [b - a for s in stamps for a, b in zip(s, s[1:]) if sent <= a and b <= first[0]]
    median_before = statistics.median(before)
    q = statistics.quantiles(during, n=100) if len(during) > 1 else [during[0]] * 99
    out = {"long_prompt_tokens": args.prompt, "ttft_s": round(first[0] - sent, 3),
           "ttft_alone_s": round(by_itself[0] - sent_alone, 3),
           "gap_median_before_s": round(median_before, 4), "gaps_during": len(during),
           "gap_p50_during_s": round(statistics.median(during), 4), "gap_p99_during_s": round(q[98], 4),
           "gap_max_during_s": round(max(during), 4), "p99_over_median_before": round(q[98] / median_before, 3),
           # each step gives every stream one gap: the prompt's rows over the steps it took
           "prompt_rows_per_step": round(args.prompt * args.streams / max(len(during), 1), 2)}
    if len(alone) > 1:
        qa = statistics.quantiles(alone, n=100)
        out.update(control_tokens=[hi - lo for lo, hi in ranges], control_gap_median_s=round(statistics.median(alone), 4),
                   control_gap_p99_s=round(qa[98], 4),
                   p99_over_control_median=round(q[98] / statistics.median(alone), 3),
                   control_p99_over_control_median=round(qa[98] / statistics.median(alone), 3))
    return {**out, "edge": edge, "load_avg_1m": round(os.getloadavg()[0], 2), "box": shared.as_dict() if shared else None}


def limits(stub: Any, context: int, vocab: int) -> dict[str, Any]:
    """A prompt of context - 1 tokens gets its one token; one of context tokens is refused naming the limit."""
    out: dict[str, Any] = {}
    try:
        out["context_minus_1"] = {"tokens": len(generate(stub, [7 + i % (vocab - 10) for i in range(context - 1)], 1))}
    except grpc.RpcError as e:
        out["context_minus_1"] = {"error": e.code().name, "details": e.details()}
    try:
        generate(stub, [7] * context, 1)
        out["context"] = {"error": None}
    except grpc.RpcError as e:
        out["context"] = {"error": e.code().name, "details": e.details()}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.long_prompt", description=__doc__.splitlines()[0])
    p.add_argument("--config", type=pathlib.Path, default=MEDIUM)
    p.add_argument("--context", type=int, default=8192)
    p.add_argument("--prompt", type=int, default=6000)
    p.add_argument("--streams", type=int, default=7)
    p.add_argument("--no-control", dest="control", action="store_false",
                   help="skip the control run (the same streams over the same tokens with no long prompt)")
    p.add_argument("--repo", action="append", default=[], help="LABEL=DIR: another checkout to run too")
    p.add_argument("--llamacpp", type=pathlib.Path, default=None, metavar="DIR",
                   help="also time llama.cpp on the same prompt alone (the build and GGUF of "
                        "../shared/bench/llamacpp/run.sh DIR [CONFIG])")
    p.add_argument("--out", type=pathlib.Path, default=None)
    args = p.parse_args(argv)
    repos = {"now": ROOT, **{r.split("=", 1)[0]: pathlib.Path(r.split("=", 1)[1]).resolve() for r in args.repo}}
    cfg = json.loads(args.config.read_text())
    cfg["sequence_len"] = args.context
    results: dict[str, Any] = {"config": str(args.config), "context": args.context, "streams": args.streams}
    with tempfile.TemporaryDirectory() as tmp:
        config = pathlib.Path(tmp) / "config.json"
        config.write_text(json.dumps(cfg))
        for label, repo in repos.items():
            cache = pathlib.Path(tmp) / label
            cache.mkdir()
            service = ModelService(repo, config, 8, 32, str(cache), pathlib.Path(tmp) / f"{label}.log", [])
            try:
                results[label] = {"start_seconds": round(service.start_seconds, 1),
                                  **run(service.address, args, cfg["vocab_size"])}
            finally:
                service.close()
            print(json.dumps({label: results[label]}), file=sys.stderr, flush=True)
    if args.llamacpp is not None:
        results["llamacpp"] = llamacpp_prompt(args.llamacpp, args.config, args.prompt, args.context)
        for label in repos:
            if "ttft_alone_s" in results[label]:
                results[label]["alone_over_llamacpp"] = round(
                    results[label]["ttft_alone_s"] / results["llamacpp"]["seconds"], 3)
    print_report(results, args.out)
    return 0


def llamacpp_prompt(directory: pathlib.Path, config: pathlib.Path, tokens: int, context: int) -> dict[str, Any]:
    """llama.cpp's time for a prompt of `tokens` alone at `context` (benchmarks/llamacpp_prompt.py)."""
    return llamacpp_script(directory, config, ROOT / "benchmarks" / "llamacpp_prompt.py", [str(tokens), str(context)])


if __name__ == "__main__":
    sys.exit(main())
