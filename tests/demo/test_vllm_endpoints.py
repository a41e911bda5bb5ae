"""What vLLM users reach for beside the OpenAI routes, on the stack `make run` starts: GET /v1/models/{id} (the
openai package's models.retrieve), /tokenize, /detokenize, /version and /metrics on the HTTP port; and the one
access line each request logs."""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
import uuid

import openai
import pytest
from openai import OpenAI

from gateway.client import GatewayClient
from tests.demo.conftest import DEMO_CONFIG
from tests.demo.launcher import Launched
from tests.waiting import wait_until

pytestmark = pytest.mark.slow


def call(stack: Launched, path: str, body: dict | None = None, headers: dict | None = None) -> tuple[int, dict | str]:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(f"{stack.http_url}{path}", data=data,
                                     headers={"content-type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            raw = reply.read().decode()
            status = reply.status
    except urllib.error.HTTPError as error:
        raw, status = error.read().decode(), error.code
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw


def test_models_retrieve_answers_the_served_model_and_404_for_another(demo_stack: Launched) -> None:
    with OpenAI(base_url=f"{demo_stack.http_url}/v1", api_key="unused", max_retries=0) as client:
        assert client.models.retrieve("grok-1").id == "grok-1"
        with pytest.raises(openai.NotFoundError) as caught:
            client.models.retrieve("gpt-4")
    assert "grok-1" in str(caught.value)


def test_tokenize_counts_what_a_completion_and_a_chat_count(demo_stack: Launched, client: GatewayClient) -> None:
    status, tokenized = call(demo_stack, "/tokenize", {"model": "grok-1", "prompt": "The model service"})
    assert status == 200 and isinstance(tokenized, dict)
    reply = client.complete("The model service", max_tokens=1, temperature=0.0)
    assert tokenized["count"] == len(tokenized["tokens"]) == reply.usage.prompt_tokens
    context = json.loads(DEMO_CONFIG.read_text())["sequence_len"]  # the committed model's, as served
    assert tokenized["max_model_len"] == context == client.info().model.config.sequence_len
    assert tokenized["token_strs"] is None
    messages = [{"role": "user", "content": "What does the gateway do?"}]
    status, chat = call(demo_stack, "/tokenize", {"messages": messages, "return_token_strs": True})
    status_chat, answer = call(demo_stack, "/v1/chat/completions", {"messages": messages, "max_tokens": 1})
    assert status == status_chat == 200 and isinstance(chat, dict) and isinstance(answer, dict)
    assert chat["count"] == answer["usage"]["prompt_tokens"]
    assert "".join(chat["token_strs"]).endswith("User: What does the gateway do?\n\nAssistant:")


def test_detokenize_gives_back_the_text_and_names_a_bad_id(demo_stack: Launched) -> None:
    _, tokenized = call(demo_stack, "/tokenize", {"prompt": "The gateway validates input."})
    assert isinstance(tokenized, dict)
    assert call(demo_stack, "/detokenize", {"tokens": tokenized["tokens"]}) == (
        200, {"prompt": "The gateway validates input."})
    status, error = call(demo_stack, "/detokenize", {"tokens": [5, 100000]})
    assert status == 400 and isinstance(error, dict) and error["error"]["param"] == "tokens", error


def test_tokenize_refuses_a_body_with_both_or_neither_text(demo_stack: Launched) -> None:
    for body in ({}, {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}):
        status, error = call(demo_stack, "/tokenize", body)
        assert status == 400 and isinstance(error, dict) and "exactly one of" in error["error"]["message"]


def test_version_and_metrics_on_the_http_port(demo_stack: Launched) -> None:
    """/metrics on the HTTP port is the whole stack's (make run): the gateway's series, the model replica's, vLLM's
    names beside ours, and no `_created` series."""
    status, version = call(demo_stack, "/version")
    assert status == 200 and isinstance(version, dict) and version["version"]
    assert call(demo_stack, "/v1/completions", {"prompt": "The model service", "max_tokens": 3})[0] == 200
    status, metrics = call(demo_stack, "/metrics")
    assert status == 200 and isinstance(metrics, str) and "grok_gateway_requests_total" in metrics
    model = f'replica="127.0.0.1:{demo_stack.ports["model-metrics"]}"'
    assert f"grok_gateway_model_metrics_up{{{model}}} 1.0" in metrics
    for name in ("grok_model_active_slots", "grok_model_kv_cache_usage_perc", "vllm:num_requests_running",
                 "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert re.search(rf"^{name}{{.*{model}", metrics, re.M), name
    for name in ("vllm:time_to_first_token_seconds_bucket", "vllm:generation_tokens_total", "vllm:e2e_request"):
        assert re.search(rf"^{name}.*model_name=", metrics, re.M), name
    assert "_created" not in metrics


def test_each_request_logs_one_access_line_with_path_status_and_tokens(demo_stack: Launched) -> None:
    """One gateway line per request (the tokenizer's calls for it show only at debug level)."""
    rid = f"access-{uuid.uuid4().hex[:8]}"
    status, reply = call(demo_stack, "/v1/completions", {"prompt": "The model service", "max_tokens": 5},
                         headers={"x-request-id": rid})
    assert status == 200 and isinstance(reply, dict)
    missing = call(demo_stack, "/v1/nothing", {}, headers={"x-request-id": "unused"})[0]
    assert missing == 404

    def records(service: str) -> list[dict]:
        lines = getattr(demo_stack, service).logs().splitlines()
        return [r for r in (json.loads(line) for line in lines if line.startswith("{")) if r.get("request_id") == rid]

    wait_until(lambda: records("gateway"), 10, interval=0.1, message="no access line for the request")
    (line,) = records("gateway")
    assert (line["msg"], line["path"], line["status"], line["http_method"]) == (
        "request", "/v1/completions", 200, "POST")
    assert (line["prompt_tokens"], line["completion_tokens"]) == (
        reply["usage"]["prompt_tokens"], reply["usage"]["completion_tokens"])
    assert records("tokenizer") == []
    wait_until(lambda: '"path": "/v1/nothing", "status": 404' in demo_stack.gateway.logs(), 10, interval=0.1,
               message="no access line for the 404")


def test_a_request_of_several_prompts_logs_one_access_line_with_their_tokens(demo_stack: Launched) -> None:
    rid = f"access-{uuid.uuid4().hex[:8]}"
    status, reply = call(demo_stack, "/v1/completions", {"prompt": ["The model service", "The gateway"],
                                                         "max_tokens": 5}, headers={"x-request-id": rid})
    assert status == 200 and isinstance(reply, dict) and len(reply["choices"]) == 2

    def lines() -> list[dict]:
        records = (json.loads(line) for line in demo_stack.gateway.logs().splitlines() if line.startswith("{"))
        return [r for r in records if r.get("request_id") == rid and r.get("path") == "/v1/completions"]

    wait_until(lines, 10, interval=0.1, message="no access line for the request")
    (line,) = lines()
    assert (line["status"], line["prompt_tokens"], line["completion_tokens"]) == (
        200, reply["usage"]["prompt_tokens"], reply["usage"]["completion_tokens"])


def test_continue_final_message_leaves_the_last_message_open(demo_stack: Launched) -> None:
    """vLLM's continue_final_message: the prompt ends with the last message's own text (no end of its turn, no new
    "Assistant:"), and the answer goes on from it exactly as a completion of that prompt does, its first space
    included."""
    messages = [{"role": "user", "content": "What does the gateway do?"}, {"role": "assistant", "content": "The"}]
    fields = {"messages": messages, "continue_final_message": True, "add_generation_prompt": False}
    status, tokenized = call(demo_stack, "/tokenize", {**fields, "return_token_strs": True})
    assert status == 200 and isinstance(tokenized, dict)
    prompt = "".join(tokenized["token_strs"])
    assert prompt.endswith("User: What does the gateway do?\n\nAssistant: The"), prompt
    status, chat = call(demo_stack, "/v1/chat/completions", {**fields, "max_tokens": 8, "temperature": 0})
    _, completion = call(demo_stack, "/v1/completions", {"prompt": prompt, "max_tokens": 8, "temperature": 0})
    assert status == 200 and isinstance(chat, dict) and isinstance(completion, dict)
    assert chat["choices"][0]["message"]["content"] == completion["choices"][0]["text"]
    assert chat["usage"]["prompt_tokens"] == tokenized["count"]
    # Without it the template closes the assistant's turn and opens a new one.
    _, closed = call(demo_stack, "/tokenize", {"messages": messages, "return_token_strs": True})
    assert isinstance(closed, dict) and "".join(closed["token_strs"]).endswith("Assistant: The\n\nAssistant:")


@pytest.mark.parametrize(("extra", "param"), [
    ({"continue_final_message": True, "add_generation_prompt": True}, "add_generation_prompt"),
    ({"chat_template": "{{ messages[0]['content'] }}"}, "chat_template"),
])
def test_chat_fields_this_server_cannot_honour_are_400(demo_stack: Launched, extra: dict, param: str) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"}], **extra}
    for path in ("/v1/chat/completions", "/tokenize"):
        status, error = call(demo_stack, path, {**body, "max_tokens": 2} if path != "/tokenize" else body)
        assert status == 400 and isinstance(error, dict) and error["error"]["param"] == param, (path, error)
