"""The scheduling policy as pure functions: what to do this step, and what a step's output means.

vLLM v1's split (`schedule() -> SchedulerOutput`, then `update_from_output(...)`): the loop (scheduler.py) takes
a snapshot of its queue and running samples (`View`), asks `schedule` for a `StepPlan`, carries it out (KV
blocks, the engine's StepBatch), then reads each result with `token_out` / `finish_reason`. No threads, locks,
clocks or engine calls here, so the policy is tested as data (tests/engine/test_plan.py).

Every token is a row; a step spends one budget of rows (the engine's `max_rows`) over, in this order:
  - one row for every running sample whose tokens are all computed but its newest (a decode: the row draws
    the next token); but while prompts of a burst wait (they arrived before those streams began decoding),
    half the step is kept for them and the decodes that fit go to the streams that drew least, the others
    taking the rows the prompts leave: the last prompt of a burst gets its first token before any stream of
    it finishes, however many of it decode (the rows once went to the decodes first, and a 64-request burst's
    tail waited past its head's last token);
  - prompt rows of samples still computing theirs, in admission order (a sample of an n > 1 request that
    shares its first sample's prompt blocks only after that sample computed them: `after`);
  - waiting requests in queue order, into the lowest free slots: a request of n samples waits for n free slots
    (of more samples than the engine has slots, its first samples take the slots free and the rest stay at the
    head), every request for the KV blocks it takes; nothing overtakes the head of the queue.
Speculative drafts (speculative.py) take only the rows left after all of that. While samples decode that were
already streaming (their first token delivered) when the oldest prompt with rows to compute arrived, prompt rows
get at most `prefill_budget` row-equivalents (pacing.py: a row at position p costs 1 + p / key_scale, a chunk's
sequence its keys read once, `keys_per_row` keys to one, and the scheduler sizes the budget from measured step
times, so running streams keep their pace while a long prompt enters; rows of `floor` row-equivalents go in
whatever the keys cost); otherwise (nothing decodes, or only samples whose first token came after that prompt
arrived, as in a burst of prompts arriving together) prompts get every row of the step: a prompt is not held back
for streams that came after it.
On an accelerator a step runs the program of the least row bucket holding its rows (`buckets`), its rows padded to
it: after the paced prompt rows, prompts take the rows up to that bucket too (at their row-equivalents: a row far
into a long prompt still costs its attention), continuing where the paced pass left them and admitting further from
the queue's head, so a mixed step computes the prompts waiting beside the streams instead of padding.
Requests that were cancelled or passed their deadline end first, and their slots and blocks serve this very
step's admissions.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from model_service.engine_api import StepOutputLike
from model_service.pacing import chunk_rows, rows_cost
from model_service.requests import FinishReason, GenerationRequest, TokenOut
from model_service.sampling_settings import SamplingSettings

Key = tuple[int, int]  # (request ref, sample index): one running sample


@dataclass(frozen=True)
class Sample:
    """A request's sample as the policy sees it (running, or to be admitted: then `slot` is -1)."""

    key: Key
    slot: int
    computed: int  # positions computed (a waiting one: where it starts, after what the prefix cache serves)
    length: int  # prompt + drawn tokens (in flight included)
    done: bool = False  # needs no more rows (its last token is drawn; waiting for delivery)
    ended: bool = False  # cancelled or past its deadline
    after: Key | None = None  # n > 1: computes only once `after` has computed `shared` positions
    shared: int = 0
    drafts: int = 0  # decoding: speculative draft tokens proposed after its newest token (speculative.py)
    arrived: float = math.inf  # when its request arrived (the loop's clock; compared, never read here)
    decoding_since: float = -math.inf  # when its first token was delivered (inf: not yet)
    drawn: int = 0  # tokens it has drawn (a burst's decodes go to the streams that drew least)


@dataclass(frozen=True)
class Waiting:
    """A queued request as the policy sees it."""

    ref: int  # the loop's name for the request
    samples: tuple[Sample, ...]  # the samples it admits (all n; after a preemption the unfinished ones)
    blocks: int = 0  # KV blocks it takes
    ended: bool = False  # cancelled or past its deadline
    arrived: float = math.inf  # when it arrived (the loop's clock)
    each: tuple[int, ...] = ()  # the blocks of each sample admitted after the ones before it (sum: `blocks`)


@dataclass(frozen=True)
class View:
    """The loop's queue and samples at a step boundary."""

    waiting: tuple[Waiting, ...]  # in queue order
    running: tuple[Sample, ...]  # in admission order
    free: frozenset[int]
    free_blocks: int | None = None  # KV blocks free or evictable (None: not limited)


@dataclass(frozen=True)
class Policy:
    max_rows: int  # token rows per step
    prefill_budget: float  # prompt row-equivalents per step while samples decode (pacing.Pacing.budget)
    key_scale: float = float("inf")  # keys whose attention costs one row (pacing.key_scale): position cost
    slots: int = 0  # the engine's slots: a request of more samples is admitted as far as slots free (0: never)
    keys_per_row: float = float("inf")  # a prompt chunk's keys read at one row-equivalent (pacing.keys_per_row)
    floor: float = 0.0  # paced prompts' rows of at least this cost a step, whatever their keys' read costs
    buckets: tuple[int, ...] = ()  # the row counts the engine's step programs run (an accelerator's; () on CPU)


@dataclass(frozen=True)
class Admit:
    """Admit request `ref`: its samples `samples` into `slots` (in that order)."""

    ref: int
    slots: tuple[int, ...]
    samples: tuple[int, ...]
    rest: bool = False  # samples of it are left waiting (more samples than slots): it stays at the queue's head


@dataclass(frozen=True)
class Chunk:
    """Rows `start .. start + rows - 1` of sample `key`; `draw`: its last row draws the next token (a decode
    with `drafts`: its last token's row and every draft row draw, speculative.py)."""

    key: Key
    start: int
    rows: int
    draw: bool
    drafts: int = 0


@dataclass(frozen=True)
class StepPlan:
    """What the loop does this step, in this order."""

    end_running: tuple[Key, ...] = ()  # free these samples' slots and end their requests
    end_waiting: tuple[int, ...] = ()  # drop these requests from the queue and end them
    admit: tuple[Admit, ...] = ()  # in queue order
    chunks: tuple[Chunk, ...] = ()  # the step's rows, in this order (decodes first)

    @property
    def admitted(self) -> frozenset[int]:
        return frozenset(a.ref for a in self.admit)

    @property
    def rows(self) -> int:
        return sum(c.rows for c in self.chunks)


def schedule(view: View, policy: Policy) -> StepPlan:
    """The plan for one step; see the module docstring for the policy."""
    ended = tuple(s for s in view.running if s.ended)
    end_waiting = tuple(w.ref for w in view.waiting if w.ended)
    live = [s for s in view.running if not s.ended]
    free = set(view.free) | {s.slot for s in ended}
    computed = {s.key: s.computed for s in live}
    # Another sample of a prompt whose tail is only its last token looks like a decode; it still waits for the
    # first sample to compute the blocks they share.
    decoding = [s for s in live if not s.done and s.computed == s.length - 1
                and (s.after is None or computed.get(s.after, s.shared) >= s.shared)]
    prefilling = [s for s in live if s.computed < s.length - 1]
    oldest_prompt = min([s.arrived for s in live if not s.done and s.computed < s.length - 1]
                        + [w.arrived for w in view.waiting if not w.ended], default=math.inf)
    paced = any(s.decoding_since < oldest_prompt for s in decoding)  # streams the prompts came after
    decoding, deferred = _burst_decodes(decoding, 0 if paced else min(
        _prompt_rows(prefilling, view.waiting), policy.max_rows // 2), policy.max_rows)
    decodes = [Chunk(s.key, s.length - 1, 1, True) for s in decoding]
    budget = _Budget(policy.max_rows - len(decodes), policy.prefill_budget if paced else float("inf"),
                     policy.key_scale, policy.keys_per_row, policy.floor if paced else 0.0)
    prompts = _Prompts(computed, free, view.free_blocks, policy.slots)
    prompts.fill(prefilling, view.waiting, budget)
    # Rows the prompts left (the head waits for a slot or blocks) go back to the decodes deferred for them.
    decodes += [Chunk(s.key, s.length - 1, 1, True) for s in deferred[:max(0, budget.rows)]]
    budget.rows -= min(len(deferred), max(0, budget.rows))
    spare = _bucket_spare(len(decodes) + prompts.rows, policy.buckets) if paced and prompts.rows else 0
    if spare and budget.rows > 0:
        # The step runs the least program holding its rows, padded: rows up to that program's cost nothing more
        # to compute, so paced prompts take them (at their row-equivalents: a row far into a long prompt costs
        # its attention too, padding does not), and a mixed step takes more of the prompts waiting beside the
        # streams instead of paying for rows it leaves empty.
        filled = _Budget(min(spare, budget.rows), float(spare), policy.key_scale, policy.keys_per_row, 0.0)
        prompts.fill(prefilling, view.waiting, filled, strict=True)
        budget.rows -= min(spare, budget.rows) - filled.rows
    admit = prompts.admit
    chunks = decodes + prompts.chunks
    drafts = {s.key: s.drafts for s in live if s.drafts}
    for i, c in enumerate(chunks[:len(decodes)]):  # drafts take only the rows nothing else needs
        k = min(drafts.get(c.key, 0), budget.rows)
        if k:
            chunks[i] = Chunk(c.key, c.start, 1 + k, True, k)
            budget.rows -= k
    return StepPlan(tuple(s.key for s in ended), end_waiting, tuple(admit), tuple(chunks))


def _fits(s: Sample, budget: _Budget) -> bool:
    """Whether the first prompt row of `s` (its sequence's keys read included) is within the budget's cost."""
    return rows_cost(s.computed, 1, budget.scale) + s.computed / budget.keys_per_row <= budget.cost


def _bucket_spare(rows: int, buckets: tuple[int, ...]) -> int:
    """Rows between `rows` and the least bucket holding them (0 without buckets, or past the largest)."""
    return next((b - rows for b in buckets if b >= rows), 0)


class _Prompts:
    """A step's prompt chunks and admissions, filled in passes (the paced budget, then a program's padding): each
    pass continues the samples' prompts where the last left them and admits from the queue's head on."""

    def __init__(self, computed: dict[Key, int], free: set[int], blocks: int | None, slots: int) -> None:
        self.computed = computed
        self.free = free
        self.blocks = blocks
        self.slots = slots
        self.admit: list[Admit] = []
        self.admitted: list[Sample] = []  # with their slots
        self._chunks: dict[Key, Chunk] = {}  # in order
        self._next = 0  # the queue's first request not admitted yet

    @property
    def chunks(self) -> list[Chunk]:
        return list(self._chunks.values())

    @property
    def rows(self) -> int:
        return sum(c.rows for c in self._chunks.values())

    def fill(self, prefilling: list[Sample], waiting: tuple[Waiting, ...], budget: _Budget,
             strict: bool = False) -> None:
        self._add(prefilling + self.admitted, budget, strict)
        while self._next < len(waiting):
            w = waiting[self._next]
            if w.ended:
                self._next += 1
                continue
            k = _admissible(w, len(self.free), self.blocks, self.slots)
            if budget.rows <= 0 or budget.spent or k == 0 or (strict and not _fits(w.samples[0], budget)):
                break  # the head waits (for rows, slots or blocks); the queue stays in order
            if self.blocks is not None:
                self.blocks -= sum(w.each[:k]) if k < len(w.samples) else w.blocks
            slots = tuple(sorted(self.free)[:k])
            self.free.difference_update(slots)
            self.admit.append(Admit(w.ref, slots, tuple(s.key[1] for s in w.samples[:k]), k < len(w.samples)))
            new = [dataclasses.replace(s, slot=slot) for s, slot in zip(w.samples, slots)]
            self.computed.update((s.key, s.computed) for s in new)
            self.admitted += new
            self._add(new, budget, strict)
            self._next += 1

    def _add(self, samples: list[Sample], budget: _Budget, strict: bool) -> None:
        """More rows of `samples`' prompts, from where this step's chunks left them."""
        now = [dataclasses.replace(s, computed=self.computed[s.key])
               if self.computed.get(s.key, s.computed) != s.computed else s for s in samples]
        for c in _prompt_chunks(now, self.computed, budget, strict):
            before = self._chunks.get(c.key)
            self._chunks[c.key] = c if before is None else Chunk(c.key, before.start, before.rows + c.rows, c.draw)


def _admissible(w: Waiting, free: int, blocks: int | None, slots: int) -> int:
    """How many of the request's samples enter now: all of them (they share one prefill), or, when it has more
    samples than the engine has slots, as many as the free slots and blocks take (the first ones first)."""
    if len(w.samples) <= free and (blocks is None or w.blocks <= blocks):
        return len(w.samples)
    if not slots or len(w.samples) <= slots or not w.each:
        return 0
    k, spent = 0, 0
    while k < min(free, len(w.samples)) and (blocks is None or spent + w.each[k] <= blocks):
        spent += w.each[k]
        k += 1
    return k


def _prompt_rows(prefilling: list[Sample], waiting: tuple[Waiting, ...]) -> int:
    """Prompt rows left to compute: of samples holding a slot, and of the waiting requests."""
    return (sum(s.length - s.computed for s in prefilling if not s.done)
            + sum(s.length - s.computed for w in waiting if not w.ended for s in w.samples))


def _burst_decodes(decoding: list[Sample], reserve: int, max_rows: int) -> tuple[list[Sample], list[Sample]]:
    """The decodes that run first, and those deferred to the rows prompts leave: `reserve` rows are kept for the
    prompts of a burst, the decodes that fit going to the streams that drew least (in admission order among
    equals), so no stream of a burst finishes before the burst's last prompt has its first token."""
    room = max_rows - reserve
    if len(decoding) <= room:
        return decoding, []
    first = {s.key for s in sorted(decoding, key=lambda s: s.drawn)[:room]}
    return [s for s in decoding if s.key in first], [s for s in decoding if s.key not in first]


@dataclass
class _Budget:
    rows: int  # rows left in the step
    cost: float  # prompt row-equivalents left (inf with nothing decoding)
    scale: float  # pacing.key_scale
    keys_per_row: float  # pacing.Pacing.keys_per_row: a chunk's keys are read once a step
    floor: float  # row-equivalents of rows still given whatever the keys' read costs (pacing.MIN_ROWS)

    @property
    def spent(self) -> bool:
        return self.cost <= 0 and self.floor <= 0


def _prompt_chunks(samples: list[Sample], computed: dict[Key, int], budget: _Budget,
                   strict: bool = False) -> list[Chunk]:
    """Prompt rows of `samples` in order within `budget` (spent); `computed` is updated with what they compute.
    `strict`: no row beyond the budget's cost (chunk_rows gives a sample's first row whatever it costs, and later
    rows only within the budget)."""
    out = []
    for s in samples:
        if s.done or s.computed >= s.length or budget.rows <= 0 or budget.spent:
            continue
        if s.after is not None and computed.get(s.after, s.shared) < s.shared:
            continue  # its first sample has not computed the shared prompt blocks yet
        if strict and not _fits(s, budget):
            continue  # not even its next row fits: a cheaper prompt after it may use the rows
        rows = min(budget.rows, chunk_rows(s.computed, s.length, budget.cost, budget.scale, budget.keys_per_row,
                                           budget.floor))
        out.append(Chunk(s.key, s.computed, rows, s.computed + rows == s.length))
        computed[s.key] = s.computed + rows
        own = rows_cost(s.computed, rows, budget.scale)
        budget.rows -= rows
        budget.cost -= own + s.computed / budget.keys_per_row
        budget.floor -= own
    return out


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


def scored_tokens(req: GenerationRequest, out: StepOutputLike, first_row: int, position: int,
                  rows: int) -> list[TokenOut]:
    """Prompt tokens position + 1 .. position + rows (each scored by the row before it) with their probabilities
    and `prompt_logprobs` alternatives, from rows first_row .. of a step's output."""
    k = req.prompt_logprobs or 0
    out_tokens = []
    for i in range(rows):
        r = first_row + i
        alts = alternatives(out.score_ids[r], [math.exp(float(p)) for p in out.score_logprobs[r][:k]], k)
        out_tokens.append(TokenOut(int(req.prompt[position + i + 1]), math.exp(float(out.logprob[r])), alts))
    return out_tokens


def end_ids(req: GenerationRequest, eos_id: int) -> tuple[int, ...]:
    """The ids whose draw ends the request (finish_reason's EOS and STOP_TOKEN), each once."""
    return tuple(dict.fromkeys(((eos_id,) if not req.ignore_eos else ()) + req.stop_token_ids))


def drawing(req: GenerationRequest, eos_id: int) -> SamplingSettings:
    """How the request's samples draw on the device: its settings, with the ids min_tokens bars."""
    if not req.sampling.min_tokens:
        return req.sampling
    return dataclasses.replace(req.sampling, ends=end_ids(req, eos_id))


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
