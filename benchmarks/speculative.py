"""Speculative decoding on and off, alternating, on model services started as a user would; prints JSON.

    .venv/bin/python -m benchmarks.speculative [--runs 3] [--spec '{"method": "ngram", ...}']

Three workloads (--workloads), one stream each (greedy; decode tokens/s after the first token; the token ids of both arms
compared):
    quote   the demo model, whose training text it knows by heart: the prompt is a corpus paragraph and then the
            paragraph before it in the corpus, each ending in end-of-text, so the model answers with the paragraph that
            follows, which the prompt already holds; lookups find drafts (the case speculation is for). Each answer
            is as long as the paragraph it quotes;
    continue the demo model: a corpus paragraph, end-of-text, and its first 8 tokens again; the answer asked for is
            the rest of the paragraph, which the prompt holds;
    medium  the medium config's random weights, random 32-token prompts: nothing to look up (what speculation
            must not slow down).
Reported per workload: tokens/s on and off (the median request's, and all tokens over all decode time), their
ratios, the acceptance rate (the final message's timings), and whether every run's tokens were identical; and the
same rates again under `quoting` for the requests whose answer (speculation off) occurs in their prompt token for
token, the case speculation is for (the demo model drifts into other text in some of them).
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
from benchmarks.engine import MEDIUM, ModelService, print_report
from grok.model.v1 import model_pb2, model_pb2_grpc

ROOT = pathlib.Path(__file__).resolve().parent.parent
SPEC = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'


def quote_prompts(count: int | None = None, context: int = 256) -> list[tuple[list[int], int]]:
    """(prompt, max_tokens) pairs on the demo model: paragraph i + 1 of its training text, end-of-text, paragraph i,
    end-of-text; the answer asked for is paragraph i + 1 again, so it must fit the context beside the prompt.
    Every prose paragraph of at least 40 tokens, or `count` of them drawn with a fixed seed (not the dialogues:
    many open with the same system line, so the one before does not tell which comes next)."""
    import sentencepiece

    from demo_build.data import corpus_documents, split_paragraphs
    from demo_build.train_tokenizer import corpus_lines

    sp = sentencepiece.SentencePieceProcessor(model_file=str(ROOT / "demo" / "tokenizer.model"))
    training = json.loads((ROOT / "demo" / "training.json").read_text())["train_config"]
    train, _ = split_paragraphs(list(corpus_documents(ROOT / "demo_build" / "corpus")), training["holdout_every"])
    prose = set(corpus_lines(ROOT / "demo_build" / "corpus"))
    ids = [sp.encode(text) for text in train]
    pairs = [(ids[i + 1] + [sp.eos_id()] + ids[i] + [sp.eos_id()], len(ids[i + 1]))
             for i in range(len(ids) - 1) if train[i] in prose and train[i + 1] in prose
             and len(ids[i + 1]) >= 40 and len(ids[i]) + 2 * len(ids[i + 1]) + 2 <= context]
    return pairs if count is None else random.Random(3).sample(pairs, count)


def continue_prompts(words: int = 8, context: int = 256) -> list[tuple[list[int], int]]:
    """(prompt, max_tokens) pairs on the demo model: a prose paragraph of its training text, end-of-text, and the
    paragraph's first `words` tokens again; the answer asked for is the rest of the paragraph (the prompt's own
    text continued, as a user quoting a document asks for its continuation)."""
    import sentencepiece

    from demo_build.data import corpus_documents, split_paragraphs
    from demo_build.train_tokenizer import corpus_lines

    sp = sentencepiece.SentencePieceProcessor(model_file=str(ROOT / "demo" / "tokenizer.model"))
    training = json.loads((ROOT / "demo" / "training.json").read_text())["train_config"]
    train, _ = split_paragraphs(list(corpus_documents(ROOT / "demo_build" / "corpus")), training["holdout_every"])
    prose = set(corpus_lines(ROOT / "demo_build" / "corpus"))
    out = []
    for text in train:
        ids = sp.encode(text)
        if text in prose and len(ids) >= 40 and 2 * len(ids) + 1 <= context:
            out.append((ids + [sp.eos_id()] + ids[:words], len(ids) - words))
    return out


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
            "decode_seconds": stamps[-1] - stamps[0] if stamps else 0.0,
            "acceptance": round(timings.draft_acceptance_rate, 3) if timings else None}


def workload(name: str, config: pathlib.Path, checkpoint: pathlib.Path | None,
             prompts: list[tuple[list[int], int]], args: argparse.Namespace, tmp: pathlib.Path) -> dict[str, Any]:
    """`prompts` are (token ids, max_tokens) pairs."""
    arms = {"off": [], "on": ["--speculative-config", args.spec]}
    services = {}
    try:
        for label, arm_flags in arms.items():
            cache = tmp / f"{name}-{label}"
            cache.mkdir()
            services[label] = ModelService(ROOT, config, 1, 32, str(cache), tmp / f"{name}-{label}.log", arm_flags,
                                           checkpoint)
        for service in services.values():
            one_stream(service.address, prompts[0][0][:32], 4)  # connect and compile outside the measurement
        runs: dict[str, list[dict[str, Any]]] = {label: [] for label in arms}
        watch = box.CpuWatch()
        watch.start()
        for r in range(args.runs):
            for prompt, tokens in prompts:
                for label, service in services.items():  # alternating: a change of load hits both alike
                    runs[label].append(one_stream(service.address, prompt, tokens))
        shared = watch.stop()
    finally:
        for service in services.values():
            service.close()
    out = rates(runs, len(prompts))
    # The requests whose answer (speculation off) is text of their prompt, token for token: the case speculation
    # is for. The rest drift into text the prompt does not hold, which no lookup can draft.
    prompt_of = [prompt for _ in range(args.runs) for prompt, _ in prompts]
    quoting = [i for i, x in enumerate(runs["off"]) if quotes(x["ids"], prompt_of[i])]
    if quoting:
        out["quoting"] = rates({k: [runs[k][i] for i in quoting] for k in runs}, len({tuple(prompt_of[i])
                                                                                   for i in quoting}))
    out.update({"identical_tokens": all(a["ids"] == b["ids"] for a, b in zip(runs["on"], runs["off"])),
                "load_avg_1m": round(os.getloadavg()[0], 2), "box": shared.as_dict() if shared else None})
    return out


def quotes(answer: list[int], prompt: list[int]) -> bool:
    """Whether `answer` occurs in `prompt` as one contiguous run of tokens."""
    n = len(answer)
    return n > 0 and any(prompt[i:i + n] == answer for i in range(len(prompt) - n + 1))


def rates(runs: dict[str, list[dict[str, Any]]], requests: int) -> dict[str, Any]:
    """Tokens/s on and off (the median request's and all tokens over all decode time), acceptance, messages."""
    on, off = (statistics.median(x["tokens_per_s"] for x in runs[k]) for k in ("on", "off"))
    total = {k: sum(len(x["ids"]) - 1 for x in runs[k]) / sum(x["decode_seconds"] for x in runs[k]) for k in runs}
    return {"tokens_per_s_on": on, "tokens_per_s_off": off, "on_over_off": round(on / off, 3),
            "all_tokens_per_s_on": round(total["on"], 2), "all_tokens_per_s_off": round(total["off"], 2),
            "all_on_over_off": round(total["on"] / total["off"], 3), "requests": requests,
            "acceptance_median": statistics.median(x["acceptance"] or 0.0 for x in runs["on"]),
            "messages_on": sum(x["messages"] for x in runs["on"]),
            "messages_off": sum(x["messages"] for x in runs["off"])}


WORKLOADS = {"quote": quote_prompts, "continue": continue_prompts, "medium": None}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.speculative", description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--spec", default=SPEC, help="the --speculative-config of the `on` arm")
    p.add_argument("--out", type=pathlib.Path, default=None)
    p.add_argument("--workloads", default="quote,continue,medium", help="comma-separated, of " + ",".join(WORKLOADS))
    args = p.parse_args(argv)
    out: dict[str, Any] = {"spec": json.loads(args.spec)}
    demo = (ROOT / "demo" / "config.json", ROOT / "demo" / "checkpoint")
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = pathlib.Path(tmp_dir)
        for name in args.workloads.split(","):
            if name == "medium":
                rng = random.Random(9)
                prompts = [([rng.randrange(3, 131072) for _ in range(32)], 96) for _ in range(2)]
                out[name] = workload(name, MEDIUM, None, prompts, args, tmp)
            else:
                out[name] = workload(name, *demo, WORKLOADS[name](), args, tmp)
            print(json.dumps({name: {k: v for k, v in out[name].items() if k != "box"}}), file=sys.stderr)
    print_report(out, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
