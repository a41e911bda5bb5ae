"""Wire-level attacks: malformed tracing headers on every service, and HTTP streaming faults on raw sockets.

A trace context that does not parse must be ignored (the call served as if it had none), never refused or
crashed on; a stream whose client vanishes, a body that lies about its length, pipelined or HTTP/1.0
requests and odd framings must each get an answer (or a clean close) while the next request is served as
usual."""

from __future__ import annotations

import json
import re
import socket
from collections.abc import Callable
from typing import Any

from benchmarks.attack_cases import Case, Facts, model_request, text_request
from benchmarks.attack_http import HttpError, request
from grok.gateway.v1 import gateway_pb2
from grok.tokenizer.v1 import tokenizer_pb2

TRACE = "0af7651916cd43dd8448eb211c80319c"
SPAN = "b7ad6b7169203331"
# (name, traceparent, tracestate or None): each malformed in its own way, each to be ignored.
BAD_TRACE_HEADERS: list[tuple[str, str, str | None]] = [
    ("garbage", "not-a-traceparent", None),
    ("version-ff", f"ff-{TRACE}-{SPAN}-01", None),
    ("zero-trace-id", f"00-{'0' * 32}-{SPAN}-01", None),
    ("zero-span-id", f"00-{TRACE}-{'0' * 16}-01", None),
    ("uppercase", f"00-{TRACE.upper()}-{SPAN.upper()}-01", None),
    ("short-ids", "00-0af7-b7ad-01", None),
    ("extra-field", f"00-{TRACE}-{SPAN}-01-extra", None),
    ("bad-flags", f"00-{TRACE}-{SPAN}-zz", None),
    ("empty", "", None),
    ("4KiB", "0" * 4096, None),
    ("huge-tracestate", f"00-{TRACE}-{SPAN}-01", ",".join(f"k{i}=v{i}" for i in range(400))),
    ("bad-tracestate", f"00-{TRACE}-{SPAN}-01", "=,=,==;;"),
]


def _metadata(traceparent: str, tracestate: str | None) -> tuple[tuple[str, str], ...]:
    return (("traceparent", traceparent),) + ((("tracestate", tracestate),) if tracestate is not None else ())


def tracing_cases(f: Facts) -> list[Case]:
    """Each malformed trace context on a call of every service: answered OK."""
    complete = text_request(gateway_pb2.CompleteRequest, f)
    generate = model_request(f)
    encode = tokenizer_pb2.EncodeRequest(text=f.prompt)
    body = json.dumps({"model": "grok-1", "prompt": f.prompt, "max_tokens": f.max_tokens, "seed": f.seed})
    cases = []
    for name, parent, state in BAD_TRACE_HEADERS:
        md = _metadata(parent, state)
        cases += [
            Case(f"trace-gw-{name}", "gateway", lambda t, md=md: t.gateway.Complete(complete, timeout=60, metadata=md),
                 "OK"),
            Case(f"trace-model-{name}", "model",
                 lambda t, md=md: list(t.model.Generate(generate, timeout=60, metadata=md)), "OK"),
            Case(f"trace-tok-{name}", "tokenizer",
                 lambda t, md=md: t.tokenizer.Encode(encode, timeout=10, metadata=md), "OK"),
            Case(f"trace-http-{name}", "gateway-http",
                 lambda t, headers=dict(md): request(t.http, "POST", "/v1/completions", body, headers), 200),
        ]
    return cases


def _address(base: str) -> tuple[str, int]:
    host, port = base.removeprefix("http://").split(":")
    return host, int(port)


def exchange(base: str, raw: bytes, read: str = "all", timeout: float = 30.0) -> bytes:
    """Send raw bytes; read the whole answer ("all": until the server closes), only the first chunk ("first"),
    or nothing ("none"); then close."""
    with socket.create_connection(_address(base), timeout=timeout) as s:
        s.sendall(raw)
        if read == "none":
            return b""
        out = b""
        while True:
            chunk = s.recv(65536)
            if not chunk:
                return out
            out += chunk
            if read == "first" and b"\r\n\r\n" in out:
                return out


def http_message(path: str, body: bytes, headers: dict[str, str] | None = None, version: str = "1.1",
                 close: bool = True) -> bytes:
    head = {"host": "attack", "content-type": "application/json", "content-length": str(len(body)),
            **({"connection": "close"} if close else {}), **(headers or {})}
    lines = "".join(f"{k}: {v}\r\n" for k, v in head.items() if v is not None)
    return f"POST {path} HTTP/{version}\r\n{lines}\r\n".encode() + body


def statuses(answer: bytes) -> list[int]:
    """The status of every response in `answer` (several when requests were pipelined: a response's status line
    follows the previous body directly)."""
    return [int(code) for code in re.findall(rb"HTTP/1\.[01] ([0-9]{3}) ", answer)]


def then_served(fault: Callable[[Any], Any], body: dict[str, Any]) -> Callable[[Any], Any]:
    """Run the fault, then a normal streaming request, whose reply is the case's answer (200 when served)."""
    def call(t: Any) -> Any:
        fault(t)
        return request(t.http, "POST", "/v1/completions", json.dumps({**body, "stream": True}))
    return call


def expect(status: int, fault: Callable[[Any], bytes]) -> Callable[[Any], Any]:
    """The fault's single answer must have `status`: 2xx returns, others raise HttpError as the runner expects."""
    def call(t: Any) -> Any:
        got = statuses(fault(t))
        if len(got) != 1:
            raise HttpError(599, f"{len(got)} responses: {got}")
        if got[0] >= 300:
            raise HttpError(got[0], "")
        return got[0], None, {}
    return call


def streaming_cases(f: Facts) -> list[Case]:
    ok = {"model": "grok-1", "prompt": f.prompt, "max_tokens": f.max_tokens, "seed": f.seed, "temperature": 0.8}
    stream = json.dumps({**ok, "stream": True, "max_tokens": 32}).encode()
    plain = json.dumps(ok).encode()
    path = "/v1/completions"
    chunked = b"%x\r\n%s\r\n0\r\n\r\n" % (len(plain), plain)

    def pipelined(t: Any) -> bytes:
        return exchange(t.http, http_message(path, plain, close=False) + http_message(path, plain))

    def two_pipelined(t: Any) -> Any:
        got = statuses(pipelined(t))
        if got != [200, 200]:
            raise HttpError(599, f"pipelined answers: {got}")
        return 200, None, {}

    return [
        Case("stream-client-gone-after-headers", "gateway-http", then_served(
            lambda t: exchange(t.http, http_message(path, stream), read="first"), ok), 200),
        Case("stream-client-gone-before-answer", "gateway-http", then_served(
            lambda t: exchange(t.http, http_message(path, stream), read="none"), ok), 200),
        Case("stream-body-shorter-than-length", "gateway-http", then_served(
            lambda t: exchange(t.http, http_message(path, plain[:10], {"content-length": str(len(plain))}),
                               read="none"), ok), 200),
        Case("stream-headers-only-then-gone", "gateway-http", then_served(
            lambda t: exchange(t.http, http_message(path, b"", {"content-length": "500"}), read="none"), ok), 200),
        Case("stream-pipelined-two", "gateway-http", two_pipelined, 200),
        Case("stream-1.0-request", "gateway-http", expect(200, lambda t: exchange(
            t.http, http_message(path, plain, version="1.0", close=False))), 200),
        Case("stream-chunked-body", "gateway-http", expect(200, lambda t: exchange(t.http, http_message(
            path, chunked, {"content-length": None, "transfer-encoding": "chunked"}))), 200),
        Case("stream-chunked-bad-size", "gateway-http", expect(400, lambda t: exchange(t.http, http_message(
            path, b"zz\r\n{}\r\n0\r\n\r\n", {"content-length": None, "transfer-encoding": "chunked"}))), 400),
        # RFC 9112 6.3: a server may refuse both framings, or read the body by Transfer-Encoding alone (as here).
        Case("stream-length-and-chunked", "gateway-http", expect(200, lambda t: exchange(t.http, http_message(
            path, chunked, {"transfer-encoding": "chunked"}))), 200),
        Case("stream-body-not-json", "gateway-http", expect(400, lambda t: exchange(
            t.http, http_message(path, b"{not json"))), 400),
        Case("stream-body-not-utf8", "gateway-http", expect(400, lambda t: exchange(
            t.http, http_message(path, b'{"prompt": "\xff\xfe"}'))), 400),
        Case("stream-stream-options-without-stream", "gateway-http", expect(400, lambda t: exchange(
            t.http, http_message(path, json.dumps({**ok, "stream_options": {"include_usage": True}}).encode()))),
            400),
        Case("stream-stream-usage", "gateway-http", expect(200, lambda t: exchange(t.http, http_message(
            path, json.dumps({**ok, "stream": True, "stream_options": {"include_usage": True}}).encode()))), 200),
        Case("stream-stream-n-2", "gateway-http", expect(200, lambda t: exchange(
            t.http, http_message(path, json.dumps({**ok, "stream": True, "n": 2}).encode()))), 200),
        Case("stream-stream-refused-constraint", "gateway-http", expect(400, lambda t: exchange(t.http, http_message(
            path, json.dumps({**ok, "stream": True, "guided_json": {"$ref": "#"}}).encode()))), 400),
        Case("stream-stream-chat", "gateway-http", expect(200, lambda t: exchange(t.http, http_message(
            "/v1/chat/completions", json.dumps({k: v for k, v in ok.items() if k != "prompt"} | {
                "stream": True, "messages": [{"role": "user", "content": f.prompt}]}).encode()))), 200),
    ]
