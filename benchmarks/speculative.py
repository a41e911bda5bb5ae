"""Speculative decoding on and off, alternating, on model services started as a user would; prints JSON.

    .venv/bin/python -m benchmarks.speculative [--runs 3] [--spec '{"method": "ngram", ...}']

Two workloads, one stream each (greedy; decode tokens/s after the first token; the token ids of both arms
compared):
    quote   the demo model, a paragraph of its corpus followed by the paragraph's first words: the answer quotes
            the prompt, so lookups find drafts (the case speculation is for);
    medium  the medium config's random weights, random 32-token prompts: nothing to look up (what speculation
            must not slow down).
Reported per workload: tokens/s on and off, their ratio, the acceptance rate (the final message's timings),
and whether every run's tokens were identical.
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
import time
from typing import Any

import grpc

from benchmarks import box
from benchmarks.engine import MEDIUM, ModelService
from grok.model.v1 import model_pb2, model_pb2_grpc

ROOT = pathlib.Path(__file__).resolve().parent.parent
SPEC = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'


def quote_prompts(count: int) -> list[list[int]]:
    """Corpus paragraphs, each followed by a blank line and its first eight words, as demo token ids."""
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_file=str(ROOT / "demo" / "tokenizer.model"))
    paragraphs = [p for f in sorted((ROOT / "demo_build" / "corpus").glob("0*.txt"))
                  for p in f.read_text().split("\n\n") if len(p.split()) > 60]
    rng = random.Random(3)
    return [sp.encode(p + "\n\n" + " ".join(p.split()[:8])) for p in rng.sample(paragraphs, count)]


def one_stream(address: str, prompt: list[int], tokens: int) -> dict[str, Any]:
    with grpc.insecure_channel(address) as channel:
        stub = model_pb2_grpc.ModelServiceStub(channel)
        ids, stamps, timings = [], [], None
        for r in stub.Generate(model_pb2.GenerateRequest(token_ids=prompt, max_tokens=tokens, ignore_eos=True),
                               timeout=3600):
            ids += r.token_ids
            stamps.append(time.monotonic())
            if r.HasField("timings"):
                timings = r.timings
    rate = (len(ids) - 1) / (stamps[-1] - stamps[0]) if len(stamps) > 1 else 0.0
    return {"ids": ids, "tokens_per_s": round(rate, 2), "messages": len(stamps),
            "acceptance": round(timings.draft_acceptance_rate, 3) if timings else None}


def workload(name: str, config: pathlib.Path, checkpoint: pathlib.Path | None, prompts: list[list[int]],
             tokens: int, args: argparse.Namespace, tmp: pathlib.Path) -> dict[str, Any]:
    arms = {"off": [], "on": ["--speculative-config", args.spec]}
    services = {}
    try:
        for label, arm_flags in arms.items():
            cache = tmp / f"{name}-{label}"
            cache.mkdir()
            services[label] = ModelService(ROOT, config, 1, 32, str(cache), tmp / f"{name}-{label}.log", arm_flags,
                                           checkpoint)
        for service in services.values():
            one_stream(service.address, prompts[0][:32], 4)  # connect outside the measurement
        runs: dict[str, list[dict[str, Any]]] = {label: [] for label in arms}
        watch = box.CpuWatch()
        watch.start()
        for r in range(args.runs):
            for prompt in prompts:
                for label, service in services.items():  # alternating: a change of load hits both alike
                    runs[label].append(one_stream(service.address, prompt, tokens))
        shared = watch.stop()
    finally:
        for service in services.values():
            service.close()
    on, off = (statistics.median(x["tokens_per_s"] for x in runs[k]) for k in ("on", "off"))
    return {"tokens_per_s_on": on, "tokens_per_s_off": off, "on_over_off": round(on / off, 3),
            "acceptance_median": statistics.median(x["acceptance"] or 0.0 for x in runs["on"]),
            "messages_on": sum(x["messages"] for x in runs["on"]), "messages_off": sum(x["messages"] for x in runs["off"]),
            "identical_tokens": all(a["ids"] == b["ids"] for a, b in zip(runs["on"], runs["off"])),
            "load_avg_1m": round(os.getloadavg()[0], 2), "box": shared.as_dict() if shared else None}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.speculative", description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--spec", default=SPEC, help="the --speculative-config of the `on` arm")
    p.add_argument("--out", type=pathlib.Path, default=None)
    args = p.parse_args(argv)
    out: dict[str, Any] = {"spec": json.loads(args.spec)}
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = pathlib.Path(tmp_dir)
        out["quote"] = workload("quote", ROOT / "configs" / "demo.json", ROOT / "demo" / "checkpoint", quote_prompts(3),
                                96, args, tmp)
        print(json.dumps({"quote": {k: v for k, v in out["quote"].items() if k != "box"}}), file=sys.stderr)
        rng = random.Random(9)
        prompts = [[rng.randrange(3, 131072) for _ in range(32)] for _ in range(2)]
        out["medium"] = workload("medium", MEDIUM, None, prompts, 96, args, tmp)
    text = json.dumps(out, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
