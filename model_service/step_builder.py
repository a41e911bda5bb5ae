"""From the plan to the engine's StepBatch: the samples' KV blocks, token rows, draws, scores and slot starts.

The scheduler's helper on the decode thread (no JAX, no locks). It owns nothing but what it is given: the
engine's limits, the scheduler's block allocator (kv_blocks.KVBlocks) and the structured-output guidance. It
describes requests and samples to the policy (`waiting`, `sample`), gives admitted samples their blocks
(`admit`: the prefix cache serves a prompt's leading blocks; the other samples of an n > 1 request share the
first one's full prompt blocks), and lays a plan's chunks out as rows (`build`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence

import numpy as np

from model_service.engine_api import EngineLike
from model_service.guided import Guidance
from model_service.kv_blocks import KVBlocks
from model_service.loop_state import Running
from model_service.plan import Chunk, Key, Sample, Waiting, drawing
from model_service.requests import Emission, ErrorKind, RequestHandle, SchedulerError
from model_service.speculative import SpeculativeConfig, propose
from model_service.step_batch import SlotStart, StepBatch

log = logging.getLogger(__name__)

Scored = tuple[Running, int, int, int]  # (sample, first row, first prompt position, rows) of a scored chunk


class StepBuilder:
    def __init__(self, engine: EngineLike, kv: KVBlocks, guidance: Guidance,
                 speculative: SpeculativeConfig | None = None) -> None:
        self.engine = engine
        self.kv = kv
        self.guidance = guidance
        self.speculative = speculative
        self._starts: list[SlotStart] = []
        self.failed: list[Running] = []  # samples whose grammar failed while building the last batch

    # ---- the policy's view --------------------------------------------------------------------
    def waiting(self, handle: RequestHandle, now: float, holders: Sequence[Running] = ()) -> Waiting:
        """A queued request: its samples not holding a slot (where each starts computing; after a preemption
        they recompute their own tokens), the blocks each takes and in all. The first of them computes the
        prompt, the others share its full prompt blocks; when samples of it still hold slots (`holders`: more
        samples than slots, or one sample preempted), all share a holder's."""
        req, ref, kv = handle.request, id(handle), self.kv
        reuse, salt = req.prompt_logprobs is None, req.cache_salt  # scored prompt rows must all be computed
        n = len(req.prompt)
        source = self.prompt_source(holders)
        lead = source.index if source is not None else None
        held = {r.index for r in holders}
        samples, each = [], []
        for i in range(req.n):
            if i in handle.finished_samples or i in held:
                continue
            tokens = req.prompt + tuple(handle.delivered.get(i, ()))
            shared = self.shared_prompt(n, len(tokens)) if lead is not None else 0
            if shared:
                samples.append(Sample((ref, i), -1, shared, len(tokens), after=(ref, lead), shared=shared))
                each.append(kv.blocks_for(self.positions(len(tokens))) - shared // kv.block_size)
                continue
            samples.append(Sample((ref, i), -1, kv.reusable(tokens, salt) if reuse else 0, len(tokens)))
            each.append(kv.cost(tokens, self.positions(len(tokens)), reuse, salt))
            lead = i if lead is None else lead
        return Waiting(ref, tuple(samples), sum(each), handle.abandoned(now) is not None, handle.enqueued_at,
                       tuple(each))

    @staticmethod
    def prompt_source(holders: Sequence[Running]) -> Running | None:
        """The running sample of a request whose prompt blocks its waiting samples share: one that computes its
        own, or shares blocks already written."""
        for run in sorted(holders, key=lambda r: r.index):
            if run.after is None or run.after.finished or run.after.computed >= run.shared:
                return run
        return None

    def sample(self, run: Running, now: float, drafting: bool = False) -> Sample:
        """The policy's view of a running sample; `drafting`: propose speculative drafts if it decodes."""
        req = run.handle.request
        done = run.finished or run.length >= self.engine.sequence_len or (
            req.max_tokens is not None and run.drawn >= req.max_tokens)
        after = (id(run.after.handle), run.after.index) if run.after is not None else None
        # Drafts follow a drawn token only: a prompt's last row computed alone (after a chunk) is no decode row.
        run.proposal = self._propose(run) if drafting and not done and run.at_drawn_token else []
        return Sample((id(run.handle), run.index), run.slot, run.computed, run.length, done,
                      run.handle.abandoned(now) is not None, after, run.shared, len(run.proposal),
                      run.handle.enqueued_at, run.decoding_since, run.drawn)

    def _propose(self, run: Running) -> list[int]:
        """Drafts for a decoding sample whose tokens are all on the host: never past max_tokens or the context,
        none for a constrained one (its masks are per slot) or one whose drafts keep failing."""
        spec, req = self.speculative, run.handle.request
        if spec is None or run.guide is not None or not run.pacer.ready():
            return []
        if run.in_flight or len(run.tokens) != run.length:  # the loop did not wait for its newest token
            return []
        room = self.engine.sequence_len - run.length
        if req.max_tokens is not None:
            room = min(room, req.max_tokens - run.drawn - 1)
        if room <= 0:
            return []
        drafts = propose(run.tokens, min(spec.num_speculative_tokens, room), spec.prompt_lookup_max,
                         spec.prompt_lookup_min)
        run.pacer.looked_up(bool(drafts))
        return drafts

    def drafts_due(self, runs: Iterable[Running]) -> bool:
        """Whether some decoding sample looks for drafts at the next step: then the loop waits for the draws in
        flight first (drafts follow the newest token)."""
        return self.speculative is not None and any(
            run.guide is None and not run.finished and run.at_drawn_token and run.pacer.due()
            for run in runs)

    def shared_prompt(self, prompt_len: int, length: int) -> int:
        """Positions a sample of `length` tokens shares with the first sample of its prompt: the prompt's full
        blocks, less the block of its own last token (a sample computes at least that token)."""
        return min(prompt_len, length - 1) // self.kv.block_size * self.kv.block_size

    def positions(self, length: int) -> int:
        """Positions a sample of `length` tokens needs blocks for: its tokens and the one it draws next."""
        return min(length + 1, self.engine.sequence_len)

    def growth(self, runs: Iterable[Running]) -> int:
        """Blocks the next step's decode rows take (a row whose position starts a block; its drafts' rows)."""
        need = 0
        for run in runs:
            if not run.finished and run.computed == run.length - 1 and run.length < self.engine.sequence_len:
                rows = run.length + len(run.proposal)
                need += max(0, self.kv.blocks_for(rows) - len(self.kv.blocks_of(run.slot)))
        return need

    def blocks_short(self, runs: Iterable[Running]) -> int:
        """Blocks the next step's decode rows need beyond what is free or evictable (positive: preempt)."""
        return max(0, self.growth(runs) - self.kv.available())

    # ---- admission ----------------------------------------------------------------------------
    def admit(self, handle: RequestHandle, slots: tuple[int, ...], samples: tuple[int, ...], now: float,
              order: int, holders: Sequence[Running] = ()) -> list[Running]:
        """Running samples for the admitted request, with their blocks; their slots start with this step. They
        share the prompt blocks of the sample `waiting` named (a holder's, else the first admitted one's)."""
        req = handle.request
        source = self.prompt_source(holders)
        seed = handle.draw_seed()
        reuse = req.prompt_logprobs is None
        runs: list[Running] = []
        try:
            for slot, index in zip(slots, samples):
                drawn = tuple(handle.delivered.get(index, ()))
                run = Running(handle, (seed + index) % 2**32, slot, index, list(req.prompt + drawn), 0, now, order)
                positions = self.positions(run.length)
                lead = source or (runs[0] if runs else None)
                shared = self.shared_prompt(len(req.prompt), run.length) if lead is not None else 0
                if shared and lead is not None:  # the lead computes (or computed) the prompt blocks shared
                    run.after, run.shared = lead, shared
                    self.kv.share(slot, lead.slot, run.shared, positions)
                    run.computed = run.shared
                else:
                    run.computed = self.kv.assign_prompt(slot, run.tokens, positions, reuse, req.cache_salt)
                self.guidance.attach(handle, run)
                for token in drawn if run.guide is not None else ():  # a resumed grammar moves past them
                    self.guidance.advance(run, token)
                runs.append(run)
        except Exception:
            for run in runs:
                self.kv.release(run.slot)
            raise
        settings = drawing(req, self.engine.eos_id)
        self._starts.extend(SlotStart(r.slot, r.seed, settings, req.prompt, tuple(r.tokens[len(req.prompt):]))
                            for r in runs)
        return runs

    # ---- the batch ----------------------------------------------------------------------------
    def build(self, chunks: tuple[Chunk, ...],
              running: dict[Key, Running]) -> tuple[StepBatch, list[Running], list[Scored]]:
        """The plan's chunks as the engine's rows, in order; returns the batch, the sample of each draw entry,
        and the scored chunks. A chunk's decode row gets its block first (blocks_short() must be 0)."""
        e = self.engine
        r, p = e.max_rows, e.max_samples
        tokens, from_last = np.zeros(r, np.int32), np.zeros(r, bool)
        positions, seq = np.zeros(r, np.int32), np.zeros(r, np.int32)
        sample_rows, sample_slots = np.zeros(p, np.int32), np.full(p, e.slots, np.int32)
        chain, nxt = np.zeros(p, np.int32), np.full(p, -1, np.int32)
        pending = np.full((p, e.draft_tokens), e.vocab_size, np.int32)
        score, targets = np.zeros(r, bool), np.zeros(r, np.int32)
        owners: list[Running] = []
        scored: list[Scored] = []
        masks: list[tuple[int, np.ndarray]] = []
        row = 0
        for c in chunks:
            run = running[c.key]
            if c.start >= run.known:  # a decode row: its token is the slot's last draw; then its drafts
                if c.drafts and self.kv.blocks_for(c.start + c.rows) - len(self.kv.blocks_of(run.slot)) > \
                        self.kv.available():
                    c = Chunk(c.key, c.start, 1, True)  # no blocks for the drafts' rows: decode without them
                self.kv.grow(run.slot, c.start + c.rows)
                from_last[row] = True
                tokens[row + 1:row + c.rows] = run.proposal[:c.drafts]
            else:
                tokens[row:row + c.rows] = run.tokens[c.start:c.start + c.rows]
            positions[row:row + c.rows] = np.arange(c.start, c.start + c.rows)
            seq[row:row + c.rows] = run.slot
            scored_rows = self._score_rows(run, c)
            if scored_rows:
                score[row:row + scored_rows] = True
                targets[row:row + scored_rows] = run.handle.request.prompt[c.start + 1:c.start + 1 + scored_rows]
                scored.append((run, row, c.start, scored_rows))
            row += c.rows
            run.computed = c.start + c.rows - c.drafts  # a draft row's keys count once its draft is accepted
            if run.after is None and c.start < run.known:
                self.kv.register(run.slot, run.tokens[:run.known], min(run.computed, run.known),
                                 run.handle.request.cache_salt)
            if c.draw and self._draws(run, masks):
                drafts = run.proposal[:c.drafts]
                for j in range(c.drafts + 1):  # the last token's row, then each draft's row
                    e_ = len(owners)
                    sample_rows[e_], sample_slots[e_], chain[e_] = row - 1 - c.drafts + j, run.slot, j
                    nxt[e_] = drafts[j] if j < c.drafts else -1
                    pending[e_, :j] = drafts[:j]
                    owners.append(run)
                run.length += 1
                run.in_flight += 1
            run.proposal = []
        starts, self._starts = tuple(self._starts), []
        spec = self.speculative is not None
        batch = StepBatch(tokens, from_last, positions, seq, row, self.kv.table(), sample_rows, sample_slots,
                          score if scored else None, targets if scored else None, starts, tuple(masks),
                          chain if spec else None, nxt if spec else None, pending if spec else None)
        return batch, owners, scored

    def _score_rows(self, run: Running, c: Chunk) -> int:
        """How many of the chunk's first rows score the next prompt token (prompt logprobs: positions 0..n-2 of
        the first sample's first prefill)."""
        req = run.handle.request
        if req.prompt_logprobs is None or run.index != 0 or run.known != len(req.prompt):
            return 0
        return max(0, min(c.rows, len(req.prompt) - 1 - c.start))

    def _draws(self, run: Running, masks: list[tuple[int, np.ndarray]]) -> bool:
        """Whether the sample draws this step; a constrained one gets its mask, or ends if its grammar fails."""
        if run.guide is None:
            return True
        mask, error = self.guidance.mask(run)
        if error is None and mask is not None and mask.any():
            masks.append((run.slot, mask))
            return True
        if error is None:  # nothing the grammar allows is allowed by the request's own token sets
            req = run.handle.request
            error = SchedulerError(ErrorKind.INVALID_ARGUMENT, f"{req.constraint.field}: no token allowed by "
                                   f"allowed_token_ids/blocked_token_ids can continue the output at token "
                                   f"{run.generated}")
        run.handle.emit(Emission((), run.generated, len(run.handle.request.prompt), error=error))
        run.finished = True
        self.failed.append(run)
        return False
