"""The engine's values: its device state and what a step hands back to the host (engine.py produces and
consumes them; the scheduler only passes the state along and reads `StepOutput`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from model_service.logits_processing import Controls, History
from model_service.sampling import TOP_K, SampleResult, SamplingParams


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


DRAW_FIELDS = 4  # a packed draw's columns before its alternatives: token, probability's bits, bad, accepted


def pack_draws(result: SampleResult, accepted: jax.Array) -> jax.Array:
    """A step's draws as one int32 array [P, 4 + 2K] (token, the probability's float32 bits, bad, accepted, the K
    alternatives' ids, their probabilities' bits): one copy to the host instead of six. On a v5e's host the six
    took 0.67 ms after the device finished, the one 0.47 ms (medium, one stream; benchmarks.device_profile's host
    phases at 98622eb and eaff5f2); on CPU that phase is 0.35 ms either way. Bitcasts: every probability arrives bit
    for bit."""
    def bits(x: jax.Array) -> jax.Array:
        return jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)

    column = (result.token.astype(jnp.int32), bits(result.prob), result.bad.astype(jnp.int32),
              accepted.astype(jnp.int32))
    return jnp.concatenate([jnp.stack(column, axis=1), result.top_ids.astype(jnp.int32), bits(result.top_probs)],
                           axis=1)


def idle_draws(entries: int, vocab_size: int) -> jax.Array:
    """pack_draws' array for a step that draws nothing: [entries, 4 + 2K] zeros (K alternatives: min(TOP_K, V))."""
    return jnp.zeros((entries, DRAW_FIELDS + 2 * min(TOP_K, vocab_size)), jnp.int32)


def unpack_draws(packed: np.ndarray) -> tuple[np.ndarray, ...]:
    """pack_draws' array on the host -> token, prob, top_ids, top_probs, bad, accepted."""
    k = (packed.shape[1] - DRAW_FIELDS) // 2
    f32 = packed.view(np.float32)
    return (packed[:, 0].copy(), f32[:, 1].copy(), packed[:, DRAW_FIELDS:DRAW_FIELDS + k].copy(),
            f32[:, DRAW_FIELDS + k:].copy(), packed[:, 2] != 0, packed[:, 3] != 0)


class PendingStep:
    """A dispatched step's results on their way to the host (its draws packed: pack_draws); `get()` waits for
    them (once)."""

    def __init__(self, draws: jax.Array, scores: Scores | None) -> None:
        for leaf in jax.tree.leaves((draws, scores)):
            leaf.copy_to_host_async()
        self._device: tuple[jax.Array, Scores | None] | None = (draws, scores)
        self._output: StepOutput | None = None

    def get(self) -> StepOutput:
        if self._output is None:
            assert self._device is not None
            draws, scores = jax.device_get(self._device)
            self._device = None
            token, prob, top_ids, top_probs, bad, accepted = unpack_draws(np.asarray(draws))
            self._output = StepOutput(token, prob, top_ids, top_probs, bad,
                                      *((scores.logprob, scores.top_ids, scores.top_logprobs) if scores is not None
                                        else (None, None, None)), accepted)
        return self._output
