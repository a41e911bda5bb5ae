"""Token sampling as the reference's `sample_token` defines it, one draw after another (the CPU; the building blocks
are in sampling_ops.py, the accelerators' step-wide form in sampling_vectorised.py).

Every slot carries its own temperature, nucleus mass, token mask, number of alternatives and PRNG key,
and each slot's draw is computed by a per-slot function mapped over the slots, so a request's tokens
never depend on what the other slots hold (batch invariance). The order of operations is the
reference's: divide by the temperature, mask disallowed ids with -1e10, nucleus-filter, draw with
`jax.random.categorical`; the reported probability and top-k alternatives come from the softmax of the
filtered logits. Temperature 0 is greedy (argmax of the filtered logits; probabilities then use
temperature 1). Work nobody asked for is skipped: free slots, the nucleus search at top_p 1, the draw
of a greedy slot, the alternatives of a slot that wants none, the noise of entries the filters removed
(with the native kernels: `categorical_kept`); one exponential pass serves the nucleus search and the
reported probabilities.

The controls (logit_bias, penalties, top-k, min-p, min_tokens: sampling_settings.py for their order) are applied
when `sample_tokens` gets their per-slot settings, each under its own per-slot condition, so a slot that
uses none of them runs exactly the steps above.

Key schedule (the reference's): `key = PRNGKey(seed)`, `(rest, draw) = split(key)`; the first token
is drawn with `draw`; before each later token the slot's `rest` is split again the same way.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from model_service.logits_processing import (
    Controls,
    History,
    add_bias,
    apply_penalties,
    hold_ends,
    min_p_filter,
    penalized,
    top_k_filter,
)
from model_service.sampling_ops import (  # noqa: F401 - the building blocks, imported from here by their users
    FLOAT32_MAX,
    KEPT_FLOOR,
    KEPT_MARGIN,
    KEPT_SIZES,
    MASKED_LOGIT,
    SORT_MAX_VOCAB,
    TOP_K,
    SampleResult,
    SamplingParams,
    _gumbel_at,
    _search_threshold,
    _search_threshold_probs,
    _sort_threshold,
    categorical,
    categorical_kept,
    first_argmax,
    gumbel_noise,
    seed_key,
    split_key,
    split_keys,
    top_p_filter,
)
from model_service.sampling_settings import build_mask  # noqa: F401 - the engine builds masks
from model_service.sampling_vectorised import sample_batched
from model_service.ops.base import Nucleus
from model_service.ops.xla import SearchNucleus

SEARCH = SearchNucleus()  # XLA's forms: the default


def _sample_active(key: jax.Array, logits: jax.Array, temperature: jax.Array, top_p: jax.Array, mask: jax.Array,
                   num_top: jax.Array, extra: SlotControls | None = None, nucleus: Nucleus = SEARCH) -> SampleResult:
    """A slot that uses no control runs the reference's steps alone (one condition for all of them: the off path
    carries no per-control branches or buffers); otherwise each control is applied under its own condition."""
    if extra is None:
        return _sample_filtered(key, logits, temperature, top_p, mask, num_top, nucleus=nucleus)
    c, v = extra.controls, logits.shape[-1]
    used = (jnp.any(c.bias_ids < v) | penalized(c)
            | ((c.top_k > 0) & (c.top_k < v)) | (c.min_p > 0) | extra.barred)
    return jax.lax.cond(used, lambda: _sample_filtered(key, logits, temperature, top_p, mask, num_top, extra, nucleus),
                        lambda: _sample_filtered(key, logits, temperature, top_p, mask, num_top, nucleus=nucleus))


def _sample_filtered(
    key: jax.Array,  # [2] uint32
    logits: jax.Array,  # [V] float32
    temperature: jax.Array,  # [] float32
    top_p: jax.Array,  # [] float32
    mask: jax.Array,  # [V] bool
    num_top: jax.Array,  # [] int32
    extra: SlotControls | None = None,
    nucleus: Nucleus = SEARCH,  # a large vocabulary's nucleus threshold and the draw (the backend's: Ops.sampling)
) -> SampleResult:
    raw = logits
    if extra is not None:  # bias and penalties act on the raw logits (sampling_settings.py: order of operations)
        logits = _biased_and_penalized(logits, extra)
        with jax.named_scope("min_tokens"):
            mask = jax.lax.cond(extra.barred, lambda m: hold_ends(m, extra.controls.ends), lambda m: m, mask)
    greedy = temperature <= 0
    # Greedy requests report probabilities at temperature 1 (proto: Token.probability).
    scale = jnp.where(greedy, jnp.float32(1), temperature).astype(logits.dtype)
    # Clipped to finite: a tiny temperature or repetition_penalty (both valid) overflows a logit to inf,
    # and inf - max(row) is NaN in every probability. Identity on finite values, so exact; fused here.
    row = jnp.where(mask, jnp.clip(logits / scale, -FLOAT32_MAX, FLOAT32_MAX), MASKED_LOGIT)  # [V]
    # softmax(row) = exp(row - max) / sum; the nucleus keeps the max, so the filtered softmax has the same
    # exponentials with the removed ones exactly 0 (exp(-1e10 - max) underflows to 0 as well).
    exps = jnp.exp(row - jnp.max(row))  # [V]
    if extra is not None:  # top-k keeps the max too, so the same argument holds after it
        k = extra.controls.top_k
        with jax.named_scope("top_k"):
            row, exps = jax.lax.cond((k > 0) & (k < row.shape[-1]),
                                     lambda o: top_k_filter(o[0], o[1], k, MASKED_LOGIT), lambda o: o, (row, exps))

    def filtered(operands: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        r, e = operands
        p = top_p.astype(r.dtype)
        if r.shape[-1] <= SORT_MAX_VOCAB:
            threshold = _sort_threshold(r[None], p.reshape(1, 1))[0, 0]
        else:
            threshold = nucleus.threshold(r, e / jnp.sum(e), p)
        kept = r >= threshold
        return jnp.where(kept, r, MASKED_LOGIT), jnp.where(kept, e, 0.0)

    # Both shortcuts are exact: top_p = 1 keeps every logit, and a greedy slot takes the argmax.
    with jax.named_scope("nucleus"):
        row, exps = jax.lax.cond(top_p < 1, filtered, lambda operands: operands, (row, exps))
    if extra is not None:
        min_p = extra.controls.min_p
        with jax.named_scope("min_p"):
            row, exps = jax.lax.cond(min_p > 0, lambda o: min_p_filter(o[0], o[1], min_p, MASKED_LOGIT),
                                     lambda o: o, (row, exps))
    with jax.named_scope("draw"):
        drawn = jax.lax.cond(greedy, lambda r: first_argmax(r), lambda r: nucleus.draw(key, r), row)
    with jax.named_scope("probabilities"):
        total = jnp.sum(exps)  # the softmax of the filtered row is exps / total, divided where it is read
        k = min(TOP_K, row.shape[-1])
        top_probs, top_ids = jax.lax.cond(
            num_top > 0, lambda e: tuple(jax.lax.top_k(e / total, k)),
            lambda e: (jnp.zeros((k,), e.dtype), jnp.zeros((k,), jnp.int32)), exps)
    bad = ~jnp.all(jnp.isfinite(raw))
    # The same division as the row's (XLA turns it into a product by 1 / total), computed where it is read.
    return SampleResult(drawn, (exps / total)[drawn], top_ids.astype(jnp.int32), top_probs, bad)


def _biased_and_penalized(logits: jax.Array, extra: SlotControls) -> jax.Array:
    """logit_bias, then the penalties, each skipped when the slot does not use it (exact: identity)."""
    c = extra.controls
    with jax.named_scope("logit_bias"):
        logits = jax.lax.cond(jnp.any(c.bias_ids < logits.shape[-1]), lambda x: add_bias(x, c.bias_ids, c.bias),
                              lambda x: x, logits)
    def penalise(x: jax.Array) -> jax.Array:  # the slot's history rows are read here only, where they are used
        counts = extra.history.counts[extra.row]  # plus the tokens drawn before this one in the same step (drafts)
        if extra.pending is not None:
            counts = counts.at[extra.pending].add(1, mode="drop")
        return apply_penalties(x, extra.history.prompt[extra.row], counts, c.repetition, c.presence, c.frequency)

    with jax.named_scope("penalties"):
        return jax.lax.cond(penalized(c), penalise, lambda x: x, logits)


class SlotControls(NamedTuple):
    """One slot's controls (its row of `Controls`) and where its token history is: row `row` of `history`, read only
    by the penalties (a [V] copy of each per draw otherwise)."""

    controls: Controls
    history: History  # every slot's: prompt [S, V] bool, counts [S, V] int32
    row: jax.Array  # [] int32
    pending: jax.Array | None = None  # [K] int32 tokens this draw's history has beyond counts (V: none)
    barred: jax.Array | bool = False  # [] bool: min_tokens bars this draw from the slot's ending ids


def _idle_result(v: int) -> SampleResult:
    k = min(TOP_K, v)
    return SampleResult(jnp.int32(0), jnp.float32(0), jnp.zeros((k,), jnp.int32), jnp.zeros((k,), jnp.float32),
                        jnp.bool_(False))


def sample_tokens(keys: jax.Array, logits: jax.Array, params: SamplingParams, controls: Controls | None = None,
                  history: History | None = None, nucleus: Nucleus = SEARCH, index: jax.Array | None = None,
                  used: jax.Array | None = None, vectorised: bool = False,
                  pending: jax.Array | None = None, chain: jax.Array | None = None) -> SampleResult:
    """Draw one token per entry. keys [B, 2] (draw keys), logits [B, V] float32.

    Entries are processed one after another (a loop, not vmap) so that the per-entry branches are real: an
    unused entry computes nothing (not even the copy of its row), a greedy one skips the nucleus filter
    and the random draw (top_p = 1 skips the filter too; both shortcuts are exact), and an entry's result
    is computed exactly as if it were alone. `controls` and `history` (both or neither) add the controls of
    sampling_settings.py; without them the reference's sampler alone is compiled. `nucleus` (the backend's,
    Ops.sampling: XLA's search by default, ops.native.KernelNucleus with the native kernels on one device) finds
    large vocabularies' nucleus thresholds and draws from the filtered row; one whose `vectorised` is set
    (ops.xla.BatchedDraws, the accelerators') asks for the form below. `index` [B] int32 (default: entry i)
    names the row of `params`, `controls` and `history` that entry i draws with (the engine's per-slot settings);
    `used` [B] bool (default: params.active at that row) says which entries draw at all. `vectorised` (accelerators, `nucleus` unused) computes
    every entry at once instead, one stage at a time, each stage only when some entry uses it (a greedy step
    is one masked argmax per entry; sampling_vectorised.py): each entry's token is the same function of its row.
    `pending` [B, K] int32 (V: none) are tokens entry i's penalties count beyond its row of `history` (drafts
    drawn before it in the same step, speculative decoding). `chain` [B] int32 (default 0) says which of its slot's
    draws in this step entry i is (speculative decoding verifies several): min_tokens bars it from the slot's
    ending ids while that is below the draws the slot has left to bar (`Controls.min_left`).
    """
    assert (controls is None) == (history is None)
    b, v = logits.shape
    logits = logits.astype(jnp.float32)
    rows = jnp.arange(b, dtype=jnp.int32) if index is None else index
    draws = jnp.take(params.active, rows) if used is None else used

    def one(i: jax.Array) -> SampleResult:  # entry i's settings are read only here, inside its used branch
        j = rows[i]
        if controls is not None:
            c = jax.tree.map(lambda a: a[j], controls)
            extra = SlotControls(c, history, j, None if pending is None else pending[i],
                                 c.min_left > (0 if chain is None else chain[i]))
        else:
            extra = None
        return _sample_active(keys[i], logits[i], params.temperature[j], params.top_p[j], params.mask[j],
                              params.num_top[j], extra, nucleus)

    def body(i: jax.Array, out: SampleResult) -> SampleResult:
        res = jax.lax.cond(draws[i], one, lambda _: _idle_result(v), i)
        return jax.tree.map(lambda all_, r: all_.at[i].set(r), out, res)

    # one batched computation per stage, each only when a draw uses it (sampling_vectorised.py)
    if vectorised or getattr(nucleus, "vectorised", False):
        return sample_batched(keys, logits, params, controls, history, rows, draws, pending, chain)
    zeros = jax.tree.map(lambda r: jnp.zeros((b,) + r.shape, r.dtype), _idle_result(v))
    # Entries after the last used one are idle: the loop stops there (a step of one draw on a many-slot engine
    # runs one iteration, not one per slot).
    count = jnp.max(jnp.where(draws, jnp.arange(1, b + 1, dtype=jnp.int32), 0))
    return jax.lax.fori_loop(0, count, body, zeros)
