"""Input the gateway must refuse or repair at its edge, before anything reaches a backend: request
ids (non-ASCII, oversized) and strings holding a lone UTF-16 surrogate (valid JSON, not valid Unicode).
Each used to end in a 500 / RESOURCE_EXHAUSTED from somewhere inside the stack."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import grpc
import pytest

from gateway.client import completion_request
from grok.gateway.v1 import gateway_pb2_grpc
from serving_common.logs import MAX_REQUEST_ID_CHARS
from tests.gateway.conftest import Stack
from tests.gateway.http_client import post

COMPLETION = {"model": "grok-1", "prompt": "xy|hello", "max_tokens": 3}
CHAT = {"model": "grok-1", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 3}


def post_raw(url: str, body: str, headers: dict[str, str] | None = None) -> tuple[int, dict, dict[str, str]]:
    """POST a JSON text as written (so it may hold escapes json.dumps would not produce); status, body, headers."""
    request = urllib.request.Request(url, data=body.encode(), headers={"content-type": "application/json",
                                                                         **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            return reply.status, json.loads(reply.read()), dict(reply.headers)
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read()), dict(error.headers)


@pytest.mark.slow
@pytest.mark.parametrize("given", ["caf\xe9", "tab\there", "\x7f"])
def test_an_invalid_request_id_over_http_is_replaced_by_a_fresh_one(golden_http_url: str, given: str) -> None:
    """Through the real backends: their gRPC servers refused the forwarded id (a 500 at the gateway)."""
    body = {"model": "grok-1", "prompt": "hello", "max_tokens": 2}
    status, body, headers = post_raw(f"{golden_http_url}/v1/completions", json.dumps(body), {"x-request-id": given})
    assert status == 200, body
    returned = headers["x-request-id"]
    assert returned and returned != given and returned.isascii() and returned.isprintable()


def test_a_request_id_of_the_limit_is_kept_and_one_longer_is_400(fast_stack: Stack) -> None:
    url = f"{fast_stack.http_url}/v1/completions"
    status, _, headers = post_raw(url, json.dumps(COMPLETION), {"x-request-id": "a" * MAX_REQUEST_ID_CHARS})
    assert status == 200 and headers["x-request-id"] == "a" * MAX_REQUEST_ID_CHARS
    for size in (MAX_REQUEST_ID_CHARS + 1, 8 * 1024, 12 * 1024):
        status, body, _ = post_raw(url, json.dumps(COMPLETION), {"x-request-id": "a" * size})
        assert status == 400, (size, body)
        assert body["error"]["param"] == "x-request-id" and str(MAX_REQUEST_ID_CHARS) in body["error"]["message"]


def test_a_request_id_over_the_limit_over_grpc_is_invalid_argument(fast_stack: Stack) -> None:
    with grpc.insecure_channel(fast_stack.address) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        for size in (MAX_REQUEST_ID_CHARS + 1, 8 * 1024, 12 * 1024):
            with pytest.raises(grpc.RpcError) as caught:
                stub.Complete(completion_request("xy|hello", max_tokens=3), timeout=30,
                              metadata=(("x-request-id", "a" * size),))
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, size
            assert "x-request-id" in caught.value.details()
        reply, call = stub.Complete.with_call(completion_request("xy|hello", max_tokens=3), timeout=30,
                                              metadata=(("x-request-id", "b" * MAX_REQUEST_ID_CHARS),))
        assert ("x-request-id", "b" * MAX_REQUEST_ID_CHARS) in call.trailing_metadata()


SURROGATE = '"a\\ud800b"'  # JSON text: a lone high surrogate escape


@pytest.mark.parametrize(("path", "body", "field"), [
    ("/v1/completions", '{"model": "grok-1", "max_tokens": 3, "prompt": %s}' % SURROGATE, "prompt"),
    ("/v1/completions", '{"model": "grok-1", "max_tokens": 3, "prompt": ["ok", %s]}' % SURROGATE, "prompt.1"),
    ("/v1/completions", '{"model": "grok-1", "max_tokens": 3, "prompt": "xy|hi", "stop": %s}' % SURROGATE, "stop"),
    ("/v1/completions", '{"model": "grok-1", "max_tokens": 3, "prompt": "xy|hi", "stop": ["x", %s]}' % SURROGATE,
     "stop.1"),
    ("/v1/chat/completions", '{"model": "grok-1", "max_tokens": 3, "messages": [{"role": "user", "content": %s}]}'
     % SURROGATE, "messages.0.content"),
    ("/v1/chat/completions", '{"model": "grok-1", "max_tokens": 3, "messages": [{"role": "user", "content": '
     '[{"type": "text", "text": %s}]}]}' % SURROGATE, "messages.0.content.0.text"),
    ("/v1/chat/completions", '{"model": "grok-1", "max_tokens": 3, "stop": %s, "messages": [{"role": "user", '
     '"content": "hi"}]}' % SURROGATE, "stop"),
    ("/v1/completions", '{"model": "grok-1", "max_tokens": 3, "prompt": "xy|hi", "logit_bias": {%s: 1}}' % SURROGATE,
     "logit_bias.a\\ud800b"),  # a bad key is named printably
])
def test_a_lone_surrogate_in_any_text_is_400_naming_the_field(fast_stack: Stack, path: str, body: str,
                                                               field: str) -> None:
    status, reply, _ = post_raw(f"{fast_stack.http_url}{path}", body)
    assert status == 400, reply
    assert reply["error"]["param"] == field, reply
    assert "surrogate" in reply["error"]["message"]
    status, _, _ = post_raw(f"{fast_stack.http_url}/v1/completions", json.dumps(COMPLETION))
    assert status == 200  # the gateway serves on


@pytest.mark.parametrize("depth", [958, 5_000, 200_000])
@pytest.mark.parametrize("path, field", [("/v1/completions", "response_format"), ("/v1/chat/completions", "tools"),
                                         ("/v1/completions", "unknown_field")])
def test_a_deeply_nested_body_is_400_at_any_depth(fast_stack: Stack, depth: int, path: str, field: str) -> None:
    """Nesting is refused by a bounded, non-recursive check before anything recurses over the body (Python's json
    and pydantic both would: a RecursionError answered 500)."""
    nested = "[" * depth + "]" * depth
    start = '{"prompt": "x", ' if path == "/v1/completions" else '{"messages": [{"role": "user", "content": "x"}], '
    body = f'{start}"{field}": {nested}}}'.encode()
    status, reply = post(f"{fast_stack.http_url}{path}", body)
    assert status == 400, reply
    assert "levels deep" in reply["error"]["message"] and reply["error"]["param"] == "body"
    assert post(f"{fast_stack.http_url}/v1/completions", {"prompt": "x", "max_tokens": 2})[0] == 200
