"""How to sample, per request: one value carried from the servicer through the scheduler to the device.

`SamplingSettings` says how each token of a request is drawn, with vLLM's definitions and ranges: the
reference's temperature / top_p / token mask, the number of alternatives reported per token, and the
controls (top-k, min-p, penalties, logit_bias). Its defaults are "greedy, every control off"; a request
whose controls are all off is sampled exactly as the reference samples (the device code skips every
control per slot: see logits_processing.py). The seed is not part of it: the n samples of one request
share these settings and differ in their seed. No JAX here: the servicer, the scheduler and the lockstep
op table use this module; the engine turns a value into its per-slot device rows (engine.py).

Order of operations on one slot's logits (vLLM's sampler order; the reference's part unchanged):
  1. logit_bias added to the raw logits (vLLM applies it as a logits processor, before the sampler);
  2. penalties on the biased logits: repetition (over prompt and generated tokens: positive logits
     divided by it, the others multiplied), then frequency (minus penalty x count) and presence (minus
     penalty if generated at least once), both over the generated tokens only;
  3. the reference's steps: divide by the temperature, mask disallowed ids with -1e10;
  4. top-k (keep logits >= the k-th largest), then the reference's nucleus filter, then min-p (keep
     tokens whose probability is >= min_p x the largest probability);
  5. the draw (or argmax at temperature 0); reported probabilities are the softmax of what is left.
min_tokens removes the ending ids in step 3, with the mask (vLLM's logits processor sets them to -inf).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

# The bounds of the fields, declared once for the gateway and the model service (validation.py checks them).
from serving_common.limits import (
    LOGIT_BIAS_LIMIT,
    MAX_LOGIT_BIAS,
    MAX_STOP_TOKEN_IDS,
    MAX_TOP_LOGPROBS,
    PENALTY_LIMIT,
)

MAX_ENDS = MAX_STOP_TOKEN_IDS + 1  # the ids min_tokens bars: EOS and the stop token ids

__all__ = ["GREEDY", "LOGIT_BIAS_LIMIT", "MAX_ENDS", "MAX_LOGIT_BIAS", "MAX_STOP_TOKEN_IDS", "MAX_TOP_LOGPROBS",
           "PENALTY_LIMIT", "SamplingSettings", "build_mask"]


@dataclass(frozen=True)
class SamplingSettings:
    """How one request's tokens are drawn. Field values are checked by validation.py."""

    temperature: float = 0.0  # >= 0; 0 is greedy
    top_p: float = 1.0  # in (0, 1]; 1 is off
    allowed: tuple[int, ...] = ()  # token ids that may be sampled (empty: all)
    blocked: tuple[int, ...] = ()  # token ids that are never sampled (the pad id never is)
    top_logprobs: int = 0  # alternatives reported per token, 0..MAX_TOP_LOGPROBS
    top_k: int = 0  # 0 or -1: off; else keep the k most likely tokens (ties at the k-th kept)
    min_p: float = 0.0  # in [0, 1]; 0: off
    repetition_penalty: float = 1.0  # > 0; 1: off
    presence_penalty: float = 0.0  # in [-2, 2]
    frequency_penalty: float = 0.0  # in [-2, 2]
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias in [-100, 100]), ids unique
    # vLLM's min_tokens: the first `min_tokens` draws never take one of `ends` (the ids that would end the request:
    # EOS unless ignore_eos, and stop_token_ids; the scheduler fills them in, plan.end_ids), unless nothing else
    # may be drawn (a constraint or allowed_token_ids that leave only them).
    min_tokens: int = 0
    ends: tuple[int, ...] = ()

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def controls_off(self) -> bool:
        """No control beyond the reference's temperature / top_p / mask is used."""
        return (self.top_k in (0, -1) and self.min_p == 0.0 and not self.penalized and not self.logit_bias
                and not self.min_tokens)


GREEDY = SamplingSettings()


def build_mask(vocab_size: int, pad_id: int, allowed: Sequence[int], blocked: Sequence[int]) -> np.ndarray:
    """The [V] bool mask of sampleable ids: `allowed` (all if empty) minus `blocked` minus the pad id."""
    if allowed:
        mask = np.zeros((vocab_size,), dtype=bool)
        mask[np.asarray(allowed, dtype=np.int64)] = True
    else:
        mask = np.ones((vocab_size,), dtype=bool)
    if blocked:
        mask[np.asarray(blocked, dtype=np.int64)] = False
    mask[pad_id] = False
    return mask
