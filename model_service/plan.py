"""The scheduling policy as pure functions: what to do this step, and what a step's output means.

vLLM v1's split (`schedule() -> SchedulerOutput`, then `update_from_output(...)`): the decode loop
(scheduler.py) takes a snapshot of its queue and slots (`View`), asks `schedule` for a `StepPlan`, carries
it out on the engine, then reads each result with `token_out` / `finish_reason`. No threads, locks, clocks
or engine calls here, so the policy is tested as data (tests/engine/test_plan.py).

Policy, between two decode steps:
  - requests that were cancelled or passed their deadline end first: a decoding slot is freed (the
    engine clears it), a slot still being prefilled in chunks is returned, a waiting request leaves the queue;
  - waiting requests are admitted in queue order into the lowest free slots (so busy slots stay in the
    fewest decode tiles); a request of n samples waits for n free slots, and every request for the KV
    blocks its prompt takes; nothing overtakes the head of the queue;
  - with nothing decoding, as many as fit are admitted; while requests decode, at most `prefills_per_step`
    (default: all slots) and only until the admitted prompts' token cost reaches `prefill_token_budget`
    (at least one), so running streams are never starved;
  - a long prompt is prefilled one chunk per step (`chunk`), a newly admitted one starting this step.
Whether a decode step follows is not decided here: it runs when some slot is decoding once the plan is
carried out, which depends on each prefill's first token (a request may end at it: EOS, max_tokens 1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from model_service.engine_api import StepOutputLike
from model_service.requests import FinishReason, GenerationRequest, TokenOut


@dataclass(frozen=True)
class Waiting:
    """A queued request as the policy sees it."""

    ref: int  # the loop's name for the request
    samples: int  # slots it needs (its n)
    cost: int  # prompt tokens it counts against the per-step budget (its bucket, or one chunk)
    chunked: bool  # prefilled chunk by chunk straight into its slot
    ended: bool = False  # cancelled or past its deadline
    blocks: int = 0  # KV blocks its prompt takes


@dataclass(frozen=True)
class Occupant:
    """A request holding a slot (decoding, or being prefilled in chunks)."""

    slot: int
    ref: int
    ended: bool = False


@dataclass(frozen=True)
class View:
    """The loop's queue and slots at a step boundary."""

    waiting: tuple[Waiting, ...]  # in queue order
    free: frozenset[int]
    decoding: tuple[Occupant, ...]
    prefilling: tuple[Occupant, ...]  # in the order their chunked prefills began
    free_blocks: int | None = None  # KV blocks free or evictable (None: not limited)


@dataclass(frozen=True)
class Policy:
    slots: int
    prefills_per_step: int | None = None  # None: up to every slot
    prefill_token_budget: int = 128


@dataclass(frozen=True)
class Admit:
    """Prefill `ref` into `slots` (one per sample), or begin its chunked prefill in `slots[0]`."""

    ref: int
    slots: tuple[int, ...]
    chunked: bool


@dataclass(frozen=True)
class StepPlan:
    """What the loop does before the next decode step, in this order."""

    end_decoding: tuple[Occupant, ...] = ()  # free these slots and end their requests
    end_prefilling: tuple[Occupant, ...] = ()  # return these slots (never activated) and end their requests
    end_waiting: tuple[Waiting, ...] = ()  # drop these from the queue and end them
    admit: tuple[Admit, ...] = ()  # in queue order
    chunk: tuple[int, ...] = ()  # slots whose chunked prefill runs its next chunk, in this order

    @property
    def admitted(self) -> frozenset[int]:
        return frozenset(a.ref for a in self.admit)


def schedule(view: View, policy: Policy) -> StepPlan:
    """The plan for one step boundary; see the module docstring for the policy."""
    end_decoding = tuple(o for o in view.decoding if o.ended)
    end_prefilling = tuple(o for o in view.prefilling if o.ended)
    end_waiting = tuple(w for w in view.waiting if w.ended)
    free = set(view.free) | {o.slot for o in end_decoding + end_prefilling}
    decoding = len(view.decoding) > len(end_decoding)
    admit = _admit([w for w in view.waiting if not w.ended], free, decoding, policy, view.free_blocks)
    chunk = tuple(o.slot for o in view.prefilling if not o.ended) + tuple(a.slots[0] for a in admit if a.chunked)
    return StepPlan(end_decoding, end_prefilling, end_waiting, admit, chunk)


def _admit(queue: list[Waiting], free: set[int], decoding: bool, policy: Policy,
           blocks: int | None) -> tuple[Admit, ...]:
    limit = policy.prefills_per_step or policy.slots
    admitted: list[Admit] = []
    tokens = 0
    for w in queue:
        if decoding and (len(admitted) >= limit or (admitted and tokens >= policy.prefill_token_budget)):
            break
        # The head waits for enough slots and KV blocks; the queue stays in order.
        if len(free) < w.samples or (blocks is not None and w.blocks > blocks):
            break
        if blocks is not None:
            blocks -= w.blocks
        slots = tuple(sorted(free)[:w.samples])
        free.difference_update(slots)
        admitted.append(Admit(w.ref, slots, w.chunked))
        tokens += w.cost
    return tuple(admitted)


# ---- reading a step's output (update_from_output) -------------------------------------------------
def alternatives(ids: Any, probs: Any, k: int) -> tuple[tuple[int, float], ...]:
    """The first `k` (id, probability) pairs of a step's top-k, less those of probability 0: a token the step
    could not draw is no alternative (top-k over a filtered distribution pads with such ties)."""
    return tuple((int(i), p) for i, p in ((i, float(p)) for i, p in zip(ids[:k], probs[:k])) if p > 0)


def token_out(out: StepOutputLike, row: int, top_logprobs: int) -> TokenOut:
    """The token of `row` with its probability and the `top_logprobs` alternatives the request asked for
    (fewer when fewer could be drawn)."""
    top = alternatives(out.top_ids[row], out.top_probs[row], top_logprobs)
    return TokenOut(int(out.token[row]), float(out.prob[row]), top)


def prompt_out(req: GenerationRequest, out: StepOutputLike) -> tuple[TokenOut, ...] | None:
    """Prompt tokens 1..n-1 with their probabilities and `prompt_logprobs` alternatives (from the prefill)."""
    scored = getattr(out, "prompt", None)
    if req.prompt_logprobs is None or scored is None:
        return None
    k = req.prompt_logprobs
    return tuple(TokenOut(int(token), math.exp(float(lp)),
                          alternatives(ids, [math.exp(float(p)) for p in tops[:k]], k))
                 for token, lp, ids, tops in zip(req.prompt[1:], scored.logprob, scored.top_ids, scored.top_logprobs))


def finish_reason(req: GenerationRequest, generated: int, token: int, eos_id: int,
                  sequence_len: int) -> FinishReason | None:
    """Why the request ends with its `generated`-th token `token`, or None when it goes on."""
    if token == eos_id and not req.ignore_eos:
        return FinishReason.EOS
    if token in req.stop_token_ids:
        return FinishReason.STOP_TOKEN
    if req.max_tokens is not None and generated >= req.max_tokens:
        return FinishReason.LENGTH
    if len(req.prompt) + generated >= sequence_len:
        return FinishReason.CONTEXT_LENGTH
    return None
