"""The engine's values: its decode-time state, a prefilled prompt, a chunked prefill in progress, and what a
step hands back to the host (engine.py produces and consumes them; the scheduler only passes them along).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import numpy as np

from model_service.logits_processing import Controls, History
from model_service.sampling import SampleResult, SamplingParams
from model_service.sampling_settings import SamplingSettings


class DecodeState(NamedTuple):
    """Everything the decode step reads and writes, for all slots."""

    memory: Any  # the model's Memory pytree, batch = slots
    tokens: jax.Array  # [B] int32, each slot's last sampled token (the next step's input)
    keys: jax.Array  # [B, 2] uint32, each slot's PRNG key (split before every draw)
    sampling: SamplingParams  # [B] / [B, V]
    controls: Controls  # [B] / [B, MAX_LOGIT_BIAS]: the sampling controls (logits_processing.py)
    history: History  # [B, V]: prompt tokens and generated-token counts, for the penalties


class Prefix(NamedTuple):
    """One prefilled prompt, ready to be inserted into a slot."""

    memory: Any  # Memory, batch 1
    token: jax.Array  # [] int32, the first sampled token
    key: jax.Array  # [2] uint32, the key to split for the next draw
    sampling: SamplingParams  # [1] / [1, V]
    controls: Controls  # batch 1
    history: History  # [1, V], the first token already counted
    logits: jax.Array  # [1, V] float32, the prompt's last logits: `resample` draws more first tokens from them


@dataclass(frozen=True)
class Prefilled:
    """What `prefill` / `resample` return for `insert`: the device prefix and, on the host, the prompt length
    and which prefill it came from (the samples of one prefill share the prompt's full KV blocks)."""

    prefix: Prefix
    length: int
    origin: int


@dataclass
class ChunkedPrefill:
    """A prompt being prefilled chunk by chunk straight into its slot (Engine.begin_prefill)."""

    tokens: np.ndarray  # [n_chunks * C] int32, the prompt padded to whole chunks
    length: int
    slot: int
    seed: int
    sampling: SamplingSettings
    next_start: int = 0


@dataclass(frozen=True)
class PromptLogprobs:
    """Host arrays scoring a prompt's tokens 1..n-1 (each after the tokens before it) under the raw logits."""

    logprob: np.ndarray  # [n-1] float32, of the prompt's own next token
    top_ids: np.ndarray  # [n-1, TOP_K] int32, most likely first
    top_logprobs: np.ndarray  # [n-1, TOP_K] float32


@dataclass(frozen=True)
class StepOutput:
    """Host copy of a SampleResult: what the scheduler reads after each prefill or decode step."""

    token: np.ndarray  # [B] int32
    prob: np.ndarray  # [B] float32
    top_ids: np.ndarray  # [B, TOP_K] int32
    top_probs: np.ndarray  # [B, TOP_K] float32
    bad: np.ndarray  # [B] bool
    prompt: PromptLogprobs | None = None  # a prefill's prompt logprobs, when asked for

    @classmethod
    def from_device(cls, result: SampleResult) -> "StepOutput":
        host = jax.device_get(result)
        return cls(host.token, host.prob, host.top_ids, host.top_probs, host.bad)


class PendingStep:
    """A decode step's result on its way to the host; `get()` waits for it (once) and returns a StepOutput."""

    def __init__(self, result: SampleResult) -> None:
        for leaf in jax.tree.leaves(result):
            leaf.copy_to_host_async()
        self._result: SampleResult | None = result
        self._output: StepOutput | None = None

    def get(self) -> StepOutput:
        if self._output is None:
            assert self._result is not None
            self._output, self._result = StepOutput.from_device(self._result), None
        return self._output
