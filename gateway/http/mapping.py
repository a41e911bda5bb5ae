"""OpenAI request bodies -> the gateway's GenerateRequest, which then runs through the same Pipeline
(and the same validation) as a gRPC request.

Fields the gRPC API has are mapped here (prompt, max_tokens, temperature, top_p, seed, stop,
ignore_eos, logprobs -> top_logprobs, allowed_token_ids, the sampling controls top_k, min_p, the penalties,
logit_bias, stop_token_ids, and the rest of SamplingParams). Fields whose feature this server lacks are
accepted at their "off" value and refused otherwise, in one function, `unsupported_features`. Fields neither
API has (a misspelled `"temprature"`) are ignored, as OpenAI-compatible servers do, but named: `ignored_fields`
gives the response's `Warning` header and the gateway's log line.
"""

from __future__ import annotations

import difflib
import json
from typing import Any

from gateway.http.errors import ApiError, bad_request
from gateway.http.schemas import ChatCompletionRequest, CompletionRequest, SamplingFields
from gateway.http.structured import constraint_fields
from grok.gateway.v1 import gateway_pb2
from serving_common.limits import MAX_SAMPLES

UINT32_MAX = 2**32 - 1
INT32_MAX = 2**31 - 1


def _not_yet(param: str, value: Any, default: str) -> ApiError:
    shown = json.dumps(value) if value is None or isinstance(value, (bool, int, float)) else repr(value)
    return bad_request(param, f"{shown} is not supported yet (only {default}); leave it out or use that value")


def sampling_controls(request: SamplingFields, out: gateway_pb2.SamplingParams) -> None:
    """top_k, min_p, the penalties, logit_bias and stop_token_ids into `out` (ranges are checked by the
    pipeline, as for gRPC; here only what the proto cannot hold)."""
    _check_int32("top_k", request.top_k)
    out.top_k = request.top_k or 0
    out.min_p = request.min_p or 0.0
    if request.repetition_penalty is not None:
        out.repetition_penalty = request.repetition_penalty
    out.presence_penalty = request.presence_penalty or 0.0
    out.frequency_penalty = request.frequency_penalty or 0.0
    for key, bias in (request.logit_bias or {}).items():
        try:
            token = int(key)
        except ValueError:
            raise bad_request("logit_bias", f"keys must be token ids (got {key!r})") from None
        _check_int32("logit_bias", token)
        out.logit_bias[token] = bias
    for token in request.stop_token_ids or []:
        _check_int32("stop_token_ids", token)
    out.stop_token_ids.extend(request.stop_token_ids or [])
    if request.n is not None and request.n < 1:
        raise bad_request("n", f"must be >= 1 (got {request.n})")
    _check_int32("n", request.n)
    out.n = request.n if request.n is not None else 1
    _check_int32("prompt_logprobs", request.prompt_logprobs)
    if request.prompt_logprobs is not None:
        out.prompt_logprobs = request.prompt_logprobs
    if isinstance(request, CompletionRequest) and request.echo:
        out.echo = True
        if request.logprobs is not None and request.prompt_logprobs is None:
            out.prompt_logprobs = request.logprobs  # echo with logprobs scores the prompt tokens too (OpenAI)
# ------------------------------------------------------------------------------------------------


def unsupported_features(request: SamplingFields) -> None:
    """400 naming the first field set to a value that needs a feature this server does not offer (instead of
    ignoring it); each field's "off" value passes."""
    if isinstance(request, CompletionRequest) and request.best_of not in (None, request.n or 1):
        raise _not_yet("best_of", request.best_of, "null or n (every sample is returned)")
    if isinstance(request, CompletionRequest) and request.suffix:
        raise _not_yet("suffix", request.suffix, "null")
    if not request.skip_special_tokens:
        raise _not_yet("skip_special_tokens", False, "true: control tokens such as EOS never appear in the text")
    if request.use_beam_search:
        raise _not_yet("use_beam_search", True, "false: tokens are sampled (or greedy at temperature 0)")
    if request.bad_words:
        raise _not_yet("bad_words", "[...]", "none; logit_bias of -100 bars single tokens")
    if request.logits_processors:
        raise _not_yet("logits_processors", "[...]", "none")
    if request.prompt_embeds is not None:
        raise _not_yet("prompt_embeds", "...", "null: send the prompt as text or token ids")
    if request.guided_whitespace_pattern is not None:
        raise _not_yet("guided_whitespace_pattern", request.guided_whitespace_pattern,
                       "null: JSON constraints allow the JSON grammar's whitespace")
    if request.priority:
        raise _not_yet("priority", request.priority, "0: requests are served first come, first served")
    if request.allowed_token_ids is not None and not request.allowed_token_ids:
        raise bad_request("allowed_token_ids", "an empty list allows no token; leave it out to allow every token")
    if isinstance(request, ChatCompletionRequest):
        if request.tools or request.functions:
            raise _not_yet("tools" if request.tools else "functions", "[...]", "no tools")
        if request.tool_choice not in (None, "none", "auto"):  # with no tools, "auto" and "none" both mean none
            raise _not_yet("tool_choice", request.tool_choice, 'null, "none" or "auto" (no tools are called)')
        if request.function_call not in (None, "none", "auto"):
            raise _not_yet("function_call", request.function_call, 'null, "none" or "auto" (no tools are called)')
        if request.modalities not in (None, ["text"]) or request.audio is not None:
            raise _not_yet("audio" if request.audio is not None else "modalities",
                           request.modalities if request.audio is None else "{...}", 'text only: ["text"] or null')
        if request.echo:
            raise _not_yet("echo", True, "false: the answer holds the assistant's new text only")


MAX_NAMED_FIELDS = 8  # in one Warning header; the log line has them all
MAX_FIELD_CHARS = 64


def ignored_fields(request: SamplingFields) -> dict[str, str | None]:
    """The body's top-level fields the API does not have, each with the known field it is closest to (a likely
    misspelling: temprature -> temperature) or None."""
    known = list(type(request).model_fields)
    return {name: next(iter(difflib.get_close_matches(name, known, n=1, cutoff=0.75)), None)
            for name in sorted(request.model_extra or {})}


def _printable(name: str) -> str:
    """A field name as a header may carry it: ASCII, no quotes or backslashes, not too long."""
    shown = json.dumps(name[:MAX_FIELD_CHARS])[1:-1].replace('\\"', "'").replace("\\", "/")
    return shown + ("..." if len(name) > MAX_FIELD_CHARS else "")


def ignored_warning(ignored: dict[str, str | None]) -> str:
    """The `Warning` header (RFC 7234's 299, "miscellaneous persistent warning") naming the ignored fields."""
    named = [f"{_printable(name)} (did you mean {close}?)" if close else _printable(name)
             for name, close in list(ignored.items())[:MAX_NAMED_FIELDS]]
    more = f" and {len(ignored) - MAX_NAMED_FIELDS} more" if len(ignored) > MAX_NAMED_FIELDS else ""
    return f'299 grok-serve "unknown fields ignored: {", ".join(named)}{more}"'


# Prompts one completion request may hold (OpenAI's list of prompts): each is a request of its own to the model.
MAX_PROMPTS = 64


def completion_prompts(request: CompletionRequest) -> list[str | list[int]]:
    """The prompts of a completion request, as OpenAI's API takes them: a string, a list of strings, a list of
    token ids, or a list of such lists (each prompt answered as one request, their choices in the list's order)."""
    prompt = request.prompt
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise bad_request("prompt", "an empty list holds no prompt; send a string, a list of strings, a list of "
                                    "token ids or a list of such lists")
    prompts: list[str | list[int]] = [list(prompt)] if isinstance(prompt[0], int) else list(prompt)  # type: ignore
    if empty := [i for i, p in enumerate(prompts) if not p]:
        raise bad_request(f"prompt[{empty[0]}]", "must be non-empty")
    if len(prompts) > MAX_PROMPTS:
        raise bad_request("prompt", f"{len(prompts)} prompts in one request is over the limit of {MAX_PROMPTS}; "
                                    "split them over several requests")
    n = request.n or 1
    if len(prompts) > 1 and len(prompts) * n > MAX_SAMPLES:  # each completion is a stream the gateway holds
        raise bad_request("n", f"{len(prompts)} prompts x n = {n} is {len(prompts) * n} completions, over the "
                               f"limit of {MAX_SAMPLES} a request; split the prompts over several requests")
    for p in prompts:
        for token in p if isinstance(p, list) else ():
            _check_int32("prompt", token)
    return prompts


def top_logprobs(request: SamplingFields) -> int | None:
    """Alternatives per token, or None when the response carries no logprobs at all."""
    if isinstance(request, CompletionRequest):
        return request.logprobs
    assert isinstance(request, ChatCompletionRequest)
    if not request.logprobs:
        if request.top_logprobs:
            raise bad_request("top_logprobs", "needs logprobs: true")
        return None
    return request.top_logprobs or 0


def _check_int32(param: str, value: int | None) -> None:
    """Values past the proto's int32 fields are refused here; smaller bad values by the pipeline."""
    if value is not None and not -INT32_MAX <= value <= INT32_MAX:
        raise bad_request(param, f"{value} is out of range")


def generate_request(request: SamplingFields, prompt: str | list[int]) -> gateway_pb2.GenerateRequest:
    """The gateway request for `prompt` (text, or token ids) with the sampling fields of `request` (checked
    first)."""
    unsupported_features(request)
    _check_int32("max_tokens", request.max_tokens)
    if isinstance(request, ChatCompletionRequest):
        _check_int32("max_completion_tokens", request.max_completion_tokens)
        _check_int32("top_logprobs", request.top_logprobs)
    else:
        _check_int32("logprobs", request.logprobs)  # type: ignore[attr-defined]
    for token in request.allowed_token_ids or []:
        _check_int32("allowed_token_ids", token)
    out = gateway_pb2.SamplingParams(
        temperature=1.0 if request.temperature is None else request.temperature,
        ignore_eos=request.ignore_eos, top_logprobs=top_logprobs(request) or 0,
        logprobs=top_logprobs(request) is not None,
        allowed_token_ids=request.allowed_token_ids or [])
    max_tokens = request.max_tokens
    if isinstance(request, ChatCompletionRequest) and request.max_completion_tokens is not None:
        max_tokens = request.max_completion_tokens
    if max_tokens is not None:
        out.max_tokens = max_tokens
    if request.top_p is not None:
        out.top_p = request.top_p
    if request.seed is not None:
        if not 0 <= request.seed <= UINT32_MAX:
            raise bad_request("seed", f"must be in [0, {UINT32_MAX}] (got {request.seed})")
        out.seed = request.seed
    stops = [request.stop] if isinstance(request.stop, str) else list(request.stop or [])
    out.stop.extend(stops)
    out.include_stop_str_in_output = request.include_stop_str_in_output
    _check_int32("min_tokens", request.min_tokens)
    out.min_tokens = request.min_tokens
    sampling_controls(request, out)
    constraint_fields(request, out)
    if request.cache_salt is not None:
        out.cache_salt = request.cache_salt
    if request.truncate_prompt_tokens is not None:
        _check_int32("truncate_prompt_tokens", request.truncate_prompt_tokens)
        out.truncate_prompt_tokens = request.truncate_prompt_tokens
    if isinstance(prompt, list):
        return gateway_pb2.GenerateRequest(prompt_token_ids=prompt, sampling=out)
    return gateway_pb2.GenerateRequest(prompt=prompt, sampling=out)
