"""Prefix-cache isolation at the gateway (round three of docs/reliability.md): every model request carries a cache_salt made of the
caller's API key identity (a digest, never the key) and vLLM's cache_salt field; no key and no salt is the shared
cache (b""); a bad cache_salt is a 400 / INVALID_ARGUMENT naming it."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import grpc
import pytest

from gateway.auth import ApiKeyInterceptor, ApiKeys, cache_salt, tenant_of, tenant_var
from gateway.config import Limits
from gateway.errors import GatewayError
from gateway.http.app import RequireKey
from gateway.http.mapping import generate_request
from gateway.http.schemas import CompletionRequest
from gateway.pipeline import model_request
from gateway.validation import Plan, check_request
from grok.gateway.v1 import gateway_pb2
from serving_common.limits import MAX_CACHE_SALT_CHARS


def test_a_tenant_is_a_digest_of_its_key_never_the_key() -> None:
    a, b = tenant_of("Bearer key-a"), tenant_of("Bearer key-b")
    assert a != b and a == tenant_of("bearer  key-a ") and len(a) == 16
    assert b"key-a" not in a and tenant_of(None) == b"" and tenant_of("Bearer ") == b""


def test_salts_differ_for_every_tenant_and_salt_and_are_empty_for_neither() -> None:
    assert cache_salt(b"", None) == b""
    pairs = [(t, s) for t, s in itertools.product((b"", tenant_of("Bearer a"), tenant_of("Bearer b")),
                                                 (None, "x", "y", "x\x00")) if (t, s) != (b"", None)]
    salts = [cache_salt(t, s) for t, s in pairs]
    assert len(set(salts)) == len(pairs) and b"" not in salts


def request(**sampling: Any) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(prompt="hi", sampling=gateway_pb2.SamplingParams(**sampling))


def test_the_model_request_carries_the_tenant_and_the_salt() -> None:
    planned = Plan((5, 6), 4)
    assert model_request(request(), planned, "r").cache_salt == b""
    token = tenant_var.set(tenant_of("Bearer key-a"))
    try:
        salted = model_request(request(cache_salt="s1"), planned, "r").cache_salt
        assert salted == cache_salt(tenant_of("Bearer key-a"), "s1")
        assert model_request(request(), planned, "r").cache_salt == cache_salt(tenant_of("Bearer key-a"), None)
    finally:
        tenant_var.reset(token)
    assert model_request(request(cache_salt="s1"), planned, "r").cache_salt == cache_salt(b"", "s1") != salted


@pytest.mark.parametrize("salt,says", [("", "non-empty"), ("s" * (MAX_CACHE_SALT_CHARS + 1), "over the limit")])
def test_a_bad_cache_salt_is_invalid_naming_it(salt: str, says: str) -> None:
    with pytest.raises(GatewayError) as caught:
        check_request(request(cache_salt=salt), Limits())
    assert caught.value.code is grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.message.startswith("cache_salt: ") and says in caught.value.message


def test_the_http_cache_salt_reaches_the_grpc_request() -> None:
    body = CompletionRequest(model="grok-1", prompt="hi", cache_salt="tenant-chosen")
    assert generate_request(body, "hi").sampling.cache_salt == "tenant-chosen"
    assert not generate_request(CompletionRequest(model="grok-1", prompt="hi"), "hi").sampling.HasField("cache_salt")


def test_the_grpc_key_check_sets_the_calls_tenant() -> None:
    seen: list[bytes] = []

    async def handle(request: bytes, context: Any) -> bytes:
        seen.append(tenant_var.get())
        return b""

    async def call() -> None:
        server = grpc.aio.server(interceptors=[ApiKeyInterceptor(ApiKeys(["key-a", "key-b"]))])
        server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
            "test.Tenant", {"Call": grpc.unary_unary_rpc_method_handler(handle)})])
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                method = channel.unary_unary("/test.Tenant/Call")
                for key in ("key-a", "key-b"):
                    await method(b"", metadata=(("authorization", f"Bearer {key}"),))
        finally:
            await server.stop(0)

    asyncio.run(call())
    assert seen == [tenant_of("Bearer key-a"), tenant_of("Bearer key-b")]


def test_the_http_key_check_sets_the_requests_tenant() -> None:
    seen: list[bytes] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        seen.append(tenant_var.get())

    async def call(key: str) -> None:
        scope = {"type": "http", "path": "/v1/completions", "headers": [(b"authorization", f"Bearer {key}".encode())]}
        await RequireKey(app, ApiKeys(["key-a", "key-b"]))(scope, None, None)

    for key in ("key-b", "key-a"):
        asyncio.run(call(key))
    assert seen == [tenant_of("Bearer key-b"), tenant_of("Bearer key-a")]
