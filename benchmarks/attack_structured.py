"""Structured-output abuse: the constraints that crashed, stalled or answered INTERNAL (docs/reliability.md, round three, 1-3),
each sent to the model service (token ids), the gateway's gRPC Complete and its HTTP completions. Each must be
refused with INVALID_ARGUMENT / 400 naming `constraint.<kind>` (before a slot is taken, or mid-stream where only
a later step fails), and the stack must keep serving: a burst of them beside a plain request, and the
worst-case accepted constraints, end as expected too."""

from __future__ import annotations

import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc

from benchmarks.attack_cases import INVALID, Case, Facts, model_request, text_request
from benchmarks.attack_http import post
from grok.gateway.v1 import gateway_pb2
from serving_common.limits import MAX_CHOICES, MAX_CONSTRAINT_CHARS, MAX_CONSTRAINT_DEPTH, MAX_GRAMMAR_RULES

# The HTTP field of each kind (vLLM's guided_* fields) and the gRPC oneof member.
HTTP_FIELD = {"json_schema": "guided_json", "regex": "guided_regex", "choice": "guided_choice",
              "grammar": "guided_grammar"}


def lark_chain(n: int) -> str:
    return "start: r0\n" + "".join(f"r{i}: r{i + 1}\n" for i in range(n)) + f'r{n}: "z"\n'


def gbnf_chain(n: int) -> str:
    return "root ::= r0\n" + "".join(f"r{i} ::= r{i + 1}\n" for i in range(n)) + f'r{n} ::= "z"\n'


# (name, kind, value): refused with INVALID_ARGUMENT naming constraint.<kind> before a slot is taken.
REFUSED: list[tuple[str, str, Any]] = [
    ("lark-chain-3000", "grammar", lark_chain(3000)),  # segfaulted the model service
    ("gbnf-chain-3000", "grammar", gbnf_chain(3000)),  # 8-25 s of quadratic conversion on the event loop
    ("lark-chain-over-bound", "grammar", lark_chain(MAX_GRAMMAR_RULES + 1)),
    ("schema-deep-text", "json_schema", "[" * 5000 + "]" * 5000),  # RecursionError: INTERNAL
    ("schema-deep-items", "json_schema", '{"items":' * (MAX_CONSTRAINT_DEPTH + 1) + "{}"
     + "}" * (MAX_CONSTRAINT_DEPTH + 1)),
    ("schema-ref-self", "json_schema", '{"$ref": "#"}'),  # NoExtensionBias: INTERNAL
    ("schema-ref-cycle", "json_schema", json.dumps({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
                                                    "$ref": "#/$defs/a"})),
    ("schema-ref-missing", "json_schema", '{"$ref": "#/$defs/none"}'),
    ("schema-false", "json_schema", "false"),
    ("schema-array", "json_schema", "[]"),
    ("schema-number", "json_schema", "5"),
    ("schema-not-json", "json_schema", "{'type': 'object'}"),
    ("schema-bad-type", "json_schema", '{"type": "no-such-type"}'),
    ("regex-empty-class", "regex", r"[^\x00-\x{10FFFF}]"),  # NoExtensionBias: INTERNAL
    ("regex-deep-parens", "regex", "(" * 2000 + "a" + ")" * 2000),
    ("regex-unbalanced", "regex", "(ab"),
    ("regex-over-size", "regex", "a" * (MAX_CONSTRAINT_CHARS + 1)),
    ("grammar-self-loop", "grammar", 'start: "a" start'),  # a per-step limit inside advance: INTERNAL
    ("grammar-left-self", "grammar", 'start: start "a"'),
    ("grammar-deep-parens", "grammar", "start: " + "(" * 500 + '"a"' + ")" * 500),
    ("gbnf-deep-parens", "grammar", "root ::= " + "(" * 500 + '"a"' + ")" * 500),
    ("grammar-syntax", "grammar", "start: %%%"),
    ("grammar-no-start", "grammar", 'rule: "a"'),
    ("grammar-blank", "grammar", "   \n  "),
    ("choice-too-many", "choice", [f"c{i}" for i in range(MAX_CHOICES + 1)]),
    ("choice-empty-string", "choice", ["ok", ""]),
    ("choice-over-size", "choice", ["x" * (MAX_CONSTRAINT_CHARS // 2 + 1)] * 2),
]
# (name, kind, value): the worst cases under the bounds, and the schema `true` the docs allow: answered OK.
ACCEPTED: list[tuple[str, str, Any]] = [
    ("schema-true", "json_schema", "true"),
    ("schema-empty", "json_schema", "{}"),
    ("gbnf-chain-under-bound", "grammar", gbnf_chain(MAX_GRAMMAR_RULES - 2)),
    ("schema-nested-under-bound", "json_schema",
     '{"type":"array","items":' * 20 + '{"type":"integer"}' + "}" * 20),
    ("choice-1024", "choice", [f"option {i}" for i in range(MAX_CHOICES)]),
    ("regex-digits", "regex", "[0-9]{1,3}"),
]


def _with_constraint(request: Any, kind: str, value: Any) -> Any:
    target = request.sampling if isinstance(request, gateway_pb2.CompleteRequest) else request
    if kind == "choice":
        target.choice.choices.extend(value)
    else:
        setattr(target, kind, value)
    return request


def model_call(f: Facts, kind: str, value: Any, **fields: Any) -> Callable[[Any], Any]:
    request = _with_constraint(model_request(f, **fields), kind, value)
    return lambda t: list(t.model.Generate(request, timeout=60))


def complete_call(f: Facts, kind: str, value: Any, **fields: Any) -> Callable[[Any], Any]:
    request = _with_constraint(text_request(gateway_pb2.CompleteRequest, f, **fields), kind, value)
    return lambda t: t.gateway.Complete(request, timeout=60)


def http_fields(f: Facts, kind: str, value: Any) -> dict[str, Any]:
    return {"model": "grok-1", "prompt": f.prompt, "max_tokens": f.max_tokens, "seed": f.seed,
            "temperature": f.temperature, HTTP_FIELD[kind]: value}


def nothing_left_later(f: Facts) -> tuple[list[str], list[int]]:
    """A choice whose first step is allowed but whose second is not: every piece that could follow "a" blocked."""
    blocked = [i for i, p in enumerate(f.pieces) if p[:1] in (b"b", b"c") or p[:2] in (b"ab", b"ac")]
    return ["ab", "ac"], blocked


def burst(f: Facts) -> Callable[[Any], Any]:
    """16 refused constraints at once beside one plain request: the plain one answers OK, every bad one is
    INVALID_ARGUMENT (a summary exception otherwise)."""
    bad = [complete_call(f, kind, value) for _, kind, value in REFUSED[:16]]
    plain = text_request(gateway_pb2.CompleteRequest, f)

    def outcome(call: Callable[[Any], Any], t: Any) -> str:
        try:
            call(t)
            return "OK"
        except grpc.RpcError as error:
            return error.code().name

    def run(t: Any) -> Any:
        with ThreadPoolExecutor(len(bad) + 1) as pool:
            futures = [pool.submit(outcome, call, t) for call in bad]
            answer = pool.submit(lambda: t.gateway.Complete(plain, timeout=60))
            outcomes = [fut.result() for fut in futures]
            reply = answer.result()
        if set(outcomes) != {INVALID}:
            raise AssertionError(f"bad constraints answered {sorted(set(outcomes))}")
        return reply
    return run


def structured_cases(f: Facts) -> list[Case]:
    cases: list[Case] = []
    for name, kind, value in REFUSED:
        field = f"constraint.{kind}"
        cases.append(Case(f"so-model-{name}", "model", model_call(f, kind, value), INVALID, field))
        cases.append(Case(f"so-gw-{name}", "gateway", complete_call(f, kind, value), INVALID, field))
        cases.append(Case(f"so-http-{name}", "gateway-http", post("/v1/completions", http_fields(f, kind, value)),
                          400))
    for name, kind, value in ACCEPTED:
        cases.append(Case(f"so-model-ok-{name}", "model", model_call(f, kind, value), "OK", tags=("finite",)))
        cases.append(Case(f"so-gw-ok-{name}", "gateway", complete_call(f, kind, value), "OK", tags=("finite",)))
        cases.append(Case(f"so-http-ok-{name}", "gateway-http", post("/v1/completions", http_fields(f, kind, value)),
                          200, tags=("finite",)))
    choices, blocked = nothing_left_later(f)
    cases += [
        Case("so-model-nothing-left-later", "model", model_call(f, "choice", choices, blocked_token_ids=blocked),
             INVALID, "constraint.choice", "nothing the constraint allows"),
        Case("so-gw-nothing-left-later", "gateway", complete_call(f, "choice", choices, blocked_token_ids=blocked),
             INVALID, "constraint.choice", "nothing the constraint allows"),
        Case("so-http-nothing-left-later", "gateway-http", post("/v1/completions", {
            **http_fields(f, "choice", choices), "allowed_token_ids": [i for i in range(f.vocab) if i not in blocked]}),
            400),
        Case("so-model-nothing-can-start", "model",
             model_call(f, "regex", "[0-9]+", allowed_token_ids=[f.prompt_ids[0]]),
             INVALID, "constraint.regex", "no token can start"),
        Case("so-http-response-format-ref-self", "gateway-http", post("/v1/completions", {
            **{k: v for k, v in http_fields(f, "regex", "").items() if k != "guided_regex"},
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#"}}}}), 400),
        Case("so-http-structured-outputs-chain", "gateway-http", post("/v1/completions", {
            **{k: v for k, v in http_fields(f, "regex", "").items() if k != "guided_regex"},
            "structured_outputs": {"grammar": lark_chain(3000)}}), 400),
        Case("so-gw-burst-beside-a-plain-request", "gateway", burst(f), "OK", tags=("finite",)),
    ]
    return cases
