"""A fake Engine whose outputs are computable by hand, for the scheduler unit suite.

The token after `t` is always `t + 1` (mod vocab): a prompt ending in 40 yields 41, 42, 43, ...
Every token's probability is 0.5 and its alternatives are (token, token + 1, ...) with probabilities
0.5, 0.25, ... (only the first `kept` of them above 0). Token POISON comes out with `bad` set (as if its logits were NaN). Every call is
recorded so tests can check the order of prefills and decode steps. Clearing `running` makes the next
prefill or decode step hang until it is set again (a wedged device, for the watchdog).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from model_service.sampling_settings import GREEDY, SamplingSettings

POISON = 13
K = 8


@dataclass(frozen=True)
class FakeOutput:
    token: np.ndarray  # [B]
    prob: np.ndarray  # [B]
    top_ids: np.ndarray  # [B, K]
    top_probs: np.ndarray  # [B, K]
    bad: np.ndarray  # [B]
    prompt: object = None  # FakePrompt when prompt logprobs were asked for


@dataclass(frozen=True)
class FakePrompt:
    """Prompt scores of the fake: every prompt token 1..n-1 has probability 0.25; its alternatives are
    (token, token + 1, ...) with probabilities 0.5, 0.25, ..."""

    logprob: np.ndarray
    top_ids: np.ndarray
    top_logprobs: np.ndarray


@dataclass(frozen=True)
class FakePending:
    """A decode step already computed; `get()` hands it over (the real engine's PendingStep waits for it)."""

    output: FakeOutput

    def get(self) -> FakeOutput:
        return self.output


@dataclass(frozen=True)
class FakeState:
    last: np.ndarray  # [slots] last token per slot


def _running() -> threading.Event:
    event = threading.Event()
    event.set()
    return event


@dataclass
class FakeEngine:
    slots: int = 4
    buckets: tuple[int, ...] = (8, 16)
    sequence_len: int = 32
    vocab_size: int = 64
    eos_id: int = 2
    pad_id: int = 0
    step_delay: float = 0.0
    fail_prefill_for: int = -1  # prompts starting with this id make prefill raise
    prefill_chunk: int = 0  # > 0: longer prompts are prefilled in chunks of this many tokens
    kept: int = K  # alternatives with a probability above 0 (as if a nucleus had kept only these)
    num_blocks: int = 1 << 20  # KV memory is never short here (the real engine's paging is tested with it)
    calls: list[tuple] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    running: threading.Event = field(default_factory=_running)

    def _alternatives(self, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """[n, K] ids and probabilities: (token, token + 1, ...) at 0.5, 0.25, ...; past `kept`, probability 0
        and ids 0, 1, ... (what top-k over a filtered distribution gives: ties at 0 take the lowest ids)."""
        ids = (tokens[:, None] + np.arange(K)[None, :]) % self.vocab_size
        probs = np.broadcast_to(0.5 ** np.arange(1, K + 1), ids.shape).copy()
        ids[:, self.kept:] = np.arange(K - self.kept)[None, :]
        probs[:, self.kept:] = 0.0
        return ids, probs

    def _out(self, tokens: np.ndarray) -> FakeOutput:
        ids, probs = self._alternatives(tokens)
        return FakeOutput(tokens, np.full(tokens.shape, 0.5), ids, probs, tokens == POISON)

    def _log(self, *entry: object) -> None:
        with self.lock:
            self.calls.append(entry)

    def init_decode_state(self) -> FakeState:
        self._log("init")
        return FakeState(np.zeros((self.slots,), dtype=np.int64))

    def bucket_for(self, length: int) -> int:
        return min(b for b in self.buckets if b >= length)

    def prefill(self, tokens: Sequence[int], sampling: SamplingSettings = GREEDY, *, seed: int,
                prompt_logprobs: int | None = None) -> tuple[int, FakeOutput]:
        self._log("prefill", tuple(tokens))
        self.running.wait()
        if tokens[0] == self.fail_prefill_for:
            raise RuntimeError("fake prefill failure")
        first = (tokens[-1] + 1) % self.vocab_size
        out = self._out(np.array([first]))
        if prompt_logprobs is not None:
            rest = np.asarray(tokens[1:])
            ids, probs = self._alternatives(rest)
            with np.errstate(divide="ignore"):  # log(0) = -inf, as a masked logit's log-softmax
                out = FakeOutput(out.token, out.prob, out.top_ids, out.top_probs, out.bad, FakePrompt(
                    np.log(np.full(rest.shape, 0.25)), ids, np.log(probs)))
        return first, out

    def resample(self, prefix: int, *, seed: int) -> tuple[int, FakeOutput]:
        """Another sample's first token: the prefill's plus `seed` (so with seed 0, sample i starts at first + i)."""
        self._log("resample", seed)
        first = (prefix + seed) % self.vocab_size
        return first, self._out(np.array([first]))

    def chunked(self, length: int) -> bool:
        return 0 < self.prefill_chunk < length

    def begin_prefill(self, tokens: Sequence[int], sampling: SamplingSettings = GREEDY, *, slot: int,
                      seed: int) -> list:
        self._log("begin_prefill", tuple(tokens), slot)
        return [list(tokens), slot, 0]

    def prefill_next_chunk(self, job: list, state: FakeState) -> tuple[FakeState, FakeOutput | None]:
        tokens, slot, start = job
        self._log("chunk", slot, start)
        if self.step_delay:
            time.sleep(self.step_delay)
        job[2] = start + self.prefill_chunk
        if job[2] < len(tokens):
            return state, None
        first = (tokens[-1] + 1) % self.vocab_size
        last = state.last.copy()
        last[slot] = first
        return FakeState(last), self._out(np.array([first]))

    def insert(self, prefix: int, state: FakeState, slot: int) -> FakeState:
        self._log("insert", slot)
        last = state.last.copy()
        last[slot] = prefix
        return FakeState(last)

    def generate(self, state: FakeState) -> tuple[FakeState, FakePending]:
        self._log("generate")
        self.running.wait()
        if self.step_delay:
            time.sleep(self.step_delay)
        nxt = (state.last + 1) % self.vocab_size
        return FakeState(nxt), FakePending(self._out(nxt))

    def free_slot(self, state: FakeState, slot: int) -> FakeState:
        self._log("free", slot)
        last = state.last.copy()
        last[slot] = 0
        return FakeState(last)

    def blocks_needed(self, prompt_len: int, samples: int = 1) -> int:
        return samples

    def free_blocks(self) -> int:
        return self.num_blocks

    def blocks_short(self) -> int:
        return 0

    def kv_usage(self) -> None:
        return None

    def count(self, kind: str) -> int:
        with self.lock:
            return sum(1 for c in self.calls if c[0] == kind)
