"""Tenants: vLLM's cache_salt at every API, and a second gateway that requires API keys (over the same
tokenizer and model). A bad salt is a 400 / INVALID_ARGUMENT naming it; a caller without a valid key learns
nothing (401 / UNAUTHENTICATED) but /health; and a greedy prompt answers the same tokens whatever the salt or
the key, its blocks cached per tenant (docs/security.md, "Tenants")."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from benchmarks.attack_cases import INVALID, Case, Facts, model_request, text_request
from benchmarks.attack_http import HttpError, get, post, request
from grok.gateway.v1 import gateway_pb2
from serving_common.limits import MAX_CACHE_SALT_CHARS

KEYS = ("attack-key-a", "attack-key-b")


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def keyed_post(path: str, fields: dict[str, Any], headers: dict[str, str] | None = None) -> Callable[[Any], Any]:
    return lambda t: request(t.keyed_http, "POST", path, json.dumps(fields), headers)


def keyed_get(path: str, headers: dict[str, str] | None = None) -> Callable[[Any], Any]:
    return lambda t: request(t.keyed_http, "GET", path, None, headers)


def same_text(calls: list[Callable[[Any], Any]]) -> Callable[[Any], Any]:
    """Each call's completion text, twice each (the second time from its tenant's cache): all equal."""
    def run(t: Any) -> Any:
        texts = [json.dumps(call(t)[1]["choices"][0]["text"]) for call in calls for _ in range(2)]
        if len(set(texts)) != 1:
            raise HttpError(599, f"greedy texts differ across salts/keys: {texts}")
        return 200, texts, {}
    return run


def grpc_keyed(f: Facts, key: str | None, **fields: Any) -> Callable[[Any], Any]:
    request_ = text_request(gateway_pb2.CompleteRequest, f, **fields)
    metadata = (("authorization", f"Bearer {key}"),) if key else ()
    return lambda t: t.keyed_gateway.Complete(request_, timeout=60, metadata=metadata)


def tenant_cases(f: Facts) -> list[Case]:
    base = {"model": "grok-1", "prompt": f.prompt, "max_tokens": f.max_tokens, "seed": f.seed, "temperature": 0.8}
    greedy = {**base, "temperature": 0.0, "prompt": " ".join([f.prompt] * 3)}
    path = "/v1/completions"
    cases = [
        Case(f"tenant-http-salt-{name}", "gateway-http", post(path, {**base, "cache_salt": value}), code)
        for name, value, code in [
            ("empty", "", 400), ("over-limit", "s" * (MAX_CACHE_SALT_CHARS + 1), 400), ("number", 5, 400),
            ("list", ["a"], 400), ("object", {"a": 1}, 400), ("null", None, 200), ("plain", "tenant-a", 200),
            ("unicode", "ключ-🔑", 200), ("at-limit", "s" * MAX_CACHE_SALT_CHARS, 200)]
    ]
    cases += [
        Case("tenant-http-chat-salt-empty", "gateway-http", post("/v1/chat/completions", {
            **{k: v for k, v in base.items() if k != "prompt"}, "messages": [{"role": "user", "content": f.prompt}],
            "cache_salt": ""}), 400),
        Case("tenant-gw-salt-empty", "gateway", lambda t: t.gateway.Complete(
            text_request(gateway_pb2.CompleteRequest, f, cache_salt=""), timeout=60), INVALID, "cache_salt",
            "non-empty"),
        Case("tenant-gw-salt-over-limit", "gateway", lambda t: t.gateway.Complete(
            text_request(gateway_pb2.CompleteRequest, f, cache_salt="s" * (MAX_CACHE_SALT_CHARS + 1)), timeout=60),
            INVALID, "cache_salt", str(MAX_CACHE_SALT_CHARS)),
        Case("tenant-gw-salt-ok", "gateway", lambda t: t.gateway.Complete(
            text_request(gateway_pb2.CompleteRequest, f, cache_salt="tenant-a"), timeout=60), "OK"),
        Case("tenant-model-salt-bytes", "model", lambda t: list(t.model.Generate(
            model_request(f, cache_salt=bytes(range(256)) * 4), timeout=60)), "OK"),
        Case("tenant-http-same-text-any-salt", "gateway-http", same_text(
            [post(path, greedy)] + [post(path, {**greedy, "cache_salt": s}) for s in ("tenant-a", "tenant-b")]), 200),
        # The keyed gateway: every path but /health needs a configured key.
        Case("tenant-keyed-no-key", "gateway-http", keyed_post(path, base), 401),
        Case("tenant-keyed-wrong-key", "gateway-http", keyed_post(path, base, bearer("not-a-key")), 401),
        Case("tenant-keyed-models-no-key", "gateway-http", keyed_get("/v1/models"), 401),
        Case("tenant-keyed-health-open", "gateway-http", keyed_get("/health"), 200),
        Case("tenant-keyed-key-a", "gateway-http", keyed_post(path, base, bearer(KEYS[0])), 200, tags=("finite",)),
        Case("tenant-keyed-key-b-salted", "gateway-http", keyed_post(path, {**base, "cache_salt": "x"},
                                                                     bearer(KEYS[1])), 200, tags=("finite",)),
        Case("tenant-keyed-same-text-per-key", "gateway-http", same_text(
            [keyed_post(path, greedy, bearer(k)) for k in KEYS] + [post(path, greedy)]), 200),
        Case("tenant-keyed-grpc-no-key", "gateway", grpc_keyed(f, None), "UNAUTHENTICATED"),
        Case("tenant-keyed-grpc-wrong-key", "gateway", grpc_keyed(f, "nope"), "UNAUTHENTICATED"),
        Case("tenant-keyed-grpc-key-a", "gateway", grpc_keyed(f, KEYS[0]), "OK"),
        Case("tenant-keyed-grpc-key-b-bad-salt", "gateway", grpc_keyed(f, KEYS[1], cache_salt=""), INVALID,
             "cache_salt"),
    ]
    # vLLM serves /metrics on the API port; with keys configured it is a keyed route like the others.
    cases.append(Case("tenant-http-metrics-need-a-key", "gateway-http", keyed_get("/metrics"), 401))
    return cases
