"""One step's plan as the engine takes it: token rows, block tables, which rows sample, which slots start.

The scheduler builds a `StepBatch` from its plan (scheduler.py) and hands it to `Engine.step`; a multi-process
replica broadcasts the same value to every process (distributed/ops.py), one message per step. Every array
has a fixed shape for the engine's configuration, so one compiled program runs every step:

  rows    [R]  token, position and sequence (slot) of each token row; a prompt is rows at consecutive
               positions, a decode is one row whose token is the slot's last drawn token (`from_last`, still
               on the device when the step is dispatched);
  tables  [S, table_len] each slot's KV blocks (kv_blocks.KVBlocks, owned by the scheduler);
  samples [P]  which rows' logits are drawn from, with which slot's settings and key (S: unused entry), and
               for speculative decoding which of a slot's draws each is and the draft it is checked against;
  score   [R]  rows whose next prompt token is scored (prompt logprobs), and that token;
  starts       slots whose request begins (or resumes after a preemption) this step: their settings;
  masks        constrained slots' allowed-token masks for this step's draw (structured output).
No JAX here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from model_service.sampling_settings import SamplingSettings


@dataclass(frozen=True)
class SlotStart:
    """A slot taken by a request's sample: how it draws, and what the penalties count from the start."""

    slot: int
    seed: int  # uint32: the key schedule starts at PRNGKey(seed)
    settings: SamplingSettings
    prompt: tuple[int, ...]  # the prompt's tokens (repetition_penalty reads them)
    drawn: tuple[int, ...] = ()  # tokens this sample drew before a preemption: the key moves past them, counted


@dataclass(frozen=True)
class StepBatch:
    tokens: np.ndarray  # [R] int32 (ignored where from_last)
    from_last: np.ndarray  # [R] bool: the row's token is its slot's last drawn token
    positions: np.ndarray  # [R] int32
    seq: np.ndarray  # [R] int32, the row's slot
    rows: int  # rows in use (the first `rows`; the rest are padding)
    tables: np.ndarray  # [S, table_len] int32
    sample_rows: np.ndarray  # [P] int32, the row each sample entry draws from
    sample_slots: np.ndarray  # [P] int32, the slot whose settings and key it draws with (S: unused)
    score: np.ndarray | None = None  # [R] bool, rows whose next token is scored (None: none this step)
    targets: np.ndarray | None = None  # [R] int32, the token that follows each scored row
    starts: tuple[SlotStart, ...] = ()
    masks: tuple[tuple[int, np.ndarray], ...] = field(default=())  # (slot, [V] bool) for this step's draw
    # Speculative decoding: a slot drawing from its last token's row and from k draft rows after it has k + 1
    # consecutive entries; entry j's `sample_chain` is j, its `sample_next` the draft the next entry's row holds
    # (-1: none), its `sample_pending` the drafts before it [P, K] (V: none; its penalties count them).
    sample_chain: np.ndarray | None = None  # [P] int32 (None: every draw its slot's only one)
    sample_next: np.ndarray | None = None  # [P] int32
    sample_pending: np.ndarray | None = None  # [P, K] int32

    @property
    def samples(self) -> int:
        """Sample entries in use (the first ones)."""
        return int(np.count_nonzero(self.sample_slots < self.tables.shape[0]))


def empty_batch(max_rows: int, max_samples: int, tables: np.ndarray) -> StepBatch:
    """A step with nothing in it (every row padding, no sample): compile and keep-alive runs."""
    slots = tables.shape[0]
    return StepBatch(np.zeros(max_rows, np.int32), np.zeros(max_rows, bool), np.zeros(max_rows, np.int32),
                     np.zeros(max_rows, np.int32), 0, tables, np.zeros(max_samples, np.int32),
                     np.full(max_samples, slots, np.int32))
