"""The attack table over the three gRPC services: each case is one call and the status it must end with.

`Facts` holds what a case needs to know of the stack under attack (vocabulary, context, longest prompt,
the limits it was started with). `bad_input_cases` is the bad-input table that
tests/gateway/test_bad_input.py runs too (each case names the field its message must name);
`grpc_cases` adds the rest: the range of every sampling control at the gateway and the model, the
accepted extremes (which must answer with finite probabilities only), request ids, requests whose
stream ends without a message, and bytes that do not parse. HTTP cases are in attack_http.py.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.client import completion_request
from gateway.config import Limits, prompt_byte_limit
from grok.gateway.v1 import gateway_pb2
from grok.model.v1 import model_pb2
from grok.tokenizer.v1 import tokenizer_pb2

F32_MAX = 3.4028234663852886e38
TINY = 1e-38
SUBNORMAL = 1e-45
INVALID = "INVALID_ARGUMENT"
GATEWAY_LIMITS = Limits()


class Targets(Protocol):
    """The stubs a case calls (tests/gateway/conftest.Stubs is one)."""

    gateway: Any
    tokenizer: Any
    model: Any
    channels: dict[str, grpc.Channel]


@dataclass(frozen=True)
class Facts:
    """The stack under attack: the model's shape and the limits its services were started with."""

    vocab: int
    context: int
    bucket: int  # the longest prompt the model accepts (context - 1)
    prompt: str  # a prompt that works
    prompt_ids: tuple[int, ...]  # its token ids (model-direct cases)
    max_tokens: int = 8  # per successful case: short, so the table runs fast
    max_prompt_bytes: int = 0  # 0: the gateway's default (it is started without flags), derived from the context
    max_stop: int = GATEWAY_LIMITS.max_stop
    max_stop_chars: int = GATEWAY_LIMITS.max_stop_chars
    max_top_logprobs: int = GATEWAY_LIMITS.max_top_logprobs
    text_limit: int = 4096  # the tokenizer's --max-text-bytes
    batch_limit: int = 4  # --max-batch
    ids_limit: int = 256  # --max-tokens
    seed: int = 7
    temperature: float = 0.8
    pieces: tuple[bytes, ...] = ()  # each id's bytes (tokenizer GetPieces), for constraints built on the vocabulary
    slots: int = 2

    def __post_init__(self) -> None:
        if not self.max_prompt_bytes:
            object.__setattr__(self, "max_prompt_bytes", prompt_byte_limit(GATEWAY_LIMITS, self.context))


@dataclass(frozen=True)
class Case:
    """One call and its expected end: a gRPC status name ("OK" for success) or an HTTP status number."""

    name: str
    service: str  # gateway | tokenizer | model | gateway-http
    call: Callable[[Any], Any]
    code: str | int
    field: str = ""  # the field the error message (and its BadRequest violation) must name
    says: str = ""  # a fragment the message must contain
    tags: tuple[str, ...] = ()


def text_request(kind: type, facts: Facts, **fields: Any) -> Any:
    """A gateway GenerateRequest / CompleteRequest of the working prompt with `fields` changed."""
    base = completion_request(facts.prompt, max_tokens=facts.max_tokens, temperature=facts.temperature,
                              seed=facts.seed, ignore_eos=True)
    request = kind.FromString(base.SerializeToString())  # the two messages share every field
    for key, value in fields.items():
        target = request if key == "prompt" else request.sampling
        if isinstance(value, dict):
            getattr(target, key).update(value)
        elif isinstance(value, list):
            getattr(target, key).extend(value)
        else:
            setattr(target, key, value)
    return request


def gen(facts: Facts, **fields: Any) -> Callable[[Any], Any]:
    request = text_request(gateway_pb2.GenerateRequest, facts, **fields)
    return lambda t: list(t.gateway.Generate(request, timeout=60))


def complete(facts: Facts, **fields: Any) -> Callable[[Any], Any]:
    request = text_request(gateway_pb2.CompleteRequest, facts, **fields)
    return lambda t: t.gateway.Complete(request, timeout=60)


def model_request(facts: Facts, **fields: Any) -> model_pb2.GenerateRequest:
    request = model_pb2.GenerateRequest(token_ids=facts.prompt_ids, max_tokens=facts.max_tokens,
                                        temperature=facts.temperature, seed=facts.seed)
    for key, value in fields.items():
        if isinstance(value, dict):
            getattr(request, key).update(value)
        elif isinstance(value, list):
            del getattr(request, key)[:]
            getattr(request, key).extend(value)
        else:
            setattr(request, key, value)
    return request


def model(facts: Facts, **fields: Any) -> Callable[[Any], Any]:
    request = model_request(facts, **fields)
    return lambda t: list(t.model.Generate(request, timeout=60))


def tok(method: str, request: Any) -> Callable[[Any], Any]:
    def call(t: Any) -> Any:
        reply = getattr(t.tokenizer, method)(request, timeout=10)
        return list(reply) if method in ("DecodeStream", "GetPieces") else reply
    return call


def bad_input_cases(f: Facts) -> list[Case]:
    """Bad input at every service: the status, and the field its message and BadRequest name."""
    v, long_prompt = f.vocab, "one two three four five six seven eight nine ten " * (f.bucket // 5 + 2)
    return [
        Case("gw-empty-prompt", "gateway", gen(f, prompt=""), INVALID, "prompt", "non-empty"),
        Case("gw-prompt-over-bytes", "gateway", complete(f, prompt="x" * (f.max_prompt_bytes + 1)), INVALID, "prompt",
             str(f.max_prompt_bytes)),
        Case("gw-max-tokens-0", "gateway", gen(f, max_tokens=0), INVALID, "max_tokens", ">= 1"),
        Case("gw-max-tokens-negative", "gateway", complete(f, max_tokens=-5), INVALID, "max_tokens", ">= 1"),
        Case("gw-max-tokens-over-context", "gateway", gen(f, max_tokens=f.context), INVALID, "max_tokens", "context"),
        Case("gw-temperature-negative", "gateway", gen(f, temperature=-0.5), INVALID, "temperature", ">= 0"),
        Case("gw-temperature-nan", "gateway", complete(f, temperature=math.nan), INVALID, "temperature", "finite"),
        Case("gw-temperature-inf", "gateway", gen(f, temperature=math.inf), INVALID, "temperature", "finite"),
        Case("gw-top-p-0", "gateway", gen(f, top_p=0.0), INVALID, "top_p", "(0, 1]"),
        Case("gw-top-p-over-1", "gateway", complete(f, top_p=1.5), INVALID, "top_p", "(0, 1]"),
        Case("gw-top-p-nan", "gateway", gen(f, top_p=math.nan), INVALID, "top_p", "(0, 1]"),
        Case("gw-top-p-negative", "gateway", gen(f, top_p=-0.1), INVALID, "top_p", "(0, 1]"),
        Case("gw-top-logprobs-over", "gateway", gen(f, top_logprobs=f.max_top_logprobs + 1), INVALID, "top_logprobs",
             f"0..{f.max_top_logprobs}"),
        Case("gw-top-logprobs-negative", "gateway", complete(f, top_logprobs=-1), INVALID, "top_logprobs",
             f"0..{f.max_top_logprobs}"),
        Case("gw-too-many-stops", "gateway", gen(f, stop=["a"] * (f.max_stop + 1)), INVALID, "stop",
             f"limit of {f.max_stop}"),
        Case("gw-empty-stop", "gateway", gen(f, stop=["ok", ""]), INVALID, "stop[1]", "non-empty"),
        Case("gw-stop-too-long", "gateway", complete(f, stop=["s" * (f.max_stop_chars + 1)]), INVALID, "stop[0]",
             str(f.max_stop_chars)),
        Case("gw-allowed-out-of-vocab", "gateway", gen(f, allowed_token_ids=[v]), INVALID, "allowed_token_ids",
             "vocabulary"),
        Case("gw-blocked-negative", "gateway", complete(f, blocked_token_ids=[-1]), INVALID, "blocked_token_ids",
             "vocabulary"),
        Case("gw-only-pad-allowed", "gateway", gen(f, allowed_token_ids=[0]), INVALID,
             "allowed_token_ids/blocked_token_ids", "no token is left"),
        Case("gw-prompt-over-bucket", "gateway", gen(f, prompt=long_prompt), INVALID, "prompt", "longest prompt"),
        Case("gw-prompt-over-tokenizer-limit", "gateway", complete(f, prompt="y" * (f.text_limit + 904)), INVALID,
             "text", str(f.text_limit)),
        Case("tok-encode-over-limit", "tokenizer",
             tok("Encode", tokenizer_pb2.EncodeRequest(text="z" * (f.text_limit + 1))), INVALID, "text",
             "--max-text-bytes"),
        Case("tok-batch-too-large", "tokenizer", tok("EncodeBatch", tokenizer_pb2.EncodeBatchRequest(
            requests=[tokenizer_pb2.EncodeRequest(text="a")] * (f.batch_limit + 1))), INVALID, "requests",
            "--max-batch"),
        Case("tok-batch-text-over-limit", "tokenizer", tok("EncodeBatch", tokenizer_pb2.EncodeBatchRequest(requests=[
            tokenizer_pb2.EncodeRequest(text="a"), tokenizer_pb2.EncodeRequest(text="b" * (f.text_limit + 1))])),
            INVALID, "requests[1].text", str(f.text_limit + 1)),
        Case("tok-decode-id-over-vocab", "tokenizer", tok("Decode", tokenizer_pb2.DecodeRequest(token_ids=[5, v])),
             INVALID, "token_ids[1]", "out of range"),
        Case("tok-decode-negative-id", "tokenizer", tok("Decode", tokenizer_pb2.DecodeRequest(token_ids=[-3])),
             INVALID, "token_ids[0]", "out of range"),
        Case("tok-decode-too-many-ids", "tokenizer",
             tok("Decode", tokenizer_pb2.DecodeRequest(token_ids=[5] * (f.ids_limit + 1))), INVALID, "token_ids",
             "--max-tokens"),
        Case("tok-stream-bad-id", "tokenizer", lambda t: list(t.tokenizer.DecodeStream(iter([
            tokenizer_pb2.DecodeStreamRequest(token_ids=[5]), tokenizer_pb2.DecodeStreamRequest(token_ids=[10**6])]),
            timeout=10)), INVALID, "token_ids[0]", "out of range"),
        Case("tok-stream-too-many-ids", "tokenizer", lambda t: list(t.tokenizer.DecodeStream(iter([
            tokenizer_pb2.DecodeStreamRequest(token_ids=[5] * (f.ids_limit + 1))]), timeout=10)), INVALID,
            "token_ids", "--max-tokens"),
        Case("model-empty-prompt", "model", model(f, token_ids=[]), INVALID, "token_ids", "empty"),
        Case("model-id-over-vocab", "model", model(f, token_ids=[5, v]), INVALID, "token_ids", f"[0, {v})"),
        Case("model-negative-id", "model", model(f, token_ids=[-1]), INVALID, "token_ids", f"[0, {v})"),
        Case("model-prompt-over-bucket", "model", model(f, token_ids=[5] * (f.bucket + 1)), INVALID, "token_ids",
             "longest accepted"),
        Case("model-max-tokens-0", "model", model(f, max_tokens=0), INVALID, "max_tokens", ">= 1"),
        Case("model-over-context", "model", model(f, token_ids=[5] * (f.bucket - 4), max_tokens=f.context - f.bucket + 5),
             INVALID, "max_tokens", "context"),
        Case("model-temperature-nan", "model", model(f, temperature=math.nan), INVALID, "temperature", "finite"),
        Case("model-temperature-negative", "model", model(f, temperature=-2.0), INVALID, "temperature", ">= 0"),
        Case("model-top-p-0", "model", model(f, top_p=0.0), INVALID, "top_p", "(0, 1]"),
        Case("model-top-p-inf", "model", model(f, top_p=math.inf), INVALID, "top_p", "(0, 1]"),
        Case("model-top-logprobs-over", "model", model(f, top_logprobs=f.max_top_logprobs + 1), INVALID,
             "top_logprobs", f"0..{f.max_top_logprobs}"),
        Case("model-blocked-out-of-vocab", "model", model(f, blocked_token_ids=[v + 88]), INVALID, "blocked_token_ids",
             f"[0, {v})"),
        Case("model-allowed-negative", "model", model(f, allowed_token_ids=[-7]), INVALID, "allowed_token_ids",
             f"[0, {v})"),
        Case("model-nothing-left", "model", model(f, blocked_token_ids=list(range(1, v))), INVALID,
             "allowed_token_ids/blocked_token_ids", "no token is left"),
        Case("health-unknown-service", "model", lambda t: health_pb2_grpc.HealthStub(t.channels["model"]).Check(
            health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=10), "NOT_FOUND", "", "no.such.Service"),
    ]


# (field, bad values) of the controls, as both the gateway and the model spell them.
BAD_CONTROLS: list[tuple[str, list[Any]]] = [
    ("top_k", [-2, -1000]),
    ("min_p", [-0.1, 1.5, math.nan, math.inf]),
    ("repetition_penalty", [0.0, -1.0, math.nan, math.inf, -math.inf]),
    ("presence_penalty", [2.1, -2.1, math.nan]),
    ("frequency_penalty", [2.5, -2.5, math.inf]),
    ("min_tokens", [-1, Facts.max_tokens + 1, 2**31 - 1]),  # 0..max_tokens (every case asks for max_tokens)
]
# Accepted extremes: each must answer OK with finite probabilities and log-probabilities only.
EXTREMES: list[tuple[str, dict[str, Any]]] = [
    ("temperature-tiny", {"temperature": TINY}), ("temperature-subnormal", {"temperature": SUBNORMAL}),
    ("temperature-max", {"temperature": F32_MAX}), ("temperature-0", {"temperature": 0.0}),
    ("top-p-subnormal", {"top_p": SUBNORMAL}), ("top-k-1", {"top_k": 1}), ("top-k-huge", {"top_k": 2**31 - 1}),
    ("min-p-1", {"min_p": 1.0}), ("min-p-subnormal", {"min_p": SUBNORMAL}),
    ("repetition-tiny", {"repetition_penalty": TINY}), ("repetition-subnormal", {"repetition_penalty": SUBNORMAL}),
    ("repetition-max", {"repetition_penalty": F32_MAX}),
    ("penalties-2", {"presence_penalty": 2.0, "frequency_penalty": 2.0}),
    ("penalties-minus-2", {"presence_penalty": -2.0, "frequency_penalty": -2.0}),
    ("min-tokens-all", {"min_tokens": Facts.max_tokens}),
    ("logit-bias-100", {"logit_bias": {5: 100.0, 6: -100.0, 7: 100.0}}),
    ("all-extremes", {"temperature": TINY, "top_p": SUBNORMAL, "top_k": 1, "min_p": 1.0, "repetition_penalty": TINY,
                      "presence_penalty": 2.0, "frequency_penalty": -2.0, "logit_bias": {5: 100.0}}),
]


def control_cases(f: Facts) -> list[Case]:
    """Every bad value of every control is INVALID_ARGUMENT naming it; every accepted extreme is OK."""
    cases = []
    for name, values in BAD_CONTROLS:
        for i, value in enumerate(values):
            cases.append(Case(f"gw-{name}-bad-{i}", "gateway", complete(f, **{name: value}), INVALID, name))
            cases.append(Case(f"model-{name}-bad-{i}", "model", model(f, **{name: value}), INVALID, name))
    for i, bias in enumerate((101.0, -101.0, math.nan)):
        cases.append(Case(f"gw-logit-bias-bad-{i}", "gateway", complete(f, logit_bias={5: bias}), INVALID, "logit_bias"))
        cases.append(Case(f"model-logit-bias-bad-{i}", "model", model(f, logit_bias={5: bias}), INVALID, "logit_bias"))
    cases += [
        Case("gw-logit-bias-out-of-vocab", "gateway", complete(f, logit_bias={f.vocab: 1.0}), INVALID, "logit_bias"),
        Case("gw-stop-token-out-of-vocab", "gateway", complete(f, stop_token_ids=[f.vocab]), INVALID,
             "stop_token_ids"),
        Case("gw-n-negative", "gateway", complete(f, n=-1), INVALID, "n"),
        Case("gw-prompt-logprobs-over", "gateway", complete(f, prompt_logprobs=100), INVALID, "prompt_logprobs"),
        Case("model-request-id-too-long", "model", model(f, request_id="r" * 129), INVALID, "request_id", "128"),
    ]
    for name, fields in EXTREMES:
        logprobs = {"top_logprobs": f.max_top_logprobs}
        cases.append(Case(f"gw-extreme-{name}", "gateway", complete(f, **fields, **logprobs), "OK", tags=("finite",)))
        cases.append(Case(f"gw-stream-extreme-{name}", "gateway", gen(f, **fields, **logprobs), "OK",
                          tags=("finite",)))
        cases.append(Case(f"model-extreme-{name}", "model", model(f, **fields, **logprobs), "OK", tags=("finite",)))
    return cases


UNARY_METHODS = [  # (service, full method name) of every unary-request method
    ("gateway", "/grok.gateway.v1.GatewayService/Complete"), ("gateway", "/grok.gateway.v1.GatewayService/Generate"),
    ("gateway", "/grok.gateway.v1.GatewayService/GetInfo"), ("gateway", "/grpc.health.v1.Health/Check"),
    ("tokenizer", "/grok.tokenizer.v1.TokenizerService/Encode"),
    ("tokenizer", "/grok.tokenizer.v1.TokenizerService/EncodeBatch"),
    ("tokenizer", "/grok.tokenizer.v1.TokenizerService/Decode"),
    ("tokenizer", "/grok.tokenizer.v1.TokenizerService/GetPieces"),
    ("tokenizer", "/grok.tokenizer.v1.TokenizerService/GetInfo"), ("tokenizer", "/grpc.health.v1.Health/Check"),
    ("model", "/grok.model.v1.ModelService/Generate"), ("model", "/grok.model.v1.ModelService/GetInfo"),
    ("model", "/grpc.health.v1.Health/Check"),
]
MALFORMED = [  # (service, method, raw request bytes) that do not parse
    ("gateway", "/grok.gateway.v1.GatewayService/Complete", b"\x0a\x03\xff\xfe\xfd"),  # prompt not UTF-8
    ("gateway", "/grok.gateway.v1.GatewayService/Generate", b"\x0a\x03\xed\xa0\x80"),  # a lone surrogate, encoded
    ("gateway", "/grok.gateway.v1.GatewayService/Generate", b"\x0a\x7fabc"),  # length past the end
    ("gateway", "/grok.gateway.v1.GatewayService/GetInfo", b"\xff\xff\xff"),
    ("tokenizer", "/grok.tokenizer.v1.TokenizerService/Encode", b"\x0a\x02\xc3\x28"),
    ("tokenizer", "/grok.tokenizer.v1.TokenizerService/Decode", b"\x0a\x05\x01\x02"),
    ("model", "/grok.model.v1.ModelService/Generate", b"\x0a\x09\x01"),
    ("model", "/grok.model.v1.ModelService/GetInfo", b"\x07"),
    ("model", "/grpc.health.v1.Health/Check", b"\x0a\x02\xff\xff"),
]


def _raw_stream(service: str, method: str, messages: Iterable[bytes]) -> Callable[[Any], Any]:
    """Call `method` sending these raw messages as a request stream (none: headers, then the end)."""
    return lambda t: list(t.channels[service].stream_stream(method)(iter(list(messages)), timeout=10))


def _with_id(service: str, request_id: str) -> Callable[[Any], Any]:
    method = {"gateway": "/grok.gateway.v1.GatewayService/GetInfo", "tokenizer":
              "/grok.tokenizer.v1.TokenizerService/GetInfo", "model": "/grok.model.v1.ModelService/GetInfo"}[service]
    return lambda t: t.channels[service].unary_unary(method)(b"", timeout=10, metadata=(("x-request-id", request_id),))


def protocol_cases() -> list[Case]:
    """Request streams that end without a message, bytes that do not parse, request ids at the limits."""
    cases = [Case(f"{service}-empty-stream-{method.rsplit('/', 1)[1]}", service, _raw_stream(service, method, []), INVALID, "request", "before its request message")
             for service, method in UNARY_METHODS]
    cases += [Case(f"{service}-malformed-{i}-{method.rsplit('/', 1)[1]}", service, _raw_stream(service, method, [raw]),
                   INVALID, "request", "not a valid") for i, (service, method, raw) in enumerate(MALFORMED)]
    for service in ("gateway", "tokenizer", "model"):
        cases += [
            Case(f"{service}-request-id-128", service, _with_id(service, "i" * 128), "OK"),
            Case(f"{service}-request-id-129", service, _with_id(service, "i" * 129), INVALID, "x-request-id", "128"),
            Case(f"{service}-request-id-12KiB", service, _with_id(service, "i" * 12288), INVALID, "x-request-id"),
            Case(f"{service}-request-id-over-header-limit", service, _with_id(service, "i" * 20000),
                 "RESOURCE_EXHAUSTED"),
        ]
    return cases


def grpc_cases(f: Facts) -> list[Case]:
    return bad_input_cases(f) + control_cases(f) + protocol_cases()
