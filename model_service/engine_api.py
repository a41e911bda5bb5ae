"""The engine as the scheduler sees it (JetStream's `engine_api`): Protocols, no implementation, no JAX.

model_service.engine.Engine implements `EngineLike` on one process, distributed.lockstep.LockstepEngine on
a group of processes, and tests/engine/fake_engine.FakeEngine by hand. Decode state, prefixes and chunked
prefill jobs are opaque to the scheduler: it passes back what the engine returned. What a step produced
arrives as host arrays (`StepOutputLike`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from model_service.sampling_settings import SamplingSettings


class StepOutputLike(Protocol):
    """Host arrays of one prefill (batch 1) or decode step (batch = slots)."""

    token: Any  # [B] int
    prob: Any  # [B] float
    top_ids: Any  # [B, K] int
    top_probs: Any  # [B, K] float
    bad: Any  # [B] bool
    prompt: Any  # PromptLogprobs-like (logprob [n-1], top_ids / top_logprobs [n-1, K]) or None


class PendingStepLike(Protocol):
    """A dispatched decode step; `get()` waits for its host arrays."""

    def get(self) -> StepOutputLike: ...


class EngineLike(Protocol):
    """The part of model_service.engine.Engine the scheduler uses."""

    slots: int
    buckets: tuple[int, ...]
    sequence_len: int
    vocab_size: int
    eos_id: int
    pad_id: int
    prefill_chunk: int  # tokens per chunk of a chunked prefill
    num_blocks: int  # KV pool blocks

    def init_decode_state(self) -> Any: ...
    def bucket_for(self, length: int) -> int: ...
    def prefill(self, tokens: Sequence[int], sampling: SamplingSettings, *, seed: int,
                prompt_logprobs: int | None = None) -> tuple[Any, StepOutputLike]: ...
    def resample(self, prefix: Any, *, seed: int) -> tuple[Any, StepOutputLike]: ...
    def insert(self, prefix: Any, state: Any, slot: int) -> Any: ...
    def chunked(self, length: int) -> bool: ...
    def begin_prefill(self, tokens: Sequence[int], sampling: SamplingSettings, *, slot: int, seed: int) -> Any: ...
    def prefill_next_chunk(self, job: Any, state: Any) -> tuple[Any, StepOutputLike | None]: ...
    def generate(self, state: Any) -> tuple[Any, PendingStepLike]: ...
    def free_slot(self, state: Any, slot: int) -> Any: ...
    def blocks_needed(self, prompt_len: int, samples: int = 1) -> int: ...
    def free_blocks(self) -> int: ...
    def blocks_short(self) -> int: ...
    def kv_usage(self) -> Any: ...


class MaskingEngine(EngineLike, Protocol):
    """An engine that serves structured output: the scheduler sets a slot's next-step mask ([V] bool)."""

    def set_slot_mask(self, state: Any, slot: int, mask: Any) -> Any: ...
