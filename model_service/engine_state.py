"""The engine's values: its device state and what a step hands back to the host (engine.py produces and
consumes them; the scheduler only passes the state along and reads `StepOutput`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import numpy as np

from model_service.logits_processing import Controls, History
from model_service.sampling import SampleResult, SamplingParams


class SlotState(NamedTuple):
    """Per slot (a running sample of a request): how it draws, its key and its last drawn token."""

    keys: jax.Array  # [S, 2] uint32, split before every draw (the reference's schedule)
    last: jax.Array  # [S] int32, the slot's last drawn token: the next decode row's input
    sampling: SamplingParams  # [S] / [S, V]
    controls: Controls  # [S] / [S, MAX_LOGIT_BIAS]
    history: History  # [S, V]: prompt tokens and drawn-token counts, for the penalties


class EngineState(NamedTuple):
    """Everything a step reads and writes."""

    pools: Any  # kv_memory.Pools: every layer's KV block pool
    slots: SlotState


class Scores(NamedTuple):
    """Prompt logprobs of a step's scored rows (zeros elsewhere)."""

    logprob: jax.Array  # [R] float32, of the row's next prompt token
    top_logprobs: jax.Array  # [R, K] float32
    top_ids: jax.Array  # [R, K] int32


@dataclass(frozen=True)
class StepOutput:
    """Host copy of one step's results: a draw per sample entry, a score per scored row."""

    token: np.ndarray  # [P] int32
    prob: np.ndarray  # [P] float32
    top_ids: np.ndarray  # [P, TOP_K] int32
    top_probs: np.ndarray  # [P, TOP_K] float32
    bad: np.ndarray  # [P] bool: the entry's logits were not finite
    logprob: np.ndarray | None = None  # [R] float32 (None: the step scored no row)
    score_ids: np.ndarray | None = None  # [R, TOP_K] int32
    score_logprobs: np.ndarray | None = None  # [R, TOP_K] float32
    accepted: np.ndarray | None = None  # [P] bool: the draw counts (a speculative draw after a wrong draft does not)


class PendingStep:
    """A dispatched step's results on their way to the host; `get()` waits for them (once)."""

    def __init__(self, result: SampleResult, scores: Scores | None, accepted: jax.Array | None = None) -> None:
        for leaf in jax.tree.leaves((result, scores, accepted)):
            leaf.copy_to_host_async()
        self._device: tuple[SampleResult, Scores | None, jax.Array | None] | None = (result, scores, accepted)
        self._output: StepOutput | None = None

    def get(self) -> StepOutput:
        if self._output is None:
            assert self._device is not None
            result, scores, accepted = jax.device_get(self._device)
            self._device = None
            self._output = StepOutput(result.token, result.prob, result.top_ids, result.top_probs, result.bad,
                                      *((scores.logprob, scores.top_ids, scores.top_logprobs) if scores is not None
                                        else (None, None, None)), accepted)
        return self._output
