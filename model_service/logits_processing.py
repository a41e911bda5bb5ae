"""The device side of the sampling controls in sampling_settings.py: per-slot settings, token history, filters.

Everything here works on one slot's row (the sampler maps over slots), so a request's result never
depends on its neighbours. Each control is applied under a `lax.cond` on its own "on" flag, so a slot
that uses none of them computes exactly the reference's sampler (bit-identical) and pays nothing but
the flags.

Penalties need, per slot, which tokens the prompt holds and how often each token was generated. Both
live on the device in the decode state (`History`): a [slots, V] bool prompt mask and [slots, V] int32
counts, updated inside the jitted step by one scatter of the slots' new tokens. At Grok-1's V = 131,072
that is 640 KB per slot (20 MB at 32 slots), small beside one slot's KV memory; a compact form (a list of
the slot's tokens) would make every penalized step scan the whole sequence instead of reading one row.
logit_bias is kept sparse ([slots, MAX_LOGIT_BIAS] ids and values) rather than as a dense [slots, V] row.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from model_service.sampling_settings import MAX_ENDS, MAX_LOGIT_BIAS, SamplingSettings


class Controls(NamedTuple):
    """Per-slot control settings; every leaf leads with the slot axis [B]."""

    top_k: jax.Array  # [B] int32, 0 = off
    min_p: jax.Array  # [B] float32, 0 = off
    repetition: jax.Array  # [B] float32, 1 = off
    presence: jax.Array  # [B] float32, 0 = off
    frequency: jax.Array  # [B] float32, 0 = off
    bias_ids: jax.Array  # [B, MAX_LOGIT_BIAS] int32, V marks an unused entry
    bias: jax.Array  # [B, MAX_LOGIT_BIAS] float32
    min_left: jax.Array  # [B] int32, draws still barred from an ending id (min_tokens less the draws made)
    ends: jax.Array  # [B, MAX_ENDS] int32, the ids min_tokens bars, V marks an unused entry


class History(NamedTuple):
    """What the penalties read, per slot."""

    prompt: jax.Array  # [B, V] bool, the token occurs in the prompt
    counts: jax.Array  # [B, V] int32, times the token was generated so far


def controls_row(c: SamplingSettings, vocab_size: int, drawn: int = 0) -> Controls:
    """Host arrays of one request's controls (the control fields of its settings), batch 1 (top_k -1 is stored
    as 0: both mean off), for a sample that has made `drawn` draws already (a preempted one resuming)."""
    ids = np.full((1, MAX_LOGIT_BIAS), vocab_size, np.int32)
    bias = np.zeros((1, MAX_LOGIT_BIAS), np.float32)
    for i, (token, value) in enumerate(c.logit_bias):
        ids[0, i], bias[0, i] = token, value
    ends = np.full((1, MAX_ENDS), vocab_size, np.int32)
    ends[0, :len(c.ends)] = c.ends
    f32 = lambda x: np.asarray([x], np.float32)  # noqa: E731
    return Controls(np.asarray([max(c.top_k, 0)], np.int32), f32(c.min_p), f32(c.repetition_penalty),
                    f32(c.presence_penalty), f32(c.frequency_penalty), ids, bias,
                    np.asarray([max(c.min_tokens - drawn, 0) if c.ends else 0], np.int32), ends)


def idle_controls(slots: int, vocab_size: int) -> Controls:
    """Every control off for `slots` slots (device arrays)."""
    return Controls(jnp.zeros((slots,), jnp.int32), jnp.zeros((slots,), jnp.float32),
                    jnp.ones((slots,), jnp.float32), jnp.zeros((slots,), jnp.float32),
                    jnp.zeros((slots,), jnp.float32), jnp.full((slots, MAX_LOGIT_BIAS), vocab_size, jnp.int32),
                    jnp.zeros((slots, MAX_LOGIT_BIAS), jnp.float32), jnp.zeros((slots,), jnp.int32),
                    jnp.full((slots, MAX_ENDS), vocab_size, jnp.int32))


def penalized(controls: Controls) -> jax.Array:
    """[B] bool: the slots whose penalties read their token counts (the only readers of History.counts)."""
    return (controls.repetition != 1) | (controls.presence != 0) | (controls.frequency != 0)


def hold_ends(mask: jax.Array, ends: jax.Array) -> jax.Array:
    """min_tokens: `mask` [V] bool without the ending ids [MAX_ENDS] (V: unused), unless that leaves nothing."""
    held = mask.at[ends].set(False, mode="drop")
    return jnp.where(jnp.any(held), held, mask)


def add_bias(logits: jax.Array, ids: jax.Array, bias: jax.Array) -> jax.Array:
    """logits [V] + bias at ids [K] (ids == V are unused entries, dropped)."""
    return logits.at[ids].add(bias, mode="drop")


def apply_penalties(logits: jax.Array, prompt: jax.Array, counts: jax.Array, repetition: jax.Array,
                    presence: jax.Array, frequency: jax.Array) -> jax.Array:
    """vLLM's penalties on one row: logits [V] float32, prompt [V] bool, counts [V] int32."""
    generated = counts > 0
    seen = prompt | generated
    logits = jnp.where(seen, jnp.where(logits > 0, logits / repetition, logits * repetition), logits)
    logits = logits - frequency * counts.astype(logits.dtype)
    return logits - presence * generated.astype(logits.dtype)


def _monotone_keys(x: jax.Array) -> jax.Array:
    """uint32 keys ordered as the float32 values are (see sampling._search_threshold_probs)."""
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    sign = jnp.uint32(0x80000000)
    return jnp.where(bits >= sign, ~bits, bits | sign)


def kth_largest(row: jax.Array, k: jax.Array) -> jax.Array:
    """The k-th largest value of row [V] (1 <= k <= V), exactly, by a binary search over the uint32 image of
    the floats: each probe counts the values at or above it (a full sort of 131,072 logits costs ~40 ms on
    CPU, 32 probes ~1.5)."""
    keys = _monotone_keys(row)

    def probe(_: int, bounds: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        lo, hi = bounds  # invariant: count(keys >= lo) >= k; the answer is in [lo, hi]
        mid = lo + (hi - lo + 1) // 2
        enough = jnp.sum((keys >= mid).astype(jnp.int32)) >= k
        return jnp.where(enough, mid, lo), jnp.where(enough, hi, mid - 1)

    lo, _ = jax.lax.fori_loop(0, 32, probe, (jnp.min(keys), jnp.max(keys)))
    sign = jnp.uint32(0x80000000)
    return jax.lax.bitcast_convert_type(jnp.where(lo >= sign, lo ^ sign, ~lo), row.dtype)


def top_k_filter(row: jax.Array, exps: jax.Array, k: jax.Array, masked: float) -> tuple[jax.Array, jax.Array]:
    """Keep the logits >= the k-th largest (vLLM keeps ties); row [V] tempered logits, exps [V] their
    exponentials (zeroed where removed)."""
    kept = row >= kth_largest(row, k)
    return jnp.where(kept, row, masked), jnp.where(kept, exps, 0.0)


def min_p_filter(row: jax.Array, exps: jax.Array, min_p: jax.Array,
                 masked: float) -> tuple[jax.Array, jax.Array]:
    """Keep tokens whose probability is >= min_p x the largest probability (vLLM's min-p)."""
    probs = exps / jnp.sum(exps)
    kept = probs >= min_p * jnp.max(probs)
    return jnp.where(kept, row, masked), jnp.where(kept, exps, 0.0)
