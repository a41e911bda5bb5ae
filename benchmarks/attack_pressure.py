"""KV pressure: requests at the edges of the context and the KV pool, bursts over the slots and the queue,
cancels and deadlines mid-request. Each must end OK or with a status a client can act on (RESOURCE_EXHAUSTED
saying to retry, INVALID_ARGUMENT naming the field, DEADLINE_EXCEEDED), and repeated prompts, which the
prefix cache serves, must give the tokens the first computation gave."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc

from benchmarks.attack_cases import INVALID, Case, Facts, model_request, text_request
from grok.gateway.v1 import gateway_pb2
from grok.model.v1 import model_pb2
from serving_common.limits import MAX_SAMPLES


def _ids(responses: list[model_pb2.GenerateResponse]) -> list[int]:
    return [i for r in responses for i in r.token_ids]


def burst(call: Callable[[Any], Any], count: int) -> Callable[[Any], Any]:
    """`count` calls at once: each ends OK or RESOURCE_EXHAUSTED with a retry hint, at least two OK (the slots)."""
    def run(t: Any) -> Any:
        def one() -> str:
            try:
                call(t)
                return "OK"
            except grpc.RpcError as error:
                if error.code() is grpc.StatusCode.RESOURCE_EXHAUSTED and "retry" in (error.details() or ""):
                    return "RETRY"
                return f"{error.code().name}: {error.details()}"
        with ThreadPoolExecutor(count) as pool:
            outcomes = list(pool.map(lambda _: one(), range(count)))
        wrong = [o for o in outcomes if o not in ("OK", "RETRY")]
        if wrong or outcomes.count("OK") < 2:
            raise AssertionError(f"burst outcomes: {sorted(set(outcomes))}")
        return outcomes
    return run


def same_every_time(call: Callable[[Any], Any], times: int) -> Callable[[Any], Any]:
    """The same greedy request `times` times in a row (the later ones from the prefix cache): equal tokens."""
    def run(t: Any) -> Any:
        answers = [_ids(call(t)) for _ in range(times)]
        if any(a != answers[0] for a in answers):
            raise AssertionError(f"repeated prompt gave different tokens: {answers}")
        return answers
    return run


def cancelled_then_served(f: Facts) -> Callable[[Any], Any]:
    """A long request cancelled after its first message; then a plain request is served."""
    long = model_request(f, token_ids=[5] * f.bucket, max_tokens=f.context - f.bucket)
    plain = model_request(f)

    def run(t: Any) -> Any:
        stream = t.model.Generate(long, timeout=60)
        next(stream)
        stream.cancel()
        return list(t.model.Generate(plain, timeout=60))
    return run


def expired_then_served(f: Facts) -> Callable[[Any], Any]:
    """A request whose deadline passes while it runs ends DEADLINE_EXCEEDED; the next is served."""
    long = model_request(f, token_ids=[6] * f.bucket, max_tokens=f.context - f.bucket)
    plain = model_request(f)

    def run(t: Any) -> Any:
        try:
            list(t.model.Generate(long, timeout=0.001))
        except grpc.RpcError as error:
            if error.code() is not grpc.StatusCode.DEADLINE_EXCEEDED:
                raise
        return list(t.model.Generate(plain, timeout=60))
    return run


def model_call(f: Facts, **fields: Any) -> Callable[[Any], Any]:
    request = model_request(f, **fields)
    return lambda t: list(t.model.Generate(request, timeout=120))


def complete_call(f: Facts, **fields: Any) -> Callable[[Any], Any]:
    request = text_request(gateway_pb2.CompleteRequest, f, **fields)
    return lambda t: t.gateway.Complete(request, timeout=120)


def pressure_cases(f: Facts) -> list[Case]:
    full = {"token_ids": [7] * f.bucket, "max_tokens": f.context - f.bucket}  # the longest prompt, to the context
    long_prompt = list(f.prompt_ids) * (f.bucket // max(1, len(f.prompt_ids)))
    greedy = {"temperature": 0.0, "token_ids": long_prompt[:f.context - 8], "max_tokens": 8}  # fits the context
    return [
        Case("kv-model-longest-prompt-to-context", "model", model_call(f, **full), "OK", tags=("finite",)),
        Case("kv-model-longest-prompt-alternatives", "model", model_call(f, **full, top_logprobs=8), "OK",
             tags=("finite",)),
        Case("kv-model-n-slots-to-context", "model", model_call(f, **full, n=f.slots), "OK", tags=("finite",)),
        Case("kv-model-n-over-slots", "model", model_call(f, n=f.slots + 3), "OK", tags=("finite",)),
        Case("kv-gw-n-over-slots", "gateway", complete_call(f, n=f.slots + 3), "OK"),
        Case("kv-model-n-over-limit", "model", model_call(f, n=MAX_SAMPLES + 1), INVALID, "n", str(MAX_SAMPLES)),
        Case("kv-gw-n-over-limit", "gateway", complete_call(f, n=MAX_SAMPLES + 1), INVALID, "n", str(MAX_SAMPLES)),
        Case("kv-model-burst-12-full", "model", burst(model_call(f, **full), 12), "OK"),
        Case("kv-gw-burst-12", "gateway", burst(complete_call(f, max_tokens=f.context // 2), 12), "OK"),
        Case("kv-model-burst-n-2", "model", burst(model_call(f, **full, n=2), 6), "OK"),
        Case("kv-model-prefix-cache-same-tokens", "model", same_every_time(model_call(f, **greedy), 4), "OK"),
        Case("kv-model-cancel-mid-stream", "model", cancelled_then_served(f), "OK"),
        Case("kv-model-deadline-mid-stream", "model", expired_then_served(f), "OK"),
    ]
