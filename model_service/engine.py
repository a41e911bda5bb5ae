"""The Engine: one step (two jitted programs on CPU; on accelerators one, compiled before serving for each row
bucket) over a list of token rows, and the device state it reads and writes.

The engine never sees a request, a queue or a block allocator: the scheduler owns those and hands the engine
a `StepBatch` (step_batch.py) per step: token rows (prompt chunks and decode rows mixed), every slot's block
table, which rows are drawn from with which slot's settings, and which slots start. Its whole state is one
immutable pytree, `EngineState` (the paged KV pools and, per slot, key, last token, settings and penalty
history), passed in and returned by every call with its buffers donated and its shardings fixed.

A step runs the rows in tiles of `tile` rows, one after another, through the same program (GrokModel.rows),
then the final norm and unembedding of the sampled rows only, then the sampler per entry. So a row's bits
depend only on its own token, position and keys: the same whatever shares its step, however its prompt was
split over steps, whether its prefix came from the cache. On one device with native products a step of few
rows (decode of up to every slot) runs its rows through the rows program compiled for `small_rows` rows (the
draws and scores are a second program, compiled once, over the rows padded back): the elementwise work
between the products scales with the program's rows, not the rows in use, and there a row's bits are the same
in a program of 8, 16, 32 or 64 rows (GrokModel.row_sums). `step` returns before the device finishes: its
`PendingStep` is copied to the host in the background and read with `get()`, so the caller can dispatch the
next step first and overlap its own work with it.

Public surface: `init_state`, `compile`, `step`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from model_service.config import ModelConfig
from model_service.engine_state import EngineState, PendingStep, Scores, SlotState, idle_draws, pack_draws
from model_service.logits_processing import Controls, History, controls_row, idle_controls, penalized
from model_service.model import TokenRows
from model_service.sampling import TOP_K, SamplingParams, build_mask, sample_tokens, seed_key, split_key, split_keys
from model_service.sampling_settings import SamplingSettings
from model_service.step_batch import SlotStart, StepBatch, empty_batch

log = logging.getLogger(__name__)

COMPILE_SETTINGS = SamplingSettings(temperature=1.0, top_logprobs=TOP_K, repetition_penalty=1.1)


def accepted_draws(token: jax.Array, used: jax.Array, chain: jax.Array, nxt: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Which draws count, and which is each slot's last: a slot's draws are consecutive entries, the j-th of them
    (`chain`) drawn from the row holding its (j-1)-th draft; draw j counts only if every earlier draw of its
    chain was used and equalled the draft after it (`nxt`: the draft the next entry's row holds, -1 for none).
    -> accepted [P], final [P]. Counted with prefix sums, not a loop over the entries (a dependent step each on
    an accelerator)."""
    p = token.shape[0]
    index = jnp.arange(p)
    start = jax.lax.cummax(jnp.where(chain == 0, index, -1))  # the entry that starts each entry's chain
    broken = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(~(used & (token == nxt)), dtype=jnp.int32)])
    kept = broken[index] == broken[jnp.maximum(start, 0)]  # no entry from the chain's start up to this one broke it
    accepted = used & (start >= 0) & ((chain == 0) | kept)
    continued = jnp.concatenate([accepted[1:] & (chain[1:] > 0), jnp.zeros((1,), bool)])
    return accepted, accepted & ~continued


def compile_threads() -> int:
    """Threads that compile the step's row buckets side by side: GROK_COMPILE_THREADS when set (1 compiles them
    one after another), else the CPUs this process may use."""
    given = os.environ.get("GROK_COMPILE_THREADS")
    if not given:
        return len(os.sched_getaffinity(0))
    if not given.isdigit() or int(given) < 1:
        raise ValueError(f"GROK_COMPILE_THREADS={given!r} is not a number of threads (a whole number >= 1)")
    return int(given)


START_ROWS = 8  # the smaller size of a step's starting-slot arrays (Engine.start_sizes)
SMALL_TILES = (8, 16, 32)  # row counts of the few-rows program (tests/model: a row's bits in each equal a 64-row tile's)


def small_rows(max_samples: int, tile: int, max_rows: int, row_sums: bool) -> int | None:
    """Rows of the program for steps of few rows: the least of SMALL_TILES holding a decode row per draw
    (`max_samples`) in whole tiles, if fewer than `max_rows`. None when no such program pays, or unless the
    model's rows keep their bits whatever the program's row count (GrokModel.row_sums: XLA's products and
    reductions choose their form by the shape they meet)."""
    if not row_sums:
        return None
    for rows in SMALL_TILES:
        if rows >= max_samples and rows % min(tile, rows) == 0 and rows < max_rows:
            return rows
    return None


class Engine:
    """One step over token rows of up to `slots` sequences of one GrokModel, over a pool of KV blocks."""

    def __init__(self, model: Any, params: Any, cfg: ModelConfig, mesh: Mesh, slots: int,
                 kv_blocks: int | None = None, step_tokens: int | None = None, tile: int | None = None,
                 draft_tokens: int = 0) -> None:
        self.model = model
        self.params = model.pack_params(params)  # laid out for the backend's operations (no-op if loaded so)
        self.mesh = mesh
        self.slots = slots
        # The step's shape is the backend's (backend.py), unless given: at least a row per slot, whole tiles.
        b = model.backend
        self.tile = min(tile or b.tile_rows, max(step_tokens or b.step_tokens, slots))
        self.max_rows = -(-max(step_tokens or b.step_tokens, slots) // self.tile) * self.tile
        self.draft_tokens = draft_tokens  # speculative decoding: a slot draws at most 1 + this many times a step
        self.max_samples = slots * (1 + draft_tokens)
        self.small_rows = small_rows(self.max_samples, self.tile, self.max_rows, getattr(model, "row_sums", False))
        self.model_config = cfg
        self.sequence_len = cfg.sequence_len
        self.vocab_size = cfg.vocab_size
        self.eos_id = cfg.eos_token
        self.pad_id = cfg.pad_token
        self.block_size = model.block_size
        self.table_len = model.table_len
        self.num_blocks = kv_blocks if kv_blocks is not None else slots * model.blocks_per_sequence
        if self.num_blocks < model.blocks_per_sequence:
            raise ValueError(f"the KV pool ({self.num_blocks} blocks of {self.block_size}) must hold at least one "
                             f"full context ({cfg.sequence_len} tokens = {model.blocks_per_sequence} blocks)")
        self.nucleus = model.ops.sampling  # the backend's sampler: its draws one by one, or all at once (Ops.sampling)
        replicated = NamedSharding(mesh, PartitionSpec())
        slot_shardings = SlotState(replicated, replicated, SamplingParams(*([replicated] * len(SamplingParams._fields))),
                                   Controls(*([replicated] * len(Controls._fields))), History(replicated, replicated))
        self.state_shardings = EngineState(model.pools_shardings(self.num_blocks), slot_shardings)
        self.params_shardings = model.params_shardings(self.params)
        # The draws read only the language model's own parameters (the table and the final norm): passing them
        # alone spares each step's second call the handling of every layer's arrays (~500 at medium's size).
        self.head_params = model.head_params(self.params)
        state_out = dict(donate_argnums=(0,), out_shardings=self.state_shardings)
        self._init = jax.jit(self._init_impl, out_shardings=self.state_shardings)
        self._start = jax.jit(self._start_impl, **state_out)
        # A step's new slots (and its constrained slots' masks) go to the device as [B] / [B, V] host arrays, B the
        # least of these holding them: a step that starts one request moves 1/8 of the vocabulary-wide rows that
        # one starting every slot at once would (both sizes compiled by compile()).
        self.start_sizes = tuple(sorted({min(START_ROWS, slots), slots}))
        self._mask = jax.jit(self._mask_impl, **state_out)
        # A step is two programs: the rows (compiled at max_rows and, where there is one, small_rows; the
        # hidden states come out padded to max_rows) and the draws and scores (compiled once).
        pools_sh, slots_sh = self.state_shardings
        self._rows = jax.jit(self._rows_impl, donate_argnums=(1,),
                             in_shardings=(self.params_shardings, pools_sh, slots_sh.last) + (None,) * 2,
                             out_shardings=(None, pools_sh))
        self._draws = jax.jit(self._draws_impl, donate_argnums=(1,),
                              in_shardings=(model.params_shardings(self.head_params), slots_sh) + (None,) * 4,
                              out_shardings=(slots_sh, None, None))
        # Accelerators: a step is one program (rows, draws and scores), compiled for each of the backend's row
        # buckets; compile() compiles them all ahead of time and the step then calls those executables only, so a
        # step whose arguments would need another program fails instead of compiling while serving.
        self.one_program = b.one_program
        self.buckets = tuple(x for x in b.row_buckets if x < self.max_rows and x % min(self.tile, x) == 0) + (
            self.max_rows,) if b.one_program else ()
        self._program = jax.jit(self._program_impl, donate_argnums=(1,),
                                in_shardings=(self.params_shardings, self.state_shardings) + (None,) * 5,
                                out_shardings=(self.state_shardings, None, None))
        self._compiled: dict[int, Any] = {}

    # ---- pure functions (jitted above) ------------------------------------------------------
    def _init_impl(self) -> EngineState:
        s, v = self.slots, self.vocab_size
        slots = SlotState(jnp.zeros((s, 2), jnp.uint32), jnp.full((s,), self.pad_id, jnp.int32),
                          SamplingParams(jnp.zeros((s,), jnp.float32), jnp.ones((s,), jnp.float32),
                                         jnp.ones((s, v), bool), jnp.ones((s,), bool), jnp.zeros((s,), jnp.int32)),
                          idle_controls(s, v), History(jnp.zeros((s, v), bool), jnp.zeros((s, v), jnp.int32)))
        return EngineState(self.model.init_pools(self.num_blocks), slots)

    def _start_impl(self, state: EngineState, slot: jax.Array, seed: jax.Array, drawn: jax.Array,
                    sampling: SamplingParams, controls: Controls, tokens: jax.Array,
                    prompt_len: jax.Array, length: jax.Array) -> EngineState:
        # slot [N] (S: unused entry), seed [N] uint32, drawn [N] int32 draws already made; sampling/controls
        # batch N; tokens [N, C] the prompt then the drawn tokens, prompt_len / length [N] how many of each
        def key_after(s: jax.Array, n: jax.Array) -> jax.Array:
            return jax.lax.fori_loop(0, n, lambda _, k: split_key(k)[0], seed_key(s))

        keys = jax.vmap(key_after)(seed, drawn)
        at = jnp.arange(tokens.shape[1])[None, :]
        n = tokens.shape[0]
        rows = jnp.broadcast_to(jnp.arange(n)[:, None], tokens.shape)
        s = state.slots
        put = lambda all_, new: all_.at[slot].set(new, mode="drop")  # noqa: E731

        def history(h: History) -> History:  # the prompt's ids and the drawn tokens' counts, as the penalties read
            prompt = jnp.zeros((n, self.vocab_size), bool).at[rows, tokens].max(at < prompt_len[:, None], mode="drop")
            counts = jnp.zeros((n, self.vocab_size), jnp.int32).at[rows, tokens].add(
                ((at >= prompt_len[:, None]) & (at < length[:, None])).astype(jnp.int32), mode="drop")
            return History(put(h.prompt, prompt), put(h.counts, counts))

        # Only the penalties read a slot's history (and count its draws), so a start without them leaves its rows
        # as they were: a TPU scatters the prompt's ids one at a time (the whole start program took 2.8 ms on a
        # v5e, medium, benchmarks.closed_loop --step-probe; what share of it these scatters are is not measured).
        penalties = jnp.any(penalized(controls) & (slot < self.slots))
        return state._replace(slots=SlotState(
            put(s.keys, keys), put(s.last, jnp.full((n,), self.pad_id, jnp.int32)),
            jax.tree.map(put, s.sampling, sampling), jax.tree.map(put, s.controls, controls),
            jax.lax.cond(penalties, history, lambda h: h, s.history)))

    def _mask_impl(self, state: EngineState, slot: jax.Array, masks: jax.Array) -> EngineState:
        # slot [N] (S: unused), masks [N, V] bool: each constrained slot's allowed tokens for this step's draw
        s = state.slots
        return state._replace(slots=s._replace(sampling=s.sampling._replace(
            mask=s.sampling.mask.at[slot].set(masks, mode="drop"))))

    def _rows_impl(self, params: Any, pools: Any, last: jax.Array, packed: jax.Array,
                   tables: jax.Array) -> tuple[jax.Array, Any]:
        # packed [6, R] int32 (R: max_rows or small_rows): tokens, from_last, positions, seq, valid, and the tiles to
        # run in [5, 0] (one host array: each one more costs a transfer per step); last [S] each slot's last draw;
        # tables [S, L] -> hidden states [max_rows, D] (rows past R zero), the pools
        h, pools = self._hidden(params, pools, last, packed, tables)
        r = h.shape[0]
        return (jnp.pad(h, ((0, self.max_rows - r), (0, 0))) if r < self.max_rows else h), pools

    def _hidden(self, params: Any, pools: Any, last: jax.Array, packed: jax.Array,
                tables: jax.Array) -> tuple[jax.Array, Any]:
        tokens, from_last, positions, seq, valid = packed[0], packed[1] != 0, packed[2], packed[3], packed[4] != 0
        tiles = packed[5, 0]
        r = tokens.shape[0]
        tokens = jnp.where(from_last, last[seq], tokens)
        return self.model.rows(params, pools, TokenRows(tokens, positions, seq, valid, tables), min(self.tile, r),
                               tiles)

    def _program_impl(self, params: Any, state: EngineState, packed: jax.Array, tables: jax.Array,
                      draws: jax.Array, pending: jax.Array, scoring: jax.Array) -> tuple[EngineState, Any, Scores]:
        # One program a step (accelerators): the rows of one bucket [R], then the draws and the scores of those rows
        # (scoring [2, R]); the hidden states never leave the device and are never padded.
        # A step that draws nothing (a prompt's chunks before its last) skips the unembedding and the sampler
        # (Grok-1 width: the 1.6 GB table read, ~2 ms on a v5e); its draws come back zero, read by no one.
        h, pools = self._hidden(params, state.pools, state.slots.last, packed, tables)
        head = self.model.head_params(params)

        slots, drawn = jax.lax.cond(jnp.any(draws[1] < self.slots),
                                    lambda s: self._sample(head, s, h, draws, pending),
                                    lambda s: (s, idle_draws(draws.shape[1], self.vocab_size)), state.slots)
        return EngineState(pools, slots), drawn, self._scores(head, h, scoring[1], scoring[0] != 0)

    def _draws_impl(self, params: Any, s: SlotState, h: jax.Array, draws: jax.Array, pending: jax.Array,
                    scoring: jax.Array) -> tuple[SlotState, Any, Scores]:
        # h [max_rows, D]; draws [4, P] int32: sample_rows, sample_slots, chain, nxt, with pending [P, K] the
        # speculative drafts (step_batch.py); scoring [2, max_rows] int32: score (0/1), targets
        slots, drawn = self._sample(params, s, h, draws, pending)
        return slots, drawn, self._scores(params, h, scoring[1], scoring[0] != 0)

    def _sample(self, params: Any, s: SlotState, h: jax.Array, draws: jax.Array,
                pending: jax.Array) -> tuple[SlotState, jax.Array]:
        """The step's draws from the hidden states h: the slots after them and pack_draws' array."""
        sample_rows, sample_slots, chain, nxt = draws[0], draws[1], draws[2], draws[3]
        n_slots = self.slots
        used = sample_slots < n_slots
        slot = jnp.minimum(sample_slots, n_slots - 1)
        logits = self.model.head(params, h[sample_rows], used)  # [P, V]
        # A slot's j-th draw this step uses the j-th key of its schedule: the one a step at a time would use.
        start = jax.vmap(lambda k, j: jax.lax.fori_loop(0, j, lambda _, kk: split_key(kk)[0], k))(s.keys[slot], chain)
        rest, draw = split_keys(start)
        result = sample_tokens(draw, logits, s.sampling, s.controls, s.history, self.nucleus, slot, used,
                               pending=pending if self.draft_tokens else None, chain=chain)
        accepted, final = accepted_draws(result.token, used, chain, nxt)
        counted = accepted & penalized(s.controls)[slot]
        counts = jax.lax.cond(jnp.any(counted), lambda c: c.at[sample_slots, result.token].add(
            counted.astype(jnp.int32), mode="drop"), lambda c: c, s.history.counts)
        # min_tokens: each accepted draw is one fewer the slot's ending ids are barred from
        min_left = jnp.maximum(s.controls.min_left.at[sample_slots].add(-accepted.astype(jnp.int32), mode="drop"), 0)
        at = jnp.where(final, sample_slots, n_slots)  # a slot's last accepted draw sets its key and last token
        slots = SlotState(s.keys.at[at].set(rest, mode="drop"), s.last.at[at].set(result.token, mode="drop"),
                          s.sampling, s.controls._replace(min_left=min_left), s.history._replace(counts=counts))
        return slots, pack_draws(result, accepted)

    def _scores(self, params: Any, h: jax.Array, targets: jax.Array, score: jax.Array) -> Scores:
        """Prompt logprobs of the `score` rows, a tile of rows at a time (only tiles holding one)."""
        r = h.shape[0]
        t = min(self.tile, r)
        k = min(TOP_K, self.vocab_size)

        def tile(args: tuple[jax.Array, jax.Array, jax.Array]) -> Scores:
            hs, ts, us = args
            zeros = Scores(jnp.zeros((t,), jnp.float32), jnp.zeros((t, k), jnp.float32), jnp.zeros((t, k), jnp.int32))
            return jax.lax.cond(jnp.any(us), lambda: Scores(*self.model.score(params, hs, ts, us, k)), lambda: zeros)

        out = jax.lax.map(tile, (h.reshape(r // t, t, -1), targets.reshape(r // t, t), score.reshape(r // t, t)))
        return Scores(out.logprob.reshape(r), out.top_logprobs.reshape(r, k), out.top_ids.reshape(r, k))

    # ---- host API ---------------------------------------------------------------------------
    def init_state(self) -> EngineState:
        """A fresh state: every slot idle, the pools zero."""
        return self._init()

    def step(self, state: EngineState, batch: StepBatch) -> tuple[EngineState, PendingStep]:
        """Start the batch's slots, set its masks, and dispatch its rows; returns at once with the new state and
        the step's draws (and scores) on their way to the host (`PendingStep.get()`)."""
        if batch.starts:
            state = self._start(state, *self._starts(batch.starts))
        if batch.masks:
            state = self._mask(state, *self._masks(batch.masks))
        rows, draws = self.run_args(batch)
        if self.one_program:
            program = self._compiled.get(rows[0].shape[1], self._program)
            state, drawn, scores = program(self.params, state, *rows, *draws)
            return state, PendingStep(drawn, scores if batch.score is not None else None)
        h, pools = self._rows(self.params, state.pools, state.slots.last, *rows)
        slots, drawn, scores = self._draws(self.head_params, state.slots, h, *draws)
        return EngineState(pools, slots), PendingStep(drawn, scores if batch.score is not None else None)

    def run_args(self, batch: StepBatch) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        """The two step programs' arguments for `batch`, after (params, pools, last) and (params, slots, h): the
        rows cut to the program that holds them (`small_rows` or `max_rows`) and the tiles they fill; the draws,
        scores and the defaults of what the batch leaves out."""
        r = self.rows_for(batch.rows)
        valid = np.arange(r) < batch.rows
        tiles = np.int32(-(-batch.rows // min(self.tile, r)))
        scored = r if self.one_program else self.max_rows  # the draws program reads hidden states padded or not
        score = batch.score[:scored] if batch.score is not None else np.zeros(scored, bool)
        targets = batch.targets[:scored] if batch.targets is not None else np.zeros(scored, np.int32)
        p, k = self.draws_for(r), self.draft_tokens
        chain = batch.sample_chain[:p] if batch.sample_chain is not None else np.zeros(p, np.int32)
        nxt = batch.sample_next[:p] if batch.sample_next is not None else np.full(p, -1, np.int32)
        pending = batch.sample_pending[:p] if batch.sample_pending is not None else np.full((p, k), self.vocab_size,
                                                                                              np.int32)
        packed = np.zeros((6, r), np.int32)
        packed[0], packed[1], packed[2], packed[3], packed[4] = (batch.tokens[:r], batch.from_last[:r],
                                                                 batch.positions[:r], batch.seq[:r], valid)
        packed[5, 0] = tiles
        return ((packed, batch.tables),
                (np.stack([batch.sample_rows[:p], batch.sample_slots[:p], chain, nxt]).astype(np.int32), pending,
                 np.stack([score, targets]).astype(np.int32)))

    def rows_for(self, rows: int) -> int:
        """The rows of the program that runs a step of `rows` token rows: the least bucket holding them
        (accelerators), small_rows where it holds them (CPU), else max_rows."""
        if self.one_program:
            return next(b for b in self.buckets if b >= rows)
        return self.small_rows if self.small_rows and rows <= self.small_rows else self.max_rows

    def draws_for(self, rows: int) -> int:
        """The draw entries of the program for `rows` (rows_for) rows: on accelerators at most one per row (each
        entry draws from a row of its own, and the step builder packs them first), so a step of few rows samples
        few rows of logits, not a row per possible sample (the vocabulary-wide reductions of 64 slots cost
        ~0.2 ms at medium's 131,072 ids on a v5e); on CPU every entry (the draws program is compiled once)."""
        return min(self.max_samples, rows) if self.one_program else self.max_samples

    def start_size(self, count: int) -> int:
        """The entries of the host arrays that carry `count` starting slots (or masks): the least size holding them."""
        return next(n for n in self.start_sizes if n >= count)

    def _starts(self, starts: tuple[SlotStart, ...], size: int | None = None) -> tuple[Any, ...]:
        """The starting slots as fixed-shape host arrays ([N] entries, N = start_size(); unused ones name slot S,
        dropped)."""
        n, c, v = size or self.start_size(len(starts)), self.sequence_len, self.vocab_size
        slot = np.full(n, self.slots, np.int32)
        seed = np.zeros(n, np.uint32)
        drawn = np.zeros(n, np.int32)
        tokens = np.full((n, c), v, np.int32)  # id V: dropped by the scatters
        prompt_len = np.zeros(n, np.int32)
        length = np.zeros(n, np.int32)
        temperature, top_p = np.zeros(n, np.float32), np.ones(n, np.float32)
        mask, num_top = np.ones((n, v), bool), np.zeros(n, np.int32)
        controls = [controls_row(SamplingSettings(), v)] * n
        for i, st in enumerate(starts):
            s = st.settings
            slot[i], seed[i], drawn[i] = st.slot, st.seed, len(st.drawn)
            ids = (st.prompt + st.drawn)[:c]
            tokens[i, :len(ids)] = ids
            prompt_len[i], length[i] = len(st.prompt), len(ids)
            temperature[i], top_p[i], num_top[i] = s.temperature, s.top_p, s.top_logprobs
            mask[i] = build_mask(v, self.pad_id, s.allowed, s.blocked)
            controls[i] = controls_row(s, v, len(st.drawn))
        stacked = Controls(*(np.concatenate(parts) for parts in zip(*controls)))
        return (slot, seed, drawn, SamplingParams(temperature, top_p, mask, np.ones(n, bool), num_top), stacked,
                tokens, prompt_len, length)

    def _masks(self, masks: tuple[tuple[int, np.ndarray], ...], size: int | None = None
               ) -> tuple[np.ndarray, np.ndarray]:
        n = size or self.start_size(len(masks))
        slot = np.full(n, self.slots, np.int32)
        rows = np.ones((n, self.vocab_size), bool)
        for i, (s, m) in enumerate(masks):
            slot[i], rows[i] = s, m
        return slot, rows

    def compile(self) -> dict[str, float]:
        """Compile (by running) every program a step may run: starting slots, setting masks, and the step with
        a draw and a scored row. Returns seconds per program; with a warm persistent compilation cache these
        are loads."""
        timings: dict[str, float] = {}

        def timed(name: str, fn: Any) -> Any:
            start = time.monotonic()
            out = jax.block_until_ready(fn())
            timings[name] = time.monotonic() - start
            return out

        state = timed("init", self.init_state)
        tables = np.full((self.slots, self.table_len), self.num_blocks, np.int32)  # every entry: scratch
        batch = empty_batch(self.max_rows, self.max_samples, tables)
        start = SlotStart(0, 0, COMPILE_SETTINGS, (self.eos_id,))
        for n in self.start_sizes:
            state = timed(f"start_{n}", lambda: self._start(state, *self._starts((start,), n)))  # noqa: B023
            state = timed(f"mask_{n}", lambda: self._mask(  # noqa: B023
                state, *self._masks(((0, np.ones(self.vocab_size, bool)),), n)))
        batch.sample_slots[0] = 0
        batch = StepBatch(batch.tokens, batch.from_last, batch.positions, batch.seq, 1, tables, batch.sample_rows,
                          batch.sample_slots, np.arange(self.max_rows) == 0, np.zeros(self.max_rows, np.int32))
        if self.one_program:
            timings["bucket_programs"] = self._compile_buckets(state, batch)
        programs = (("step", self.buckets[0]),) if self.one_program else (("step", self.max_rows),
                                                                          ("small_step", self.small_rows))
        for name, rows in programs:
            if rows:  # the full program (a prompt's rows), and the one for a few rows where there is one
                begin = time.monotonic()
                state, pending = self.step(state, dataclasses.replace(batch, rows=rows))
                pending.get()
                timings[name] = time.monotonic() - begin
        log.info("compiled", extra={k: round(v, 3) for k, v in timings.items()} | {"buckets": list(self.buckets)})
        return timings

    def _compile_buckets(self, state: EngineState, batch: StepBatch) -> float:
        """Compile the step program for every row bucket and keep the executables: `step` calls only these from
        then on. Tracing runs one bucket after another; XLA's compilations, which release the GIL, run side by
        side on up to `compile_threads()` threads. Returns the seconds it took."""
        begin = time.monotonic()
        lowered = {}
        for r in self.buckets:
            rows, draws = self.run_args(dataclasses.replace(batch, rows=r))
            lowered[r] = self._program.lower(self.params, state, *rows, *draws)
        with ThreadPoolExecutor(max(1, min(len(lowered), compile_threads()))) as pool:
            self._compiled.update(zip(lowered, pool.map(lambda low: low.compile(), lowered.values())))
        return time.monotonic() - begin
