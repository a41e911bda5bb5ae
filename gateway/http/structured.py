"""Structured output over HTTP: OpenAI's `response_format` and vLLM's `structured_outputs` (and its older
`guided_json` / `guided_regex` / `guided_choice` / `guided_grammar` fields) -> the `constraint` oneof of the
gateway's SamplingParams. Only the shape is checked here; the model service compiles the constraint and
refuses an invalid one (INVALID_ARGUMENT naming `constraint.<kind>`, a 400 here).
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

from gateway.http.errors import ApiError, bad_request
from gateway.http.schemas import SamplingFields
from grok.gateway.v1 import gateway_pb2

KINDS = ("json", "regex", "choice", "grammar")
REFUSED = re.compile(r"(?:^|: )constraint\.[a-z_]+: ")  # how the model service names a constraint it refuses


def constraint_fields(request: SamplingFields, out: gateway_pb2.SamplingParams) -> None:
    """Set `out`'s constraint from whichever of the request's structured-output fields is given (at most one)."""
    given = [(name, value) for name, value in (("response_format", _response_format(request.response_format)),
                                               ("structured_outputs", _structured(request.structured_outputs)),
                                               ("guided_*", _guided(request))) if value is not None]
    if len(given) > 1:
        raise bad_request(given[1][0], f"conflicts with {given[0][0]}: give one structured-output constraint")
    if given:
        kind, value = given[0][1]
        if kind == "choice":
            out.choice.choices.extend(value)
        else:
            setattr(out, kind, value)


def _response_format(fmt: dict[str, Any] | None) -> tuple[str, Any] | None:
    kind = (fmt or {}).get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return "json_schema", '{"type": "object"}'
    if kind != "json_schema":
        raise bad_request("response_format", f"type {kind!r} is not one of text, json_object, json_schema")
    spec = fmt.get("json_schema")  # type: ignore[union-attr]
    if not isinstance(spec, dict) or not isinstance(spec.get("schema"), (dict, bool)):
        raise bad_request("response_format.json_schema.schema",
                          'give the JSON schema as an object: {"type": "json_schema", "json_schema": '
                          '{"name": "...", "schema": {...}}}')
    return "json_schema", json.dumps(spec["schema"])


def _structured(so: dict[str, Any] | None) -> tuple[str, Any] | None:
    if so is None:
        return None
    if not isinstance(so, dict):
        raise bad_request("structured_outputs", "must be an object with one of json, regex, choice, grammar")
    if so.get("json_object"):
        so = {**so, "json": {"type": "object"}}
        del so["json_object"]
    set_ = [k for k in KINDS if so.get(k) is not None]
    if len(set_) != 1:
        raise bad_request("structured_outputs", f"give exactly one of {', '.join(KINDS)} (got {set_ or 'none'})")
    return _kind(f"structured_outputs.{set_[0]}", set_[0], so[set_[0]])


def _guided(request: SamplingFields) -> tuple[str, Any] | None:
    set_ = [k for k in KINDS if getattr(request, f"guided_{k}") is not None]
    if not set_:
        return None
    if len(set_) > 1:
        raise bad_request(f"guided_{set_[1]}", f"conflicts with guided_{set_[0]}: give one of them")
    return _kind(f"guided_{set_[0]}", set_[0], getattr(request, f"guided_{set_[0]}"))


def _kind(param: str, kind: str, value: Any) -> tuple[str, Any]:
    """One vLLM constraint: json (a schema object or its JSON text), regex, choice (strings), grammar."""
    if kind == "json":
        if isinstance(value, (dict, bool)):
            return "json_schema", json.dumps(value)
        if isinstance(value, str):
            return "json_schema", value
        raise bad_request(param, "must be a JSON schema (an object, or its JSON text)")
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise bad_request(param, "must be a non-empty list of strings")
        return "choice", value
    if not isinstance(value, str):
        raise bad_request(param, "must be a string")
    return kind, value


def name_constraint_param(error: ApiError, request: SamplingFields) -> ApiError:
    """A 400 about the constraint (refused by the model service) names the field the caller sent it in."""
    if error.status != 400 or error.param is not None or not REFUSED.search(error.message):
        return error
    if (request.response_format or {}).get("type", "text") != "text":
        param = "response_format"
    elif isinstance(request.structured_outputs, dict):
        param = next((f"structured_outputs.{k}" for k in KINDS if request.structured_outputs.get(k) is not None),
                     "structured_outputs")
    else:
        param = next((f"guided_{k}" for k in KINDS if getattr(request, f"guided_{k}") is not None), None)
    return dataclasses.replace(error, param=param)
