"""echo and prompt logprobs end to end on the real golden stack, through the gateway's gRPC API and the HTTP API
(official openai package): the prompt leads the text, the scored prompt equals the model service's own."""

from __future__ import annotations

import json
import math

import pytest

from gateway.client import GatewayClient
from grok.model.v1 import model_pb2
from grok.tokenizer.v1 import tokenizer_pb2
from tests.gateway.conftest import Stack, Stubs
from tests.gateway.http_client import curl, post, sdk, sse_events

pytestmark = pytest.mark.slow

PROMPT = "The quick brown fox"
OPTIONS = dict(max_tokens=3, ignore_eos=True)


def model_scores(stubs: Stubs, k: int) -> tuple[list[int], list[model_pb2.Token]]:
    ids = list(stubs.tokenizer.Encode(tokenizer_pb2.EncodeRequest(text=PROMPT), timeout=10).token_ids)
    replies = list(stubs.model.Generate(model_pb2.GenerateRequest(token_ids=ids, max_tokens=1, prompt_logprobs=k),
                                        timeout=60))
    return ids, [t for r in replies for t in r.prompt_logprobs]


def test_grpc_echo_puts_the_prompt_before_the_completion(golden_stack: Stack) -> None:
    with GatewayClient(golden_stack.address, timeout=60) as client:
        plain = client.complete(PROMPT, **OPTIONS)
        echoed = client.complete(PROMPT, echo=True, **OPTIONS)
        streamed = list(client.generate(PROMPT, echo=True, **OPTIONS))
    assert echoed.text == PROMPT + plain.text and echoed.usage == plain.usage
    assert streamed[0].text.startswith(PROMPT) and "".join(m.text for m in streamed) == echoed.text


def test_grpc_prompt_logprobs_equal_the_model_services_scores(golden_stack: Stack, golden_stubs: Stubs) -> None:
    ids, scores = model_scores(golden_stubs, 2)
    with GatewayClient(golden_stack.address, timeout=60) as client:
        reply = client.complete(PROMPT, prompt_logprobs=2, **OPTIONS)
        plain = client.complete(PROMPT, **OPTIONS)
    scored = list(reply.prompt_logprobs)
    assert [p.id for p in scored] == ids and not scored[0].HasField("logprob") and not scored[0].top_tokens
    assert [p.logprob for p in scored[1:]] == pytest.approx([t.logprob for t in scores], abs=1e-6)
    assert all(len(p.top_tokens) == 2 and p.top_tokens[0].text for p in scored[1:])
    assert reply.text == plain.text and not plain.prompt_logprobs


def test_openai_echo_with_logprobs_scores_the_prompt_tokens_first(golden_stack: Stack, golden_stubs: Stubs,
                                                                 golden_http_url: str) -> None:
    ids, scores = model_scores(golden_stubs, 1)
    reply = sdk(golden_http_url).completions.create(model="grok-1", prompt=PROMPT, echo=True, logprobs=1,
                                                    temperature=0, max_tokens=3, extra_body={"ignore_eos": True})
    choice = reply.choices[0]
    with GatewayClient(golden_stack.address, timeout=60) as client:
        plain = client.complete(PROMPT, **OPTIONS, logprobs=True)
    assert choice.text == PROMPT + plain.text
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids) + 3 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:len(ids)] == pytest.approx([t.logprob for t in scores], abs=1e-5)
    assert lp.token_logprobs[len(ids):] == pytest.approx([t.logprob for t in plain.tokens], abs=1e-5)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)


def test_openai_prompt_logprobs_in_vllms_format(golden_stubs: Stubs, golden_http_url: str) -> None:
    ids, scores = model_scores(golden_stubs, 2)
    status, body = post(f"{golden_http_url}/v1/completions", {"prompt": PROMPT, "max_tokens": 1,
                                                              "prompt_logprobs": 2})
    assert status == 200
    scored = body["choices"][0]["prompt_logprobs"]
    assert scored[0] is None and len(scored) == len(ids)
    for position, (token, score) in enumerate(zip(ids[1:], scores), start=1):
        assert math.isclose(scored[position][str(token)]["logprob"], score.logprob, abs_tol=1e-5)
        assert len(scored[position]) in (2, 3)  # the token and its 2 alternatives (it may be one of them)
    chunks = list(sdk(golden_http_url).completions.create(model="grok-1", prompt=PROMPT, max_tokens=2, stream=True,
                                                          echo=True, extra_body={"prompt_logprobs": 0}))
    assert chunks[0].choices[0].text.startswith(PROMPT)
    assert len(chunks[0].choices[0].model_extra["prompt_logprobs"]) == len(ids)


def test_bad_prompt_logprobs_is_400_naming_it(golden_http_url: str) -> None:
    status, body = post(f"{golden_http_url}/v1/completions", {"prompt": PROMPT, "max_tokens": 1,
                                                              "prompt_logprobs": 21})
    assert status == 400 and body["error"]["param"] == "prompt_logprobs"


def test_a_one_token_prompt_is_still_listed_first_with_null_logprobs(golden_stack: Stack, golden_stubs: Stubs,
                                                                    golden_http_url: str) -> None:
    """A prompt of one token has nothing to score, but echo's logprobs and prompt_logprobs still list it."""
    ids = list(golden_stubs.tokenizer.Encode(tokenizer_pb2.EncodeRequest(text="the"), timeout=10).token_ids)
    assert len(ids) == 1
    with GatewayClient(golden_stack.address, timeout=60) as client:
        reply = client.complete("the", prompt_logprobs=1, **OPTIONS)
    assert [p.id for p in reply.prompt_logprobs] == ids and not reply.prompt_logprobs[0].HasField("logprob")
    request = {"prompt": "the", "echo": True, "logprobs": 1, "prompt_logprobs": 1, **OPTIONS}
    status, body = post(f"{golden_http_url}/v1/completions", request)
    assert status == 200, body
    done = curl(f"{golden_http_url}/v1/completions", "-H", "content-type: application/json", "-d",
                json.dumps({**request, "stream": True}))
    chunks = [json.loads(e) for e in sse_events(done.stdout) if e != "[DONE]"]
    streamed = [c for chunk in chunks for c in chunk["choices"] if c["logprobs"]]
    # The echo may come in a chunk of its own or with the first drawn token: the stream's choice is their join.
    joined = {"text": "".join(c["text"] for c in streamed), "prompt_logprobs": streamed[0].get("prompt_logprobs"),
              "logprobs": {key: [v for c in streamed for v in c["logprobs"][key]]
                           for key in ("tokens", "token_logprobs", "text_offset")}}
    for first in (next(c for c in body["choices"] if c["logprobs"]), joined):
        assert first["text"].startswith("the") and first["logprobs"]["tokens"][0] == "the", first
        assert first["logprobs"]["token_logprobs"][0] is None and first["logprobs"]["text_offset"][:2] == [0, 3]
        assert first["prompt_logprobs"] == [None]


def test_echo_with_max_tokens_0_returns_the_scored_prompt_alone(golden_stack: Stack, golden_stubs: Stubs,
                                                                golden_http_url: str) -> None:
    """OpenAI's and vLLM's scoring request: `echo` with `max_tokens: 0` answers the prompt and its logprobs,
    nothing generated (finish "length", no completion tokens); without echo 0 stays refused."""
    ids, scores = model_scores(golden_stubs, 1)
    request = {"prompt": PROMPT, "echo": True, "logprobs": 1, "max_tokens": 0}
    status, body = post(f"{golden_http_url}/v1/completions", request)
    assert status == 200, body
    (choice,) = body["choices"]
    assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
    assert len(choice["logprobs"]["tokens"]) == len(ids) and choice["logprobs"]["token_logprobs"][0] is None
    assert choice["logprobs"]["token_logprobs"][1:] == pytest.approx([t.logprob for t in scores], abs=1e-5)
    assert body["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 0, "total_tokens": len(ids)}
    done = curl(f"{golden_http_url}/v1/completions", "-H", "content-type: application/json", "-d",
                json.dumps({**request, "stream": True}))
    chunks = [json.loads(e) for e in sse_events(done.stdout) if e != "[DONE]"]
    assert "".join(c["choices"][0]["text"] for c in chunks) == PROMPT
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
    with GatewayClient(golden_stack.address, timeout=60) as client:
        reply = client.complete(PROMPT, echo=True, max_tokens=0)
    assert reply.text == PROMPT and reply.usage.completion_tokens == 0 and not reply.tokens
    status, body = post(f"{golden_http_url}/v1/completions", {"prompt": PROMPT, "max_tokens": 0})
    assert status == 400 and body["error"]["param"] == "max_tokens" and "echo" in body["error"]["message"]


def test_twenty_alternatives_per_token_as_openai_allows(golden_http_url: str, golden_stubs: Stubs) -> None:
    """OpenAI's top_logprobs goes up to 20 (vLLM's default max_logprobs too): chat lists 20 alternatives per
    token, most probable first, the drawn token among them at temperature 0; prompt_logprobs takes 20 as well."""
    status, body = post(f"{golden_http_url}/v1/chat/completions", {
        "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 3, "temperature": 0, "logprobs": True,
        "top_logprobs": 20, "ignore_eos": True})
    assert status == 200, body
    for entry in body["choices"][0]["logprobs"]["content"]:
        tops = entry["top_logprobs"]
        assert len(tops) == 20 and [t["logprob"] for t in tops] == sorted((t["logprob"] for t in tops), reverse=True)
        assert tops[0]["logprob"] == entry["logprob"]  # greedy: the drawn token is the most probable
    ids, scores = model_scores(golden_stubs, 20)
    assert len(scores) == len(ids) - 1 and all(len(s.top_tokens) == 20 for s in scores)
