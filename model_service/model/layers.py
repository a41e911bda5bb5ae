"""Numerical building blocks of the Grok-1 network: int8 weights, matmuls that dequantise inside, RMSNorm, RoPE.

Every function is pure; the haiku modules in transformer.py / moe.py fetch parameters and call these.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

Array = jax.Array

RMS_EPS = 1e-5
ROPE_BASE = 10000
ATTN_LOGIT_CAP = 30.0
MASK_VALUE = -1e30


class QuantizedWeight(NamedTuple):
    """An int8 matrix kept 8-bit in device memory, stored in the layout its product reads fastest on CPU.

    `scales` is [..., blocks, N]: one block for column-parallel matrices (query/key/value, moe linear and
    linear_v), 8 consecutive row blocks of the contraction dim for row-parallel ones (attention output, moe
    linear_1). Column-parallel weights are stored [..., N, K] (the checkpoint's [..., K, N] transposed once at
    load) and scaled after the product; row-parallel ones keep the checkpoint's [..., K, N] and are
    dequantised inside the computation, so any mesh can apply their block scales.
    """

    weight: Array  # int8 [..., N, K] if blocks == 1 else [..., K, N]
    scales: Array  # [..., blocks, N]

    @property
    def transposed(self) -> bool:
        return self.scales.shape[-2] == 1

    @property
    def shape(self) -> tuple[int, ...]:
        """The reference's logical shape [..., K, N] (haiku checks parameters against it)."""
        *lead, a, b = self.weight.shape
        return (*lead, b, a) if self.transposed else (*lead, a, b)


class ExpertStack(NamedTuple):
    """An MoE matrix [E, K, N] kept as one QuantizedWeight per expert: separate buffers, because XLA copies a
    slice of a stacked array before each expert's product (a 1.4 MB copy per expert matrix per step)."""

    experts: tuple[QuantizedWeight, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        return (len(self.experts), *self.experts[0].shape)


def dequantize(q: QuantizedWeight, dtype: jnp.dtype) -> Array:
    """dtype(int8) * dtype(scale), in the stored layout (the reference's dequantisation, done per call)."""
    w = q.weight.astype(dtype)
    if q.transposed:
        return w * q.scales[..., 0, :, None].astype(dtype)
    *lead, k, n = w.shape
    blocks = q.scales.shape[-2]
    w = w.reshape(*lead, blocks, k // blocks, n) * q.scales[..., :, None, :].astype(dtype)
    return w.reshape(*lead, k, n)


SMALL_ROWS = 16  # up to this many rows, expert products use a fused multiply-reduce


def _rows_times_nk(x: Array, w: Array, small_rows: int) -> Array:
    """x [M, K] @ w[N, K]^T. For a few rows a fused multiply-reduce streams the int8 weight once and beats
    XLA-CPU's small-M matmul by ~2.5x on expert matrices; one row needs its own form (the broadcast one is
    pathological). Measured slower for the attention projections, which therefore pass small_rows=1."""
    m = x.shape[0]
    if m == 1:
        return jnp.sum(x[0][None, :] * w, axis=-1)[None]
    if m <= small_rows:
        return jnp.sum(x[:, None, :] * w[None], axis=-1)
    return jnp.einsum("mk,nk->mn", x, w)


def _row_times_blocked(x: Array, q: QuantizedWeight) -> Array:
    """One row x [1, K] (float32) times a row-parallel int8 [K, N]: per scale block a multiply-reduce over
    the converted int8 block, then the block scales [blocks, N] and a sum over blocks. Measured ~1.8x faster
    than dequantise-then-matmul for an expert's linear_1 at one row (the conversion fuses into the reduce)."""
    k, n = q.weight.shape
    blocks = q.scales.shape[0]
    w = q.weight.reshape(blocks, k // blocks, n).astype(jnp.float32)  # [blocks, K/blocks, N]
    partial = jnp.sum(x.reshape(blocks, k // blocks, 1) * w, axis=1)  # [blocks, N]
    return jnp.sum(partial * q.scales, axis=0)[None]


def _rows_times_blocked(x: Array, q: QuantizedWeight) -> Array:
    """A few rows x [M, K] (float32) times a row-parallel int8 [K, N]: one product per scale block with the
    converted int8 block, scaled [blocks, N] and summed over blocks. ~20% faster decode at batch 8 than
    dequantise-then-matmul (which materialises the dequantised matrix before each product)."""
    k, n = q.weight.shape
    blocks = q.scales.shape[0]
    w = q.weight.reshape(blocks, k // blocks, n).astype(jnp.float32)  # [blocks, K/blocks, N]
    partial = jnp.einsum("mbk,bkn->bmn", x.reshape(-1, blocks, k // blocks), w)  # [blocks, M, N]
    return jnp.sum(partial * q.scales[:, None, :], axis=0)


def qmatmul(x: Array, q: QuantizedWeight, small_rows: int = SMALL_ROWS) -> Array:
    """x [..., K] times a 2-D int8 weight -> [..., N] in x's dtype.

    float32 column-parallel: product with the converted int8 weight, scales applied per column after it.
    float32 row-parallel, up to SMALL_ROWS rows: block by block (`_row_times_blocked`, `_rows_times_blocked`),
    scales applied after each block's product.
    Otherwise: dequantise first (as the reference does), so bfloat16 reproduces its roundings and row-block
    scales work with any sharding of the contraction dim.
    """
    lead, k = x.shape[:-1], x.shape[-1]
    if x.dtype == jnp.float32 and q.transposed:
        y = _rows_times_nk(x.reshape(-1, k), q.weight.astype(jnp.float32), small_rows) * q.scales[0]
        return y.reshape(*lead, -1)
    if x.dtype == jnp.float32 and q.weight.ndim == 2 and x.size == k:
        return _row_times_blocked(x.reshape(1, k), q).reshape(*lead, -1)
    if x.dtype == jnp.float32 and q.weight.ndim == 2 and x.size <= SMALL_ROWS * k:
        return _rows_times_blocked(x.reshape(-1, k), q).reshape(*lead, -1)
    w = dequantize(q, x.dtype)
    return jnp.einsum("...k,nk->...n" if q.transposed else "...k,kn->...n", x, w)


def linear(x: Array, w: "QuantizedWeight | Array", small_rows: int = SMALL_ROWS) -> Array:
    """x [..., K] times a weight: int8 QuantizedWeight or a plain float [K, N] matrix."""
    if isinstance(w, QuantizedWeight):
        return qmatmul(x, w, small_rows)
    return jnp.dot(x, w.astype(x.dtype))


def rms_norm(x: Array, scale: Array) -> Array:
    """RMSNorm computed in float32 (eps 1e-5), returned in x's dtype."""
    xf = x.astype(jnp.float32)
    mean_sq = jnp.mean(jnp.square(xf), axis=-1, keepdims=True)
    return (scale.astype(jnp.float32) * (xf * jax.lax.rsqrt(mean_sq + RMS_EPS))).astype(x.dtype)


def rotate_half(x: Array) -> Array:
    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate((-x2, x1), axis=-1)


def apply_rope(x: Array, positions: Array) -> Array:
    """Rotary embedding with half rotation. x [B, T, H, D], positions [B, T] int."""
    dim = x.shape[-1]
    exponents = jnp.arange(0, dim, 2, dtype=jnp.float32)
    inv_freq = 1.0 / (ROPE_BASE ** (exponents / dim))  # [D/2]
    phase = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, D/2]
    phase = jnp.concatenate([phase, phase], axis=-1)[:, :, None, :]  # [B, T, 1, D]
    out = x * jnp.cos(phase) + rotate_half(x) * jnp.sin(phase)
    return out.astype(x.dtype)


def attention(q: Array, k: Array, v: Array, mask: Array, multiplier: float) -> Array:
    """Grouped-query attention. q [B, T, Hq, D]; k, v [B, Hkv, S, D]; mask [B, T, S] bool -> [B, T, Hq*D].

    Query head h reads kv head h // (Hq / Hkv). Scores are scaled by `multiplier` (no 1/sqrt(D)), capped
    with 30*tanh(x/30), masked with -1e30 and soft-maxed in float32.
    """
    b, t, hq, d = q.shape
    hkv = k.shape[1]
    qg = q.reshape(b, t, hkv, hq // hkv, d)
    logits = jnp.einsum("bthgd,bhsd->bhgts", qg, k).astype(jnp.float32)
    logits = logits * multiplier
    logits = ATTN_LOGIT_CAP * jnp.tanh(logits / ATTN_LOGIT_CAP)
    logits = jnp.where(mask[:, None, None, :, :], logits, MASK_VALUE)
    weights = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
    out = jnp.einsum("bhgts,bhsd->bthgd", weights, v)
    return out.reshape(b, t, hq * d)
