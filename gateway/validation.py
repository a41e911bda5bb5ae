"""Boundary checks of a Generate/Complete request, before and after the prompt is encoded.

`check_request` needs only the gateway's limits; `plan` needs the prompt's token count and the
model's configuration (context length, vocabulary, longest prompt) and fixes max_tokens.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from gateway.config import Limits, prompt_byte_limit
from gateway.errors import invalid
from grok.gateway.v1 import gateway_pb2
from grok.model.v1 import model_pb2
from serving_common.limits import (  # declared once for both services; the model service checks them too
    LOGIT_BIAS_LIMIT,
    MAX_CACHE_SALT_CHARS,
    MAX_LOGIT_BIAS,
    MAX_SAMPLES,
    MAX_STOP_TOKEN_IDS,
    MAX_TOP_LOGPROBS,
    PENALTY_LIMIT,
)


class TextRequest(Protocol):
    """What GenerateRequest and CompleteRequest share: a prompt (as text, or as token ids) and one SamplingParams."""

    prompt: str
    prompt_token_ids: Sequence[int]
    sampling: gateway_pb2.SamplingParams


def check_request(request: TextRequest, limits: Limits) -> None:
    """Raise INVALID_ARGUMENT naming the first bad field of `request` (a sampling field by its own name)."""
    if request.prompt and request.prompt_token_ids:
        raise invalid("prompt_token_ids", "send the prompt as text or as token ids, not both")
    if not request.prompt and not request.prompt_token_ids:
        raise invalid("prompt", "must be non-empty")
    if limits.max_prompt_bytes:  # else the limit follows the model's context: checked by `plan`
        check_prompt_bytes(request.prompt, limits.max_prompt_bytes)
    s = request.sampling
    if s.HasField("max_tokens") and s.max_tokens < (0 if s.echo else 1):
        raise invalid("max_tokens", f"must be >= 1 (got {s.max_tokens}; 0 only with echo, which then answers the "
                                    "prompt alone); leave it unset for the default")
    if not math.isfinite(s.temperature) or s.temperature < 0:
        raise invalid("temperature", f"must be finite and >= 0 (got {s.temperature}); 0 means greedy")
    if s.HasField("top_p") and not (math.isfinite(s.top_p) and 0 < s.top_p <= 1):
        raise invalid("top_p", f"must be in (0, 1] (got {s.top_p}); leave it unset for 1.0")
    if not 0 <= s.top_logprobs <= limits.max_top_logprobs:
        raise invalid("top_logprobs", f"must be in 0..{limits.max_top_logprobs} (got {s.top_logprobs})")
    check_controls(s)
    if s.min_tokens < 0:
        raise invalid("min_tokens", f"must be >= 0 (got {s.min_tokens}); 0 is off")
    if s.HasField("max_tokens") and s.min_tokens > s.max_tokens:
        raise invalid("min_tokens", f"must be at most max_tokens ({s.max_tokens}; got {s.min_tokens})")
    check_stops(list(s.stop), limits)
    check_cache_salt(s)
    if s.HasField("truncate_prompt_tokens") and s.truncate_prompt_tokens < 1 and s.truncate_prompt_tokens != -1:
        raise invalid("truncate_prompt_tokens", f"must be >= 1 or -1 (got {s.truncate_prompt_tokens}); -1 keeps "
                                                "as many as the context holds, unset keeps the whole prompt")


def check_prompt_bytes(prompt: str, limit: int) -> None:
    size = len(prompt.encode("utf-8"))
    if size > limit:
        raise invalid("prompt", f"{size} bytes is over the limit of {limit} bytes (--max-prompt-bytes; by default "
                                "16 bytes per token of the model's context)")


def check_cache_salt(s: gateway_pb2.SamplingParams) -> None:
    """vLLM's cache_salt: a non-empty string when given (its rule), bounded."""
    if not s.HasField("cache_salt"):
        return
    if not s.cache_salt:
        raise invalid("cache_salt", "must be a non-empty string when given; leave it unset for none")
    if len(s.cache_salt) > MAX_CACHE_SALT_CHARS:
        raise invalid("cache_salt", f"{len(s.cache_salt)} characters is over the limit of {MAX_CACHE_SALT_CHARS}")


def check_controls(s: gateway_pb2.SamplingParams) -> None:
    """The ranges of top_k, min_p, the penalties, logit_bias and stop_token_ids (ids are checked by `plan`)."""
    if s.top_k < -1:
        raise invalid("top_k", f"must be -1 or 0 (off) or >= 1 (got {s.top_k})")
    if not (math.isfinite(s.min_p) and 0 <= s.min_p <= 1):
        raise invalid("min_p", f"must be in [0, 1] (got {s.min_p}); 0 is off")
    if s.HasField("repetition_penalty") and not (math.isfinite(s.repetition_penalty) and s.repetition_penalty > 0):
        raise invalid("repetition_penalty", f"must be > 0 (got {s.repetition_penalty}); 1 is off")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(s, name)
        if not (math.isfinite(value) and -PENALTY_LIMIT <= value <= PENALTY_LIMIT):
            raise invalid(name, f"must be in [-{PENALTY_LIMIT:g}, {PENALTY_LIMIT:g}] (got {value}); 0 is off")
    if len(s.logit_bias) > MAX_LOGIT_BIAS:
        raise invalid("logit_bias", f"{len(s.logit_bias)} entries is over the limit of {MAX_LOGIT_BIAS}")
    for token, bias in s.logit_bias.items():
        if not (math.isfinite(bias) and -LOGIT_BIAS_LIMIT <= bias <= LOGIT_BIAS_LIMIT):
            raise invalid("logit_bias", f"the bias of token {token} must be in [-{LOGIT_BIAS_LIMIT:g}, "
                          f"{LOGIT_BIAS_LIMIT:g}] (got {bias})")
    if len(s.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise invalid("stop_token_ids", f"{len(s.stop_token_ids)} ids is over the limit of {MAX_STOP_TOKEN_IDS}")
    if s.HasField("prompt_logprobs") and not 0 <= s.prompt_logprobs <= MAX_TOP_LOGPROBS:
        raise invalid("prompt_logprobs", f"must be in 0..{MAX_TOP_LOGPROBS} (got {s.prompt_logprobs})")
    if s.n < 0 or s.n > MAX_SAMPLES:
        raise invalid("n", f"must be in 1..{MAX_SAMPLES} (got {s.n}); 0 or unset means 1; samples beyond the "
                           "model's slots wait for one to free")


def check_stops(stops: list[str], limits: Limits) -> None:
    if len(stops) > limits.max_stop:
        raise invalid("stop", f"{len(stops)} stop sequences is over the limit of {limits.max_stop}")
    for index, stop in enumerate(stops):
        if not stop:
            raise invalid(f"stop[{index}]", "must be non-empty")
        if len(stop) > limits.max_stop_chars:
            raise invalid(f"stop[{index}]", f"{len(stop)} characters is over the limit of {limits.max_stop_chars}")


@dataclass(frozen=True)
class Plan:
    """What the gateway asks of the model once the prompt is encoded."""

    prompt_ids: tuple[int, ...]
    max_tokens: int  # what the model generates
    n: int = 1  # completions
    echo_only: bool = False  # echo with max_tokens 0: the model scores the prompt, its one token is dropped


def plan(request: TextRequest, prompt_ids: list[int], info: model_pb2.GetInfoResponse, limits: Limits) -> Plan:
    """Check the encoded prompt and token ids against the model; choose max_tokens."""
    config = info.config
    vocab, context = config.vocab_size, config.sequence_len
    s = request.sampling
    if not limits.max_prompt_bytes:
        check_prompt_bytes(request.prompt, prompt_byte_limit(limits, context))
    id_fields = ("allowed_token_ids", "blocked_token_ids", "stop_token_ids", "logit_bias")
    id_lists = [("prompt", request.prompt_token_ids)] + [(field, getattr(s, field)) for field in id_fields]
    for field, ids in id_lists:
        for token in ids:
            if not 0 <= token < vocab:
                raise invalid(field, f"token id {token} is outside the vocabulary [0, {vocab})")
    n = s.n or 1
    if s.HasField("truncate_prompt_tokens"):  # vLLM's: the prompt's last k tokens
        keep = context if s.truncate_prompt_tokens == -1 else s.truncate_prompt_tokens
        if keep > context:
            raise invalid("truncate_prompt_tokens", f"{keep} is over the model's context of {context} tokens; "
                                                    "send at most that, or -1 for the context")
        prompt_ids = prompt_ids[-keep:]
    count = len(prompt_ids)
    if count == 0:
        raise invalid("prompt", "encodes to no tokens")
    longest = max(info.prefill_buckets) if info.prefill_buckets else context
    if count > longest:
        raise invalid("prompt", f"{count} tokens is over the longest prompt the model accepts ({longest} tokens)")
    if count >= context:
        raise invalid("prompt", f"{count} tokens leave no room to generate in the model's context of {context}")
    if s.HasField("max_tokens"):
        if count + s.max_tokens > context:
            raise invalid("max_tokens", f"prompt ({count} tokens) + max_tokens ({s.max_tokens}) is over the "
                          f"model's context of {context} tokens; lower max_tokens to at most {context - count}")
        if s.max_tokens == 0:  # (with echo) the prompt alone: the model runs its prompt and one token, as vLLM's does
            return Plan(tuple(prompt_ids), 1, n, echo_only=True)
        return Plan(tuple(prompt_ids), s.max_tokens, n)
    return Plan(tuple(prompt_ids), min(limits.default_max_tokens, context - count), n)
