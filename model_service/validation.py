"""Request validation: the first thing wrong with a request, naming the field as the APIs spell it.

`validate` runs in `Scheduler.submit`, before anything is queued, so a bad request costs no slot and gets
INVALID_ARGUMENT with a message a person can act on. The limits come from the engine (`EngineLimits`:
vocabulary, context, slots, KV pool) and from sampling_settings.py. No JAX here.
"""

from __future__ import annotations

import math
from typing import Protocol

from model_service.requests import ErrorKind, GenerationRequest, SchedulerError
from serving_common.limits import MAX_SAMPLES
from model_service.sampling_settings import (
    LOGIT_BIAS_LIMIT,
    MAX_LOGIT_BIAS,
    MAX_STOP_TOKEN_IDS,
    MAX_TOP_LOGPROBS,
    PENALTY_LIMIT,
    SamplingSettings,
)


class EngineLimits(Protocol):
    """What validation needs to know of the engine (EngineLike has all of it)."""

    slots: int
    sequence_len: int
    vocab_size: int
    pad_id: int
    num_blocks: int
    block_size: int


def blocks_needed(engine: EngineLimits, prompt_len: int, samples: int = 1, tokens: int = 1) -> int:
    """KV blocks a request's samples hold once each has drawn `tokens` tokens (at admission: one, the room for
    its first draw), the samples after the first sharing its full blocks before the last prompt token's block."""
    bs = engine.block_size
    each = -(-min(prompt_len + tokens, engine.sequence_len) // bs)
    shared = (prompt_len - 1) // bs
    return each + (samples - 1) * (each - shared)


def certain_tokens(req: GenerationRequest, engine: EngineLimits) -> int:
    """Tokens every sample of `req` draws whatever it draws: all of max_tokens (or up to the context) when nothing
    can end it earlier (ignore_eos, no stop ids, no constraint), else min_tokens (at least one)."""
    if req.ignore_eos and not req.stop_token_ids and req.constraint is None:
        return req.max_tokens if req.max_tokens is not None else engine.sequence_len - len(req.prompt)
    return max(1, req.sampling.min_tokens if req.constraint is None else 1)


def validate(req: GenerationRequest, engine: EngineLimits) -> None:
    """Raise INVALID_ARGUMENT for anything the engine could not serve as asked."""
    problem = request_problem(req, engine)
    if problem:
        raise SchedulerError(ErrorKind.INVALID_ARGUMENT, problem)


def request_problem(req: GenerationRequest, engine: EngineLimits) -> str:
    """The first thing wrong with `req` (naming the field), or "" when it can be served."""
    # In the order the fields were always checked: a request with several problems hears of the same one first.
    return (prompt_problem(req, engine) or reference_problem(req.sampling) or outputs_problem(req, engine)
            or token_sets_problem(req.sampling, engine) or controls_problem(req.sampling, engine.vocab_size)
            or stop_token_ids_problem(req.stop_token_ids, engine.vocab_size))


def prompt_problem(req: GenerationRequest, engine: EngineLimits) -> str:
    """The prompt and the length limits."""
    vocab, n = engine.vocab_size, len(req.prompt)
    if n == 0:
        return "token_ids: the prompt is empty"
    if any(not 0 <= t < vocab for t in req.prompt):
        return f"token_ids: every id must be in [0, {vocab})"
    if n >= engine.sequence_len:
        return (f"token_ids: the prompt has {n} tokens and leaves no room in the {engine.sequence_len}-token "
                f"context (the longest accepted is {engine.sequence_len - 1}): shorten it")
    if req.max_tokens is not None and req.max_tokens < 1:
        return "max_tokens: must be >= 1 (or unset for as many as fit the context)"
    if req.max_tokens is not None and n + req.max_tokens > engine.sequence_len:
        return (f"max_tokens: prompt ({n}) + max_tokens ({req.max_tokens}) exceeds the context of "
                f"{engine.sequence_len} tokens")
    return min_tokens_problem(req.sampling.min_tokens, req.max_tokens)


def min_tokens_problem(min_tokens: int, max_tokens: int | None) -> str:
    """vLLM's bounds of min_tokens: at least 0 and at most max_tokens."""
    if min_tokens < 0:
        return f"min_tokens: must be >= 0 (got {min_tokens})"
    if max_tokens is not None and min_tokens > max_tokens:
        return f"min_tokens: must be at most max_tokens ({max_tokens}; got {min_tokens})"
    return ""


def outputs_problem(req: GenerationRequest, engine: EngineLimits) -> str:
    """The seed and what the request asks back (prompt_logprobs, n samples)."""
    if req.seed is not None and not 0 <= req.seed < 2**32:
        return "seed: must be a uint32"
    if req.prompt_logprobs is not None and not 0 <= req.prompt_logprobs <= MAX_TOP_LOGPROBS:
        return f"prompt_logprobs: must be in 0..{MAX_TOP_LOGPROBS} (alternatives per prompt token)"
    if not 1 <= req.n <= MAX_SAMPLES:
        return f"n: must be in 1..{MAX_SAMPLES} (got {req.n}); samples beyond the slots wait for one to free"
    return pool_problem(req, engine)


def pool_problem(req: GenerationRequest, engine: EngineLimits) -> str:
    """A request whose samples can never fit the KV pool, even alone: the tokens they certainly reach
    (certain_tokens) take more blocks than the pool has. Refused now rather than after the work (vLLM refuses
    what can never be scheduled); what only waits for memory to free is queued."""
    n, bs = len(req.prompt), engine.block_size
    tokens = certain_tokens(req, engine)
    samples = min(req.n, engine.slots)  # more than the slots run a slotful at a time
    need = blocks_needed(engine, n, samples, tokens)
    if need <= engine.num_blocks:
        return ""
    pool = f"the pool holds {engine.num_blocks * bs} ({engine.num_blocks} blocks of {bs})"
    if blocks_needed(engine, n) > engine.num_blocks:
        return (f"token_ids: a {n}-token prompt takes {blocks_needed(engine, n) * bs} KV tokens and {pool}: "
                "shorten it, or start the service with more --kv-tokens")
    field = "n" if samples > 1 and blocks_needed(engine, n, 1, tokens) <= engine.num_blocks else "max_tokens"
    why = ("ignore_eos, no stop ids" if tokens > max(1, req.sampling.min_tokens) else
           "min_tokens" if tokens > 1 else "the first")
    return (f"{field}: {samples} sample(s) of a {n}-token prompt that each certainly draw {tokens} tokens ({why}) "
            f"take {need * bs} KV tokens and {pool}: ask for fewer samples or tokens, or start the service with "
            "more --kv-tokens")


def reference_problem(s: SamplingSettings) -> str:
    """The reference's settings: temperature, top_p, and the alternatives reported per token."""
    if not math.isfinite(s.temperature) or s.temperature < 0:
        return "temperature: must be finite and >= 0"
    if not math.isfinite(s.top_p) or not 0 < s.top_p <= 1:
        return "top_p: must be in (0, 1]"
    if not 0 <= s.top_logprobs <= MAX_TOP_LOGPROBS:
        return f"top_logprobs: must be in 0..{MAX_TOP_LOGPROBS}"
    return ""


def token_sets_problem(s: SamplingSettings, engine: EngineLimits) -> str:
    """allowed/blocked ids: in the vocabulary, and some token left to sample."""
    vocab = engine.vocab_size
    for field, ids in (("allowed_token_ids", s.allowed), ("blocked_token_ids", s.blocked)):
        if any(not 0 <= t < vocab for t in ids):
            return f"{field}: every id must be in [0, {vocab})"
    removed = set(s.blocked) | {engine.pad_id}
    left = bool(set(s.allowed) - removed) if s.allowed else len(removed) < vocab
    if not left:
        return "allowed_token_ids/blocked_token_ids: no token is left to sample (the pad id is never sampled)"
    return ""


def controls_problem(c: SamplingSettings, vocab_size: int) -> str:
    """The first thing wrong with the controls of `c` (top_k, min_p, penalties, logit_bias), or ""."""
    if c.top_k < -1:
        return f"top_k: must be -1 or 0 (off) or >= 1 (got {c.top_k})"
    if not (math.isfinite(c.min_p) and 0.0 <= c.min_p <= 1.0):
        return f"min_p: must be in [0, 1] (got {c.min_p}); 0 is off"
    if not (math.isfinite(c.repetition_penalty) and c.repetition_penalty > 0):
        return f"repetition_penalty: must be > 0 (got {c.repetition_penalty}); 1 is off"
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(c, name)
        if not (math.isfinite(value) and -PENALTY_LIMIT <= value <= PENALTY_LIMIT):
            return f"{name}: must be in [-{PENALTY_LIMIT:g}, {PENALTY_LIMIT:g}] (got {value}); 0 is off"
    return logit_bias_problem(c.logit_bias, vocab_size)


def logit_bias_problem(bias: tuple[tuple[int, float], ...], vocab_size: int) -> str:
    if len(bias) > MAX_LOGIT_BIAS:
        return f"logit_bias: {len(bias)} entries is over the limit of {MAX_LOGIT_BIAS}"
    if len({token for token, _ in bias}) != len(bias):
        return "logit_bias: a token id appears twice"
    for token, value in bias:
        if not 0 <= token < vocab_size:
            return f"logit_bias: token id {token} is outside the vocabulary [0, {vocab_size})"
        if not (math.isfinite(value) and -LOGIT_BIAS_LIMIT <= value <= LOGIT_BIAS_LIMIT):
            return f"logit_bias: the bias of token {token} must be in [-100, 100] (got {value})"
    return ""


def stop_token_ids_problem(ids: tuple[int, ...], vocab_size: int) -> str:
    if len(ids) > MAX_STOP_TOKEN_IDS:
        return f"stop_token_ids: {len(ids)} ids is over the limit of {MAX_STOP_TOKEN_IDS}"
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        return f"stop_token_ids: token id {bad[0]} is outside the vocabulary [0, {vocab_size})"
    return ""
