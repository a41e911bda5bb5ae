"""Bad input at every service of the real stack (golden tiny model), table-driven.

Each case checks the status, that the message names what is wrong without internals (no exception
classes, tracebacks or addresses), the google.rpc BadRequest field violation where there is one, and
that a normal request to the same service right after still gets the reference's output. Raw bytes
that do not parse (corrupt protobuf, a string that is not UTF-8) are refused with INVALID_ARGUMENT
by every service and logged as one warning line, never an error with a traceback.
"""

from __future__ import annotations

import json
from typing import Any

import grpc
import pytest

from benchmarks.attack_cases import MALFORMED, Facts, bad_input_cases
from gateway.client import completion_request
from grok.gateway.v1 import gateway_pb2
from grok.model.v1 import model_pb2
from grok.tokenizer.v1 import tokenizer_pb2
from serving_common.errors import details_of
from tests.gateway.conftest import Stack, Stubs
from tests.procs import GOLDEN

pytestmark = pytest.mark.slow

GOLDEN_CASE = json.loads((GOLDEN / "pipeline_fp32.json").read_text())["requests"][1]
VOCAB, CONTEXT, BUCKET = 512, 128, 127  # BUCKET: the longest prompt the model accepts
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


# The table is shared with the attack command (benchmarks/attack_cases.py), here on the golden stack's facts.
GOLDEN_FACTS = Facts(vocab=VOCAB, context=CONTEXT, bucket=BUCKET, prompt=GOLDEN_CASE["request"]["prompt"],
                     prompt_ids=tuple(GOLDEN_CASE["prompt_ids"]))
CASES = bad_input_cases(GOLDEN_FACTS)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_input_gets_a_clear_status_and_the_service_serves_on(golden_stubs: Stubs, case: Case) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        case.call(golden_stubs)
    error = caught.value
    message = error.details() or ""
    assert error.code().name == case.code, message
    assert case.says in message
    assert not any(word in message for word in INTERNALS), message
    if case.field:
        assert case.field in message
        assert case.field in [v.field for v in details_of(error).violations]
    normal_request_works(case.service, golden_stubs)


def test_the_table_has_at_least_40_cases_over_every_service() -> None:
    assert len(CASES) >= 40 and {c.service for c in CASES} == {"gateway", "tokenizer", "model"}


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
