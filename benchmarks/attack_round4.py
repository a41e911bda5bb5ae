"""Round four's classes (`r4-*`, issue 64 and 65.8): absolute-form request targets (RFC 9112 3.2.2) served by
their path; `n` beyond the model's slots served, sample i equal to a request with seed + i, at the model, the
gateway and HTTP (streamed too); `n` past its limit refused naming it; a burst over the slots whose every
request gets its first token before any of them finishes; a text prompt at the byte limit derived from the
context accepted and one byte over refused naming the limit."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from benchmarks.attack_cases import INVALID, Case, Facts, model_request
from benchmarks.attack_http import HttpError, request
from benchmarks.attack_wire import exchange, statuses
from serving_common.limits import MAX_SAMPLES


def absolute_form(target: str, body: bytes, method: str = "POST") -> Callable[[Any], Any]:
    """A raw request whose target is absolute-form (`POST http://host/path HTTP/1.1`); its one status."""
    def call(t: Any) -> Any:
        head = (f"{method} {target} HTTP/1.1\r\nhost: attack\r\ncontent-type: application/json\r\n"
                f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode()
        got = statuses(exchange(t.http, head + body))
        if len(got) != 1:
            raise HttpError(599, f"{len(got)} responses: {got}")
        if got[0] >= 300:
            raise HttpError(got[0], "")
        return got[0], None, {}
    return call


def samples_equal_seeded(f: Facts, n: int) -> Callable[[Any], Any]:
    """n samples at the model: every index answered, sample i's tokens those of a request with seed + i."""
    def call(t: Any) -> Any:
        replies = list(t.model.Generate(model_request(f, n=n, temperature=1.0), timeout=120))
        by_index = {i: [tok for r in replies if r.index == i for tok in r.token_ids] for i in range(n)}
        for i in (0, n - 1):
            alone = [tok for r in t.model.Generate(model_request(f, seed=(f.seed + i) % 2**32, temperature=1.0),
                                                   timeout=120) for tok in r.token_ids]
            if by_index[i] != alone:
                raise AssertionError(f"sample {i} of {n} differs from the request with seed + {i}")
        return replies
    return call


def http_choices(f: Facts, n: int, stream: bool) -> Callable[[Any], Any]:
    body = {"model": "grok-1", "prompt": f.prompt, "max_tokens": f.max_tokens, "n": n, "seed": f.seed,
            "temperature": 1.0, "stream": stream}

    def call(t: Any) -> Any:
        status, reply, headers = request(t.http, "POST", "/v1/completions", json.dumps(body))
        events = reply if stream else [reply]
        seen = {c["index"] for e in events for c in e.get("choices", [])}
        if seen != set(range(n)):
            raise AssertionError(f"choices {sorted(seen)} for n = {n}")
        return status, reply, headers
    return call


def burst_first_tokens(f: Facts, count: int) -> Callable[[Any], Any]:
    """`count` streams at once (no more than the slots): every first token before any stream's last."""
    req = model_request(f, max_tokens=16)

    def call(t: Any) -> Any:
        def one(_: int) -> tuple[float, float]:
            stamps = [time.monotonic() for r in t.model.Generate(req, timeout=120) if r.token_ids]
            return stamps[0], stamps[-1]
        with ThreadPoolExecutor(count) as pool:
            spans = list(pool.map(one, range(count)))
        if max(first for first, _ in spans) > min(last for _, last in spans):
            raise AssertionError(f"a first token came after another request's last: {spans}")
        return spans
    return call


def prompt_at_byte_limit(f: Facts) -> Callable[[Any], Any]:
    """A text prompt of exactly the derived byte limit (`a` and spaces encode to few tokens) is not refused for
    its bytes: served, or refused only for its tokens."""
    body = {"model": "grok-1", "prompt": ("a " * f.max_prompt_bytes)[:f.max_prompt_bytes], "max_tokens": 1}

    def call(t: Any) -> Any:
        try:
            return request(t.http, "POST", "/v1/completions", json.dumps(body))
        except HttpError as error:
            if "bytes" in error.body:
                raise
            return 200, None, {}
    return call


def round4_cases(f: Facts) -> list[Case]:
    plain = json.dumps({"model": "grok-1", "prompt": f.prompt, "max_tokens": f.max_tokens}).encode()
    beyond = f.slots + 3
    return [
        Case("r4-absolute-form-target", "gateway-http",
             absolute_form("http://127.0.0.1/v1/completions", plain), 200),
        Case("r4-absolute-form-uppercase-scheme-port-query", "gateway-http",
             absolute_form("HTTP://attack.test:8000/v1/completions?x=1", plain), 200),
        Case("r4-absolute-form-unknown-path", "gateway-http", absolute_form("http://127.0.0.1/nowhere", b""), 404),
        Case("r4-absolute-form-health", "gateway-http", absolute_form("http://127.0.0.1/health", b"", "GET"), 200),
        Case("r4-model-n-beyond-slots-seeded", "model", samples_equal_seeded(f, beyond), "OK", tags=("finite",)),
        Case("r4-http-n-beyond-slots", "gateway-http", http_choices(f, beyond, False), 200, tags=("finite",)),
        Case("r4-http-n-beyond-slots-stream", "gateway-http", http_choices(f, beyond, True), 200),
        Case("r4-model-n-over-limit", "model", lambda t: list(t.model.Generate(
            model_request(f, n=MAX_SAMPLES + 1), timeout=30)), INVALID, "n", str(MAX_SAMPLES)),
        Case("r4-model-burst-first-tokens", "model", burst_first_tokens(f, f.slots), "OK"),
        Case("r4-http-prompt-at-byte-limit", "gateway-http", prompt_at_byte_limit(f), 200),
    ]
