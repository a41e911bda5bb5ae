"""Unit tests of the HTTP API's pieces: request mapping, chat templates, error mapping, API keys, flags."""

from __future__ import annotations

import json
import math
import pathlib

import grpc
import pydantic
import pytest
from fastapi.exceptions import RequestValidationError
from starlette.requests import Request

from gateway.__main__ import parse_config
from gateway.auth import ApiKeys, load_keys
from gateway.http.app import validation_error
from gateway.http.chat import ChatTemplate
from gateway.http.errors import ApiError, from_status
from gateway.http.mapping import generate_request
from gateway.http.responses import MIN_LOGPROB, Shaper
from gateway.http.schemas import ChatCompletionRequest, ChatMessage, CompletionRequest
from grok.gateway.v1 import gateway_pb2


def test_completion_fields_map_to_the_grpc_request_with_openai_defaults() -> None:
    request = CompletionRequest(prompt="hi", stop="\n", seed=7, logprobs=3, ignore_eos=True)
    out = generate_request(request, "hi").sampling
    assert out.max_tokens == 16 and out.temperature == 1.0 and out.top_p == 1.0  # OpenAI's defaults
    assert list(out.stop) == ["\n"] and out.seed == 7 and out.top_logprobs == 3 and out.ignore_eos


def test_chat_max_completion_tokens_wins_and_unset_max_tokens_stays_unset() -> None:
    messages = [ChatMessage(role="user", content="x")]
    assert not generate_request(ChatCompletionRequest(messages=messages), "p").sampling.HasField("max_tokens")
    both = ChatCompletionRequest(messages=messages, max_tokens=5, max_completion_tokens=9)
    assert generate_request(both, "p").sampling.max_tokens == 9


def test_chat_top_logprobs_needs_logprobs() -> None:
    request = ChatCompletionRequest(messages=[ChatMessage(role="user", content="x")], top_logprobs=2)
    with pytest.raises(ApiError) as caught:
        generate_request(request, "p")
    assert caught.value.param == "top_logprobs"
    request = ChatCompletionRequest(messages=[ChatMessage(role="user", content="x")], logprobs=True, top_logprobs=2)
    assert generate_request(request, "p").sampling.top_logprobs == 2


def test_vllm_sampling_controls_map_to_the_shared_sampling_params() -> None:
    request = CompletionRequest(prompt="hi", top_k=40, min_p=0.1, repetition_penalty=1.25, presence_penalty=0.5,
                                frequency_penalty=-0.5, logit_bias={"5": -100, "17": 2.5}, stop_token_ids=[3, 9])
    out = generate_request(request, "hi").sampling
    assert (out.top_k, out.repetition_penalty, out.presence_penalty, out.frequency_penalty) == (40, 1.25, 0.5, -0.5)
    assert out.min_p == pytest.approx(0.1) and dict(out.logit_bias) == {5: -100.0, 17: 2.5}
    assert list(out.stop_token_ids) == [3, 9]
    off = generate_request(CompletionRequest(prompt="hi"), "hi").sampling  # OpenAI's defaults are all "off"
    assert (off.top_k, off.min_p, off.presence_penalty, off.frequency_penalty) == (0, 0, 0, 0)
    assert not off.HasField("repetition_penalty") and not off.logit_bias and not off.stop_token_ids


def test_logit_bias_keys_must_be_token_ids() -> None:
    with pytest.raises(ApiError) as caught:
        generate_request(CompletionRequest(prompt="x", logit_bias={"hello": 1.0}), "x")
    assert caught.value.status == 400 and caught.value.param == "logit_bias"


@pytest.mark.parametrize(("field", "value"), [("max_tokens", 2**40), ("seed", 2**32), ("seed", -5), ("top_k", 2**40),
                                              ("stop_token_ids", [2**40])])
def test_values_outside_the_proto_ranges_are_400(field: str, value: int) -> None:
    with pytest.raises(ApiError) as caught:
        generate_request(CompletionRequest(prompt="x", **{field: value}), "x")
    assert caught.value.status == 400 and caught.value.param == field


@pytest.mark.parametrize(("model", "body", "param", "message"), [
    (CompletionRequest, {"prompt": "x", "stop": 5}, "stop",
     "stop: Input should be a valid string; Input should be a valid list"),
    (CompletionRequest, {"prompt": "x", "guided_json": 5}, "guided_json",
     "guided_json: Input should be a valid dictionary; Input should be a valid string"),
    (CompletionRequest, {"prompt": "x", "logit_bias": {"1": "a"}}, "logit_bias.1",
     "logit_bias.1: Input should be a valid number, unable to parse string as a number"),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": 5}]}, "messages.0.content",
     "messages.0.content: Input should be a valid string; Input should be a valid list"),
])
def test_a_field_of_several_types_is_named_as_sent(model: type[pydantic.BaseModel], body: dict, param: str,
                                                   message: str) -> None:
    """Pydantic tags each member of a union it tried ("stop.list[str]"); the 400 names the field the client sent
    and every type it may have."""
    with pytest.raises(pydantic.ValidationError) as caught:
        model(**body)
    error = RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in caught.value.errors()], body=body)
    request = Request({"type": "http", "headers": [(b"content-type", b"application/json")]})
    reply = json.loads(validation_error(request, error).body)
    assert reply["error"]["param"] == param and reply["error"]["message"] == message


def test_default_template_writes_a_transcript_ending_with_the_assistant_prompt() -> None:
    messages = [ChatMessage(role="developer", content=" Be terse. "), ChatMessage(role="user", content="Hi"),
                ChatMessage(role="assistant", content="Hello."),
                ChatMessage(role="user", content=[{"type": "text", "text": "Two"}, {"type": "text", "text": "parts"}])]
    assert ChatTemplate.load().render(messages) == (
        "System: Be terse.\n\nUser: Hi\n\nAssistant: Hello.\n\nUser: Two\nparts\n\nAssistant:")
    assert ChatTemplate.load().render(messages[:2], add_generation_prompt=False).endswith("User: Hi\n\n")


def test_the_default_template_ends_an_answer_at_the_turns_it_writes_and_a_custom_one_at_none(
        tmp_path: pathlib.Path) -> None:
    default = ChatTemplate.load()
    assert default.turn_starts == ("\n\nUser:", "\n\nSystem:")
    for role, start in (("user", "\n\nUser:"), ("system", "\n\nSystem:")):  # as the template writes a next turn
        rendered = default.render([ChatMessage(role="assistant", content="A."), ChatMessage(role=role, content="B")])
        assert rendered.startswith("Assistant: A." + start), rendered
    path = tmp_path / "t.jinja"
    path.write_text("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}")
    assert ChatTemplate.load(str(path)).turn_starts == ()


def test_custom_template_file_and_template_errors(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "t.jinja"
    path.write_text("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}{{ suffix }}")
    assert ChatTemplate.load(str(path)).render([ChatMessage(role="user", content="a")], extra={"suffix": "!"}) \
        == "<user>a!"
    path.write_text("{% for m in messages %}")
    with pytest.raises(ValueError, match="--chat-template"):
        ChatTemplate.load(str(path))
    with pytest.raises(ValueError, match="cannot read"):
        ChatTemplate.load(str(tmp_path / "missing.jinja"))
    with pytest.raises(ApiError) as caught:
        ChatTemplate.load().render([ChatMessage(role="user", content=[{"type": "image_url"}])])
    assert caught.value.param == "messages[0].content"


@pytest.mark.parametrize(("code", "status"), [
    (grpc.StatusCode.INVALID_ARGUMENT, 400), (grpc.StatusCode.UNAUTHENTICATED, 401), (grpc.StatusCode.NOT_FOUND, 404),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, 429), (grpc.StatusCode.UNAVAILABLE, 503),
    (grpc.StatusCode.DEADLINE_EXCEEDED, 504), (grpc.StatusCode.INTERNAL, 500), (grpc.StatusCode.UNKNOWN, 500)])
def test_grpc_statuses_map_to_http_statuses(code: grpc.StatusCode, status: int) -> None:
    assert from_status(code, "something went wrong").status == status


def test_statuses_that_mean_later_carry_retry_after_and_a_400_does_not() -> None:
    for code in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE):
        assert from_status(code, "the waiting queue is full; retry later").response().headers["retry-after"] == "1"
    assert "retry-after" not in from_status(grpc.StatusCode.INVALID_ARGUMENT, "n: too many").response().headers


def test_field_named_by_a_grpc_error_becomes_the_openai_param() -> None:
    assert from_status(grpc.StatusCode.INVALID_ARGUMENT, "top_logprobs: must be in 0..20").param == "logprobs"
    assert from_status(grpc.StatusCode.INVALID_ARGUMENT, "top_logprobs: x", "chat").param == "top_logprobs"
    assert from_status(grpc.StatusCode.INVALID_ARGUMENT, "prompt: 300 tokens", "chat").param == "messages"
    assert from_status(grpc.StatusCode.INVALID_ARGUMENT, "stop[2]: must be non-empty").param == "stop"
    assert from_status(grpc.StatusCode.UNAVAILABLE, "model: down").param is None


def test_the_message_names_the_field_as_param_does() -> None:
    assert from_status(grpc.StatusCode.INVALID_ARGUMENT, "top_logprobs: must be in 0..20").message == (
        "logprobs: must be in 0..20")
    assert from_status(grpc.StatusCode.INVALID_ARGUMENT, "prompt: 300 tokens", "chat").message == "messages: 300 tokens"
    assert from_status(grpc.StatusCode.INVALID_ARGUMENT, "stop[2]: empty").message == "stop[2]: empty"


def test_alternatives_with_the_same_text_keep_the_most_probable_in_completions_logprobs() -> None:
    # Two ids can read alike (a byte piece and a piece of the same character): the dict keeps the first.
    tops = [gateway_pb2.TopToken(id=7, text="A", logprob=-0.5), gateway_pb2.TopToken(id=300, text="A", logprob=-2.0),
            gateway_pb2.TopToken(id=9, text=" b", logprob=-3.0)]
    token = gateway_pb2.Token(id=7, text="A", logprob=-0.5, top_tokens=tops)
    body = Shaper("completions", "r", "grok-1", top_logprobs=3).completion_logprobs([token])
    assert body["top_logprobs"] == [{"A": -0.5, " b": -3.0}]


def test_logprob_of_a_masked_token_is_finite_in_json() -> None:
    token = gateway_pb2.Token(id=1, text="a", logprob=-math.inf)
    body = Shaper("chat", "r", "grok-1", top_logprobs=0).chat_logprobs([token])
    assert body["content"][0]["logprob"] == MIN_LOGPROB


def test_api_keys_accept_only_bearer_with_a_configured_key() -> None:
    keys = ApiKeys(["k1", "k2-longer"])
    assert keys.allows("Bearer k1") and keys.allows("bearer k2-longer") and keys.allows("Bearer  k1 ")
    for value in (None, "", "k1", "Bearer", "Bearer k", "Bearer k1x", "Basic k1", "Bearer k2"):
        assert not keys.allows(value), value
    assert ApiKeys([]).allows(None)  # no key configured: open


def test_keys_come_from_the_flag_and_the_file(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "keys"
    path.write_text("# team keys\nfile-key-1\n\n  file-key-2  \n")
    assert load_keys("a,b", str(path)) == ("a", "b", "file-key-1", "file-key-2")
    assert load_keys(None, None) == ()
    (tmp_path / "empty").write_text("# none\n")
    with pytest.raises(ValueError, match="holds no key"):
        load_keys(None, str(tmp_path / "empty"))


def test_http_and_security_flags_parse_into_the_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GROK_GATEWAY_API_KEY", "secret")
    config = parse_config(["--tokenizer", "t:1", "--model", "m:2", "--http-port", "0", "--served-model-name", "g",
                           "--http-timeout", "5"])
    assert (config.http.port, config.http.model_name, config.http.timeout_seconds) == (0, "g", 5.0)
    assert config.api_keys == ("secret",) and "secret" not in repr(config)
    assert config.tls is None and config.backend_tls is None
    assert parse_config(["--tokenizer", "t:1", "--model", "m:2"]).http.port == 8000


@pytest.mark.parametrize("argv", [["--tls-cert", "x.pem"], ["--tls-client-cert", "c.pem"], ["--http-timeout", "-1"],
                                  ["--tls-cert", "missing.pem", "--tls-key", "missing.key"]])
def test_bad_security_flags_are_usage_errors(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as caught:
        parse_config(["--tokenizer", "t:1", "--model", "m:2", *argv])
    assert caught.value.code == 2


def test_nesting_depth_counts_levels_without_recursing_and_ignores_brackets_in_strings() -> None:
    from gateway.http.body import MAX_NESTING, nesting_depth, too_deep

    assert nesting_depth(b'{"a": [1, {"b": []}]}') == 4
    assert nesting_depth(b'{"a": "[[[[[[[[ \\" {{{{"}') == 1
    deep = b"[" * 100_000 + b"]" * 100_000
    assert too_deep(deep) == MAX_NESTING + 1  # the count stops once it is enough to refuse
    assert too_deep(b"[" * MAX_NESTING + b"]" * MAX_NESTING) is None
    many_flat = b"[" + b"[]," * 1000 + b"[]]"
    assert nesting_depth(many_flat) == 2 and too_deep(many_flat) is None


def test_ignored_fields_are_named_with_the_field_they_most_likely_misspell() -> None:
    from gateway.http.mapping import MAX_NAMED_FIELDS, ignored_fields, ignored_warning

    request = CompletionRequest.model_validate({"prompt": "hi", "temprature": 0.1, "max_tokns": 3, "zzz": 1,
                                                "temperature": 0.5})
    assert ignored_fields(request) == {"max_tokns": "max_tokens", "temprature": "temperature", "zzz": None}
    assert generate_request(request, "hi").sampling.temperature == pytest.approx(0.5)  # the known one is used
    assert ignored_fields(CompletionRequest(prompt="hi", top_k=3)) == {}
    header = ignored_warning({'a"b\\é' + "x" * 100: None, **{f"f{i}": None for i in range(MAX_NAMED_FIELDS)}})
    header.encode("ascii")  # a header value
    assert header.startswith('299 grok-serve "unknown fields ignored: a\'b/') and header.endswith(' and 1 more"')
    assert header.count('"') == 2


def test_completions_of_several_prompts_are_bounded_by_the_samples_limit_in_all() -> None:
    """n may reach 128 (samples beyond the slots wait); several prompts times n are bounded the same way, since
    each completion is a stream the gateway holds."""
    from gateway.http.mapping import completion_prompts

    assert len(completion_prompts(CompletionRequest(prompt=["a", "b"], n=64))) == 2
    assert len(completion_prompts(CompletionRequest(prompt="a", n=128))) == 1
    with pytest.raises(ApiError) as caught:
        completion_prompts(CompletionRequest(prompt=["a", "b", "c"], n=64))
    assert caught.value.status == 400 and caught.value.param == "n" and "192 completions" in caught.value.message
