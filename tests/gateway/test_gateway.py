"""The gateway as a real process in front of fake backends: streaming, stops, validation, statuses."""

from __future__ import annotations

import asyncio
import math
import urllib.request

import grpc
import pytest

from gateway.client import AsyncGatewayClient, GatewayClient, completion_request, generate_request
from grok.gateway.v1 import gateway_pb2
from tests.gateway.conftest import Stack
from tests.gateway.fakes import PIECES
from tests.waiting import wait_until


def outcomes(stack: Stack, index: int = 0) -> list[str]:
    return [r["outcome"] for r in stack.models[index].log_records() if r.get("msg") == "request done"]


def outcome_of(stack: Stack, request_id: str, index: int = 0, timeout: float = 5.0) -> str:
    """How the fake model says the request `request_id` ended ("finished"/"cancelled"), once logged."""
    def logged() -> list[str]:
        return [r["outcome"] for r in stack.models[index].log_records()
                if r.get("msg") == "request done" and r.get("rid") == request_id]
    return wait_until(logged, timeout, interval=0.02, message=f"the model never logged {request_id!r} done")[0]


def test_stream_carries_per_token_text_and_ends_with_usage_and_finish_reason(client: GatewayClient) -> None:
    messages = list(client.generate("xy|hello world", max_tokens=20, top_logprobs=2))
    assert "".join(m.text for m in messages) == "hello world"
    assert all(m.text == "".join(t.text for t in m.tokens) for m in messages)
    assert all(not m.HasField("usage") for m in messages[:-1])
    last = messages[-1]
    assert last.finish_reason == gateway_pb2.FINISH_REASON_EOS
    assert last.usage.prompt_tokens == 7 and last.usage.completion_tokens == 5  # x y | hello " " wor ld / +EOS
    assert last.usage.total_tokens == 12
    first = messages[0].tokens[0]
    assert first.text == "hello" and math.isclose(first.probability, 0.5) and math.isclose(first.logprob, math.log(0.5), rel_tol=1e-6)
    # Alternatives are the pieces decoded on their own: the fake's alternatives are id, id+1, ...
    assert [t.text for t in first.top_tokens] == ["hello", PIECES[1]]
    assert last.timings.total_seconds >= last.timings.time_to_first_token_seconds > 0


def test_complete_text_equals_concatenated_stream(client: GatewayClient) -> None:
    options = dict(max_tokens=30, stop=["rl"], ignore_eos=True)
    streamed = list(client.generate("p|hello world, again ", **options))
    complete = client.complete("p|hello world, again ", **options)
    assert complete.text == "".join(m.text for m in streamed) == "hello wo"
    assert [t.id for t in complete.tokens] == [t.id for m in streamed for t in m.tokens]
    assert complete.finish_reason == streamed[-1].finish_reason == gateway_pb2.FINISH_REASON_STOP
    assert complete.usage == streamed[-1].usage


def test_max_tokens_gives_finish_reason_length(client: GatewayClient) -> None:
    reply = client.complete("p|abc", max_tokens=7, ignore_eos=True)
    assert reply.text == "abcabcabcab"  # "ab" is one piece: ab c ab c ab c ab
    assert reply.finish_reason == gateway_pb2.FINISH_REASON_LENGTH and reply.usage.completion_tokens == 7


def test_stop_across_token_boundaries_is_not_emitted_and_ends_the_model_stream(slow_stack: Stack) -> None:
    # The slow fake model (50 ms per token) needs 5 s for the 100 tokens allowed: only a cancel from the
    # gateway can end its stream after the third token, however loaded the machine is.
    with GatewayClient(slow_stack.address, timeout=30) as client:
        messages = list(client.generate("p|hello world", max_tokens=100, stop=["lo wo", "zz"], ignore_eos=True,
                                        request_id="stop-test"))
    assert "".join(m.text for m in messages) == "hel"
    assert messages[-1].finish_reason == gateway_pb2.FINISH_REASON_STOP
    # The stop spans "hello", " " and "wor"; "hello" is cut to what it added to the completion.
    assert [t.text for m in messages for t in m.tokens] == ["hel"]
    assert messages[-1].usage.completion_tokens == 3
    # Ending at the stop cancelled the model's stream (100 tokens were allowed).
    assert outcome_of(slow_stack, "stop-test") == "cancelled"


def test_a_stop_inside_a_message_of_several_tokens_counts_the_tokens_up_to_the_stop(grouped_stack: Stack) -> None:
    # The model sends hello, " ", wor, ld in one message: the stop completes at wor, so ld is not the
    # completion's (as when the tokens arrive one per message).
    with GatewayClient(grouped_stack.address, timeout=30) as client:
        reply = client.complete("p|hello world", max_tokens=12, stop=["lo wo"], ignore_eos=True)
    assert reply.text == "hel" and reply.finish_reason == gateway_pb2.FINISH_REASON_STOP
    assert reply.usage.completion_tokens == 3


def test_multibyte_characters_are_never_split_across_messages(client: GatewayClient) -> None:
    text = "aé🙂ü€b"
    messages = list(client.generate("p|" + text.replace("é", "\u00e9"), max_tokens=40))
    assert "".join(m.text for m in messages) == text
    for message in messages:
        assert "\ufffd" not in message.text
        message.text.encode("utf-8")  # every delta is whole characters
    texts = [t.text for m in messages for t in m.tokens]
    # 🙂 is four byte tokens: three empty texts, then the character.
    assert texts[2:6] == ["", "", "", "🙂"]


def test_invalid_utf8_from_the_model_becomes_replacement_characters_as_decode_does(client: GatewayClient) -> None:
    # The prompt ends in a lone lead byte's token only through the fake's byte ids: use blocked ids
    # instead to show the model's raw bytes pass through the detokenizer: "\xe2" then "a".
    reply = client.complete("p|€", max_tokens=2, ignore_eos=True)
    assert reply.text == "\ufffd"  # two of the three bytes of €, flushed at the end as Decode does
    assert reply.finish_reason == gateway_pb2.FINISH_REASON_LENGTH
    assert "".join(t.text for t in reply.tokens) == reply.text


BAD_REQUESTS = [
    ({"prompt": ""}, "prompt"),
    ({"prompt": "x" * 201}, "prompt"),
    ({"prompt": "p|a", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "p|a", "max_tokens": 126}, "max_tokens"),  # 3 prompt tokens + 126 > 128
    ({"prompt": "p|a", "temperature": -1.0}, "temperature"),
    ({"prompt": "p|a", "temperature": math.nan}, "temperature"),
    ({"prompt": "p|a", "temperature": math.inf}, "temperature"),
    ({"prompt": "p|a", "top_p": 0.0}, "top_p"),
    ({"prompt": "p|a", "top_p": 1.5}, "top_p"),
    ({"prompt": "p|a", "top_logprobs": 21}, "top_logprobs"),
    ({"prompt": "p|a", "allowed_token_ids": [512]}, "allowed_token_ids"),
    ({"prompt": "p|a", "blocked_token_ids": [-3]}, "blocked_token_ids"),
    ({"prompt": "p|a", "stop": ["a", "b", "c", "d"]}, "stop"),
    ({"prompt": "p|a", "stop": ["x" * 11]}, "stop[0]"),
    ({"prompt": "p|a", "stop": [""]}, "stop[0]"),
    ({"prompt": "x" * 65}, "prompt"),  # 65 tokens: over the longest prefill bucket (64)
]


@pytest.mark.parametrize(("fields", "field"), BAD_REQUESTS, ids=[f"{f}-{i}" for i, (_, f) in enumerate(BAD_REQUESTS)])
def test_bad_request_is_invalid_argument_naming_the_field_on_both_rpcs(fast_stack: Stack, fields: dict,
                                                                        field: str) -> None:
    with GatewayClient(fast_stack.address, timeout=10) as c:
        request = generate_request(**fields)
        for call in (lambda: list(c.stub.Generate(request, timeout=10)),
                     lambda: c.stub.Complete(completion_request(**fields), timeout=10)):
            with pytest.raises(grpc.RpcError) as caught:
                call()
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert caught.value.details().startswith(f"{field}:"), caught.value.details()


def test_unset_max_tokens_uses_the_default_flag(client: GatewayClient) -> None:
    assert client.complete("p|ab", ignore_eos=True).usage.completion_tokens == 20


def test_get_info_reports_model_tokenizer_and_limits_but_no_addresses(fast_stack: Stack, client: GatewayClient) -> None:
    info = client.info()
    assert info.model.config.vocab_size == 512 and info.tokenizer.vocab_size == 512
    assert not info.model_addresses  # internal: in the gateway's log only
    assert info.limits.max_stop_sequences == 3 and info.limits.max_stop_chars == 10
    assert info.limits.max_prompt_bytes == 200 and info.limits.default_max_tokens == 20


def test_async_client_streams_and_completes(fast_stack: Stack) -> None:
    async def main() -> tuple[str, str]:
        async with AsyncGatewayClient(fast_stack.address, timeout=10) as c:
            streamed = "".join([m.text async for m in c.generate("p|hello", max_tokens=10)])
            return streamed, (await c.complete("p|hello", max_tokens=10)).text
    assert asyncio.run(main()) == ("hello", "hello")


def test_metrics_endpoint_counts_requests_tokens_and_latencies(fast_stack: Stack, client: GatewayClient) -> None:
    client.complete("p|ab", max_tokens=3, ignore_eos=True)
    with pytest.raises(grpc.RpcError):
        client.complete("")
    args = list(fast_stack.gateway.proc.args)
    port = args[args.index("--metrics-port") + 1]
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    assert 'grok_gateway_requests_total{code="OK",finish_reason="LENGTH",method="Complete"}' in body
    assert 'grok_gateway_requests_total{code="INVALID_ARGUMENT",finish_reason="NONE",method="Complete"}' in body
    for name in ("time_to_first_token_seconds", "inter_token_latency_seconds", "request_duration_seconds"):
        assert f'grok_gateway_{name}_count{{method="Complete"}}' in body
    assert "grok_gateway_completion_tokens_total" in body and "grok_gateway_prompt_tokens_total" in body



def test_chat_refuses_an_empty_conversation_and_a_template_refusal_naming_messages(client: GatewayClient) -> None:
    for messages in ([], [{"role": "robot", "content": "x"}]):
        with pytest.raises(grpc.RpcError) as caught:
            list(client.chat(messages, max_tokens=2))
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert caught.value.details().startswith("messages: "), caught.value.details()


def test_chat_streams_what_generate_streams_for_the_rendered_prompt(client: GatewayClient) -> None:
    messages = [{"role": "user", "content": "hi"}]
    chat = list(client.chat(messages, max_tokens=5))
    assert chat[-1].finish_reason and chat[-1].usage.prompt_tokens > 0
    assert sum(len(m.tokens) for m in chat) == chat[-1].usage.completion_tokens


def test_chat_answer_ends_before_the_next_turn_the_model_starts(client: GatewayClient) -> None:
    # The fake repeats the prompt after "|": "hi", then the template's next turn "\n\nUser: more\n\nAssistant:".
    messages = [{"role": "user", "content": "x|hi"}, {"role": "user", "content": "more"}]
    chat = list(client.chat(messages, max_tokens=40))
    assert "".join(m.text for m in chat) == "hi" and chat[-1].finish_reason == gateway_pb2.FINISH_REASON_STOP
