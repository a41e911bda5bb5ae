"""Bad input at every service of the real stack (golden tiny model), table-driven.

Each case checks the status, that the message names what is wrong without internals (no exception
classes, tracebacks or addresses), the google.rpc BadRequest field violation where there is one, and
that a normal request to the same service right after still gets the reference's output. Raw bytes
that do not parse (corrupt protobuf, a string that is not UTF-8) are refused with INVALID_ARGUMENT
by every service and logged as one warning line, never an error with a traceback.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.client import completion_request
from grok.gateway.v1 import gateway_pb2
from grok.model.v1 import model_pb2
from grok.tokenizer.v1 import tokenizer_pb2
from serving_common.errors import details_of
from tests.gateway.conftest import Stack, Stubs
from tests.procs import GOLDEN

pytestmark = pytest.mark.slow

GOLDEN_CASE = json.loads((GOLDEN / "pipeline_fp32.json").read_text())["requests"][1]
VOCAB, CONTEXT, BUCKET = 512, 128, 64
INTERNALS = ("Traceback", "<class", "Exception", "Error:", "127.0.0.1", "ipv4:", "/tmp/", "site-packages")


def golden_text_request(**fields: Any) -> gateway_pb2.CompleteRequest:
    q = GOLDEN_CASE["request"]
    return completion_request(q["prompt"], max_tokens=q["max_len"], temperature=q["temperature"],
                              top_p=q["nucleus_p"], seed=q["rng_seed"], ignore_eos=True, **fields)


def golden_model_request(**fields: Any) -> model_pb2.GenerateRequest:
    q = GOLDEN_CASE["request"]
    return model_pb2.GenerateRequest(token_ids=GOLDEN_CASE["prompt_ids"], max_tokens=q["max_len"],
                                     temperature=q["temperature"], top_p=q["nucleus_p"], seed=q["rng_seed"],
                                     **fields)


def normal_request_works(service: str, s: Stubs) -> None:
    """The reference's output from the same service, right after the bad request."""
    if service == "gateway":
        assert s.gateway.Complete(golden_text_request(), timeout=60).text == GOLDEN_CASE["output_text"]
    elif service == "tokenizer":
        reply = s.tokenizer.Encode(tokenizer_pb2.EncodeRequest(text=GOLDEN_CASE["request"]["prompt"]), timeout=10)
        assert list(reply.token_ids) == GOLDEN_CASE["prompt_ids"]
    else:
        ids = [t for r in s.model.Generate(golden_model_request(), timeout=60) for t in r.token_ids]
        assert ids == GOLDEN_CASE["output_ids"]


@dataclass(frozen=True)
class Case:
    name: str
    service: str  # gateway | tokenizer | model
    call: Callable[[Stubs], Any]
    code: grpc.StatusCode
    field: str  # the BadRequest field violation ("" when the status has none)
    says: str = ""  # a fragment the message must contain besides the field


def text_request(kind: type, **fields: Any) -> Any:
    """A gateway GenerateRequest or CompleteRequest: the golden request with `fields` changed."""
    request = kind.FromString(golden_text_request().SerializeToString())  # the two share every field
    for key, value in fields.items():
        target = request if key == "prompt" else request.sampling
        if isinstance(value, list):
            getattr(target, key).extend(value)
        else:
            setattr(target, key, value)
    return request


def gen(**fields: Any) -> Callable[[Stubs], Any]:
    request = text_request(gateway_pb2.GenerateRequest, **fields)
    return lambda s: list(s.gateway.Generate(request, timeout=60))


def complete(**fields: Any) -> Callable[[Stubs], Any]:
    request = text_request(gateway_pb2.CompleteRequest, **fields)
    return lambda s: s.gateway.Complete(request, timeout=60)


def model(**fields: Any) -> Callable[[Stubs], Any]:
    request = golden_model_request()
    for key, value in fields.items():
        if isinstance(value, list):
            del getattr(request, key)[:]
            getattr(request, key).extend(value)
        else:
            setattr(request, key, value)
    return lambda s: list(s.model.Generate(request, timeout=60))


INVALID = grpc.StatusCode.INVALID_ARGUMENT
LONG_PROMPT = "one two three four five six seven eight nine ten " * 12  # over the 64-token bucket, < 4096 bytes

CASES = [
    # ---- gateway, Generate and Complete ----
    Case("gw-empty-prompt", "gateway", gen(prompt=""), INVALID, "prompt", "non-empty"),
    Case("gw-prompt-over-bytes", "gateway", complete(prompt="x" * 65537), INVALID, "prompt", "65536"),
    Case("gw-max-tokens-0", "gateway", gen(max_tokens=0), INVALID, "max_tokens", ">= 1"),
    Case("gw-max-tokens-negative", "gateway", complete(max_tokens=-5), INVALID, "max_tokens", ">= 1"),
    Case("gw-max-tokens-over-context", "gateway", gen(max_tokens=CONTEXT), INVALID, "max_tokens", "context"),
    Case("gw-temperature-negative", "gateway", gen(temperature=-0.5), INVALID, "temperature", ">= 0"),
    Case("gw-temperature-nan", "gateway", complete(temperature=math.nan), INVALID, "temperature", "finite"),
    Case("gw-temperature-inf", "gateway", gen(temperature=math.inf), INVALID, "temperature", "finite"),
    Case("gw-top-p-0", "gateway", gen(top_p=0.0), INVALID, "top_p", "(0, 1]"),
    Case("gw-top-p-over-1", "gateway", complete(top_p=1.5), INVALID, "top_p", "(0, 1]"),
    Case("gw-top-p-nan", "gateway", gen(top_p=math.nan), INVALID, "top_p", "(0, 1]"),
    Case("gw-top-p-negative", "gateway", gen(top_p=-0.1), INVALID, "top_p", "(0, 1]"),
    Case("gw-top-logprobs-9", "gateway", gen(top_logprobs=9), INVALID, "top_logprobs", "0..8"),
    Case("gw-top-logprobs-negative", "gateway", complete(top_logprobs=-1), INVALID, "top_logprobs", "0..8"),
    Case("gw-too-many-stops", "gateway", gen(stop=["a"] * 9), INVALID, "stop", "limit of 8"),
    Case("gw-empty-stop", "gateway", gen(stop=["ok", ""]), INVALID, "stop[1]", "non-empty"),
    Case("gw-stop-too-long", "gateway", complete(stop=["s" * 257]), INVALID, "stop[0]", "256"),
    Case("gw-allowed-out-of-vocab", "gateway", gen(allowed_token_ids=[VOCAB]), INVALID, "allowed_token_ids",
         "vocabulary"),
    Case("gw-blocked-negative", "gateway", complete(blocked_token_ids=[-1]), INVALID, "blocked_token_ids",
         "vocabulary"),
    Case("gw-only-pad-allowed", "gateway", gen(allowed_token_ids=[0]), INVALID,
         "allowed_token_ids/blocked_token_ids", "no token is left"),
    Case("gw-prompt-over-bucket", "gateway", gen(prompt=LONG_PROMPT), INVALID, "prompt", "longest prompt"),
    Case("gw-prompt-over-tokenizer-limit", "gateway", complete(prompt="y" * 5000), INVALID, "text", "4096"),
    # ---- tokenizer service, directly ----
    Case("tok-encode-over-limit", "tokenizer",
         lambda s: s.tokenizer.Encode(tokenizer_pb2.EncodeRequest(text="z" * 4097), timeout=10),
         INVALID, "text", "--max-text-bytes"),
    Case("tok-batch-too-large", "tokenizer",
         lambda s: s.tokenizer.EncodeBatch(tokenizer_pb2.EncodeBatchRequest(
             requests=[tokenizer_pb2.EncodeRequest(text="a")] * 5), timeout=10), INVALID, "requests", "--max-batch"),
    Case("tok-batch-text-over-limit", "tokenizer",
         lambda s: s.tokenizer.EncodeBatch(tokenizer_pb2.EncodeBatchRequest(requests=[
             tokenizer_pb2.EncodeRequest(text="a"), tokenizer_pb2.EncodeRequest(text="b" * 4097)]), timeout=10),
         INVALID, "requests[1].text", "4097"),
    Case("tok-decode-id-over-vocab", "tokenizer",
         lambda s: s.tokenizer.Decode(tokenizer_pb2.DecodeRequest(token_ids=[5, VOCAB]), timeout=10),
         INVALID, "token_ids[1]", "out of range"),
    Case("tok-decode-negative-id", "tokenizer",
         lambda s: s.tokenizer.Decode(tokenizer_pb2.DecodeRequest(token_ids=[-3]), timeout=10),
         INVALID, "token_ids[0]", "out of range"),
    Case("tok-decode-too-many-ids", "tokenizer",
         lambda s: s.tokenizer.Decode(tokenizer_pb2.DecodeRequest(token_ids=[5] * 257), timeout=10),
         INVALID, "token_ids", "--max-tokens"),
    Case("tok-stream-bad-id", "tokenizer",
         lambda s: list(s.tokenizer.DecodeStream(iter([tokenizer_pb2.DecodeStreamRequest(token_ids=[5]),
                                                       tokenizer_pb2.DecodeStreamRequest(token_ids=[10**6])]),
                                                 timeout=10)), INVALID, "token_ids[0]", "out of range"),
    Case("tok-stream-too-many-ids", "tokenizer",
         lambda s: list(s.tokenizer.DecodeStream(iter([tokenizer_pb2.DecodeStreamRequest(token_ids=[5] * 257)]),
                                                 timeout=10)), INVALID, "token_ids", "--max-tokens"),
    # ---- model service, directly ----
    Case("model-empty-prompt", "model", model(token_ids=[]), INVALID, "token_ids", "empty"),
    Case("model-id-over-vocab", "model", model(token_ids=[5, VOCAB]), INVALID, "token_ids", f"[0, {VOCAB})"),
    Case("model-negative-id", "model", model(token_ids=[-1]), INVALID, "token_ids", f"[0, {VOCAB})"),
    Case("model-prompt-over-bucket", "model", model(token_ids=[5] * (BUCKET + 1)), INVALID, "token_ids",
         "prefill bucket"),
    Case("model-max-tokens-0", "model", model(max_tokens=0), INVALID, "max_tokens", ">= 1"),
    Case("model-over-context", "model", model(token_ids=[5] * 60, max_tokens=69), INVALID, "max_tokens",
         "context"),
    Case("model-temperature-nan", "model", model(temperature=math.nan), INVALID, "temperature", "finite"),
    Case("model-temperature-negative", "model", model(temperature=-2.0), INVALID, "temperature", ">= 0"),
    Case("model-top-p-0", "model", model(top_p=0.0), INVALID, "top_p", "(0, 1]"),
    Case("model-top-p-inf", "model", model(top_p=math.inf), INVALID, "top_p", "(0, 1]"),
    Case("model-top-logprobs-9", "model", model(top_logprobs=9), INVALID, "top_logprobs", "0..8"),
    Case("model-blocked-out-of-vocab", "model", model(blocked_token_ids=[600]), INVALID, "blocked_token_ids",
         f"[0, {VOCAB})"),
    Case("model-allowed-negative", "model", model(allowed_token_ids=[-7]), INVALID, "allowed_token_ids",
         f"[0, {VOCAB})"),
    Case("model-nothing-left", "model", model(blocked_token_ids=list(range(1, VOCAB))), INVALID,
         "allowed_token_ids/blocked_token_ids", "no token is left"),
    # ---- health ----
    Case("health-unknown-service", "model",
         lambda s: health_pb2_grpc.HealthStub(s.channels["model"]).Check(
             health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=10),
         grpc.StatusCode.NOT_FOUND, "", "no.such.Service"),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_input_gets_a_clear_status_and_the_service_serves_on(golden_stubs: Stubs, case: Case) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        case.call(golden_stubs)
    error = caught.value
    message = error.details() or ""
    assert error.code() == case.code, message
    assert case.says in message
    assert not any(word in message for word in INTERNALS), message
    if case.field:
        assert case.field in message
        assert case.field in [v.field for v in details_of(error).violations]
    normal_request_works(case.service, golden_stubs)


def test_the_table_has_at_least_40_cases_over_every_service() -> None:
    assert len(CASES) >= 40 and {c.service for c in CASES} == {"gateway", "tokenizer", "model"}


MALFORMED = [  # (service, method, raw request bytes)
    ("gateway", "/grok.gateway.v1.GatewayService/Complete", b"\x0a\x03\xff\xfe\xfd"),  # prompt not UTF-8
    ("gateway", "/grok.gateway.v1.GatewayService/Generate", b"\x0a\x7fabc"),  # length past the end
    ("gateway", "/grok.gateway.v1.GatewayService/GetInfo", b"\xff\xff\xff"),
    ("tokenizer", "/grok.tokenizer.v1.TokenizerService/Encode", b"\x0a\x02\xc3\x28"),
    ("tokenizer", "/grok.tokenizer.v1.TokenizerService/Decode", b"\x0a\x05\x01\x02"),
    ("model", "/grok.model.v1.ModelService/Generate", b"\x0a\x09\x01"),
    ("model", "/grok.model.v1.ModelService/GetInfo", b"\x07"),
    ("model", "/grpc.health.v1.Health/Check", b"\x0a\x02\xff\xff"),
]


@pytest.mark.parametrize("service, method, raw", MALFORMED, ids=[f"{s}-{m.rsplit('/', 1)[1]}"
                                                                  for s, m, _ in MALFORMED])
def test_malformed_bytes_are_invalid_argument_at_every_service(golden_stack: Stack, golden_stubs: Stubs, service: str,
                                                               method: str, raw: bytes) -> None:
    streaming = method.endswith("/Generate")
    call = (golden_stubs.channels[service].unary_stream if streaming else golden_stubs.channels[service].unary_unary)(method)
    with pytest.raises(grpc.RpcError) as caught:
        reply = call(raw, timeout=10)
        if streaming:
            list(reply)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value.details()
    assert "not a valid" in caught.value.details()
    assert not any(word in caught.value.details() for word in INTERNALS)
    normal_request_works(service if method.startswith("/grok") else "model", golden_stubs)


def test_malformed_bytes_in_a_decode_stream_are_invalid_argument(golden_stubs: Stubs) -> None:
    call = golden_stubs.channels["tokenizer"].stream_stream("/grok.tokenizer.v1.TokenizerService/DecodeStream")
    good = tokenizer_pb2.DecodeStreamRequest(token_ids=[5]).SerializeToString()
    with pytest.raises(grpc.RpcError) as caught:
        list(call(iter([good, b"\x0a\xff"]), timeout=10))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "grok.tokenizer.v1.DecodeStreamRequest" in caught.value.details()


def test_malformed_requests_are_logged_as_one_warning_without_a_traceback(golden_stack: Stack,
                                                                          golden_stubs: Stubs) -> None:
    for service, method, raw in MALFORMED:
        with pytest.raises(grpc.RpcError):
            golden_stubs.channels[service].unary_unary(method)(raw, timeout=10)
    for proc in (golden_stack.gateway, golden_stack.tokenizer, golden_stack.models[0]):
        records = proc.log_records()
        assert any(r.get("msg") == "malformed request refused" and r.get("level") == "warning" for r in records)
        assert not [r for r in records if r.get("msg") == "malformed request refused" and "exc" in r]
        assert not [r for r in records if r.get("level") == "error" and "DecodeError" in json.dumps(r)]
