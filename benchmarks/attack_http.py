"""The attack table over the gateway's HTTP API (OpenAI's completions and chat): each case is one request
and the HTTP status it must get. Bodies are sent as JSON text as written, so a case can hold what a
JSON encoder would not produce (a lone surrogate escape, NaN). A 2xx answer must hold no NaN and no
infinite number anywhere (`finite_json`)."""

from __future__ import annotations

import json
import math
import socket
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

from benchmarks.attack_cases import BAD_CONTROLS, EXTREMES, Case, Facts

Reply = tuple[int, Any, dict[str, str]]


class HttpError(Exception):
    """A non-2xx answer: its status and body (the runner compares the status with the case's)."""

    def __init__(self, status: int, body: Any) -> None:
        super().__init__(f"HTTP {status}: {str(body)[:200]}")
        self.status, self.body = status, body


def _non_finite(token: str) -> Any:
    raise ValueError(f"the answer holds {token}, which is not JSON")


def request(base: str, method: str, path: str, body: str | None = None,
            headers: dict[str, str] | None = None) -> Reply:
    """One HTTP request; (status, decoded body, headers); HttpError for a non-2xx status."""
    data = body.encode("utf-8", "surrogatepass") if body is not None else None
    req = urllib.request.Request(base + path, data=data, method=method,
                                 headers={"content-type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as reply:
            raw = reply.read().decode()
            status, reply_headers = reply.status, dict(reply.headers)
    except urllib.error.HTTPError as error:
        raise HttpError(error.code, error.read().decode(errors="replace")) from None
    if reply_headers.get("content-type", "").startswith("text/event-stream"):
        events = [line[6:] for line in raw.splitlines() if line.startswith("data: ") and line != "data: [DONE]"]
        return status, [json.loads(e, parse_constant=_non_finite) for e in events], reply_headers
    return status, json.loads(raw, parse_constant=_non_finite), reply_headers


def finite_json(value: Any) -> bool:
    """No NaN or infinity anywhere in a decoded JSON value."""
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, dict):
        return all(finite_json(v) for v in value.values())
    if isinstance(value, list):
        return all(finite_json(v) for v in value)
    return True


def _body(fields: dict[str, Any]) -> str:
    """JSON text; NaN and infinities written as Python's json does (not JSON: the server must refuse them)."""
    return json.dumps(fields)


def post(path: str, fields: dict[str, Any] | str, headers: dict[str, str] | None = None) -> Callable[[Any], Any]:
    body = fields if isinstance(fields, str) else _body(fields)
    return lambda t: request(t.http, "POST", path, body, headers)


def declared_too_big(path: str, length: int) -> Callable[[Any], Any]:
    """Headers declaring a body of `length` bytes and none of it: the answer must come before the body."""
    def call(t: Any) -> Reply:
        host, port = t.http.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=30) as s:
            s.sendall(f"POST {path} HTTP/1.1\r\nhost: attack\r\ncontent-type: application/json\r\n"
                      f"content-length: {length}\r\n\r\n".encode())
            head = s.recv(65536).decode(errors="replace")
        status = int(head.split(" ", 2)[1])
        if status >= 300:
            raise HttpError(status, head)
        return status, head, {}
    return call


def get(path: str) -> Callable[[Any], Any]:
    return lambda t: request(t.http, "GET", path)


def http_cases(f: Facts) -> list[Case]:
    """Completions and chat: bad values are 400, accepted extremes 200 with finite numbers only."""
    base = {"model": "grok-1", "prompt": f.prompt, "max_tokens": f.max_tokens, "seed": f.seed,
            "temperature": f.temperature, "ignore_eos": True}
    chat = {**{k: v for k, v in base.items() if k != "prompt"}, "messages": [{"role": "user", "content": f.prompt}]}
    done: list[Case] = []

    def case(name: str, path: str, fields: dict[str, Any] | str, code: int, headers: dict[str, str] | None = None,
             tags: tuple[str, ...] = ()) -> None:
        done.append(Case(name, "gateway-http", post(path, fields, headers), code, tags=tags))

    for name, values in BAD_CONTROLS:
        for i, value in enumerate(values):
            case(f"http-{name}-bad-{i}", "/v1/completions", {**base, name: value}, 400)
    for name, value in [("temperature", -1.0), ("temperature", math.nan), ("top_p", 0.0), ("top_p", 1.5),
                        ("max_tokens", 0), ("max_tokens", f.context), ("logprobs", f.max_top_logprobs + 1),
                        ("logit_bias", {"5": 101.0}), ("logit_bias", {str(f.vocab): 1.0}),
                        ("stop", ["s"] * (f.max_stop + 1)), ("stop_token_ids", [f.vocab]), ("prompt", ""),
                        ("prompt", "x" * (f.max_prompt_bytes + 1)), ("prompt", [f.vocab])]:
        case(f"http-{name}-bad-{json.dumps(value)[:12]}", "/v1/completions", {**base, name: value}, 400)
    for name, fields in EXTREMES:
        extreme = {k: ({str(i): b for i, b in v.items()} if k == "logit_bias" else v) for k, v in fields.items()}
        case(f"http-extreme-{name}", "/v1/completions", {**base, **extreme, "logprobs": f.max_top_logprobs}, 200,
             tags=("finite",))
        case(f"http-chat-extreme-{name}", "/v1/chat/completions",
             {**chat, **extreme, "logprobs": True, "top_logprobs": f.max_top_logprobs}, 200, tags=("finite",))
    case("http-stream-extreme-repetition", "/v1/completions",
         {**base, "repetition_penalty": 1e-38, "logprobs": 2, "stream": True}, 200, tags=("finite",))
    lone = '"a\\ud800b"'
    completions_text = json.dumps(base)[:-1]
    chat_text = json.dumps({k: v for k, v in chat.items() if k != "messages"})[:-1]
    case("http-surrogate-prompt", "/v1/completions", completions_text.replace(f'"prompt": {json.dumps(f.prompt)}',
                                                                              f'"prompt": {lone}') + "}", 400)
    case("http-surrogate-stop", "/v1/completions", completions_text + f', "stop": [{lone}]}}', 400)
    case("http-surrogate-chat-content", "/v1/chat/completions",
         chat_text + f', "messages": [{{"role": "user", "content": {lone}}}]}}', 400)
    case("http-surrogate-chat-part", "/v1/chat/completions",
         chat_text + f', "messages": [{{"role": "user", "content": [{{"type": "text", "text": {lone}}}]}}]}}', 400)
    case("http-surrogate-logit-bias-key", "/v1/completions", completions_text + f', "logit_bias": {{{lone}: 1}}}}', 400)
    case("http-chat-no-messages", "/v1/chat/completions", {**chat, "messages": []}, 400)
    case("http-chat-top-logprobs-over", "/v1/chat/completions",
         {**chat, "logprobs": True, "top_logprobs": f.max_top_logprobs + 1}, 400)
    case("http-wrong-model", "/v1/completions", {**base, "model": "not-this-one"}, 404)
    # Fields whose feature the server lacks are refused, never ignored; the ones it has take only valid values.
    for name, value in [("use_beam_search", True), ("bad_words", ["a"]), ("logits_processors", ["m.f"]),
                        ("prompt_embeds", "AAAA"), ("guided_whitespace_pattern", " "), ("priority", 1),
                        ("allowed_token_ids", []), ("skip_special_tokens", False), ("suffix", "x"),
                        ("truncate_prompt_tokens", 0), ("truncate_prompt_tokens", -2),
                        ("truncate_prompt_tokens", f.context + 1), ("truncate_prompt_tokens", 2**31)]:
        case(f"http-refused-{name}-{json.dumps(value)[:12]}", "/v1/completions", {**base, name: value}, 400)
    for name, value in [("functions", [{"name": "f", "parameters": {}}]), ("function_call", {"name": "f"}),
                        ("audio", {"voice": "alloy", "format": "wav"}), ("modalities", ["audio"]), ("echo", True)]:
        case(f"http-chat-refused-{name}", "/v1/chat/completions", {**chat, name: value}, 400)
    case("http-truncate-prompt-tokens", "/v1/completions", {**base, "truncate_prompt_tokens": 1}, 200,
         tags=("finite",))
    case("http-token-ids-as-names", "/v1/completions",
         {**base, "logprobs": f.max_top_logprobs, "return_tokens_as_token_ids": True}, 200, tags=("finite",))
    done.append(Case("http-body-over-4MiB", "gateway-http", declared_too_big("/v1/completions", 5 << 20), 413))
    case("http-ok", "/v1/completions", base, 200, tags=("finite",))
    case("http-chat-ok", "/v1/chat/completions", chat, 200, tags=("finite",))
    for label, request_id, code in [("128", "i" * 128, 200), ("129", "i" * 129, 400), ("12KiB", "i" * 12288, 400),
                                    ("latin1", "caf\xe9", 200), ("control", "a\x7fb", 200)]:
        case(f"http-request-id-{label}", "/v1/completions", base, code, headers={"x-request-id": request_id})
    done += [Case("http-health", "gateway-http", get("/health"), 200), Case("http-models", "gateway-http",
                                                                            get("/v1/models"), 200)]
    return done
