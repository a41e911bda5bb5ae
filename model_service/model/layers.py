"""Numerical building blocks of the Grok-1 network: int8 weights, matmuls that dequantise inside, RMSNorm, RoPE.

Every function is pure; the haiku modules in transformer.py / moe.py fetch parameters and call these.
"""

from __future__ import annotations

import enum
from typing import NamedTuple

import jax
import jax.numpy as jnp

Array = jax.Array

RMS_EPS = 1e-5
ROPE_BASE = 10000
ATTN_LOGIT_CAP = 30.0
MASK_VALUE = -1e30


class QuantizedWeight(NamedTuple):
    """An int8 matrix kept 8-bit in device memory, stored output-major: [..., N, K] (the checkpoint's [..., K, N]
    transposed once at load).

    Every product then contracts the minor dimension of both operands: XLA-CPU fuses the int8 conversion into
    such a product, and computes each output row the same way whatever the number of rows (see `product`).
    `scales` is [..., blocks, N]: one block for column-parallel matrices (query/key/value, moe linear and
    linear_v), 8 consecutive blocks of the contraction dim for row-parallel ones (attention output, moe linear_1).
    """

    weight: Array  # int8 [..., N, K]
    scales: Array  # [..., blocks, N]

    @property
    def blocks(self) -> int:
        return self.scales.shape[-2]

    @property
    def shape(self) -> tuple[int, ...]:
        """The reference's logical shape [..., K, N] (haiku checks parameters against it)."""
        *lead, n, k = self.weight.shape
        return (*lead, k, n)


class ExpertStack(NamedTuple):
    """An MoE matrix [E, K, N] kept as one QuantizedWeight per expert: separate buffers, because XLA copies a
    slice of a stacked array before each expert's product (a 1.4 MB copy per expert matrix per step)."""

    experts: tuple[QuantizedWeight, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        return (len(self.experts), *self.experts[0].shape)


def dequantize(q: QuantizedWeight, dtype: jnp.dtype) -> Array:
    """dtype(int8) * dtype(scale) -> [..., N, K] (the reference's dequantisation, done per call)."""
    w = q.weight.astype(dtype)
    *lead, n, k = w.shape
    blocks = q.blocks
    scales = jnp.swapaxes(q.scales, -1, -2).astype(dtype)  # [..., N, blocks]
    return (w.reshape(*lead, n, blocks, k // blocks) * scales[..., None]).reshape(*lead, n, k)


class Products(enum.Enum):
    """How a layer multiplies its token rows by a weight; chosen once per program (see `product`).

    FUSED_REDUCE: a multiply fused with a reduction over the contraction dim, int8 converted inside. On XLA-CPU
      this streams each weight once for all rows and beats its dot by ~8x for int8 matrices at decode sizes; each
      output is one reduction whose order depends only on K, so a row's result is bit-identical for any number
      of rows (1, 2, ... 64).
    DOT: one dot_general per product (dequantised first for row-parallel weights and in bfloat16, as the
      reference does). XLA-CPU's dot gives a row the same bits for any M >= 2 but a different summation for a
      single row (it switches to a matrix-vector kernel), so a single row is padded to two.
    """

    FUSED_REDUCE = "fused_reduce"
    DOT = "dot"


def _reduce_rows(x: Array, w: Array) -> Array:
    """sum_k x[m, k] * w[n, k] as one fused reduction per output, weights streamed once: [M, K] x [N, K] -> [M, N].
    The output is built [N, M] so the loop over rows is innermost; a single row takes the 2-D form (the broadcast
    one is pathological on XLA-CPU). Both forms compute every output with the same reduction."""
    if x.shape[0] == 1:
        return jnp.sum(x[0][None, :] * w, axis=-1)[None]
    return jnp.sum(w[:, None, :] * x[None, :, :], axis=-1).T


def _dot_rows(x: Array, w: Array) -> Array:
    """x [M, K] @ w[N, K]^T with a single row padded to two (see Products.DOT)."""
    m = x.shape[0]
    if m == 1:
        x = jnp.concatenate([x, jnp.zeros_like(x)])
    return jnp.einsum("mk,nk->mn", x, w.astype(x.dtype))[:m]


def product(x: Array, w: "QuantizedWeight | Array", products: Products) -> Array:
    """x [..., K] times a weight stored [N, K] (int8 QuantizedWeight, or a float array) -> [..., N] in x's dtype.

    float32 int8 products apply the scales after the reduction (per column, or per row block and then summed
    over blocks); bfloat16 dequantises first so it rounds as the reference does.
    """
    lead, k = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, k)
    if not isinstance(w, QuantizedWeight):
        out = (_reduce_rows if products is Products.FUSED_REDUCE else _dot_rows)(rows, w.astype(x.dtype))
    elif x.dtype != jnp.float32 or (products is Products.DOT and w.blocks > 1):
        out = _dot_rows(rows, dequantize(w, x.dtype))
    elif w.blocks == 1:
        out = (_reduce_rows if products is Products.FUSED_REDUCE else _dot_rows)(rows, w.weight.astype(x.dtype))
        out = out * w.scales[0]
    else:
        out = _blocked_reduce_rows(rows, w)
    return out.reshape(*lead, -1)


def _blocked_reduce_rows(x: Array, q: QuantizedWeight) -> Array:
    """Row-parallel int8 [N, K] with per-block scales: one fused reduction per (output, block), then the block
    scales [blocks, N] and a sum over blocks. x [M, K] -> [M, N]."""
    n, k = q.weight.shape
    blocks = q.blocks
    w = q.weight.astype(x.dtype).reshape(n, blocks, k // blocks)
    xb = x.reshape(-1, blocks, k // blocks)  # [M, blocks, K / blocks]
    if x.shape[0] == 1:
        partial = jnp.sum(w * xb[0][None], axis=-1)[None]  # [1, N, blocks]
    else:
        partial = jnp.sum(w[:, None] * xb[None], axis=-1)  # [N, M, blocks]
        partial = jnp.swapaxes(partial, 0, 1)  # [M, N, blocks]
    return jnp.sum(partial * jnp.swapaxes(q.scales, 0, 1)[None], axis=-1)


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
