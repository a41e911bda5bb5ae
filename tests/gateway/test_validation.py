"""Unit tests of request validation and max_tokens planning (gateway/validation.py)."""

from __future__ import annotations

import math

import grpc
import pytest

from gateway.client import generate_request
from gateway.config import PROMPT_BYTES_PER_TOKEN, Limits, prompt_byte_limit
from gateway.errors import GatewayError
from gateway.validation import check_request, plan
from grok.gateway.v1 import gateway_pb2
from grok.model.v1 import model_pb2

LIMITS = Limits(max_prompt_bytes=16, max_stop=2, max_stop_chars=4, default_max_tokens=50)
INFO = model_pb2.GetInfoResponse(config=model_pb2.ModelConfig(vocab_size=100, sequence_len=64), prefill_buckets=[8, 32])


def bad_field(**fields: object) -> str:
    request = generate_request(**{"prompt": "hi", **fields})
    with pytest.raises(GatewayError) as caught:
        check_request(request, LIMITS)
    assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
    return caught.value.message


@pytest.mark.parametrize(("fields", "field"), [
    ({"prompt": ""}, "prompt"),
    ({"prompt": "x" * 17}, "prompt"),
    ({"prompt": "é" * 9}, "prompt"),  # 18 bytes, 9 characters
    ({"max_tokens": 0}, "max_tokens"),
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": math.nan}, "temperature"),
    ({"temperature": math.inf}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.01}, "top_p"),
    ({"top_p": math.nan}, "top_p"),
    ({"top_logprobs": 21}, "top_logprobs"),
    ({"top_logprobs": -1}, "top_logprobs"),
    ({"stop": ["a", "b", "c"]}, "stop"),
    ({"stop": ["abcde"]}, "stop[0]"),
    ({"stop": ["a", ""]}, "stop[1]"),
    ({"top_k": -2}, "top_k"),
    ({"min_p": -0.1}, "min_p"),
    ({"min_p": 1.5}, "min_p"),
    ({"min_p": math.nan}, "min_p"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"repetition_penalty": -1.0}, "repetition_penalty"),
    ({"repetition_penalty": math.inf}, "repetition_penalty"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -2.01}, "frequency_penalty"),
    ({"frequency_penalty": math.nan}, "frequency_penalty"),
    ({"logit_bias": {3: 100.5}}, "logit_bias"),
    ({"logit_bias": {3: math.nan}}, "logit_bias"),
    ({"logit_bias": {i: 1.0 for i in range(301)}}, "logit_bias"),
    ({"stop_token_ids": [1] * 65}, "stop_token_ids"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
])
def test_bad_parameter_is_invalid_argument_naming_the_field(fields: dict, field: str) -> None:
    assert bad_field(**fields).startswith(f"{field}:")


def test_good_request_passes() -> None:
    check_request(generate_request("é" * 8, max_tokens=1, temperature=0.5, top_p=1.0, top_logprobs=8,
                                   stop=["abcd", "x"], top_k=-1, min_p=1.0, repetition_penalty=0.01,
                                   presence_penalty=-2.0, frequency_penalty=2.0, logit_bias={5: -100.0, 6: 100.0},
                                   stop_token_ids=[1] * 64), LIMITS)


def test_unset_max_tokens_is_default_lowered_to_fit_the_context() -> None:
    assert plan(generate_request("p"), [5] * 4, INFO, LIMITS).max_tokens == 50
    assert plan(generate_request("p"), [5] * 30, INFO, LIMITS).max_tokens == 34


@pytest.mark.parametrize(("fields", "ids", "field"), [
    ({"max_tokens": 60}, [5] * 5, "max_tokens"),
    ({}, [5] * 33, "prompt"),
    ({"allowed_token_ids": [3, 100]}, [5], "allowed_token_ids"),
    ({"blocked_token_ids": [-1]}, [5], "blocked_token_ids"),
    ({"stop_token_ids": [100]}, [5], "stop_token_ids"),
    ({"logit_bias": {-1: 1.0}}, [5], "logit_bias"),
    ({"logit_bias": {100: 1.0}}, [5], "logit_bias"),
    ({"truncate_prompt_tokens": 65}, [5], "truncate_prompt_tokens"),
    ({"truncate_prompt_tokens": -1}, [5] * 70, "prompt"),  # the context's 64 tokens leave no room to generate
])
def test_plan_rejects_what_does_not_fit_the_model(fields: dict, ids: list[int], field: str) -> None:
    with pytest.raises(GatewayError) as caught:
        plan(generate_request("p", **fields), ids, INFO, LIMITS)
    assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.message.startswith(f"{field}:")


def test_prompt_plus_max_tokens_equal_to_context_is_allowed() -> None:
    assert plan(generate_request("p", max_tokens=59), [5] * 5, INFO, LIMITS).max_tokens == 59


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens() -> None:
    """vLLM's truncate_prompt_tokens: the last k tokens (those nearest the completion); a shorter prompt is kept
    whole; -1 keeps what the context holds; the default max_tokens then follows the kept prompt."""
    ids = list(range(10, 30))
    kept = plan(generate_request("p", truncate_prompt_tokens=3), ids, INFO, LIMITS)
    assert kept.prompt_ids == (27, 28, 29) and kept.max_tokens == 50
    whole = plan(generate_request("p", truncate_prompt_tokens=20), ids, INFO, LIMITS)
    assert whole.prompt_ids == tuple(ids)
    assert plan(generate_request("p", truncate_prompt_tokens=-1), ids, INFO, LIMITS).prompt_ids == tuple(ids)
    long = plan(generate_request("p", truncate_prompt_tokens=30), [5] * 33 + [6] * 30, INFO, LIMITS)
    assert long.prompt_ids == (6,) * 30 and long.max_tokens == 34  # 63 tokens would be over the longest prompt
    check_request(generate_request("p", truncate_prompt_tokens=-1), LIMITS)


def test_by_default_an_english_prompt_one_token_short_of_the_context_is_accepted() -> None:
    """Issue 64.4's repro: an 8,191-token English prompt of 67 KB at context 8,192 was refused for its bytes
    (the fixed 64 KiB default); the default now follows the context (PROMPT_BYTES_PER_TOKEN a token; English
    takes far fewer, as the next test checks), so the context decides."""
    prompt = ("The quick brown fox jumps over the lazy dog near the riverbank. " * 1100)[:67_000]
    request = generate_request(prompt)
    check_request(request, Limits())
    info = model_pb2.GetInfoResponse(config=model_pb2.ModelConfig(vocab_size=1024, sequence_len=8192))
    assert plan(request, [5] * 8191, info, Limits()).prompt_ids == (5,) * 8191


def test_the_derived_byte_limit_refuses_a_prompt_over_it_naming_the_limit_and_the_flag() -> None:
    small = model_pb2.GetInfoResponse(config=model_pb2.ModelConfig(vocab_size=100, sequence_len=64))
    limit = 64 * PROMPT_BYTES_PER_TOKEN
    plan(generate_request("x" * limit), [5] * 10, small, Limits())
    with pytest.raises(GatewayError) as caught:
        plan(generate_request("x" * (limit + 1)), [5] * 10, small, Limits())
    assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
    message = caught.value.message
    assert message.startswith("prompt:") and str(limit) in message and "--max-prompt-bytes" in message
    assert prompt_byte_limit(Limits(), 64) == limit and prompt_byte_limit(Limits(max_prompt_bytes=9), 64) == 9


def test_english_takes_well_under_the_default_bytes_per_token_with_grok1s_and_the_demos_tokenizers() -> None:
    import pathlib

    import sentencepiece as spm

    from tests.procs import GROK1_TOKENIZER, ROOT

    text = "\n".join(p.read_text() for p in sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"])
    for model in (GROK1_TOKENIZER, ROOT / "demo" / "tokenizer.model"):
        ids = spm.SentencePieceProcessor(model_file=str(model)).encode(text)
        assert len(text.encode()) / len(ids) < PROMPT_BYTES_PER_TOKEN / 2, (pathlib.Path(model).name, len(ids))
