"""Per-request sampling controls beyond the reference's temperature / top_p / mask (issue 12), host side.

`SamplingControls` is what a request asks for, in domain terms, with vLLM's definitions and ranges;
its defaults mean "off", and a request whose controls are all off is sampled exactly as the reference
samples (the device code skips every control per slot: see logits_processing.py). No JAX here: the
scheduler and the servicer use this module.

Order of operations on one slot's logits (vLLM's sampler order; the reference's part unchanged):
  1. logit_bias added to the raw logits (vLLM applies it as a logits processor, before the sampler);
  2. penalties on the biased logits: repetition (over prompt and generated tokens: positive logits
     divided by it, the others multiplied), then frequency (minus penalty x count) and presence (minus
     penalty if generated at least once), both over the generated tokens only;
  3. the reference's steps: divide by the temperature, mask disallowed ids with -1e10;
  4. top-k (keep logits >= the k-th largest), then the reference's nucleus filter, then min-p (keep
     tokens whose probability is >= min_p x the largest probability);
  5. the draw (or argmax at temperature 0); reported probabilities are the softmax of what is left.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

MAX_LOGIT_BIAS = 300  # entries per request (OpenAI's limit); the device keeps a fixed [slots, 300] table
LOGIT_BIAS_LIMIT = 100.0  # |bias| bound, as OpenAI and vLLM document
PENALTY_LIMIT = 2.0  # |presence_penalty|, |frequency_penalty| bound (OpenAI's and vLLM's)
MAX_STOP_TOKEN_IDS = 64


@dataclass(frozen=True)
class SamplingControls:
    """The optional controls of one request. Every default is "off"."""

    top_k: int = 0  # 0 or -1: off; else keep the k most likely tokens (ties at the k-th kept)
    min_p: float = 0.0  # in [0, 1]; 0: off
    repetition_penalty: float = 1.0  # > 0; 1: off
    presence_penalty: float = 0.0  # in [-2, 2]
    frequency_penalty: float = 0.0  # in [-2, 2]
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias in [-100, 100]), ids unique

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def off(self) -> bool:
        return self == NO_CONTROLS or (self.top_k in (0, -1) and self.min_p == 0.0 and not self.penalized
                                       and not self.logit_bias)


NO_CONTROLS = SamplingControls()


def controls_problem(c: SamplingControls, vocab_size: int) -> str:
    """The first thing wrong with `c` (naming the field as the APIs spell it), or ""."""
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
