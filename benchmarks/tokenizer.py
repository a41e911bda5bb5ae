"""Tokenizer service throughput: Encode and streaming decode (DecodeStream) over gRPC, tokens/s.

    python -m benchmarks.tokenizer --tokenizer ../shared/grok1-tokenizer/tokenizer.model

Encode sends texts cut from the project's corpus (each --encode-tokens tokens) from --concurrency
callers; DecodeStream pushes token ids one per message (as the gateway does, one model step at a
time) on --concurrency streams and waits for each reply. The same work done with SentencePiece in
this process is reported beside it, so the service's own overhead is visible.
"""

from __future__ import annotations

import asyncio
import json
import pathlib
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import grpc
import numpy as np

from benchmarks import results
from benchmarks.stack import SHARED, Process
from benchmarks.workload import PromptCutter
from grok.tokenizer.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from serving_common.flags import EnvArgumentParser, positive_int


async def encode_load(stub: Any, texts: list[str], concurrency: int) -> tuple[float, list[float], int]:
    """Wall seconds, per-call latencies and tokens for encoding every text with `concurrency` callers."""
    queue = list(texts)
    latencies: list[float] = []
    tokens = 0

    async def worker() -> None:
        nonlocal tokens
        while queue:
            text = queue.pop()
            start = time.perf_counter()
            reply = await stub.Encode(tokenizer_pb2.EncodeRequest(text=text), timeout=60)
            latencies.append(time.perf_counter() - start)
            tokens += len(reply.token_ids)

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return time.perf_counter() - start, latencies, tokens


async def decode_stream_load(stub: Any, streams: list[list[int]]) -> tuple[float, list[float], int]:
    """Every stream pushes its ids one per message on its own DecodeStream call, all concurrently."""
    latencies: list[float] = []

    async def one(ids: list[int]) -> None:
        call = stub.DecodeStream(timeout=600)
        for token in ids:
            start = time.perf_counter()
            await call.write(tokenizer_pb2.DecodeStreamRequest(token_ids=[token]))
            await call.read()
            latencies.append(time.perf_counter() - start)
        await call.done_writing()
        await call.read()

    start = time.perf_counter()
    await asyncio.gather(*(one(ids) for ids in streams))
    return time.perf_counter() - start, latencies, sum(len(s) for s in streams)


def local_rates(cutter: PromptCutter, texts: list[str], streams: list[list[int]]) -> dict[str, float]:
    """The same encode and one-token-at-a-time decode with SentencePiece in this process."""
    start = time.perf_counter()
    tokens = sum(len(cutter.sp.encode(t)) for t in texts)
    encode_s = time.perf_counter() - start
    start = time.perf_counter()
    for ids in streams:
        for i in range(1, len(ids) + 1):  # what a naive incremental detokenizer would decode per token
            cutter.sp.decode(ids[max(0, i - 8):i])
    decode_s = time.perf_counter() - start
    return {"encode_tokens_per_s": tokens / encode_s, "decode_window8_tokens_per_s": sum(map(len, streams)) / decode_s}


def summary(wall: float, latencies: list[float], tokens: int) -> dict[str, float]:
    return {"tokens": tokens, "seconds": wall, "tokens_per_s": tokens / wall, "calls": len(latencies),
            "latency_p50_ms": statistics.median(latencies) * 1e3,
            "latency_p99_ms": float(np.percentile(latencies, 99)) * 1e3}


async def measure(address: str, texts: list[str], streams: list[list[int]], concurrency: int,
                  runs: int) -> dict[str, list[dict[str, float]]]:
    out: dict[str, list[dict[str, float]]] = {"encode": [], "decode_stream": []}
    async with grpc.aio.insecure_channel(address) as channel:
        stub = tokenizer_pb2_grpc.TokenizerServiceStub(channel)
        await encode_load(stub, texts[:4], 2)  # warm-up
        await decode_stream_load(stub, [s[:4] for s in streams[:2]])
        for _ in range(runs):
            out["encode"].append(summary(*await encode_load(stub, texts, concurrency)))
            out["decode_stream"].append(summary(*await decode_stream_load(stub, streams)))
    return out


def run(tokenizer: str, concurrency: int, encode_tokens: int, texts_n: int, stream_tokens: int,
        runs: int) -> dict[str, Any]:
    cutter = PromptCutter(tokenizer)
    rng = np.random.default_rng(0)
    texts = [cutter.cut(encode_tokens, rng)[0] for _ in range(texts_n)]
    streams = [list(cutter.cut(stream_tokens, rng)[1]) for _ in range(concurrency)]
    service = Process("tokenizer_service", ["--model", tokenizer], pathlib.Path(tempfile.mkdtemp(prefix="bench-logs-")))
    try:
        service.wait_serving(120)
        measured = asyncio.run(measure(service.address, texts, streams, concurrency, runs))
    finally:
        service.stop()
    medians = {kind: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for kind, rs in measured.items()}
    return {"benchmark": "tokenizer", "tokenizer": tokenizer, "concurrency": concurrency,
            "encode_text_tokens": encode_tokens, "stream_tokens": stream_tokens, "runs": measured,
            "median": medians, "in_process": local_rates(cutter, texts, streams), **results.provenance()}


def main(argv: Sequence[str] | None = None) -> int:
    p = EnvArgumentParser(env_prefix="GROK_BENCH", prog="python -m benchmarks.tokenizer",
                          description=__doc__.split("\n\n")[0])
    p.add_env_argument("--tokenizer", default=str(SHARED / "grok1-tokenizer" / "tokenizer.model"),
                       help="SentencePiece model the service loads")
    p.add_env_argument("--concurrency", type=positive_int, default=8, help="concurrent callers / streams")
    p.add_env_argument("--encode-tokens", type=positive_int, default=256, help="tokens per encoded text")
    p.add_env_argument("--texts", type=positive_int, default=64, help="texts encoded per run")
    p.add_env_argument("--stream-tokens", type=positive_int, default=256, help="tokens pushed per decode stream")
    p.add_env_argument("--runs", type=positive_int, default=3, help="runs (median reported)")
    p.add_env_argument("--out", default=None, help="also write the JSON here")
    args = p.parse_args(argv)
    report = run(args.tokenizer, args.concurrency, args.encode_tokens, args.texts, args.stream_tokens, args.runs)
    if args.out:
        results.write_json(pathlib.Path(args.out), report)
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
