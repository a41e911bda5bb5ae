"""The gateway's own Python per generated token, without gRPC or a model: JSON on stdout.

    python -m benchmarks.pipeline_cost [--streams 64] [--tokens 256] [--runs 5] [--stop STR] [--logprobs N]

Drives `GatewayServicer.Generate` (validation, the pipeline, local detokenization over the real tokenizer's
piece table, stop matching, the read-ahead buffer, metrics) for `--streams` concurrent requests in one event
loop. Each request's model replies come from a replay replica, one token a reply as a decode step sends them,
every stream advancing one token a round (as a step's news reaches every request), ids taken from the encoded
text of this file so that the text is real. What it measures is the CPU of the event loop's thread per token
(`time.thread_time`), which is what bounds the gateway's tokens per second once a device decodes faster than
its one thread can relay: the gRPC write of each message (the other half, in gRPC's C core) is not in it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import pathlib
import statistics
import sys
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from benchmarks import results
from gateway.config import GatewayConfig, Limits
from gateway.metrics import GatewayMetrics
from gateway.pipeline import Pipeline
from gateway.servicer import GatewayServicer
from grok.gateway.v1 import gateway_pb2
from grok.model.v1 import model_pb2

DEFAULT_TOKENIZER = pathlib.Path(__file__).resolve().parents[1] / "demo" / "tokenizer.model"


class Round:
    """Releases every stream's next reply at once, as a decode step's news reaches every request."""

    def __init__(self) -> None:
        self.event = asyncio.Event()

    async def next(self) -> None:
        await self.event.wait()

    def tick(self) -> None:
        self.event.set()
        self.event = asyncio.Event()


class ReplayStream:
    """A model stream whose replies are `ids`, one a round, the last with its finish reason."""

    class Replica:
        address = "replay"

    replica = Replica()

    def __init__(self, ids: Sequence[int], prompt_tokens: int, rounds: Round, probabilities: int) -> None:
        self.ids, self.prompt_tokens, self.rounds, self.probabilities = ids, prompt_tokens, rounds, probabilities

    async def responses(self) -> AsyncIterator[model_pb2.GenerateResponse]:
        for count, token in enumerate(self.ids, 1):
            await self.rounds.next()
            reply = model_pb2.GenerateResponse(token_ids=[token], prompt_tokens=self.prompt_tokens,
                                               completion_tokens=count)
            if self.probabilities:
                reply.tokens.add(id=token, probability=0.5, logprob=-0.69, top_tokens=[
                    model_pb2.TopToken(id=(token + k) % 1000 + 3, probability=0.1, logprob=-2.3)
                    for k in range(self.probabilities)])
            if count == len(self.ids):
                reply.finish_reason = model_pb2.FINISH_REASON_LENGTH
            yield reply

    async def drain(self) -> None:
        return None

    def close(self) -> None:
        return None


class ReplayPool:
    """The model pool's surface the pipeline uses, answering from `ids`."""

    def __init__(self, ids: Sequence[int], vocab: int, rounds: Round, probabilities: int) -> None:
        self.ids, self.rounds, self.probabilities = ids, rounds, probabilities
        self._info = model_pb2.GetInfoResponse()
        self._info.config.vocab_size, self._info.config.sequence_len = vocab, 1 << 20

    async def info(self, deadline: float | None) -> model_pb2.GetInfoResponse:
        return self._info

    async def generate(self, request: model_pb2.GenerateRequest, deadline: float | None,
                       metadata: Any = ()) -> ReplayStream:
        return ReplayStream(self.ids[:request.max_tokens], len(request.token_ids), self.rounds, self.probabilities)


class LocalTokenizer:
    """The tokenizer client's surface the pipeline uses, answered in-process by the real tokenizer."""

    def __init__(self, path: pathlib.Path) -> None:
        from tokenizer_service.tokenizer import Tokenizer

        self.tokenizer = Tokenizer(path)
        self.table = self.tokenizer.piece_table()

    async def encode(self, text: str, deadline: float | None, metadata: Any = ()) -> list[int]:
        return list(self.tokenizer.encode(text))

    async def piece_table(self, deadline: float | None) -> Any:
        return self.table


class Context:
    def time_remaining(self) -> float:
        return 3600.0


async def one_run(servicer: GatewayServicer, rounds: Round, streams: int, tokens: int,
                  sampling: gateway_pb2.SamplingParams) -> dict[str, float]:
    request = gateway_pb2.GenerateRequest(prompt="In the beginning", sampling=sampling)
    request.sampling.max_tokens = tokens
    received = [0] * streams

    async def client(i: int) -> None:
        async for message in servicer.Generate(request, Context()):
            received[i] += len(message.tokens)

    tasks = [asyncio.create_task(client(i)) for i in range(streams)]
    await asyncio.sleep(0.05)  # every request reached its model stream
    cpu, wall = time.thread_time(), time.perf_counter()
    while not all(t.done() for t in tasks):
        rounds.tick()
        await asyncio.sleep(0)
        await asyncio.sleep(0)
    cpu, wall = time.thread_time() - cpu, time.perf_counter() - wall
    await asyncio.gather(*tasks)
    total = sum(received)
    if total != streams * tokens:
        raise RuntimeError(f"{total} tokens arrived, {streams * tokens} were sent")
    return {"tokens": total, "cpu_us_per_token": cpu * 1e6 / total, "wall_us_per_token": wall * 1e6 / total}


def run(streams: int, tokens: int, runs: int, stop: Sequence[str], logprobs: int,
        tokenizer_path: pathlib.Path) -> dict[str, Any]:
    tokenizer = LocalTokenizer(tokenizer_path)
    text = pathlib.Path(__file__).read_text() * 8
    ids = list(tokenizer.tokenizer.encode(text))[:tokens]
    if len(ids) < tokens:
        raise SystemExit(f"--tokens {tokens}: this file encodes to only {len(ids)} tokens")

    async def main() -> list[dict[str, float]]:
        rounds = Round()
        pool = ReplayPool(ids, tokenizer.table.vocab_size, rounds, logprobs)
        pipeline = Pipeline(tokenizer, pool, Limits(), GatewayMetrics(),  # type: ignore[arg-type]
                            local_detokenize=True)
        servicer = GatewayServicer(pipeline, GatewayConfig(tokenizer="local", models=("replay",)))
        sampling = gateway_pb2.SamplingParams(stop=list(stop), ignore_eos=True)
        if logprobs:
            sampling.logprobs, sampling.top_logprobs = True, logprobs
        await one_run(servicer, rounds, streams, min(tokens, 16), sampling)  # warm-up
        return [await one_run(servicer, rounds, streams, tokens, sampling) for _ in range(runs)]

    measured = asyncio.run(main())
    cpu = [m["cpu_us_per_token"] for m in measured]
    return {"benchmark": "pipeline_cost", **results.provenance(),
            "config": {"streams": streams, "tokens": tokens, "runs": runs, "stop": list(stop),
                       "logprobs": logprobs, "tokenizer": str(tokenizer_path)},
            "cpu_us_per_token_median": round(statistics.median(cpu), 2),
            "cpu_us_per_token": [round(c, 2) for c in cpu],
            "wall_us_per_token": [round(m["wall_us_per_token"], 2) for m in measured]}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--streams", type=int, default=64, help="concurrent requests (default 64)")
    p.add_argument("--tokens", type=int, default=256, help="tokens per request (default 256)")
    p.add_argument("--runs", type=int, default=5, help="runs; the median is reported (default 5)")
    p.add_argument("--stop", action="append", default=[], help="a stop sequence (repeatable; none by default)")
    p.add_argument("--logprobs", type=int, default=0, help="top_logprobs asked for (0: ids and text only)")
    p.add_argument("--tokenizer", type=pathlib.Path, default=DEFAULT_TOKENIZER, help="SentencePiece model")
    args = p.parse_args(argv)
    json.dump(run(args.streams, args.tokens, args.runs, args.stop, args.logprobs, args.tokenizer), sys.stdout)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
