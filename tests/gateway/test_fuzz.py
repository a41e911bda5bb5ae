"""Hypothesis fuzzing of every request field against the running golden stack.

Whatever the values, a call ends promptly with a valid answer or a documented status (never UNKNOWN,
INTERNAL or a hang), and afterwards every service still serves the reference's output and has logged
no error. Each field has values the services accept and wild ones; an example makes at most two
fields wild, so both the serving path and each field's validation are exercised (run with
--hypothesis-show-statistics to see the mix of outcomes). Examples are derandomized: CI runs the same
ones every time.
"""

from __future__ import annotations

import json

import grpc
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from grok.gateway.v1 import gateway_pb2
from grok.model.v1 import model_pb2
from grok.tokenizer.v1 import tokenizer_pb2
from tests.gateway.conftest import Stack, Stubs
from tests.gateway.test_bad_input import normal_request_works

pytestmark = pytest.mark.slow

FUZZ = settings(max_examples=50, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
DOCUMENTED = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED}
CALL_SECONDS = 60  # a hang shows up as DEADLINE_EXCEEDED, which is not a documented answer here
VOCAB = 512
INT32 = st.integers(-2**31, 2**31 - 1)
FLOATS = st.floats(width=32)  # nan, infinities, subnormals included
ODD_TEXT = "ab |\n\u00e9\u4e2d\U0001F600\u200b\ufffd"

VALID = {
    "prompt": st.one_of(st.text(st.characters(codec="ascii"), min_size=1, max_size=40),
                        st.text(alphabet=ODD_TEXT, min_size=1, max_size=12)),
    "max_tokens": st.integers(1, 8),
    "temperature": st.floats(0, 2, width=32),
    "top_p": st.floats(0.0625, 1, width=32),
    "seed": st.integers(0, 2**32 - 1),
    "stop": st.lists(st.text(min_size=1, max_size=6), max_size=4),
    "top_logprobs": st.integers(0, 8),
    "allowed_token_ids": st.lists(st.integers(1, VOCAB - 1), max_size=12),
    "blocked_token_ids": st.lists(st.integers(0, VOCAB - 1), max_size=12),
    "token_ids": st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=60),
    "top_k": st.integers(-1, 600),
    "min_p": st.floats(0, 1, width=32),
    "repetition_penalty": st.floats(0.0625, 4, width=32),
    "presence_penalty": st.floats(-2, 2, width=32),
    "frequency_penalty": st.floats(-2, 2, width=32),
    "logit_bias": st.dictionaries(st.integers(0, VOCAB - 1), st.floats(-100, 100, width=32), max_size=8),
    "stop_token_ids": st.lists(st.integers(0, VOCAB - 1), max_size=6),
}
WILD = {
    "prompt": st.one_of(st.text(max_size=40), st.text(alphabet=ODD_TEXT, max_size=400)),
    "max_tokens": st.one_of(st.integers(-2, 200), INT32),
    "temperature": FLOATS,
    "top_p": FLOATS,
    "seed": st.integers(0, 2**32 - 1),
    "stop": st.lists(st.text(max_size=300), max_size=10),
    "top_logprobs": st.one_of(st.integers(-2, 10), INT32),
    "allowed_token_ids": st.lists(st.one_of(st.integers(-3, 600), INT32), max_size=12),
    "blocked_token_ids": st.one_of(st.lists(st.one_of(st.integers(-3, 600), INT32), max_size=12),
                                   st.just(list(range(1, VOCAB)))),
    "token_ids": st.lists(st.one_of(st.integers(0, 600), INT32), max_size=70),
    "top_k": st.one_of(st.integers(-3, 700), INT32),
    "min_p": FLOATS,
    "repetition_penalty": FLOATS,
    "presence_penalty": FLOATS,
    "frequency_penalty": FLOATS,
    "logit_bias": st.dictionaries(st.one_of(st.integers(-3, 600), INT32), FLOATS, max_size=8),
    "stop_token_ids": st.lists(st.one_of(st.integers(-3, 600), INT32), max_size=80),
}
OPTIONAL = ("max_tokens", "top_p", "seed", "repetition_penalty")
CONTROLS = ("top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "logit_bias",
            "stop_token_ids")
SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "seed", "stop", "top_logprobs", "allowed_token_ids",
                   "blocked_token_ids") + CONTROLS
MODEL_FIELDS = ("token_ids", "max_tokens", "temperature", "top_p", "seed", "top_logprobs", "allowed_token_ids",
                "blocked_token_ids") + CONTROLS


def fill(draw: st.DrawFn, request: object, fields: tuple[str, ...]) -> None:
    """Set each field from VALID, or from WILD for up to two of them; optional ones may stay unset."""
    wild = set(draw(st.lists(st.sampled_from(fields), max_size=2)))
    for field in fields:
        if field in OPTIONAL and draw(st.integers(0, 4)) == 0:
            continue
        value = draw((WILD if field in wild else VALID)[field])
        if isinstance(value, list):
            getattr(request, field).extend(value)
        elif isinstance(value, dict):
            getattr(request, field).update(value)
        else:
            setattr(request, field, value)


@st.composite
def text_requests(draw: st.DrawFn) -> gateway_pb2.CompleteRequest:
    request = gateway_pb2.CompleteRequest(sampling=gateway_pb2.SamplingParams(ignore_eos=draw(st.booleans())))
    fill(draw, request, ("prompt",))
    fill(draw, request.sampling, SAMPLING_FIELDS)
    return request


@st.composite
def model_requests(draw: st.DrawFn) -> model_pb2.GenerateRequest:
    request = model_pb2.GenerateRequest(ignore_eos=draw(st.booleans()), request_id=draw(st.text(max_size=20)))
    fill(draw, request, MODEL_FIELDS)
    return request


def outcome(call: object) -> grpc.StatusCode:
    try:
        call()  # type: ignore[operator]
    except grpc.RpcError as error:
        assert error.code() in DOCUMENTED, (error.code(), error.details())
        event(error.code().name)
        return error.code()
    event("OK")
    return grpc.StatusCode.OK


@FUZZ
@given(request=text_requests(), streamed=st.booleans())
def test_gateway_answers_any_request_with_text_or_a_documented_status(golden_stubs: Stubs,
                                                                     request: gateway_pb2.CompleteRequest,
                                                                     streamed: bool) -> None:
    if streamed:
        generate = gateway_pb2.GenerateRequest.FromString(request.SerializeToString())
        replies: list[gateway_pb2.GenerateResponse] = []
        if outcome(lambda: replies.extend(golden_stubs.gateway.Generate(generate, timeout=CALL_SECONDS))) \
                == grpc.StatusCode.OK:
            assert replies[-1].finish_reason != gateway_pb2.FINISH_REASON_UNSPECIFIED
            assert all(r.text == "".join(t.text for t in r.tokens) for r in replies[:-1])
        return
    reply: list[gateway_pb2.CompleteResponse] = []
    if outcome(lambda: reply.append(golden_stubs.gateway.Complete(request, timeout=CALL_SECONDS))) \
            == grpc.StatusCode.OK:
        done = reply[0]
        assert done.finish_reason != gateway_pb2.FINISH_REASON_UNSPECIFIED
        assert done.usage.total_tokens == done.usage.prompt_tokens + done.usage.completion_tokens
        assert not any(stop in done.text for stop in request.sampling.stop)
        blocked = set(request.sampling.blocked_token_ids) | {0}
        assert not blocked & {t.id for t in done.tokens}


@FUZZ
@given(request=model_requests())
def test_model_service_answers_any_request_with_tokens_or_a_documented_status(
        golden_stubs: Stubs, request: model_pb2.GenerateRequest) -> None:
    replies: list[model_pb2.GenerateResponse] = []
    if outcome(lambda: replies.extend(golden_stubs.model.Generate(request, timeout=CALL_SECONDS))) \
            == grpc.StatusCode.OK:
        assert replies[-1].finish_reason != model_pb2.FINISH_REASON_UNSPECIFIED
        ids = [t for r in replies for t in r.token_ids]
        assert all(0 < t < VOCAB for t in ids)  # never the pad id
        assert not set(ids) & set(request.blocked_token_ids)
        if request.allowed_token_ids:
            assert set(ids) <= set(request.allowed_token_ids)


@FUZZ
@given(text=st.one_of(st.text(max_size=600), st.text(alphabet=ODD_TEXT, max_size=5000)),
       ids=st.lists(st.one_of(st.integers(0, VOCAB - 1), st.integers(-3, 600), INT32), max_size=300),
       chunks=st.lists(st.lists(st.one_of(st.integers(0, VOCAB - 1), INT32), max_size=5), max_size=6),
       flags=st.tuples(st.booleans(), st.booleans()))
def test_tokenizer_answers_any_request_or_a_documented_status(golden_stubs: Stubs, text: str, ids: list[int],
                                                              chunks: list[list[int]],
                                                              flags: tuple[bool, bool]) -> None:
    tokenizer = golden_stubs.tokenizer
    outcome(lambda: tokenizer.Encode(tokenizer_pb2.EncodeRequest(text=text, add_bos=flags[0], add_eos=flags[1]),
                                     timeout=CALL_SECONDS))
    outcome(lambda: tokenizer.Decode(tokenizer_pb2.DecodeRequest(token_ids=ids), timeout=CALL_SECONDS))
    outcome(lambda: list(tokenizer.DecodeStream(iter([tokenizer_pb2.DecodeStreamRequest(token_ids=c)
                                                      for c in chunks]), timeout=CALL_SECONDS)))
    batch = [tokenizer_pb2.EncodeRequest(text=text[i:i + 50]) for i in range(0, min(len(text), 300), 50)]
    outcome(lambda: tokenizer.EncodeBatch(tokenizer_pb2.EncodeBatchRequest(requests=batch), timeout=CALL_SECONDS))


def test_after_fuzzing_every_service_serves_and_logged_no_error(golden_stack: Stack, golden_stubs: Stubs) -> None:
    for service in ("gateway", "tokenizer", "model"):
        normal_request_works(service, golden_stubs)
    for proc in (golden_stack.gateway, golden_stack.tokenizer, *golden_stack.models):
        assert proc.proc.poll() is None
        errors = [r for r in proc.log_records() if r.get("level") == "error"]
        assert not errors, json.dumps(errors[:3])[:2000]
