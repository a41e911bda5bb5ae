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
    """How a layer multiplies its token rows by a weight; chosen once per model (see `product`).

    FUSED_REDUCE (CPU): up to FUSED_MAX_ROWS rows, a multiply fused with a reduction over the contraction dim,
      int8 converted (and row-block scales applied) inside the fusion. On XLA-CPU this streams each int8 weight
      once for all rows and beats its dot, which materialises a float32 copy of the weight first, by ~8x at
      decode sizes. More rows (long prompts) use dot_general, which blocks for caches.
    DOT: one dot_general per product (dequantised first), where vendor matrix kernels are the fast path.

    Neither promises that a row's bits are independent of the other rows: XLA picks kernels, and their summation
    orders, by shape and even by a row's position in the batch. Batch invariance therefore comes from shapes
    that never vary: decode runs fixed tiles of rows and prefill one prompt at a time (GrokModel).
    """

    FUSED_REDUCE = "fused_reduce"
    DOT = "dot"


FUSED_MAX_ROWS = 64


def _reduce_rows(x: Array, w: Array) -> Array:
    """sum_k x[m, k] * w[n, k] as one fused reduction per output: [M, K] x [N, K] -> [M, N]. Several rows build
    the output [N, M], so the loop over rows is innermost and each weight element is read once for all of them;
    a single row takes the 2-D form (the broadcast one is pathological on XLA-CPU)."""
    if x.shape[0] == 1:
        return jnp.sum(x[0][None, :] * w, axis=-1)[None]
    return jnp.sum(w[:, None, :] * x[None, :, :], axis=-1).T


def _dot_rows(x: Array, w: Array) -> Array:
    """x [M, K] @ w[N, K]^T."""
    return jnp.einsum("mk,nk->mn", x, w.astype(x.dtype))


def product(x: Array, w: "QuantizedWeight | Array", products: Products) -> Array:
    """x [..., K] times a weight stored [N, K] (int8 QuantizedWeight, or a float array) -> [..., N] in x's dtype.

    float32 column-parallel int8 products apply the scales after the product; row-parallel ones and bfloat16
    dequantise first (in FUSED_REDUCE inside the fusion), so bfloat16 rounds as the reference does.
    """
    lead, k = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, k)
    fused = products is Products.FUSED_REDUCE and x.dtype == jnp.float32 and rows.shape[0] <= FUSED_MAX_ROWS
    if not fused:
        out = _dot_rows(rows, dequantize(w, x.dtype) if isinstance(w, QuantizedWeight) else w)
    elif not isinstance(w, QuantizedWeight):
        # A large float matrix (the unembedding) times one row: the matrix-vector kernel is the fastest read.
        big_single = rows.shape[0] == 1 and w.size >= 1 << 22
        out = _dot_rows(rows, w) if big_single else _reduce_rows(rows, w.astype(x.dtype))
    elif w.blocks == 1:
        out = _reduce_rows(rows, w.weight.astype(x.dtype)) * w.scales[0]
    else:
        out = _reduce_rows(rows, dequantize(w, x.dtype))
    return out.reshape(*lead, -1)


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
