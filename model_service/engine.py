"""The Engine: jitted prefill / insert / generate / free_slot over the network (JetStream's split).

The engine never sees a request. Its whole decode-time state is one immutable pytree, `DecodeState`
(the paged KV memory plus, per slot, the last token, the PRNG key and the sampling settings),
passed in and returned by every call with its buffers donated and its shardings fixed as a matching
pytree. A prefill runs one prompt, padded to a bucket, into a batch-1 `Prefix` that already holds
the first sampled token; `insert` copies it into a slot's KV blocks. Every bucket's prefill, the
insert, the prefill chunks, the decode step and free_slot are compiled by `compile_all()` before the
service reports SERVING.

Which pool blocks each slot holds is decided on the host (kv_blocks.KVBlocks, owned here): a slot gets
blocks for its prompt when it is filled, one more whenever a decode step crosses a block boundary, and
gives them back when freed; long prompts prefilled in chunks take cached blocks for a prefix an earlier
prompt computed (prefix caching). Each step reads keys only from the blocks its sequences fill
(layers.paged_attention), so its cost follows the work, not the configured context. The scheduler
asks `blocks_short()` before a step and preempts when it is positive.

The decode step computes the slots in tiles of `row_tile` rows and stops after the last tile that
holds an active slot, deciding on the device: idle slots past the busy ones cost nothing, one program
serves any number of requests, and a row's bits depend only on the tile size (GrokModel.decode).
`generate` returns before the step finishes: its `PendingStep` is copied to the host in the background
and read with `get()`, so the caller can dispatch the next step first and overlap its own work with it.
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from model_service.config import ModelConfig
from model_service.engine_state import (
    ChunkedPrefill,
    DecodeState,
    PendingStep,
    Prefilled,
    Prefix,
    PromptLogprobs,
    StepOutput,
)
from model_service.kv_blocks import KVBlocks, KVUsage
from model_service.logits_processing import (
    Controls,
    History,
    controls_row,
    empty_history,
    idle_controls,
    prompt_mask,
    record_penalized_tokens,
    record_tokens,
)
from model_service.sampling import (
    TOP_K,
    SampleResult,
    SamplingParams,
    build_mask,
    sample_tokens,
    seed_key,
    split_key,
    split_keys,
)
from model_service.sampling_settings import GREEDY, SamplingSettings
from model_service.sharding import DATA

log = logging.getLogger(__name__)

CPU_ROW_TILE = 8  # rows per decode tile on CPU: one tile streams the weights once for up to 8 requests
PREFILL_CHUNK = 64  # prompts longer than this are prefilled this many tokens at a time, between decode steps
COMPILE_SETTINGS = SamplingSettings(temperature=1.0, top_logprobs=TOP_K)  # compile_all's (values are traced)


def choose_buckets(buckets: Sequence[int], sequence_len: int) -> tuple[int, ...]:
    """Sorted, unique prefill buckets; each must fit the context."""
    chosen = tuple(sorted(set(buckets)))
    if not chosen or chosen[0] < 1 or chosen[-1] > sequence_len:
        raise ValueError(f"prefill buckets {list(buckets)} must be non-empty and within 1..{sequence_len} "
                         "(the model's sequence_len)")
    return chosen


def choose_row_tile(row_tile: int | None, slots: int, mesh: Mesh) -> int:
    """Rows per decode tile: `row_tile` if given, else CPU_ROW_TILE on CPU and every slot elsewhere (where one
    wide matrix product is cheap); always every slot when the batch is split over a data axis."""
    if mesh.shape[DATA] > 1:
        return slots
    if row_tile is None:
        row_tile = CPU_ROW_TILE if mesh.devices.flat[0].platform == "cpu" else slots
    tile = min(row_tile, slots)
    if tile < 1 or slots % tile:
        raise ValueError(f"slots ({slots}) must be a multiple of the decode row tile ({tile})")
    return tile


class Engine:
    """Prefill, insert, generate and free_slot for `slots` concurrent sequences of one GrokModel."""

    def __init__(self, model: Any, params: Any, cfg: ModelConfig, mesh: Mesh, slots: int,
                 buckets: Sequence[int], row_tile: int | None = None, prefill_chunk: int = PREFILL_CHUNK,
                 kv_blocks: int | None = None, prefix_caching: bool = True) -> None:
        self.model = model
        self.params = model.pack_params(params)  # native products: matrices packed (no-op if loaded so)
        self.mesh = mesh
        self.slots = slots
        self.row_tile = choose_row_tile(row_tile, slots, mesh)
        self.buckets = choose_buckets(buckets, cfg.sequence_len)
        self.sequence_len = cfg.sequence_len
        self.vocab_size = cfg.vocab_size
        self.eos_id = cfg.eos_token
        self.pad_id = cfg.pad_token
        self.prefill_chunk = prefill_chunk  # 0: never chunk
        self.block_size = model.block_size
        if prefill_chunk % self.block_size:
            raise ValueError(f"the prefill chunk ({prefill_chunk}) must be a multiple of the KV block size "
                             f"({self.block_size})")
        self.num_blocks = kv_blocks if kv_blocks is not None else slots * model.blocks_per_sequence
        if self.num_blocks < model.blocks_per_sequence:
            raise ValueError(f"the KV pool ({self.num_blocks} blocks of {self.block_size}) must hold at least one "
                             f"full context ({cfg.sequence_len} tokens = {model.blocks_per_sequence} blocks)")
        self.prefix_caching = prefix_caching
        self.native_sampling = bool(getattr(model, "native_sampling", False))
        self._reset_host()
        replicated = NamedSharding(mesh, PartitionSpec())
        self._replicated = replicated
        self.state_shardings = DecodeState(
            memory=model.memory_shardings(slots, self.num_blocks), tokens=replicated, keys=replicated,
            sampling=SamplingParams(*([replicated] * len(SamplingParams._fields))),
            controls=Controls(*([replicated] * len(Controls._fields))), history=History(replicated, replicated))
        self.params_shardings = model.params_shardings(self.params)
        self._init = jax.jit(self._init_impl, out_shardings=self.state_shardings)
        self._prefill = jax.jit(self._prefill_impl)
        self._insert = jax.jit(self._insert_impl, donate_argnums=(1,), out_shardings=self.state_shardings)
        self._generate = jax.jit(self._generate_impl, donate_argnums=(1,),
                                 in_shardings=(self.params_shardings, self.state_shardings, replicated),
                                 out_shardings=(self.state_shardings, None))
        self._free = jax.jit(self._free_impl, donate_argnums=(0,), out_shardings=self.state_shardings)
        self._set_mask = jax.jit(self._set_mask_impl, donate_argnums=(0,), out_shardings=self.state_shardings)
        self._resample = jax.jit(self._resample_impl)
        # Compiled on first use per bucket (prompt logprobs are rare; compile_all stays as fast as before).
        self._score = jax.jit(model.prompt_logprobs, static_argnums=(2,))
        self._extend = jax.jit(self._extend_impl, donate_argnums=(1,),
                               in_shardings=(self.params_shardings, self.state_shardings) + (None,) * 5,
                               out_shardings=self.state_shardings)
        self._extend_last = jax.jit(self._extend_last_impl, donate_argnums=(1,),
                                    in_shardings=(self.params_shardings, self.state_shardings) + (None,) * 9,
                                    out_shardings=(self.state_shardings, None))

    def _reset_host(self) -> None:
        """The host's view of the slots: every block free, nothing cached, no slot live."""
        self.kv = KVBlocks(self.num_blocks, self.block_size, self.slots, self.model.table_len, self.prefill_chunk,
                           self.prefix_caching)
        self._positions = [0] * self.slots  # each slot's next position, as the device has it
        self._live = [False] * self.slots  # decoding (the device's sampling.active)
        self._origin = [-1] * self.slots  # the prefill each inserted slot came from
        self._prefills = 0

    # ---- pure functions (jitted above) ------------------------------------------------------
    def _init_impl(self) -> DecodeState:
        b = self.slots
        return DecodeState(
            memory=self.model.init_memory(b, self.num_blocks), tokens=jnp.full((b,), self.pad_id, jnp.int32),
            keys=jnp.zeros((b, 2), jnp.uint32),
            sampling=SamplingParams(jnp.zeros((b,), jnp.float32), jnp.ones((b,), jnp.float32),
                                    jnp.ones((b, self.vocab_size), bool), jnp.zeros((b,), bool),
                                    jnp.zeros((b,), jnp.int32)),
            controls=idle_controls(b, self.vocab_size), history=empty_history(b, self.vocab_size))

    def _prefill_impl(self, params: Any, tokens: jax.Array, length: jax.Array, seed: jax.Array,
                      sampling: SamplingParams, controls: Controls, prompt: jax.Array) -> tuple[Prefix, SampleResult]:
        # tokens [1, T] int32 (T = bucket), length [] int32, seed [] uint32, sampling and controls batch 1
        # (device_rows), prompt [1, V] bool
        logits, memory = self.model.prefill(params, tokens, length[None])  # [1, V]
        rest, draw = split_key(seed_key(seed))
        history = History(prompt, jnp.zeros(prompt.shape, jnp.int32))
        result = sample_tokens(draw[None], logits, sampling, controls, history, self.native_sampling)
        history = record_tokens(history, result.token, jnp.ones((1,), bool))
        return Prefix(memory, result.token[0], rest, sampling, controls, history, logits), result

    def _resample_impl(self, prefix: Prefix, seed: jax.Array) -> tuple[Prefix, SampleResult]:
        # The same prompt's first token drawn with another seed's key: exactly what a prefill with `seed` draws.
        rest, draw = split_key(seed_key(seed))
        history = History(prefix.history.prompt, jnp.zeros_like(prefix.history.counts))
        result = sample_tokens(draw[None], prefix.logits, prefix.sampling, prefix.controls, history,
                               self.native_sampling)
        history = record_tokens(history, result.token, jnp.ones((1,), bool))
        return prefix._replace(token=result.token[0], key=rest, history=history), result

    def _insert_impl(self, prefix: Prefix, state: DecodeState, slot: jax.Array, table: jax.Array) -> DecodeState:
        return DecodeState(
            memory=self.model.insert(state.memory, prefix.memory, slot, table),
            tokens=state.tokens.at[slot].set(prefix.token),
            keys=state.keys.at[slot].set(prefix.key),
            sampling=jax.tree.map(lambda all_, one: all_.at[slot].set(one[0]), state.sampling, prefix.sampling),
            controls=jax.tree.map(lambda all_, one: all_.at[slot].set(one[0]), state.controls, prefix.controls),
            history=jax.tree.map(lambda all_, one: all_.at[slot].set(one[0]), state.history, prefix.history))

    def _generate_impl(self, params: Any, state: DecodeState, tables: jax.Array) -> tuple[DecodeState, SampleResult]:
        active = state.sampling.active  # [B]
        tile = self.row_tile
        # Tiles up to the last one holding an active slot; the ones after it are skipped on the device.
        last = jnp.max(jnp.where(active, jnp.arange(self.slots, dtype=jnp.int32), -1))
        tiles = None if tile == self.slots else (last + tile) // tile
        logits, memory = self.model.decode(params, state.tokens, state.memory, tables, active, tile, tiles)  # [B, V]
        rest, draw = split_keys(state.keys)
        result = sample_tokens(draw, logits, state.sampling, state.controls, state.history, self.native_sampling)
        # A free slot keeps its token and key (a later insert overwrites them).
        tokens = jnp.where(active, result.token, state.tokens)
        keys = jnp.where(active[:, None], rest, state.keys)
        history = record_penalized_tokens(state.history, result.token, active, state.controls)
        return DecodeState(memory, tokens, keys, state.sampling, state.controls, history), result

    def _extend_impl(self, params: Any, state: DecodeState, tokens: jax.Array, table: jax.Array, slot: jax.Array,
                     start: jax.Array, last: jax.Array) -> DecodeState:
        # tokens [1, C]; the slot stays inactive (decode steps skip it) until its last chunk
        _, memory = self.model.extend(params, tokens, state.memory, table, slot, start, last)
        return state._replace(memory=memory)

    def _extend_last_impl(self, params: Any, state: DecodeState, tokens: jax.Array, table: jax.Array,
                          slot: jax.Array, start: jax.Array, last: jax.Array, seed: jax.Array, one: SamplingParams,
                          controls: Controls, prompt: jax.Array) -> tuple[DecodeState, SampleResult]:
        logits, memory = self.model.extend(params, tokens, state.memory, table, slot, start, last)  # [1, V]
        rest, draw = split_key(seed_key(seed))
        history = History(prompt, jnp.zeros(prompt.shape, jnp.int32))
        result = sample_tokens(draw[None], logits, one, controls, history, self.native_sampling)
        history = record_tokens(history, result.token, jnp.ones((1,), bool))
        put = lambda all_, o: all_.at[slot].set(o[0])  # noqa: E731
        return DecodeState(memory, state.tokens.at[slot].set(result.token[0]), state.keys.at[slot].set(rest),
                           jax.tree.map(put, state.sampling, one), jax.tree.map(put, state.controls, controls),
                           jax.tree.map(put, state.history, history)), result

    def _free_impl(self, state: DecodeState, slot: jax.Array) -> DecodeState:
        # A free slot is skipped by the step; give it neutral inputs so nothing of the finished request lingers.
        sampling = SamplingParams(state.sampling.temperature.at[slot].set(0.0),
                                  state.sampling.top_p.at[slot].set(1.0),
                                  state.sampling.mask.at[slot].set(True), state.sampling.active.at[slot].set(False),
                                  state.sampling.num_top.at[slot].set(0))
        idle = idle_controls(1, self.vocab_size)
        return DecodeState(state.memory, state.tokens.at[slot].set(self.pad_id),
                           state.keys.at[slot].set(jnp.zeros((2,), jnp.uint32)), sampling,
                           jax.tree.map(lambda all_, o: all_.at[slot].set(o[0]), state.controls, idle),
                           jax.tree.map(lambda all_: all_.at[slot].set(jnp.zeros_like(all_[0])), state.history))

    def _set_mask_impl(self, state: DecodeState, slot: jax.Array, row: jax.Array) -> DecodeState:
        # row [V] bool: the slot's next-step mask (structured output), replacing the one its request began with
        return state._replace(sampling=state.sampling._replace(mask=state.sampling.mask.at[slot].set(row)))

    # ---- host API ---------------------------------------------------------------------------
    def bucket_for(self, length: int) -> int:
        i = bisect.bisect_left(self.buckets, length)
        if i == len(self.buckets):
            raise ValueError(f"prompt of {length} tokens exceeds the largest prefill bucket {self.buckets[-1]}")
        return self.buckets[i]

    def init_decode_state(self) -> DecodeState:
        """A fresh state: every slot free, every block free, the prefix cache empty."""
        self._reset_host()
        return self._init()

    def prefill(self, tokens: Sequence[int], sampling: SamplingSettings = GREEDY, *, seed: int,
                prompt_logprobs: int | None = None) -> tuple[Prefilled, StepOutput]:
        """Run one prompt; returns the prefix to insert and its first token (host arrays, batch 1), drawn as
        `sampling` says (its `top_logprobs` alternatives are computed for every token of the request; 0 skips
        them). `prompt_logprobs` (not None) also scores the prompt's tokens (StepOutput.prompt) in a second,
        full pass over the prompt."""
        n = len(tokens)
        padded = np.full((1, self.bucket_for(n)), self.pad_id, np.int32)
        padded[0, :n] = tokens
        prefix, result = self._prefill(self.params, padded, np.int32(n), np.uint32(seed),
                                       *self.device_rows(sampling), prompt_mask(tokens, self.vocab_size))
        out = StepOutput.from_device(result)
        if prompt_logprobs is not None:
            chosen, top, ids = jax.device_get(self._score(self.params, padded, TOP_K))
            out = dataclasses.replace(out, prompt=PromptLogprobs(chosen[:n - 1], ids[:n - 1], top[:n - 1]))
        self._prefills += 1
        return Prefilled(prefix, n, self._prefills), out

    def resample(self, prefilled: Prefilled, *, seed: int) -> tuple[Prefilled, StepOutput]:
        """Another sample of a prefilled prompt (n > 1 shares one prefill): the prefix with its first token drawn
        with `seed`'s key, bit-identical to `prefill(..., seed=seed)` of the same prompt and settings. Its
        samples share the prompt's full KV blocks once inserted; each gets its own last, partial block."""
        prefix, result = self._resample(prefilled.prefix, np.uint32(seed))
        return dataclasses.replace(prefilled, prefix=prefix), StepOutput.from_device(result)

    def device_rows(self, s: SamplingSettings) -> tuple[SamplingParams, Controls]:
        """One request's settings as the device's per-slot rows (host arrays, batch 1): what the jitted prefill
        takes and `insert` copies into the slot."""
        mask = build_mask(self.vocab_size, self.pad_id, s.allowed, s.blocked)
        sampling = SamplingParams(np.asarray([s.temperature], np.float32), np.asarray([s.top_p], np.float32),
                                  mask[None], np.ones((1,), bool), np.asarray([s.top_logprobs], np.int32))
        return sampling, controls_row(s, self.vocab_size)

    def insert(self, prefilled: Prefilled, state: DecodeState, slot: int) -> DecodeState:
        """Fill free `slot` with a prefilled prompt: blocks for it (the full ones shared with a slot holding a
        sample of the same prefill), its KV copied in, the slot decoding."""
        n, origin = prefilled.length, prefilled.origin
        sibling = next((s for s in range(self.slots) if s != slot and self._origin[s] == origin), None)
        self.kv.assign(slot, n, sibling, n if sibling is not None else 0)
        state = self._insert(prefilled.prefix, state, np.int32(slot), self.kv.table()[slot])
        self._positions[slot], self._live[slot], self._origin[slot] = n, True, origin
        return state

    def chunked(self, length: int) -> bool:
        """Whether a prompt of `length` tokens is prefilled in chunks (begin_prefill) rather than at once."""
        c = self.prefill_chunk
        return 0 < c < length and -(-length // c) * c <= self.sequence_len

    def begin_prefill(self, tokens: Sequence[int], sampling: SamplingSettings = GREEDY, *, slot: int,
                      seed: int) -> ChunkedPrefill:
        """Start prefilling a long prompt into free `slot`, one chunk per `prefill_next_chunk` call.

        The slot gets blocks for the whole prompt; leading blocks an earlier prompt computed (prefix caching)
        are taken as they are and prefilling starts after them. Chunks start at multiples of the chunk size
        and depend only on the prompt, so a block's bits never depend on what runs between them or on whether
        it came from the cache. Pad tokens inside a prompt are masked as keys only within one prefill call, so
        such prompts are not chunked (`chunked` is for prompts of real tokens)."""
        c, n = self.prefill_chunk, len(tokens)
        padded = np.full((-(-n // c) * c,), self.pad_id, np.int32)
        padded[:n] = tokens
        start = self.kv.assign_prompt(slot, padded[:n].tolist())
        self._live[slot], self._origin[slot] = False, -1
        return ChunkedPrefill(padded, n, slot, seed, sampling, next_start=start)

    def prefill_next_chunk(self, job: ChunkedPrefill, state: DecodeState) -> tuple[DecodeState, StepOutput | None]:
        """Run the job's next chunk; after the last one the slot is active and its first token returned."""
        c, start = self.prefill_chunk, job.next_start
        chunk = job.tokens[None, start:start + c]
        job.next_start += c
        table = self.kv.table()[job.slot]
        if job.next_start < job.length:
            state = self._extend(self.params, state, chunk, table, np.int32(job.slot), np.int32(start),
                                          np.int32(c - 1))
            self.kv.register(job.slot, job.tokens[:job.length].tolist(), job.next_start)
            return state, None
        state, result = self._extend_last(self.params, state, chunk, table, np.int32(job.slot),
                                                   np.int32(start), np.int32(job.length - 1 - start),
                                                   np.uint32(job.seed), *self.device_rows(job.sampling),
                                                   prompt_mask(job.tokens[:job.length], self.vocab_size))
        self.kv.register(job.slot, job.tokens[:job.length].tolist(), job.length)
        self._positions[job.slot], self._live[job.slot] = job.length, True
        return state, StepOutput.from_device(result)

    def blocks_short(self) -> int:
        """Blocks the next decode step needs beyond what is free or evictable (positive: preempt first)."""
        need = sum(max(0, self.kv.blocks_for(self._next_len(s)) - len(self.kv.blocks_of(s)))
                   for s in range(self.slots) if self._live[s])
        return max(0, need - self.kv.available())

    def blocks_needed(self, prompt_len: int, samples: int = 1) -> int:
        """Blocks admitting a prompt takes at most (each sample, room for its first decoded token)."""
        return samples * self.kv.blocks_for(min(prompt_len + 1, self.sequence_len))

    def free_blocks(self) -> int:
        """Blocks a new sequence can take now (free ones and cached ones nobody holds)."""
        return self.kv.available()

    def kv_usage(self) -> KVUsage:
        return self.kv.usage()

    def generate(self, state: DecodeState) -> tuple[DecodeState, PendingStep]:
        """Dispatch one decode step for the active slots; returns at once with the new state and the step's
        tokens on their way to the host (`PendingStep.get()`). Each active slot gets a block first if its
        next token starts one (blocks_short() must be 0; else kv_blocks.OutOfBlocks, RESOURCE_EXHAUSTED)."""
        live = [s for s in range(self.slots) if self._live[s]]
        for slot in live:
            self.kv.grow(slot, self._next_len(slot))
        state, result = self._generate(self.params, state, self.kv.table())
        for slot in live:
            self._positions[slot] = self._next_len(slot)
        return state, PendingStep(result)

    def free_slot(self, state: DecodeState, slot: int) -> DecodeState:
        """End the slot's sequence: its blocks go back (cached ones stay reusable), the slot stops decoding."""
        self.kv.release(slot)
        self._positions[slot], self._live[slot], self._origin[slot] = 0, False, -1
        return self._free(state, np.int32(slot))

    def set_slot_mask(self, state: DecodeState, slot: int, mask: np.ndarray) -> DecodeState:
        """Replace the allowed-token mask ([V] bool) of active `slot` for the next decode steps."""
        return self._set_mask(state, np.int32(slot), np.asarray(mask, dtype=bool))

    def _next_len(self, slot: int) -> int:
        """Positions the slot holds after its next decode step (its token is written at its position)."""
        return min(self._positions[slot] + 1, self.sequence_len)

    def compile_all(self) -> dict[str, float]:
        """Compile (by running) every bucket's prefill, insert and resample, the prefill chunks, the decode step and
        free_slot. Leaves every block free (init_decode_state starts afresh).

        Returns seconds per program; with a warm persistent compilation cache these are loads.
        """
        timings: dict[str, float] = {}
        start = time.monotonic()
        state = jax.block_until_ready(self.init_decode_state())
        timings["init"] = time.monotonic() - start
        for bucket in self.buckets:  # the prefix (and so insert) has the bucket's length
            start = time.monotonic()
            prefix, _ = self.prefill([self.eos_id] * bucket, COMPILE_SETTINGS, seed=0)
            timings[f"prefill_{bucket}"] = time.monotonic() - start
            start = time.monotonic()
            state = jax.block_until_ready(self.insert(prefix, state, 0))
            timings[f"insert_{bucket}"] = time.monotonic() - start
            start = time.monotonic()
            self.resample(prefix, seed=1)  # n > 1 draws its other first tokens with it
            timings[f"resample_{bucket}"] = time.monotonic() - start
        if self.prefill_chunk:
            start = time.monotonic()
            state = self._compile_extend(state)
            timings["prefill_chunks"] = time.monotonic() - start
        start = time.monotonic()
        state, pending = self.generate(state)
        pending.get()
        timings["generate"] = time.monotonic() - start
        start = time.monotonic()
        jax.block_until_ready(self.free_slot(state, 0))
        timings["free_slot"] = time.monotonic() - start
        log.info("compiled", extra={k: round(v, 3) for k, v in timings.items()})
        self._reset_host()
        return timings

    def _compile_extend(self, state: DecodeState) -> DecodeState:
        """Run a first and a last prefill chunk into an empty table (its writes land in the scratch block)."""
        c, slot = self.prefill_chunk, min(1, self.slots - 1)
        tokens = np.full((1, c), self.eos_id, np.int32)
        table = self.kv.table()[slot]
        state = self._extend(self.params, state, tokens, table, np.int32(slot), np.int32(0), np.int32(c - 1))
        state, result = self._extend_last(self.params, state, tokens, table, np.int32(slot), np.int32(0),
                                                   np.int32(c - 1), np.uint32(0), *self.device_rows(COMPILE_SETTINGS),
                                                   prompt_mask(tokens[0], self.vocab_size))
        jax.block_until_ready(result)
        return self._free(state, np.int32(slot))
