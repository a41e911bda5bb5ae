"""The engine as the scheduler sees it (JetStream's `engine_api`): Protocols, no implementation, no JAX.

model_service.engine.Engine implements `EngineLike` on one process, distributed.lockstep.LockstepEngine on
a group of processes, and tests/engine/fake_engine.FakeEngine by hand. The state is opaque to the scheduler:
it passes back what the engine returned. A step is a step_batch.StepBatch; what it produced arrives as host
arrays (`StepOutputLike`).
"""

from __future__ import annotations

from typing import Any, Protocol

from model_service.step_batch import StepBatch


class StepOutputLike(Protocol):
    """Host arrays of one step: a draw per sample entry [P], prompt scores per row [R] (or None)."""

    token: Any  # [P] int
    prob: Any  # [P] float
    top_ids: Any  # [P, K] int
    top_probs: Any  # [P, K] float
    bad: Any  # [P] bool
    logprob: Any  # [R] float or None
    score_ids: Any  # [R, K] int or None
    score_logprobs: Any  # [R, K] float or None


class PendingStepLike(Protocol):
    """A dispatched step; `get()` waits for its host arrays."""

    def get(self) -> StepOutputLike: ...


class EngineLike(Protocol):
    """The part of model_service.engine.Engine the scheduler uses."""

    slots: int  # sequences at once (each sample of a request takes one)
    max_rows: int  # token rows per step
    max_samples: int  # draws per step
    sequence_len: int
    vocab_size: int
    eos_id: int
    pad_id: int
    block_size: int  # positions per KV block
    table_len: int  # entries per block table row
    num_blocks: int  # KV pool blocks (the scratch block, index num_blocks, not counted)
    buckets: tuple[int, ...]  # the row counts its step programs run, a step padded to the least holding it (() on CPU)

    def init_state(self) -> Any: ...
    def step(self, state: Any, batch: StepBatch) -> tuple[Any, PendingStepLike]: ...
