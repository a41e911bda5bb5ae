"""A fake Engine whose outputs are computable by hand, for the scheduler unit suite.

A draw from a row holding token `t` is always `t + 1` (mod vocab): a prompt ending in 40 yields 41, 42, 43, ...
(the samples of an n > 1 request draw the same tokens); a slot given a mask (StepBatch.masks, structured
output) draws the first id after `t` that the mask allows, cyclically, until its next start. Every token's probability is 0.5 and its alternatives
are (token, token + 1, ...) with probabilities 0.5, 0.25, ... (only the first `kept` of them above 0). Token
POISON comes out with `bad` set (as if its logits were NaN). A scored prompt row gets probability 0.25 for the
next prompt token with alternatives (token, token + 1, ...) at 0.5, 0.25, ... Every step is recorded
(`steps`: its batch) so tests can check what ran when. Clearing `running` makes the next step hang until it is
set again (a wedged device, for the watchdog). A step whose rows hold token `fail_on` raises.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import numpy as np

from model_service.step_batch import StepBatch

POISON = 13
K = 8


@dataclass(frozen=True)
class FakeOutput:
    token: np.ndarray  # [P]
    prob: np.ndarray  # [P]
    top_ids: np.ndarray  # [P, K]
    top_probs: np.ndarray  # [P, K]
    bad: np.ndarray  # [P]
    logprob: np.ndarray | None = None  # [R]
    score_ids: np.ndarray | None = None  # [R, K]
    score_logprobs: np.ndarray | None = None  # [R, K]
    accepted: np.ndarray | None = None  # [P]


@dataclass(frozen=True)
class FakePending:
    """A step already computed; `get()` hands it over (the real engine's PendingStep waits for it)."""

    output: FakeOutput

    def get(self) -> FakeOutput:
        return self.output


@dataclass(frozen=True)
class FakeState:
    last: np.ndarray  # [slots] last drawn token per slot
    masks: dict[int, np.ndarray] = field(default_factory=dict)  # structured output: slot -> allowed ids


def _running() -> threading.Event:
    event = threading.Event()
    event.set()
    return event


@dataclass
class FakeEngine:
    slots: int = 4
    sequence_len: int = 32
    vocab_size: int = 64
    eos_id: int = 2
    pad_id: int = 0
    max_rows: int = 16
    block_size: int = 4
    num_blocks: int = 64  # enough for every slot's whole context unless a test says otherwise
    buckets: tuple[int, ...] = ()  # no row buckets, as on CPU
    step_delay: float = 0.0
    fail_on: int = -1  # a step whose rows hold this token raises
    kept: int = K  # alternatives with a probability above 0 (as if a nucleus had kept only these)
    draft_tokens: int = 0  # speculative decoding: draws per slot per step beyond the first
    steps: list[StepBatch] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    running: threading.Event = field(default_factory=_running)

    @property
    def max_samples(self) -> int:
        return self.slots * (1 + self.draft_tokens)

    @property
    def table_len(self) -> int:
        return -(-self.sequence_len // self.block_size)

    def _alternatives(self, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """[n, K] ids and probabilities: (token, token + 1, ...) at 0.5, 0.25, ...; past `kept`, probability 0
        and ids 0, 1, ... (what top-k over a filtered distribution gives: ties at 0 take the lowest ids)."""
        ids = (tokens[:, None] + np.arange(K)[None, :]) % self.vocab_size
        probs = np.broadcast_to(0.5 ** np.arange(1, K + 1), ids.shape).copy()
        ids[:, self.kept:] = np.arange(K - self.kept)[None, :]
        probs[:, self.kept:] = 0.0
        return ids, probs

    def init_state(self) -> FakeState:
        return FakeState(np.zeros((self.slots,), dtype=np.int64))

    def step(self, state: FakeState, batch: StepBatch) -> tuple[FakeState, FakePending]:
        with self.lock:
            self.steps.append(batch)
        self.running.wait()
        if self.step_delay:
            time.sleep(self.step_delay)
        rows = np.where(batch.from_last, state.last[batch.seq], batch.tokens)[:batch.rows]
        if self.fail_on in rows:
            raise RuntimeError("fake step failure")
        used = batch.sample_slots < self.slots
        masks = {k: v for k, v in state.masks.items() if k not in {st.slot for st in batch.starts}}
        masks.update(batch.masks)
        drawn = np.zeros(batch.sample_slots.shape, np.int64)
        for i in np.flatnonzero(used):
            drawn[i] = self._next(int(rows[batch.sample_rows[i]]), masks.get(int(batch.sample_slots[i])))
        accepted = used.copy()
        if batch.sample_chain is not None:  # the engine's rule (engine.accepted_draws), in NumPy
            for i in range(1, len(accepted)):
                if batch.sample_chain[i] > 0:
                    accepted[i] &= accepted[i - 1] and drawn[i - 1] == batch.sample_next[i - 1]
        last = state.last.copy()
        for i in np.flatnonzero(accepted):
            last[batch.sample_slots[i]] = drawn[i]
        ids, probs = self._alternatives(drawn)
        out = FakeOutput(drawn, np.full(drawn.shape, 0.5), ids, probs, used & (drawn == POISON), accepted=accepted)
        if batch.score is not None:
            nxt = batch.targets
            sids, sprobs = self._alternatives(nxt)
            with np.errstate(divide="ignore"):  # log(0) = -inf, as a masked logit's log-softmax
                out = FakeOutput(out.token, out.prob, out.top_ids, out.top_probs, out.bad,
                                 np.log(np.full(nxt.shape, 0.25)), sids, np.log(sprobs), accepted)
        return FakeState(last, masks), FakePending(out)

    def _next(self, token: int, mask: np.ndarray | None) -> int:
        for step in range(1, self.vocab_size + 1):
            t = (token + step) % self.vocab_size
            if mask is None or mask[t]:
                return t
        raise AssertionError("empty mask")

    def prompt_rows(self) -> list[int]:
        """Per step, the rows that held a prompt token (not a decode row)."""
        with self.lock:
            return [int(np.count_nonzero(~b.from_last[:b.rows])) for b in self.steps]
