"""Structured output through the stack `make run` starts (gateway -> tokenizer -> model, real processes on 127.0.0.1):
the gateway's gRPC API and the HTTP API (the official openai package and raw bodies) constrain the demo
model's output to a JSON schema, a regex, a choice or a grammar, and refuse bad constraints naming the field."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator

import grpc
import jsonschema
import pytest

from gateway.client import GatewayClient
from grok.gateway.v1 import gateway_pb2
from tests.demo.launcher import Launched
from tests.gateway.http_client import post, sdk
from tests.procs import grpcurl

pytestmark = pytest.mark.slow

PROMPT = "A request travels like this."
SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0,
                                                                              "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
REGEX = r"[0-9]{3}-[a-z]{2,4}"
CHOICES = ["gateway", "tokenizer", "model service"]


@pytest.fixture(scope="module")
def stack(demo_stack: Launched) -> Launched:
    """The stack `make run` starts: its launcher gives the model service the tokenizer, which turns structured
    output on."""
    return demo_stack


@pytest.fixture(scope="module")
def client(stack: Launched) -> Iterator[GatewayClient]:
    with GatewayClient(stack.address, timeout=120) as c:
        yield c


def test_json_schema_answer_parses_and_validates(client: GatewayClient) -> None:
    for seed in range(3):
        reply = client.complete(PROMPT, max_tokens=60, temperature=1.0, seed=seed, json_schema=json.dumps(SCHEMA))
        assert reply.finish_reason == gateway_pb2.FINISH_REASON_EOS, reply.text
        jsonschema.validate(json.loads(reply.text), SCHEMA)


def test_regex_answer_fully_matches(client: GatewayClient) -> None:
    for seed in range(3):
        reply = client.complete(PROMPT, max_tokens=20, temperature=1.0, seed=seed, regex=REGEX)
        assert re.fullmatch(REGEX, reply.text), reply.text
        assert reply.finish_reason == gateway_pb2.FINISH_REASON_EOS


def test_choice_answer_is_one_of_the_choices(client: GatewayClient) -> None:
    texts = {client.complete(PROMPT, max_tokens=10, temperature=1.0, seed=seed,
                             choice=gateway_pb2.Choices(choices=CHOICES)).text for seed in range(4)}
    assert texts <= set(CHOICES)


def test_min_tokens_does_not_hold_back_the_end_of_a_complete_constraint(client: GatewayClient) -> None:
    """A choice that is complete leaves only EOS to draw: min_tokens cannot hold it back (nor is the pad drawn)."""
    reply = client.complete(PROMPT, max_tokens=10, temperature=1.0, seed=1, min_tokens=10,
                            choice=gateway_pb2.Choices(choices=CHOICES))
    assert reply.text in CHOICES and reply.finish_reason == gateway_pb2.FINISH_REASON_EOS, reply


def test_lark_and_gbnf_grammars_constrain_the_answer(client: GatewayClient) -> None:
    lark = 'start: "route " DIR\nDIR: "left" | "right"'
    gbnf = 'root ::= "step " [0-9] [0-9]?'
    assert re.fullmatch("route (left|right)", client.complete(PROMPT, max_tokens=10, grammar=lark).text)
    assert re.fullmatch("step [0-9]{1,2}", client.complete(PROMPT, max_tokens=10, grammar=gbnf).text)


def test_same_seed_same_constrained_output_streamed_or_not(client: GatewayClient) -> None:
    options = dict(max_tokens=60, temperature=1.0, seed=7, json_schema=json.dumps(SCHEMA))
    runs = [client.complete(PROMPT, **options).text for _ in range(2)]
    streamed = "".join(m.text for m in client.generate(PROMPT, **options))
    assert runs[0] == runs[1] == streamed


def test_constrained_requests_beside_plain_ones_leave_theirs_unchanged(client: GatewayClient) -> None:
    plain = dict(max_tokens=24, temperature=1.0, seed=11, ignore_eos=True)
    alone = client.complete(PROMPT, **plain).text
    constrained_alone = client.complete(PROMPT, max_tokens=60, temperature=1.0, seed=5, json_schema=json.dumps(SCHEMA)).text
    results: dict[str, str] = {}

    def run(name: str, **options: object) -> None:
        results[name] = client.complete(PROMPT, **options).text

    threads = [threading.Thread(target=run, args=("plain",), kwargs=plain),
               threading.Thread(target=run, args=("json",), kwargs=dict(max_tokens=60, temperature=1.0, seed=5,
                                                                        json_schema=json.dumps(SCHEMA))),
               threading.Thread(target=run, args=("regex",), kwargs=dict(max_tokens=20, temperature=1.0, regex=REGEX))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results["plain"] == alone
    assert results["json"] == constrained_alone  # batch-invariant: the same with neighbours as alone
    assert re.fullmatch(REGEX, results["regex"])


def test_grpcurl_choice_and_bad_regex(stack: Launched) -> None:
    body = {"prompt": PROMPT, "sampling": {"max_tokens": 10, "choice": {"choices": CHOICES}}}
    out = grpcurl("-plaintext", "-d", json.dumps(body), stack.address, "grok.gateway.v1.GatewayService/Complete")
    assert out.returncode == 0, out.stderr
    reply = json.loads(out.stdout)
    assert reply["text"] in CHOICES and "choices" not in reply  # one completion: its text once
    bad = {"prompt": PROMPT, "sampling": {"max_tokens": 4, "regex": "[0-9"}}
    out = grpcurl("-plaintext", "-d", json.dumps(bad), stack.address, "grok.gateway.v1.GatewayService/Complete")
    assert out.returncode == 64 + 3 and "constraint.regex: " in out.stderr  # INVALID_ARGUMENT


@pytest.mark.parametrize(("options", "field"), [
    (dict(json_schema="{not json"), "constraint.json_schema"),
    (dict(json_schema='{"type": "nonsense"}'), "constraint.json_schema"),
    (dict(regex="[0-9"), "constraint.regex"),
    (dict(grammar="start: undefined_rule"), "constraint.grammar"),
    (dict(choice=gateway_pb2.Choices(choices=[])), "constraint.choice"),
])
def test_bad_constraint_is_invalid_argument_naming_the_field(client: GatewayClient, options: dict, field: str) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        client.complete(PROMPT, max_tokens=4, **options)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"{field}: " in caught.value.details(), caught.value.details()  # the gateway says which hop refused


def test_openai_response_format_json_schema_over_completions_and_chat(stack: Launched) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    api = sdk(stack.http_url)
    reply = api.completions.create(model="grok-1", prompt=PROMPT, max_tokens=60, seed=3,
                                   extra_body={"response_format": fmt})
    jsonschema.validate(json.loads(reply.choices[0].text), SCHEMA)
    chat = api.chat.completions.create(model="grok-1", messages=[{"role": "user", "content": PROMPT}],
                                       max_tokens=60, seed=3, response_format=fmt)
    jsonschema.validate(json.loads(chat.choices[0].message.content), SCHEMA)
    obj = api.chat.completions.create(model="grok-1", messages=[{"role": "user", "content": PROMPT}],
                                      max_tokens=60, seed=3, response_format={"type": "json_object"})
    assert obj.choices[0].finish_reason == "length" or isinstance(json.loads(obj.choices[0].message.content), dict)


def test_vllm_structured_outputs_streamed_and_not(stack: Launched) -> None:
    api = sdk(stack.http_url)
    whole = api.completions.create(model="grok-1", prompt=PROMPT, max_tokens=20, seed=2,
                                   extra_body={"structured_outputs": {"regex": REGEX}})
    assert re.fullmatch(REGEX, whole.choices[0].text)
    chunks = api.completions.create(model="grok-1", prompt=PROMPT, max_tokens=20, seed=2, stream=True,
                                    extra_body={"structured_outputs": {"regex": REGEX}})
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    streamed = api.chat.completions.create(model="grok-1", messages=[{"role": "user", "content": PROMPT}],
                                           max_tokens=10, stream=True,
                                           extra_body={"structured_outputs": {"choice": CHOICES}})
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) in CHOICES
    schema = api.completions.create(model="grok-1", prompt=PROMPT, max_tokens=60, seed=4,
                                    extra_body={"structured_outputs": {"json": SCHEMA}})
    jsonschema.validate(json.loads(schema.choices[0].text), SCHEMA)


@pytest.mark.parametrize(("body", "param"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {"choice": "yes"}}, "structured_outputs.choice"),
    ({"structured_outputs": {"regex": "[0-9"}}, "structured_outputs.regex"),
    ({"guided_regex": "[0-9"}, "guided_regex"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format"),
])
def test_bad_constraint_over_http_is_400_naming_the_field(stack: Launched, body: dict, param: str) -> None:
    status, reply = post(f"{stack.http_url}/v1/completions", {"prompt": PROMPT, "max_tokens": 4, **body})
    assert status == 400 and reply["error"]["param"] == param, reply


ANSWER = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"],
          "additionalProperties": False}


@pytest.mark.parametrize("question", ["What is the tokenizer service? Answer as a JSON object.",
                                      "How does cancellation work? Give the answer as JSON with the key answer.",
                                      "What is a Debian conffile? Answer as a JSON object."])
def test_the_demo_model_answers_a_schema_in_words_within_64_tokens(stack: Launched, question: str) -> None:
    """Issue 65.1: a schema request gets an answer, not only valid JSON. The demo model learned its JSON answers
    as json.dumps writes them; under compact separators it wrote {"answer":": "} (greedy) to every question."""
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": ANSWER}}
    chat = sdk(stack.http_url).chat.completions.create(
        model="grok-1", messages=[{"role": "user", "content": question}], max_tokens=64, temperature=0,
        response_format=fmt)
    assert chat.choices[0].finish_reason == "stop"
    answer = json.loads(chat.choices[0].message.content)["answer"]
    assert len(re.findall(r"[A-Za-z]{2,}", answer)) >= 3, answer
