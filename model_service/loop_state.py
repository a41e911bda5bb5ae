"""What the decode loop (scheduler.py) keeps per slot and per step, and what it reports to observers.

`Running` is a request's sample holding a slot (prefilling its prompt or decoding), `InFlight` a dispatched
step. `SchedulerMetrics` are the loop's observer hooks (metrics.py
implements them with Prometheus) and `Heartbeat` is how a watchdog on another thread sees the loop.
No JAX here: a pending step is whatever the engine returned.
"""

from __future__ import annotations

import math

from dataclasses import dataclass
from typing import Any

from model_service.engine_api import PendingStepLike
from model_service.requests import FinishReason, RequestHandle, Timings
from model_service.speculative import DraftPacer


STEP_KINDS = ("decode", "mixed", "prompt")  # a step's rows: only decode rows, decode and prompt rows, only prompt rows


def step_kind(decoding: bool, prompt_cost: float) -> str:
    """The STEP_KINDS entry of a step that held decode rows (or not) and prompt rows of this cost."""
    return ("mixed" if prompt_cost else "decode") if decoding else "prompt"


class SchedulerMetrics:
    """Observer hooks; the default ignores everything (metrics.Metrics implements them)."""

    def set_active(self, n: int) -> None: ...
    def set_queued(self, n: int) -> None: ...
    def observe_prefill(self, seconds: float) -> None: ...
    def observe_step(self, seconds: float, kind: str = "decode", period: float | None = None) -> None:
        """A step was delivered `seconds` after its dispatch. `kind`: "decode" (only decode rows), "mixed" (decode
        and prompt rows) or "prompt" (only prompt rows); `period`: the loop's time for it, from the previous step's
        delivery (or this one's dispatch, if later) to this one's (what a decoding stream waits between tokens)."""
    def add_tokens(self, n: int) -> None: ...
    def finished(self, reason: FinishReason) -> None: ...
    def observe_kv(self, usage: Any) -> None:
        """The KV pool's occupancy and prefix-cache counters (kv_blocks.KVUsage), after a step."""

    def speculated(self, drafted: int, accepted: int) -> None:
        """A step verified `drafted` speculative draft tokens of a sample, `accepted` of them counted."""

    def preempted(self) -> None:
        """A running request was preempted (KV pool full); it is recomputed when readmitted."""

    def observe_reclaim(self, reason: str, seconds: float, steps: int | None) -> None:
        """A cancelled or expired request's slot was freed `seconds` after the cancel/deadline, after
        `steps` more decode steps (None when not counted)."""


@dataclass(frozen=True)
class Heartbeat:
    """How the decode loop is doing, for a watchdog on another thread."""

    steps: int  # decode steps run so far
    at: float  # time.monotonic() of the last progress (a prefill, a step, or waking up to new work)
    pending: int  # requests running or waiting
    alive: bool  # the decode thread is running


class Running:
    """One sample of a request holding a slot: its tokens and how far the KV memory has computed them.

    `length` counts the prompt and every token drawn so far, including a draw still in flight (its id is on the
    device: the slot's `last` token, which the next decode row reads); `tokens` holds the ids known on the host.
    Positions below `computed` have their keys and values written (or written by a step already dispatched).
    A sample computes rows `computed .. length - 1`; the row at `length - 1` draws the next token."""

    def __init__(self, handle: RequestHandle, seed: int, slot: int, index: int, tokens: list[int],
                 computed: int = 0, admitted_at: float = 0.0, order: int = 0) -> None:
        self.handle = handle
        self.seed = seed
        self.slot = slot
        self.index = index
        self.tokens = tokens  # the prompt, then the drawn tokens delivered so far (all, after a preemption)
        self.known = len(tokens)  # positions whose token the host sent at the start (the rest come from `last`)
        self.length = len(tokens)
        self.computed = computed
        self.order = order  # admission order (the youngest is preempted first)
        self.admitted_at = admitted_at
        self.generated = len(tokens) - len(handle.request.prompt)  # tokens drawn (delivered before a preemption)
        self.in_flight = 0  # draws dispatched, not delivered
        self.after: Running | None = None  # n > 1: the sample whose prompt blocks this one shares
        self.shared = 0  # positions shared with `after` (computed by it)
        self.prefill_seconds = 0.0
        self.step_seconds = 0.0
        self.steps = 0
        self.scored: list[Any] = []  # prompt logprobs so far (plan.TokenOut per prompt token 1..)
        self.finished = False  # its last token was delivered (or it failed): no more rows
        self.guide: Any = None  # structured output: this sample's grammar position (structured.Guide)
        self.proposal: list[int] = []  # speculative drafts proposed for its next decode row (speculative.py)
        self.pacer = DraftPacer()
        self.base_mask: Any = None  # [V] bool, the request's allowed/blocked/pad mask that a guide's mask is ANDed with

    @property
    def prompt_len(self) -> int:
        return len(self.handle.request.prompt)

    @property
    def decoding_since(self) -> float:
        """When its first token was delivered (inf before): pacing holds prompts back only for streams that were
        streaming when they arrived (plan.py), and a decode row is planned before the previous step's draw is
        delivered, so a stream starts at its first token."""
        return self.admitted_at + self.prefill_seconds if self.prefill_seconds else math.inf

    @property
    def drawn(self) -> int:
        """Tokens drawn so far, in flight included."""
        return self.length - self.prompt_len

    @property
    def at_drawn_token(self) -> bool:
        """All computed but its newest token, which was drawn (not sent with the prompt): its next row is a decode
        row, which speculative drafts may follow."""
        return self.computed == self.length - 1 and self.computed >= self.known

    def timings(self) -> Timings:
        mean = self.step_seconds / self.steps if self.steps else 0.0
        return Timings(self.admitted_at - self.handle.enqueued_at, self.prefill_seconds, mean, self.pacer.drafted,
                       self.pacer.accepted)


@dataclass
class InFlight:
    """A dispatched step and the samples its draws belong to (entry i of its output is owners[i])."""

    pending: PendingStepLike
    owners: list[Running]
    scored: list[tuple[Running, int, int, int]]  # (sample, first row, first prompt position, rows) per scored chunk
    dispatched_at: float
    decoding: bool = False  # it held decode rows
    prompt_cost: float = 0.0  # its prompt rows' cost in row-equivalents (pacing.py)
    prompt_keys: float = 0.0  # the keys its prompt chunks' sequences held before them (pacing.py)
