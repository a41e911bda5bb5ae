"""The OpenAI-compatible HTTP API of a real gateway process in front of fake backends.

Driven by real clients: the official `openai` package, curl and urllib. The fake model's output is
computable by hand (tests/gateway/fakes.py): the continuation of a prompt is its text after the first "|".
"""

from __future__ import annotations

import json
import pathlib
import signal
import socket
import time
import urllib.request

import grpc
import openai
import pytest

from gateway.http.chat import ChatTemplate
from gateway.http.schemas import ChatMessage
from grok.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from tests.gateway.conftest import Stack, start_gateway
from tests.gateway.http_client import curl, get, post, sdk, sse_events
from tests.gateway.test_gateway import outcome_of
from tests.procs import free_port
from tests.waiting import wait_until


def piece_ends(texts: list[str]) -> list[int]:
    """Where the text so far ends after each chunk."""
    ends, length = [], 0
    for text in texts:
        length += len(text)
        ends.append(length)
    return ends


def test_sdk_completion_returns_text_finish_reason_usage_and_logprobs(fast_stack: Stack) -> None:
    reply = sdk(fast_stack.http_url).completions.create(model="grok-1", prompt="xy|hello world", max_tokens=20,
                                                        logprobs=2)
    choice = reply.choices[0]
    assert reply.object == "text_completion" and reply.model == "grok-1"
    assert choice.text == "hello world" and choice.finish_reason == "stop"  # the fake model's EOS
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens, reply.usage.total_tokens) == (7, 5, 12)
    assert choice.logprobs.tokens[:4] == ["hello", " ", "wor", "ld"]
    assert choice.logprobs.text_offset[:4] == [0, 5, 6, 9]
    assert choice.logprobs.token_logprobs[0] == pytest.approx(-0.693147, abs=1e-5)
    # The fake's alternatives are id, id+1: "hello" then the next piece, each decoded on its own.
    assert list(choice.logprobs.top_logprobs[0]) == ["hello", "wor"]


def test_sdk_streamed_completion_concatenates_to_the_text_and_ends_with_usage(fast_stack: Stack) -> None:
    chunks = list(sdk(fast_stack.http_url).completions.create(
        model="grok-1", prompt="xy|hello world", max_tokens=20, stream=True, stream_options={"include_usage": True}))
    texts = [c.choices[0].text for c in chunks if c.choices]
    # One chunk per piece, or several pieces in one when the reader fell behind (the gateway joins them).
    assert "".join(texts) == "hello world" and 1 <= len([t for t in texts if t]) <= 4
    assert set(piece_ends(texts)) <= {5, 6, 9, 11}
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[:-1] == [None] * (len(finishes) - 1) and finishes[-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
    assert all(c.usage is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("cmpl-")


def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(fast_stack: Stack) -> None:
    """vLLM's stream_options.continuous_usage_stats: each chunk carries the prompt and its choice's tokens so
    far; the last chunk the request's usage, as without it."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = list(sdk(fast_stack.http_url).completions.create(
        model="grok-1", prompt="xy|hello world", max_tokens=20, stream=True, stream_options=options))
    counts = [(c.usage.prompt_tokens, c.usage.completion_tokens, c.usage.total_tokens) for c in chunks]
    assert counts[-2:] == [(7, 5, 12), (7, 5, 12)] and chunks[-1].choices == []
    # A chunk may carry several tokens when the reader fell behind; its usage still counts every token so far:
    # the text so far ends after the pieces "hello", " ", "wor", "ld" (then the EOS, no text).
    texts = [c.choices[0].text for c in chunks[:-1]]
    finished = [c.choices[0].finish_reason is not None for c in chunks[:-1]]
    # The EOS has no text: the whole text is there after 4 tokens, or 5 when the EOS came in the same message.
    tokens_at_end = {5: {1}, 6: {2}, 9: {3}, 11: {4, 5}}
    assert "".join(texts) == "hello world" and finished[-1] and not any(finished[:-1])
    for (prompt, completion, total), end, done in zip(counts, piece_ends(texts), finished):
        assert prompt == 7 and total == prompt + completion
        assert completion == 5 if done else completion in tokens_at_end[end]
    chat = list(sdk(fast_stack.http_url).chat.completions.create(
        model="grok-1", messages=[{"role": "user", "content": "x|hello world"}], max_tokens=4, stream=True,
        stream_options=options))
    assert chat[0].choices[0].delta.role == "assistant" and chat[0].usage.completion_tokens == 0
    prompt = chat[0].usage.prompt_tokens
    assert prompt > 0 and all(c.usage.prompt_tokens == prompt for c in chat)
    counts = [c.usage.completion_tokens for c in chat]
    assert counts[0] == 0 and counts[-2:] == [4, 4] and counts == sorted(counts)
    contents = [(c.choices[0].delta.content or "") if c.choices else "" for c in chat]
    for count, end, content in zip(counts, piece_ends(contents), contents):
        assert not content or count in tokens_at_end[end] - {5}  # max_tokens 4: no EOS
    # Without include_usage the option is inert, as in vLLM.
    plain = list(sdk(fast_stack.http_url).completions.create(
        model="grok-1", prompt="xy|hello world", max_tokens=20, stream=True,
        stream_options={"continuous_usage_stats": True}))
    assert all(c.usage is None for c in plain)


def test_a_list_of_prompts_answers_each_in_order(fast_stack: Stack) -> None:
    """OpenAI's list of prompts: prompt i's completion is choice i, usage counts each prompt and completion;
    streamed, the chunks name the same indexes (n > 1 on the real model: tests/gateway/test_n_e2e.py)."""
    client = sdk(fast_stack.http_url)
    prompts = ["a|one", "bb|two two", "c|three"]
    singles = [client.completions.create(model="grok-1", prompt=p, max_tokens=20) for p in prompts]
    reply = client.completions.create(model="grok-1", prompt=prompts, max_tokens=20)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert [c.text for c in reply.choices] == ["one", "two two", "three"]
    assert reply.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)
    assert reply.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)
    chunks = list(client.completions.create(model="grok-1", prompt=prompts, max_tokens=20, stream=True,
                                            stream_options={"include_usage": True}))
    texts: dict[int, str] = {}
    for chunk in chunks[:-1]:
        texts[chunk.choices[0].index] = texts.get(chunk.choices[0].index, "") + chunk.choices[0].text
    assert texts == {0: "one", 1: "two two", 2: "three"} and len({c.id for c in chunks}) == 1
    assert chunks[-1].usage.prompt_tokens == reply.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="grok-1", prompt=["a|x", ""], max_tokens=2)
    assert caught.value.body["param"] == "prompt[1]"


def test_token_id_prompts_are_answered_as_their_text_is(fast_stack: Stack) -> None:
    """OpenAI's token prompts: a list of ids, or a list of such lists (one choice each); echo gives their text."""
    url = fast_stack.http_url
    ids = [post(f"{url}/tokenize", {"prompt": p})[1]["tokens"] for p in ("a|hello wor", "b|he")]
    as_text = post(f"{url}/v1/completions", {"prompt": "a|hello wor", "max_tokens": 4, "echo": True})[1]
    status, as_ids = post(f"{url}/v1/completions", {"prompt": ids[0], "max_tokens": 4, "echo": True})
    assert status == 200 and as_ids["choices"] == as_text["choices"] and as_ids["usage"] == as_text["usage"]
    assert as_ids["choices"][0]["text"] == "a|hello worhello wor"
    status, both = post(f"{url}/v1/completions", {"prompt": ids, "max_tokens": 4})
    assert status == 200 and [c["text"] for c in both["choices"]] == ["hello wor", "he"]
    for bad, param in (([512], "prompt"), ([-1], "prompt"), ([ids[0], []], "prompt[1]"), ([2**40], "prompt")):
        status, reply = post(f"{url}/v1/completions", {"prompt": bad, "max_tokens": 2})
        assert status == 400 and reply["error"]["param"] == param, (bad, reply)
    with grpc.insecure_channel(fast_stack.address) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        sampling = gateway_pb2.SamplingParams(max_tokens=4)
        reply = stub.Complete(gateway_pb2.CompleteRequest(prompt_token_ids=ids[1], sampling=sampling), timeout=30)
        assert reply.text == "he"
        with pytest.raises(grpc.RpcError) as caught:
            stub.Complete(gateway_pb2.CompleteRequest(prompt="x", prompt_token_ids=ids[1], sampling=sampling),
                          timeout=30)
        assert caught.value.details().startswith("prompt_token_ids:")


def test_stop_reason_names_the_stop_sequence_that_ended_a_choice(fast_stack: Stack) -> None:
    """vLLM's stop_reason: the stop sequence (or stop token id) that ended the choice, null for EOS and length;
    streamed, on the choice's finish chunk."""
    client = sdk(fast_stack.http_url)
    stopped = client.completions.create(model="grok-1", prompt="xy|hello world", max_tokens=20, stop=["zz", " wor"])
    assert stopped.choices[0].text == "hello" and stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].model_extra["stop_reason"] == " wor"
    eos = client.completions.create(model="grok-1", prompt="xy|hello world", max_tokens=20)
    assert eos.choices[0].finish_reason == "stop" and eos.choices[0].model_extra["stop_reason"] is None
    chunks = list(client.completions.create(model="grok-1", prompt="xy|hello world", max_tokens=20, stop=[" wor"],
                                            stream=True))
    assert chunks[-1].choices[0].finish_reason == "stop" and chunks[-1].choices[0].model_extra["stop_reason"] == " wor"
    chat = client.chat.completions.create(model="grok-1", messages=[{"role": "user", "content": "x|hello world"}],
                                          max_tokens=20, stop=[" wor"])
    assert chat.choices[0].message.content == "hello" and chat.choices[0].model_extra["stop_reason"] == " wor"


def test_include_stop_str_in_output_returns_the_stop_sequence_that_ended_the_text(fast_stack: Stack) -> None:
    """vLLM's include_stop_str_in_output: the matched stop sequence ends the text; what followed it does not."""
    client = sdk(fast_stack.http_url)
    whole = client.completions.create(model="grok-1", prompt="xy|hello world", max_tokens=20, stop=["zz", " wor"],
                                      extra_body={"include_stop_str_in_output": True})
    assert whole.choices[0].text == "hello wor" and whole.choices[0].finish_reason == "stop"
    assert whole.choices[0].model_extra["stop_reason"] == " wor"
    chunks = list(client.completions.create(model="grok-1", prompt="xy|hello world", max_tokens=20, stop=[" wor"],
                                            stream=True, extra_body={"include_stop_str_in_output": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "hello wor"
    chat = client.chat.completions.create(model="grok-1", messages=[{"role": "user", "content": "x|hello world"}],
                                          max_tokens=20, stop=[" wor"], extra_body={"include_stop_str_in_output": True})
    assert chat.choices[0].message.content == "hello wor"


def test_sdk_chat_completion_renders_the_default_template(fast_stack: Stack) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say|hello"}]
    reply = sdk(fast_stack.http_url).chat.completions.create(model="grok-1", messages=messages, max_tokens=14,
                                                             extra_body={"ignore_eos": True})
    prompt = ChatTemplate.load().render([ChatMessage(**m) for m in messages])
    assert prompt == "System: Be brief.\n\nUser: Say|hello\n\nAssistant:"
    # The fake model repeats the prompt's text after "|": the rendered template, visible in the reply.
    assert reply.choices[0].message.content == "hello\n\nAssistant:hello"  # 1 + 12 + 1 tokens
    assert reply.choices[0].message.role == "assistant" and reply.choices[0].finish_reason == "length"
    assert reply.object == "chat.completion" and reply.usage.completion_tokens == 14


def test_chat_answer_ends_where_the_model_starts_the_next_turn_of_the_transcript(fast_stack: Stack) -> None:
    """With the default template, a chat answer ends before the "\n\nUser:" or "\n\nSystem:" that begins another
    turn (as a stop sequence would, beside the request's own), streamed or not (n > 1: tests/demo/test_chat.py)."""
    client = sdk(fast_stack.http_url)
    # The fake repeats the prompt after "|": "hi", then the template's next turn "\n\nUser: more\n\nAssistant:".
    messages = [{"role": "user", "content": "x|hi"}, {"role": "user", "content": "more"}]
    reply = client.chat.completions.create(model="grok-1", messages=messages, max_tokens=40, stop=["zz"])
    choice = reply.choices[0]
    assert (choice.message.content, choice.finish_reason, choice.model_extra["stop_reason"]) == ("hi", "stop",
                                                                                                 "\n\nUser:")
    system = [{"role": "user", "content": "x|hi"}, {"role": "system", "content": "more"}]
    chunks = list(client.chat.completions.create(model="grok-1", messages=system, max_tokens=40, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "hi"
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert chunks[-1].choices[0].model_extra["stop_reason"] == "\n\nSystem:"
    user_stop = client.chat.completions.create(model="grok-1", messages=messages, max_tokens=40, stop=["i"])
    assert user_stop.choices[0].message.content == "h" and user_stop.choices[0].model_extra["stop_reason"] == "i"
    completion = client.completions.create(model="grok-1", prompt="x|hi\n\nUser: more", max_tokens=20)
    assert completion.choices[0].text == "hi\n\nUser: more"  # a completion's prompt is no transcript


def test_sdk_chat_stream_opens_with_the_role_then_streams_content_deltas(fast_stack: Stack) -> None:
    chunks = list(sdk(fast_stack.http_url).chat.completions.create(
        model="grok-1", messages=[{"role": "user", "content": "x|hello world"}], max_tokens=4, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "hello world"  # 4 tokens
    assert chunks[-1].choices[0].finish_reason == "length" and chunks[-1].object == "chat.completion.chunk"


def test_curl_streams_sse_data_events_ending_with_done(fast_stack: Stack) -> None:
    body = json.dumps({"prompt": "ab|hello", "max_tokens": 5, "stream": True, "stream_options": {"include_usage": True}})
    out = curl(f"{fast_stack.http_url}/v1/completions", "-H", "content-type: application/json", "-d", body)
    assert out.returncode == 0, out.stderr
    events = sse_events(out.stdout)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == "hello"
    assert chunks[-1]["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}  # ab | hello


def test_unknown_fields_are_ignored_and_named_in_a_warning_header_and_a_log_line(fast_stack: Stack) -> None:
    """As vLLM: answered as if absent, and logged; here also a Warning header the client sees."""
    status, reply = post(f"{fast_stack.http_url}/v1/completions",
                         {"prompt": "a|hello", "max_tokens": 1, "no_such_field": {"x": 1}, "metadata": "m"})
    assert status == 200 and reply["choices"][0]["text"] == "hello"
    done = curl("-i", f"{fast_stack.http_url}/v1/chat/completions", "-H", "content-type: application/json",
                "-H", "x-request-id: typo-1", "-d", json.dumps({"messages": [{"role": "user", "content": "a|hi"}],
                                                               "temprature": 0, "max_tokens": 1}))
    head = done.stdout.split("\r\n\r\n", 1)[0].lower()
    assert " 200 " in head.splitlines()[0]
    assert 'warning: 299 grok-serve "unknown fields ignored: temprature (did you mean temperature?)"' in head
    def logged() -> list[dict]:
        return [r for r in fast_stack.gateway.log_records() if r.get("ignored_fields") == ["temprature"]]
    wait_until(lambda: bool(logged()), 10, message="no log line names the ignored field")
    (record,) = logged()
    assert record["level"] == "warning" and record["request_id"] == "typo-1"
    assert record["did_you_mean"] == {"temprature": "temperature"} and "temprature" in record["msg"]
    known = curl("-i", f"{fast_stack.http_url}/v1/completions", "-H", "content-type: application/json",
                 "-d", json.dumps({"prompt": "a|hi", "max_tokens": 1, "temperature": 0, "top_k": 1}))
    assert "warning:" not in known.stdout.split("\r\n\r\n", 1)[0].lower()


def test_stop_sequences_apply_over_http(fast_stack: Stack) -> None:
    reply = sdk(fast_stack.http_url).completions.create(model="grok-1", prompt="a|hello world", max_tokens=10,
                                                        stop="wor")
    assert reply.choices[0].text == "hello " and reply.choices[0].finish_reason == "stop"


def test_min_tokens_keeps_a_stop_sequence_from_ending_the_first_tokens(fast_stack: Stack) -> None:
    # the fake model's tokens here: "hello", " ", "wor", "ld", then the same again
    url = f"{fast_stack.http_url}/v1/completions"
    body = {"prompt": "a|hello world", "max_tokens": 10, "stop": "wor", "ignore_eos": True}
    for min_tokens, text in ((0, "hello "), (2, "hello "), (3, "hello worldhello ")):
        status, reply = post(url, {**body, "min_tokens": min_tokens})
        assert status == 200 and reply["choices"][0]["text"] == text, (min_tokens, reply)
        assert reply["choices"][0]["finish_reason"] == "stop"
    for bad in (11, -1):
        status, reply = post(url, {**body, "min_tokens": bad})
        assert status == 400 and reply["error"]["param"] == "min_tokens", reply


def test_best_of_other_than_n_is_refused_naming_it(fast_stack: Stack) -> None:
    status, reply = post(f"{fast_stack.http_url}/v1/completions", {"prompt": "a|b", "max_tokens": 1, "best_of": 2})
    assert status == 400
    assert reply["error"]["param"] == "best_of" and "not supported yet" in reply["error"]["message"]


@pytest.mark.parametrize("path, field, value", [
    ("/v1/completions", "skip_special_tokens", False), ("/v1/chat/completions", "skip_special_tokens", False),
    ("/v1/chat/completions", "tool_choice", "required"),
    ("/v1/chat/completions", "tool_choice", {"type": "function", "function": {"name": "f"}}),
    ("/v1/completions", "use_beam_search", True), ("/v1/chat/completions", "use_beam_search", True),
    ("/v1/completions", "bad_words", ["hello"]), ("/v1/completions", "logits_processors", ["a.b"]),
    ("/v1/completions", "prompt_embeds", "AAAA"), ("/v1/completions", "guided_whitespace_pattern", "[ ]*"),
    ("/v1/completions", "priority", 5), ("/v1/completions", "allowed_token_ids", []),
    ("/v1/chat/completions", "functions", [{"name": "f", "parameters": {}}]),
    ("/v1/chat/completions", "function_call", {"name": "f"}),
    ("/v1/chat/completions", "modalities", ["text", "audio"]),
    ("/v1/chat/completions", "audio", {"voice": "alloy", "format": "wav"}),
    ("/v1/chat/completions", "echo", True)])
def test_fields_that_would_be_ignored_are_refused_naming_them(fast_stack: Stack, path: str, field: str,
                                                              value: object) -> None:
    """vLLM's and OpenAI's fields whose feature this server lacks are refused, not ignored; their "off" values
    are accepted."""
    base = {"prompt": "a|b"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "a|b"}]}
    status, reply = post(f"{fast_stack.http_url}{path}", {**base, "max_tokens": 1, field: value})
    assert status == 400 and reply["error"]["param"] == field, reply
    accepted = [{"skip_special_tokens": True}, {"use_beam_search": False}, {"bad_words": []}, {"priority": 0},
                {"logits_processors": None}, {"prompt_embeds": None}, {"guided_whitespace_pattern": None}]
    if path != "/v1/completions":
        accepted += [{"tool_choice": "none"}, {"tool_choice": "auto"}, {"functions": []}, {"function_call": "none"},
                     {"modalities": ["text"]}, {"echo": False}]
    for off in accepted:
        assert post(f"{fast_stack.http_url}{path}", {**base, "max_tokens": 1, **off})[0] == 200, off


def test_truncate_prompt_tokens_answers_as_the_prompts_last_tokens_would(fast_stack: Stack) -> None:
    """vLLM's truncate_prompt_tokens keeps the prompt's last k tokens: the answer, usage and echo are those of
    those k tokens sent as a token prompt; k at or over the prompt's length changes nothing."""
    url = f"{fast_stack.http_url}/v1/completions"
    ids = post(f"{fast_stack.http_url}/tokenize", {"prompt": "a|hello wor"})[1]["tokens"]
    body = {"max_tokens": 4, "echo": True, "logprobs": 1}
    for k in (1, 2, 4):
        status, cut = post(url, {**body, "prompt": "a|hello wor", "truncate_prompt_tokens": k})
        assert status == 200 and cut["usage"]["prompt_tokens"] == k, cut
        last = post(url, {**body, "prompt": ids[-k:]})[1]
        assert cut["choices"] == last["choices"], k
    whole = post(url, {**body, "prompt": "a|hello wor"})[1]
    for k in (len(ids), 100, -1):
        assert post(url, {**body, "prompt": "a|hello wor", "truncate_prompt_tokens": k})[1]["choices"] == \
            whole["choices"], k
    status, chat = post(f"{fast_stack.http_url}/v1/chat/completions", {
        "messages": [{"role": "user", "content": "a|hello wor"}], "max_tokens": 2, "truncate_prompt_tokens": 3})
    assert status == 200 and chat["usage"]["prompt_tokens"] == 3, chat
    for bad in (0, -2, 129, 2**40):
        status, reply = post(url, {"prompt": "a|b", "max_tokens": 1, "truncate_prompt_tokens": bad})
        assert status == 400 and reply["error"]["param"] == "truncate_prompt_tokens", (bad, reply)
    with grpc.insecure_channel(fast_stack.address) as channel:  # the gRPC API's SamplingParams field
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        cut = stub.Complete(gateway_pb2.CompleteRequest(prompt="a|hello wor", sampling=gateway_pb2.SamplingParams(
            max_tokens=4, echo=True, truncate_prompt_tokens=2)), timeout=30)
        last = stub.Complete(gateway_pb2.CompleteRequest(prompt_token_ids=ids[-2:], sampling=gateway_pb2.SamplingParams(
            max_tokens=4, echo=True)), timeout=30)
        assert cut.text == last.text and cut.usage.prompt_tokens == 2


def test_return_tokens_as_token_ids_names_each_logprobs_token_by_its_id(fast_stack: Stack) -> None:
    """vLLM's return_tokens_as_token_ids: "token_id:<id>" where the token's text stood, in completions' and chat's
    logprobs (chat's bytes are those of that name); the text and the offsets into it are unchanged."""
    url = fast_stack.http_url
    ids = post(f"{url}/tokenize", {"prompt": "hello wor"})[1]["tokens"]
    body = {"prompt": "a|hello wor", "max_tokens": 3, "logprobs": 1}
    plain = post(f"{url}/v1/completions", body)[1]["choices"][0]
    named = post(f"{url}/v1/completions", {**body, "return_tokens_as_token_ids": True})[1]["choices"][0]
    assert named["text"] == plain["text"] == "hello wor"
    assert named["logprobs"]["tokens"] == [f"token_id:{i}" for i in ids]
    assert named["logprobs"]["text_offset"] == plain["logprobs"]["text_offset"]
    assert named["logprobs"]["token_logprobs"] == plain["logprobs"]["token_logprobs"]
    assert [list(top) for top in named["logprobs"]["top_logprobs"]] == [[f"token_id:{i}"] for i in ids]
    chat = {"messages": [{"role": "user", "content": "a|hello wor"}], "max_tokens": 3, "logprobs": True,
            "top_logprobs": 1, "return_tokens_as_token_ids": True}
    content = post(f"{url}/v1/chat/completions", chat)[1]["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in content] == [f"token_id:{i}" for i in ids]
    assert all(c["bytes"] == list(c["token"].encode()) and c["top_logprobs"][0]["token"] == c["token"]
               for c in content)


def test_sampling_controls_at_their_defaults_are_accepted(fast_stack: Stack) -> None:
    defaults = {"n": 1, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0,
                "frequency_penalty": 0.0, "logit_bias": {}, "stop_token_ids": [], "echo": False, "best_of": 1}
    status, reply = post(f"{fast_stack.http_url}/v1/completions", {"prompt": "a|b", "max_tokens": 1, **defaults})
    assert status == 200 and reply["choices"][0]["text"] == "b"


@pytest.mark.parametrize(("body", "param"), [
    ({"prompt": "", "max_tokens": 1}, "prompt"),
    ({"prompt": "a", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "a", "logprobs": 21}, "logprobs"),
    ({"prompt": "a", "temperature": -1}, "temperature"),
    ({"prompt": "a", "stop": ["1", "2", "3", "4"]}, "stop"),
    ({"prompt": "a", "seed": -1}, "seed"),
    ({"prompt": "a", "max_tokens": "many"}, "max_tokens"),
    ({"max_tokens": 1}, "prompt"),
], ids=["empty-prompt", "max-tokens-0", "logprobs-21", "temperature", "too-many-stops", "seed", "type", "missing"])
def test_bad_field_is_400_with_openai_error_body_naming_it(fast_stack: Stack, body: dict, param: str) -> None:
    status, reply = post(f"{fast_stack.http_url}/v1/completions", body)
    assert status == 400
    assert set(reply["error"]) == {"message", "type", "param", "code"}
    assert reply["error"]["type"] == "invalid_request_error" and reply["error"]["param"] == param


def test_sdk_raises_bad_request_for_invalid_chat_messages(fast_stack: Stack) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        sdk(fast_stack.http_url).chat.completions.create(model="grok-1", messages=[{"role": "tool", "content": "x"}])
    assert caught.value.status_code == 400 and "role 'tool'" in caught.value.message


def test_malformed_json_is_400(fast_stack: Stack) -> None:
    status, reply = post(f"{fast_stack.http_url}/v1/completions", b'{"prompt": "a",')
    assert status == 400 and reply["error"]["type"] == "invalid_request_error"


def test_malformed_json_names_line_and_column_not_an_offset_as_param(fast_stack: Stack) -> None:
    status, reply = post(f"{fast_stack.http_url}/v1/completions", b'{"prompt": "a",\n "max_tokens": 2,,}')
    error = reply["error"]
    assert status == 400 and set(error) == {"message", "type", "param", "code"}
    assert error["param"] in (None, "body") and error["type"] == "invalid_request_error"
    assert "not valid JSON" in error["message"] and "line 2, column 18" in error["message"]


@pytest.mark.parametrize("content_type", ["application/x-www-form-urlencoded", "text/plain"])
def test_a_body_sent_without_the_json_content_type_says_to_send_it(fast_stack: Stack, content_type: str) -> None:
    status, reply = post(f"{fast_stack.http_url}/v1/completions", {"prompt": "a|b", "max_tokens": 1},
                         headers={"content-type": content_type})
    assert status == 400 and reply["error"]["type"] == "invalid_request_error"
    assert "Content-Type: application/json" in reply["error"]["message"]
    assert content_type in reply["error"]["message"] and "valid dictionary" not in reply["error"]["message"]


@pytest.mark.parametrize("body", [b"", b"[1, 2]", b'"text"'], ids=["empty", "array", "string"])
def test_a_body_that_is_not_a_json_object_says_so(fast_stack: Stack, body: bytes) -> None:
    status, reply = post(f"{fast_stack.http_url}/v1/completions", body)
    assert status == 400 and reply["error"]["param"] == "body"
    assert reply["error"]["message"].startswith("the request body must be one JSON object")


def test_logprobs_out_of_range_on_completions_names_logprobs_in_message_and_param(fast_stack: Stack) -> None:
    status, reply = post(f"{fast_stack.http_url}/v1/completions", {"prompt": "a|b", "logprobs": 21})
    assert status == 400 and reply["error"]["param"] == "logprobs"
    assert reply["error"]["message"].startswith("logprobs: ") and "top_logprobs" not in reply["error"]["message"]


def test_unknown_model_is_404_model_not_found(fast_stack: Stack) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        sdk(fast_stack.http_url).completions.create(model="gpt-4", prompt="a|b", max_tokens=1)
    assert caught.value.code == "model_not_found" and "grok-1" in caught.value.message


def test_unknown_path_is_404_with_an_openai_error_body_listing_the_routes(fast_stack: Stack) -> None:
    status, reply = get(f"{fast_stack.http_url}/v1/embeddings")
    assert status == 404 and reply["error"]["type"] == "not_found_error"
    assert set(reply["error"]) == {"message", "type", "param", "code"}
    message = reply["error"]["message"]
    assert "/v1/embeddings" in message
    for route in ("POST /v1/completions", "POST /v1/chat/completions", "GET /v1/models", "GET /health"):
        assert route in message


def test_wrong_method_is_405_naming_the_method_to_use(fast_stack: Stack) -> None:
    status, reply = get(f"{fast_stack.http_url}/v1/completions")
    assert status == 405 and set(reply["error"]) == {"message", "type", "param", "code"}
    assert "POST /v1/completions" in reply["error"]["message"]


def test_models_lists_the_served_model_and_health_is_open(fast_stack: Stack) -> None:
    assert [m.id for m in sdk(fast_stack.http_url).models.list()] == ["grok-1"]
    assert get(f"{fast_stack.http_url}/health") == (200, {"status": "SERVING"})


def test_the_model_card_carries_the_context_as_vllms_max_model_len(fast_stack: Stack,
                                                                    tmp_path: pathlib.Path) -> None:
    """vLLM's clients read a model's context from /v1/models' `max_model_len`: the model service's sequence_len
    (the fake's 128), in the list and in the card; while no model service answers, the list still answers, without
    it."""
    listed = get(f"{fast_stack.http_url}/v1/models")[1]["data"]
    card = get(f"{fast_stack.http_url}/v1/models/grok-1")[1]
    assert listed == [card] and card["max_model_len"] == 128 and card["id"] == card["root"] == "grok-1"
    assert 0 < time.time() - card["created"] < 3600  # when the gateway started, as Unix seconds (not 0)
    http_port = free_port()
    gateway = start_gateway(fast_stack.tokenizer.address, [f"127.0.0.1:{free_port()}"], tmp_path, http_port=http_port)
    try:
        url = f"http://127.0.0.1:{http_port}/v1/models"

        def answered() -> bool:
            try:
                return get(url)[0] == 200
            except OSError:  # not listening yet
                return False
        wait_until(answered, 60, message="the gateway's HTTP port never answered")
        status, models = get(url)
        assert status == 200 and [m["id"] for m in models["data"]] == ["grok-1"]
        assert "max_model_len" not in models["data"][0]
    finally:
        gateway.terminate()


def test_http_requests_are_counted_in_the_gateway_metrics(fast_stack: Stack) -> None:
    args = list(fast_stack.gateway.proc.args)
    metrics = f"http://127.0.0.1:{args[args.index('--metrics-port') + 1]}/metrics"

    def count() -> float:
        body = urllib.request.urlopen(metrics, timeout=5).read().decode()
        line = 'grok_gateway_requests_total{code="OK",finish_reason="LENGTH",method="http_chat_completions"}'
        return float(next((ln.split()[-1] for ln in body.splitlines() if ln.startswith(line)), 0))

    before = count()
    sdk(fast_stack.http_url).chat.completions.create(model="grok-1", messages=[{"role": "user", "content": "|ab"}],
                                                     max_tokens=2)
    assert count() == before + 1


def test_busy_model_is_429_and_the_sdk_sees_a_rate_limit_error(slow_stack: Stack) -> None:
    client = sdk(slow_stack.http_url)
    stream = client.completions.create(model="grok-1", prompt="p|abc", max_tokens=100, stream=True,
                                       extra_body={"ignore_eos": True}, extra_headers={"x-request-id": "http-busy"})
    next(iter(stream))
    with pytest.raises(openai.RateLimitError) as caught:
        client.completions.create(model="grok-1", prompt="p|abc", max_tokens=1)
    assert caught.value.status_code == 429 and "retry" in caught.value.message
    stream.close()
    assert outcome_of(slow_stack, "http-busy") == "cancelled"


def read_until(sock: socket.socket, marker: bytes, received: bytes = b"") -> bytes:
    while marker not in received:
        chunk = sock.recv(4096)
        assert chunk, received.decode()
        received += chunk
    return received


def raw_request(port: int, body: dict, request_id: str) -> socket.socket:
    """Send a POST on a raw socket and leave the connection open (to drop it mid-response)."""
    payload = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                 + f"x-request-id: {request_id}\r\ncontent-length: {len(payload)}\r\n\r\n".encode() + payload)
    return sock


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
def test_client_disconnect_cancels_the_model_call(slow_stack: Stack, stream: bool) -> None:
    request_id = f"http-drop-{stream}"
    sock = raw_request(slow_stack.http_port, {"prompt": "p|abc", "max_tokens": 100, "ignore_eos": True,
                                              "stream": stream}, request_id)
    if stream:
        read_until(sock, b"data: ")
    else:
        # The model is generating; nothing is sent before the end.
        wait_until(lambda: any(r.get("msg") == "request started" and r.get("rid") == request_id
                               for r in slow_stack.models[0].log_records()), 10, message="the model never got the call")
    sock.close()
    assert outcome_of(slow_stack, request_id) == "cancelled"  # long before its 100 tokens (5 s)


def test_backend_down_is_503_and_health_says_not_serving(tmp_path: pathlib.Path) -> None:
    http_port = free_port()
    gateway = start_gateway(f"127.0.0.1:{free_port()}", [f"127.0.0.1:{free_port()}"], tmp_path, http_port=http_port)
    try:
        url = f"http://127.0.0.1:{http_port}"
        wait_until(lambda: _reachable(url), timeout=30, message=lambda: gateway.logs()[-2000:])
        assert get(f"{url}/health") == (503, {"status": "NOT_SERVING"})
        with pytest.raises(openai.InternalServerError) as caught:
            sdk(url).completions.create(model="grok-1", prompt="a|b", max_tokens=1)
        assert caught.value.status_code == 503 and "unavailable" in caught.value.message
    finally:
        gateway.terminate()


def _reachable(url: str) -> bool:
    try:
        get(f"{url}/health", timeout=1)
        return True
    except OSError:
        return False


def test_http_deadline_is_504_and_frees_the_model_slot(slow_stack: Stack, tmp_path: pathlib.Path) -> None:
    http_port = free_port()
    gateway = start_gateway(slow_stack.tokenizer.address, [m.address for m in slow_stack.models], tmp_path,
                            "--http-timeout", "0.5", http_port=http_port)
    try:
        gateway.wait_serving(30)
        status, reply = post(f"http://127.0.0.1:{http_port}/v1/completions",
                             {"prompt": "p|abc", "max_tokens": 100, "ignore_eos": True},
                             headers={"x-request-id": "http-deadline"})
        assert status == 504 and reply["error"]["code"] == "deadline_exceeded"
        assert outcome_of(slow_stack, "http-deadline", timeout=2) == "cancelled"
    finally:
        gateway.terminate()


def test_sigterm_lets_an_http_stream_finish_then_exits_cleanly(slow_stack: Stack, tmp_path: pathlib.Path) -> None:
    http_port = free_port()
    gateway = start_gateway(slow_stack.tokenizer.address, [m.address for m in slow_stack.models], tmp_path,
                            http_port=http_port)
    try:
        gateway.wait_serving(30)
        # 20 tokens at 50 ms: the stream is still running when SIGTERM arrives.
        sock = raw_request(http_port, {"prompt": "p|abc", "max_tokens": 20, "ignore_eos": True, "stream": True},
                           "drain")
        received = read_until(sock, b"data: ")
        gateway.proc.send_signal(signal.SIGTERM)
        received = read_until(sock, b"data: [DONE]", received)
        sock.close()
        assert gateway.proc.wait(30) == 0
    finally:
        gateway.kill()  # a failure above must not leave the gateway running after the test
    events = [json.loads(e) for e in sse_events(received.decode().split("\r\n\r\n", 1)[1]) if e != "[DONE]"]
    assert "".join(e["choices"][0]["text"] for e in events) == "abc" * 10  # 20 tokens: "ab", "c"
    assert events[-1]["choices"][0]["finish_reason"] == "length"


def test_body_over_the_limit_is_413_declared_or_chunked(fast_stack: Stack) -> None:
    # Declared: refused from the headers alone, before any of the body is read.
    with socket.create_connection(("127.0.0.1", fast_stack.http_port), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     b"content-length: 5000000\r\n\r\n")
        head = read_until(sock, b"request body is over")
    assert head.startswith(b"HTTP/1.1 413 ")
    # Chunked: refused once more than the limit arrived.
    big = json.dumps({"prompt": "x" * (5 << 20), "max_tokens": 1})
    chunked = curl(f"{fast_stack.http_url}/v1/completions", "-H", "content-type: application/json",
                   "-H", "transfer-encoding: chunked", "--data-binary", "@-", "-w", "\n%{http_code}", input_text=big)
    assert chunked.stdout.rsplit("\n", 1)[1] == "413", chunked.stdout[-300:] + chunked.stderr
