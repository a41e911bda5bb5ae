"""The model servicer's own Python per token on its event loop, without gRPC: CPU ms per token of the loop thread.

    python -m benchmarks.loop_cost --path many --requests 64 --tokens 32 --rounds 8

`--requests` requests of `--tokens` tokens each run at once over the scheduler and a fake engine (tests/engine/
fake_engine.py: no model compute), through GenerateMany's path (`many`: ManyStream, the relay writing each step's
tokens into the stream's next message) or Generate's (`call`: each request's response generator, one response per
step). The loop thread's CPU time (time.thread_time, so a busy machine changes it little) over the tokens
received is what the servicer's Python costs per token on the loop: what benchmarks.layers' `model_service_loop`
column holds less grpc.aio's own per-message work. The first round is a warm-up; the median of the others is
reported. Two source trees compare by running this with PYTHONPATH at each.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from collections.abc import AsyncIterator, Sequence

from opentelemetry import trace

from grok.model.v1 import model_pb2
from model_service.many import ManyStream
from model_service.metrics import Metrics
from model_service.scheduler import Scheduler
from model_service.servicer import ModelServicer
from tests.engine.fake_engine import FakeEngine


def request(i: int, tokens: int, ids_only: bool) -> model_pb2.GenerateRequest:
    return model_pb2.GenerateRequest(token_ids=[20 + i % 5, 21], max_tokens=tokens, ignore_eos=True,
                                     ids_only=ids_only)


async def many(servicer: ModelServicer, requests: int, tokens: int) -> int:
    """Tokens received through one GenerateMany stream (ids only, as the gateway asks)."""
    stream = ManyStream(servicer._one, asyncio.Event())

    async def starts() -> AsyncIterator[model_pb2.GenerateManyRequest]:
        for i in range(requests):
            yield model_pb2.GenerateManyRequest(start=model_pb2.StartRequest(id=i, request=request(i, tokens, True)))
        await asyncio.Event().wait()  # the client stays connected

    received = ended = 0
    messages = stream.messages(starts())
    async for message in messages:
        for update in message.updates:
            received += sum(len(r.token_ids) for r in update.responses)
            ended += update.ended
        if ended == requests:
            break
    await messages.aclose()
    return received


async def calls(servicer: ModelServicer, requests: int, tokens: int) -> int:
    """Tokens received from one response generator per request (Generate's path, with each token's details)."""
    async def one(i: int) -> int:
        responses = servicer._generate(request(i, tokens, False), None, f"r{i}", trace.INVALID_SPAN)
        return sum([len(r.token_ids) async for r in responses])
    return sum(await asyncio.gather(*(one(i) for i in range(requests))))


def measure(path: str, requests: int, tokens: int, rounds: int) -> dict[str, object]:
    engine = FakeEngine(slots=requests, sequence_len=tokens + 8, max_rows=2 * requests + 8,
                        num_blocks=requests * (tokens + 8), vocab_size=4096)
    scheduler = Scheduler(engine, max_queue=requests)
    scheduler.start()
    servicer = ModelServicer(model_pb2.GetInfoResponse(), Metrics())
    servicer.attach(scheduler)
    per_token: list[float] = []
    try:
        for _ in range(rounds):
            began = time.thread_time()
            received = asyncio.run((many if path == "many" else calls)(servicer, requests, tokens))
            if received != requests * tokens:
                raise RuntimeError(f"received {received} tokens, expected {requests * tokens}")
            per_token.append((time.thread_time() - began) * 1e3 / received)
    finally:
        scheduler.stop()
    kept = per_token[1:] or per_token
    return {"path": path, "requests": requests, "tokens": tokens, "rounds": rounds,
            "loop_cpu_ms_per_token": statistics.median(kept), "per_round": per_token}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.loop_cost", description=__doc__.split("\n\n")[0])
    p.add_argument("--path", choices=("many", "call"), default="many", help="GenerateMany's path or Generate's")
    p.add_argument("--requests", type=int, default=64, help="requests at once (the fake engine's slots)")
    p.add_argument("--tokens", type=int, default=32, help="tokens per request")
    p.add_argument("--rounds", type=int, default=8, help="rounds; the first is a warm-up")
    args = p.parse_args(argv)
    print(json.dumps(measure(args.path, args.requests, args.tokens, args.rounds)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
