"""n > 1 end to end on the real golden stack (its model has 2 slots): through the gateway's gRPC API (a stream
whose messages carry the completion index, Complete's choices) and the HTTP API with the openai package
(choices by index, streamed and not). Completion i equals a plain request with seed + i."""

from __future__ import annotations

import grpc
import pytest

from gateway.client import GatewayClient, completion_request
from grok.gateway.v1 import gateway_pb2
from grok.model.v1 import model_pb2
from serving_common.limits import MAX_SAMPLES
from tests.gateway.conftest import Stack, Stubs
from tests.gateway.http_client import post, sdk

pytestmark = pytest.mark.slow

PROMPT = "The quick brown fox"
OPTIONS = dict(max_tokens=6, temperature=1.0, seed=41, ignore_eos=True, top_k=40)


def plain(stack: Stack, seed: int) -> gateway_pb2.CompleteResponse:
    with GatewayClient(stack.address, timeout=60) as client:
        return client.complete(PROMPT, **{**OPTIONS, "seed": seed})


def test_grpc_stream_and_complete_give_n_completions_equal_to_seeded_requests(golden_stack: Stack) -> None:
    with GatewayClient(golden_stack.address, timeout=60) as client:
        messages = list(client.generate(PROMPT, n=2, **OPTIONS))
        whole = client.complete(PROMPT, n=2, **OPTIONS)
    alone = [plain(golden_stack, 41), plain(golden_stack, 42)]
    assert alone[0].text != alone[1].text
    for i in range(2):
        mine = [m for m in messages if m.index == i]
        assert "".join(m.text for m in mine) == alone[i].text
        assert mine[-1].finish_reason == gateway_pb2.FINISH_REASON_LENGTH and mine[-1].usage.completion_tokens == 6
        assert whole.choices[i].index == i and whole.choices[i].text == alone[i].text
        assert whole.choices[i].completion_tokens == 6
    assert whole.text == alone[0].text
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (alone[0].usage.prompt_tokens, 12)


def test_n_beyond_the_models_slots_is_served_and_out_of_range_is_invalid(golden_stubs: Stubs,
                                                                          golden_http_url: str) -> None:
    """Issue 65.8: samples beyond the model's slots wait for one (vLLM's n does not depend on max_num_seqs)."""
    slots = golden_stubs.model.GetInfo(model_pb2.GetInfoRequest(), timeout=30).slots
    status, body = post(f"{golden_http_url}/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "n": slots + 3,
                                                              "seed": 5, "temperature": 1.0})
    assert status == 200 and [c["index"] for c in body["choices"]] == list(range(slots + 3)), body
    with pytest.raises(grpc.RpcError) as caught:
        golden_stubs.gateway.Complete(completion_request(PROMPT, max_tokens=2, n=MAX_SAMPLES + 1), timeout=30)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and caught.value.details().startswith("n:")
    for n in (MAX_SAMPLES + 1, 0):
        status, body = post(f"{golden_http_url}/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "n": n})
        assert status == 400 and body["error"]["param"] == "n"


def test_openai_completions_with_n_return_one_choice_per_seed(golden_stack: Stack, golden_http_url: str) -> None:
    client = sdk(golden_http_url)
    extra = {"ignore_eos": True, "top_k": 40}
    reply = client.completions.create(model="grok-1", prompt=PROMPT, n=2, max_tokens=6, temperature=1.0, seed=41,
                                      extra_body=extra)
    alone = [plain(golden_stack, 41).text, plain(golden_stack, 42).text]
    assert [c.index for c in reply.choices] == [0, 1] and [c.text for c in reply.choices] == alone
    assert reply.usage.completion_tokens == 12
    chunks = list(client.completions.create(model="grok-1", prompt=PROMPT, n=2, max_tokens=6, temperature=1.0,
                                            seed=41, stream=True, stream_options={"include_usage": True},
                                            extra_body=extra))
    texts = ["".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i) for i in range(2)]
    assert texts == alone
    assert sorted(c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason) == [0, 1]
    assert chunks[-1].usage.completion_tokens == 12


def test_openai_chat_with_n_returns_n_messages(golden_http_url: str) -> None:
    reply = sdk(golden_http_url).chat.completions.create(model="grok-1", messages=[{"role": "user", "content": "Hi"}], n=2,
                                                  max_tokens=4, temperature=1.0, seed=3,
                                                  extra_body={"ignore_eos": True})
    assert [c.index for c in reply.choices] == [0, 1]
    assert all(c.message.role == "assistant" and c.finish_reason == "length" for c in reply.choices)
    assert reply.usage.completion_tokens == 8


def test_a_list_of_prompts_with_n_gives_each_prompt_n_choices_in_order(golden_stack: Stack,
                                                                        golden_http_url: str) -> None:
    """Prompt i's completion j is choice i * n + j, each equal to that prompt's request with seed + j; usage counts
    each prompt once."""
    prompts = [PROMPT, "The model service"]
    options = {"max_tokens": 6, "temperature": 1.0, "seed": 41, "extra_body": {"ignore_eos": True, "top_k": 40}}
    client = sdk(golden_http_url)
    reply = client.completions.create(model="grok-1", prompt=prompts, n=2, **options)
    alone = [client.completions.create(model="grok-1", prompt=p, n=2, **options) for p in prompts]
    assert [c.index for c in reply.choices] == [0, 1, 2, 3]
    assert [c.text for c in reply.choices] == [c.text for a in alone for c in a.choices]
    assert reply.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert reply.usage.completion_tokens == 24
