"""Issue 12's sampling controls end to end on the real golden stack: the gateway's gRPC API and the HTTP API
(official openai package) carry top_k, min_p, the penalties, logit_bias and stop_token_ids to the model
service unchanged (the same tokens as a direct model call), agree with each other, and refuse bad values
naming the field."""

from __future__ import annotations

import json

import grpc
import pytest

from gateway.client import GatewayClient, completion_request
from grok.gateway.v1 import gateway_pb2
from grok.model.v1 import model_pb2
from grok.tokenizer.v1 import tokenizer_pb2
from tests.gateway.conftest import Stack, Stubs
from tests.gateway.http_client import post, sdk
from tests.procs import grpcurl

pytestmark = pytest.mark.slow

PROMPT = "The quick brown fox"
CONTROLS = dict(top_k=12, min_p=0.02, repetition_penalty=1.4, presence_penalty=0.6, frequency_penalty=0.3)


def prompt_ids(stubs: Stubs) -> list[int]:
    return list(stubs.tokenizer.Encode(tokenizer_pb2.EncodeRequest(text=PROMPT), timeout=10).token_ids)


def test_grpc_and_http_give_the_model_services_tokens_for_the_same_controls(golden_stack: Stack, golden_stubs: Stubs,
                                                                            golden_http_url: str) -> None:
    bias = {7: 2.0, 300: -5.0}
    direct = [t for r in golden_stubs.model.Generate(model_pb2.GenerateRequest(
        token_ids=prompt_ids(golden_stubs), max_tokens=10, temperature=0.9, seed=5, ignore_eos=True,
        logit_bias=bias, **CONTROLS), timeout=60) for t in r.token_ids]
    with GatewayClient(golden_stack.address, timeout=60) as client:
        over_grpc = client.complete(PROMPT, max_tokens=10, temperature=0.9, seed=5, ignore_eos=True,
                                    logit_bias=bias, **CONTROLS)
    assert [t.id for t in over_grpc.tokens] == direct
    over_http = sdk(golden_http_url).completions.create(
        model="grok-1", prompt=PROMPT, max_tokens=10, temperature=0.9, seed=5, presence_penalty=0.6,
        frequency_penalty=0.3, logit_bias={"7": 2.0, "300": -5.0},
        extra_body={"ignore_eos": True, "top_k": 12, "min_p": 0.02, "repetition_penalty": 1.4})
    assert over_http.choices[0].text == over_grpc.text
    plain = client_text(golden_stack, max_tokens=10, temperature=0.9, seed=5, ignore_eos=True)
    assert plain != over_grpc.text  # the controls changed something


def client_text(stack: Stack, **options: object) -> str:
    with GatewayClient(stack.address, timeout=60) as client:
        return client.complete(PROMPT, **options).text


def test_logit_bias_of_100_forces_the_token_over_grpc_and_http(golden_stack: Stack, golden_http_url: str) -> None:
    with GatewayClient(golden_stack.address, timeout=60) as client:
        forced = client.complete(PROMPT, max_tokens=4, logit_bias={123: 100.0}, ignore_eos=True)
    assert [t.id for t in forced.tokens] == [123] * 4
    reply = sdk(golden_http_url).completions.create(model="grok-1", prompt=PROMPT, max_tokens=4,
                                                          temperature=0, logit_bias={"123": 100},
                                                          extra_body={"ignore_eos": True})
    assert reply.choices[0].text == forced.text


def test_stop_token_ids_end_with_finish_stop_without_the_tokens_text(golden_stack: Stack, golden_http_url: str) -> None:
    with GatewayClient(golden_stack.address, timeout=60) as client:
        plain = client.complete(PROMPT, max_tokens=8, ignore_eos=True)
        stop = plain.tokens[3].id
        first = [t.id for t in plain.tokens].index(stop)
        stopped = client.complete(PROMPT, max_tokens=8, ignore_eos=True, stop_token_ids=[stop])
    assert stopped.finish_reason == gateway_pb2.FINISH_REASON_STOP
    assert [t.id for t in stopped.tokens] == [t.id for t in plain.tokens[:first]]
    assert stopped.text == "".join(t.text for t in plain.tokens[:first])
    assert stopped.usage.completion_tokens == first + 1  # the stop token is generated, counted, not returned
    over_http = sdk(golden_http_url).completions.create(model="grok-1", prompt=PROMPT, max_tokens=8,
                                                              temperature=0, extra_body={"ignore_eos": True,
                                                                                         "stop_token_ids": [stop]})
    assert over_http.choices[0].finish_reason == "stop" and over_http.choices[0].text == stopped.text
    assert over_http.choices[0].model_extra["stop_reason"] == stop  # vLLM's: the id that ended it
    with GatewayClient(golden_stack.address, timeout=60) as client:
        streamed = list(client.generate(PROMPT, max_tokens=8, ignore_eos=True, stop_token_ids=[stop]))
    assert streamed[-1].stop_token_id == stop and not streamed[-1].stop_sequence


def test_min_tokens_holds_back_the_stop_token_over_grpc_and_http_as_on_the_model(
        golden_stack: Stack, golden_stubs: Stubs, golden_http_url: str) -> None:
    with GatewayClient(golden_stack.address, timeout=60) as client:
        plain = client.complete(PROMPT, max_tokens=8, ignore_eos=True)
        stop = plain.tokens[1].id
        held = client.complete(PROMPT, max_tokens=8, ignore_eos=True, stop_token_ids=[stop], min_tokens=4)
    direct = [t for r in golden_stubs.model.Generate(model_pb2.GenerateRequest(
        token_ids=prompt_ids(golden_stubs), max_tokens=8, ignore_eos=True, stop_token_ids=[stop], min_tokens=4),
        timeout=60) for t in r.token_ids]
    ids = [t.id for t in held.tokens]
    assert ids == direct[:len(ids)] and stop not in ids[:4] and ids[1] != stop
    over_http = sdk(golden_http_url).completions.create(
        model="grok-1", prompt=PROMPT, max_tokens=8, temperature=0,
        extra_body={"ignore_eos": True, "stop_token_ids": [stop], "min_tokens": 4})
    assert over_http.choices[0].text == held.text


@pytest.mark.parametrize(("field", "value"), [("top_k", -3), ("min_p", 1.5), ("repetition_penalty", 0.0),
                                              ("presence_penalty", 2.5), ("frequency_penalty", -9.0),
                                              ("stop_token_ids", [600])])
def test_bad_controls_are_invalid_argument_over_grpc_and_400_over_http(golden_stubs: Stubs, golden_http_url: str,
                                                                       field: str, value: object) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        golden_stubs.gateway.Complete(completion_request(PROMPT, max_tokens=2, **{field: value}), timeout=30)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details().startswith(f"{field}:")
    status, body = post(f"{golden_http_url}/v1/completions", {"prompt": PROMPT, "max_tokens": 2, field: value})
    assert status == 400 and body["error"]["param"] == field


def test_bad_logit_bias_over_http_names_logit_bias(golden_http_url: str) -> None:
    for bias in ({"600": 1}, {"5": 101}, {"five": 1}):
        status, body = post(f"{golden_http_url}/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "logit_bias": bias})
        assert status == 400 and body["error"]["param"] == "logit_bias", body


def test_grpcurl_complete_with_every_new_sampling_field(golden_stack: Stack) -> None:
    body = json.dumps({"prompt": PROMPT, "sampling": {
        "max_tokens": 4, "temperature": 0.9, "seed": 1, "n": 2, "top_k": 40, "min_p": 0.05, "repetition_penalty": 1.2,
        "frequency_penalty": 0.5, "presence_penalty": 0.1, "logit_bias": {"17": -100}, "stop_token_ids": [511],
        "echo": True, "prompt_logprobs": 1, "ignore_eos": True}})
    out = grpcurl("-plaintext", "-d", body, golden_stack.address, "grok.gateway.v1.GatewayService/Complete")
    assert out.returncode == 0, out.stderr
    reply = json.loads(out.stdout)
    assert [c.get("index", 0) for c in reply["choices"]] == [0, 1]
    assert all(c["text"].startswith(PROMPT) for c in reply["choices"])
    assert "logprob" not in reply["prompt_logprobs"][0] and "logprob" in reply["prompt_logprobs"][1]
