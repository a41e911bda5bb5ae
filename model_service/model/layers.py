"""Numerical building blocks of the Grok-1 network: int8 weights, matmuls that dequantise inside, RMSNorm, RoPE.

Every function is pure; the haiku modules in transformer.py / moe.py fetch parameters and call these.
"""

from __future__ import annotations

import enum

import jax
import jax.numpy as jnp

from model_service.kv_memory import block_size_of, read_blocks
import model_service.model.transcendental as transcendental
from model_service.model.packed import PackedWeight, packed_product
from model_service.model.weights import ExpertStack, QuantizedWeight  # noqa: F401 - also imported from here

Array = jax.Array

RMS_EPS = 1e-5
ROPE_BASE = 10000
ATTN_LOGIT_CAP = 30.0
MASK_VALUE = -1e30


def dequantize(q: QuantizedWeight, dtype: jnp.dtype) -> Array:
    """dtype(int8) * dtype(scale), in the stored layout (the reference's dequantisation, done per call)."""
    w = q.weight.astype(dtype)
    if q.transposed:
        return w * q.scales[..., 0, :, None].astype(dtype)
    *lead, k, n = w.shape
    blocks = q.blocks
    w = w.reshape(*lead, blocks, k // blocks, n) * q.scales[..., :, None, :].astype(dtype)
    return w.reshape(*lead, k, n)


class Products(enum.Enum):
    """How a layer multiplies its token rows by a weight; chosen once per model (see `product`).

    FUSED_REDUCE (CPU): up to FUSED_MAX_ROWS rows, a multiply fused with a reduction over the contraction dim,
      int8 converted (and row-block scales applied) inside the fusion. On XLA-CPU this streams each int8 weight
      once for all rows and beats its dot, which materialises a float32 copy of the weight first, by ~8x at
      decode sizes. More rows (long prompts) use dot_general, which blocks for caches.
    DOT: one dot_general per product (dequantised first), where vendor matrix kernels are the fast path.
    EXACT (accelerators, float32): DOT carried to float32 accuracy on a matrix unit that multiplies in bfloat16
      (TPU): an int8 weight is exact in bfloat16, so the rows are split into three bfloat16 parts whose sum is the
      float32 row (split_rows) and all three meet the widened weight in one product with float32 accumulation,
      the scales after; every other product in the program runs at XLA's highest precision
      (GrokModel.precision). The faithful mode, at ~1x the reads of bfloat16 where a step is bound by them.

    DOT_INT8 (accelerators, an opt-in: `--products int8`): the rows rounded to int8 before they meet an int8
      weight (one scale per row and per row block of the weight: the row's largest magnitude over 127), int8 times
      int8 with int32 accumulation (a TPU's matrix unit runs int8 at twice its bfloat16 rate), then the rows' and
      the weight's scales in float32. Changes results (the rounding of the rows); weights that are not int8 (the
      table, the router) meet the rows as in DOT.

    NATIVE (CPU, float32): the expert matrices are packed at load (packed.PackedWeight) and multiplied by the
      native kernel (model_service.kernels), whose rows are independent of each other by construction; every
      other product is taken as in FUSED_REDUCE.
    NATIVE_INT8: NATIVE with the rows rounded to int8 (per 32 values, kernels.matmul(activations="int8")) before
      they meet an int8 weight: 2-3x the arithmetic rate from 8 rows on, at the cost of that rounding (an opt-in;
      the router keeps float32 rows; the table is rounded to int8 too, packed.pack_table). Still row-invariant:
      a row's bits depend only on that row.

    Neither XLA form promises that a row's bits are independent of the other rows: XLA picks kernels, and their
    summation orders, by shape and even by a row's position in the batch. Batch invariance therefore comes from
    shapes that never vary: decode runs fixed tiles of rows and prefill one prompt at a time (GrokModel).
    """

    FUSED_REDUCE = "fused_reduce"
    DOT = "dot"
    EXACT = "exact"
    NATIVE = "native"
    NATIVE_INT8 = "native_int8"
    DOT_INT8 = "dot_int8"

    @property
    def native(self) -> bool:
        """Whether the weights are packed for the native kernel (NATIVE or NATIVE_INT8)."""
        return self in (Products.NATIVE, Products.NATIVE_INT8)

    @property
    def int8(self) -> bool:
        """Whether rows meet int8 weights as int8, and the table is rounded to int8 (NATIVE_INT8)."""
        return self is Products.NATIVE_INT8


FUSED_MAX_ROWS = 64


def _reduce_rows(x: Array, w: Array) -> Array:
    """sum_k x[m, k] * w[n, k] as one fused reduction per output: [M, K] x [N, K] -> [M, N].

    Measured on XLA-CPU (a gelu-gated expert at 8 rows): this form 2.3 ms; the [N, M]-ordered one 86 ms (it
    materialises the broadcast activations); dot_general 4.5 ms. A single row takes the 2-D form (the
    broadcast one is pathological there)."""
    if x.shape[0] == 1:
        return jnp.sum(x[0][None, :] * w, axis=-1)[None]
    return jnp.sum(x[:, None, :] * w[None, :, :], axis=-1)


def _blocked_row(x: Array, q: QuantizedWeight) -> Array:
    """One row x [1, K] times a row-parallel int8 [K, N]: per scale block a fused reduction over that block's
    rows of the converted weight (vectorised across N), then the block scales [blocks, N] and a sum over blocks."""
    k, n = q.weight.shape
    blocks = q.blocks
    w = q.weight.astype(x.dtype).reshape(blocks, k // blocks, n)
    partial = jnp.sum(x.reshape(blocks, k // blocks, 1) * w, axis=1)  # [blocks, N]
    return jnp.sum(partial * q.scales, axis=0)[None]


def _dot_rows(x: Array, w: Array, transposed: bool = True) -> Array:
    """x [M, K] @ w, stored [N, K] (transposed) or [K, N]."""
    return jnp.einsum("mk,nk->mn" if transposed else "mk,kn->mn", x, w.astype(x.dtype))


def split_rows(x: Array) -> Array:
    """float32 x [M, K] -> [3, M, K] bfloat16 parts (hi, mid, lo) whose float32 sum is x to float32's precision:
    each part carries the next 8 bits of the significand. Each part is rounded with reduce_precision, not by a
    float32 -> bfloat16 -> float32 round trip: with excess precision allowed (XLA's default on TPU and GPU) the
    compiler may drop such a round trip as a no-op (SimplifyFPConversions), leaving rest = 0 and the product one
    bfloat16 pass (tests/model/test_exact_products.py)."""
    hi = jax.lax.reduce_precision(x, exponent_bits=8, mantissa_bits=7)  # x rounded to bfloat16, as float32
    rest = x - hi
    mid = jax.lax.reduce_precision(rest, exponent_bits=8, mantissa_bits=7)
    return jnp.stack([hi, mid, rest - mid]).astype(jnp.bfloat16)  # hi and mid exact; lo rounded once


def _exact_rows(x: Array, w: Array, spec: str) -> Array:
    """float32 rows x [M, ...] times a weight exact in bfloat16 (int8 values, a bfloat16 table), as one product of
    the three bfloat16 parts of the rows with float32 accumulation, the parts' results added smallest first.
    `spec` is the einsum of one part (its first operand's leading axis is the rows)."""
    parts = jnp.einsum("p" + spec.replace("->", "->p"), split_rows(x), w.astype(jnp.bfloat16),
                       preferred_element_type=jnp.float32, precision=jax.lax.Precision.DEFAULT)
    return parts[0] + (parts[1] + parts[2])


def _exact_product(x: Array, w: "QuantizedWeight | Array") -> Array:
    """Products.EXACT's product of float32 rows x [M, K]: int8 weights (and bfloat16 ones) through _exact_rows,
    float32 weights [N, K] at the highest precision."""
    if not isinstance(w, QuantizedWeight):
        if w.dtype == jnp.bfloat16:
            return _exact_rows(x, w, "mk,nk->mn")
        return jnp.einsum("mk,nk->mn", x, w.astype(x.dtype), precision=jax.lax.Precision.HIGHEST)
    if w.transposed:
        return _exact_rows(x, w.weight, "mk,nk->mn") * w.scales[0]
    k, n = w.weight.shape
    size = k // w.blocks
    # One plain product per row block (a batched bfloat16 product with float32 results has no CPU kernel), each
    # times its block's scales, added in block order.
    out = None
    for b in range(w.blocks):
        part = _exact_rows(x[:, b * size:(b + 1) * size], w.weight[b * size:(b + 1) * size], "mk,kn->mn")
        out = part * w.scales[b] if out is None else out + part * w.scales[b]
    return out


def quantize_rows(x: Array, blocks: int = 1) -> tuple[Array, Array]:
    """Rows x [M, K] rounded to int8, each of their `blocks` consecutive blocks of K / blocks values on its own
    scale (its largest magnitude over 127; 1 for a block of zeros) -> (int8 [M, K], float32 scales [M, blocks])."""
    m, k = x.shape
    parts = x.astype(jnp.float32).reshape(m, blocks, k // blocks)
    top = jnp.max(jnp.abs(parts), axis=-1)
    scale = jnp.where(top > 0, top / 127.0, 1.0)
    q = jnp.clip(jnp.round(parts / scale[..., None]), -127, 127).astype(jnp.int8)
    return q.reshape(m, k), scale


def _int_dot(spec: str, a: Array, b: Array) -> Array:
    # int8 operands, int32 accumulation; precision said explicitly, as the model traces under "highest"
    return jnp.einsum(spec, a, b, preferred_element_type=jnp.int32, precision=jax.lax.Precision.DEFAULT)


def int8_product(x: Array, q: QuantizedWeight) -> Array:
    """Products.DOT_INT8: rows x [M, K] rounded to int8 (quantize_rows, one scale per row block of a row-parallel
    weight, one per row otherwise) times the int8 weight with int32 sums, then both scales -> float32 [M, N]."""
    if q.transposed:
        xq, xs = quantize_rows(x)
        return _int_dot("mk,nk->mn", xq, q.weight).astype(jnp.float32) * xs * q.scales[0].astype(jnp.float32)
    k, n = q.weight.shape
    blocks = q.blocks
    xq, xs = quantize_rows(x, blocks)
    partial = _int_dot("mbk,bkn->bmn", xq.reshape(-1, blocks, k // blocks), q.weight.reshape(blocks, k // blocks, n))
    scaled = partial.astype(jnp.float32) * xs.T[:, :, None] * q.scales[:, None, :].astype(jnp.float32)
    return jnp.sum(scaled, axis=0)


def _blocked_dot_rows(x: Array, q: QuantizedWeight) -> Array:
    """Several rows times a row-parallel int8 [K, N]: one dot per scale block with the converted block, then
    the block scales and a sum over blocks."""
    k, n = q.weight.shape
    blocks = q.blocks
    w = q.weight.astype(x.dtype).reshape(blocks, k // blocks, n)
    partial = jnp.einsum("mbk,bkn->bmn", x.reshape(-1, blocks, k // blocks), w)  # [blocks, M, N]
    return jnp.sum(partial * q.scales[:, None, :], axis=0)


def product(x: Array, w: "QuantizedWeight | PackedWeight | Array", products: Products,
            used: Array | None = None, fill_unused: bool = True, multiplier: float = 1.0) -> Array:
    """x [..., K] times a weight (int8 QuantizedWeight, or a float array stored [N, K]) -> [..., N] in x's dtype.

    float32 int8 products apply the scales after the reduction (per column, or per row block and then summed
    over blocks); DOT and bfloat16 dequantise first, so bfloat16 rounds as the reference does. In FUSED_REDUCE
    the form is chosen per shape by what measured fastest on XLA-CPU: one row always takes a fused reduction
    (the unembedding a matrix-vector dot); several rows take it only for the wide expert matrices, where
    converting the int8 weight dominates, and dots elsewhere. A PackedWeight always takes the native kernel
    (float32 rows; the result is cast back to x's dtype) and computes only the rows marked `used` (bool over x's leading
    dims, default all): the others come out zero (with `fill_unused` False undefined: for a caller that never
    reads them). XLA's forms ignore `used`. The result is times `multiplier`, one multiply in x's dtype after the
    product; a float32 product with an unscaled PackedWeight has the kernel do it (the same bits), on the
    computed rows only.
    """
    lead, k = x.shape[:-1], x.shape[-1]
    flat = x.reshape(-1, k)
    m = flat.shape[0]
    if isinstance(w, PackedWeight):
        mask = None if used is None else used.reshape(m)
        int8 = products.int8 and w.packed_scales is not None
        in_kernel = w.packed_scales is None and x.dtype == jnp.float32
        out = packed_product(flat.astype(jnp.float32), w, rows=mask, activations="int8" if int8 else "float32",
                             fill_unused=fill_unused, multiplier=multiplier if in_kernel else 1.0).astype(x.dtype)
        return (out if in_kernel else _times(out, multiplier)).reshape(*lead, -1)
    if products.native:
        products = Products.FUSED_REDUCE
    if products is Products.EXACT and x.dtype == jnp.float32:
        return _times(_exact_product(flat, w), multiplier).reshape(*lead, -1)
    if products is Products.DOT_INT8 and isinstance(w, QuantizedWeight):
        return _times(int8_product(flat, w).astype(x.dtype), multiplier).reshape(*lead, -1)
    fused = products is Products.FUSED_REDUCE and x.dtype == jnp.float32 and m <= FUSED_MAX_ROWS
    if not fused:
        if isinstance(w, QuantizedWeight):
            out = _dot_rows(flat, dequantize(w, x.dtype), w.transposed)
        else:
            out = _dot_rows(flat, w)
    elif not isinstance(w, QuantizedWeight):
        big = w.size >= 1 << 22  # the unembedding
        out = _dot_rows(flat, w) if big else _reduce_rows(flat, w.astype(x.dtype))
    elif w.transposed:
        wide = w.weight.shape[-2] > 2 * k  # the experts' gelu / linear branches
        if m == 1 or wide:
            out = _reduce_rows(flat, w.weight.astype(x.dtype)) * w.scales[0]
        else:
            out = _dot_rows(flat, w.weight.astype(x.dtype)) * w.scales[0]
    else:
        out = _blocked_row(flat, w) if m == 1 else _blocked_dot_rows(flat, w)
    return _times(out, multiplier).reshape(*lead, -1)


def _times(x: Array, multiplier: float) -> Array:
    return x if multiplier == 1.0 else x * jnp.asarray(multiplier, x.dtype)


def row_sum(x: Array) -> Array:
    """The sum over the last axis in one fixed order made only of elementwise adds (halve, add, an odd element
    carried to the next round), so a row's result never depends on the other dims: XLA's reductions choose their
    order by the whole array's shape, so a row's sum can differ between a program of 8 rows and one of 64."""
    while x.shape[-1] > 1:
        n, half = x.shape[-1], x.shape[-1] // 2
        folded = x[..., :half] + x[..., half:2 * half]
        x = folded if n % 2 == 0 else jnp.concatenate([folded, x[..., 2 * half:]], axis=-1)
    return x[..., 0]


def rms_norm(x: Array, scale: Array, row_sums: bool = False) -> Array:
    """RMSNorm computed in float32 (eps 1e-5), returned in x's dtype. `row_sums`: the mean square by `row_sum`
    (a row's bits then independent of the row count; for one device: under a mesh the features are sharded)."""
    xf = x.astype(jnp.float32)
    sq = jnp.square(xf)
    mean_sq = row_sum(sq)[..., None] / sq.shape[-1] if row_sums else jnp.mean(sq, axis=-1, keepdims=True)
    return (scale.astype(jnp.float32) * (xf * jax.lax.rsqrt(mean_sq + RMS_EPS))).astype(x.dtype)


def rotate_half(x: Array) -> Array:
    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate((-x2, x1), axis=-1)


def apply_rope(x: Array, positions: Array) -> Array:
    """Rotary embedding with half rotation. x [B, T, H, D], positions [B, T] int."""
    dim = x.shape[-1]
    inv_freq = transcendental.inverse_frequencies(ROPE_BASE, dim)  # [D/2]
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
    logits = ATTN_LOGIT_CAP * transcendental.tanh(logits / ATTN_LOGIT_CAP)
    logits = jnp.where(mask[:, None, None, :, :], logits, MASK_VALUE)
    weights = transcendental.softmax(logits, axis=-1).astype(v.dtype)
    out = jnp.einsum("bhgts,bhsd->bthgd", weights, v)
    return out.reshape(b, t, hq * d)


def paged_attention(q: Array, pool_k: Array, pool_v: Array, tables: Array, limit: Array, multiplier: float,
                    chunk: int) -> Array:
    """`attention` over keys held in a block pool, one fixed-size chunk of positions at a time.

    q [B, T, Hq, D]; pool_k, pool_v [blocks, Hkv, block_size, D] or [blocks, block_size, Hkv * D]
    (kv_memory's layouts); tables [B, n] each row's blocks in position
    order (n * block_size a multiple of `chunk`); limit [B, T] int32: query t of row b sees key positions
    0..limit[b, t]. -> [B, T, Hq*D].

    Split-K in two loops over the chunks that hold a visible key (as many as the row with the furthest limit
    needs, decided on the device): the first keeps a running maximum and sum of the scores (online softmax),
    the second adds up the value rows weighted as `attention` weights them (normalised, then cast to the
    values' dtype). A row's bits never depend on how many chunks run: each chunk goes through one fixed
    computation whatever the trip count, and a chunk with no visible key adds exactly nothing (its scores are
    -1e30: the maximum stays, the sums gain +0.0).
    """
    b, t, hq, d = q.shape
    tokens = pool_k.ndim == 3  # kv_memory's tokens layout
    hkv = pool_k.shape[2] // d if tokens else pool_k.shape[1]
    bs = block_size_of(pool_k)
    kv = "bpshd" if tokens else "bphsd"
    g, per = hq // hkv, chunk // bs
    qg = q.reshape(b, t, hkv, g, d).transpose(0, 2, 3, 1, 4).reshape(b, hkv, g * t, d)  # query rows (g, t)

    def read(pool: Array, c: Array) -> Array:  # chunk c of every row: [B, per, Hkv, bs, D] or [B, per, bs, Hkv, D]
        ids = jax.lax.dynamic_slice_in_dim(tables, c * per, per, axis=1)  # [B, per]
        return read_blocks(pool, ids, hkv).astype(q.dtype)

    def scores(c: Array) -> Array:  # [B, Hkv, G*T, chunk] float32, capped, invisible keys at -1e30
        logits = jnp.einsum(f"bhqd,{kv}->bhqps", qg, read(pool_k, c)).reshape(b, hkv, g * t, chunk)
        logits = logits.astype(jnp.float32) * multiplier
        logits = ATTN_LOGIT_CAP * transcendental.tanh(logits / ATTN_LOGIT_CAP)
        seen = (c * chunk + jnp.arange(chunk, dtype=jnp.int32))[None, None, :] <= limit[:, :, None]  # [B, T, C]
        seen = jnp.broadcast_to(seen[:, None, None], (b, hkv, g, t, chunk)).reshape(b, hkv, g * t, chunk)
        return jnp.where(seen, logits, MASK_VALUE)

    def softmax_stats(c: Array, carry: tuple[Array, Array]) -> tuple[Array, Array]:
        top, total = carry  # [B, Hkv, G*T]
        logits = scores(c)
        new_top = jnp.maximum(top, jnp.max(logits, axis=-1))
        return new_top, total * transcendental.exp(top - new_top) + jnp.sum(transcendental.exp(logits - new_top[..., None]),
                                                                             axis=-1)

    def values(c: Array, acc: Array) -> Array:
        weights = (transcendental.exp(scores(c) - top[..., None]) / total[..., None]).astype(pool_v.dtype)
        return acc + jnp.einsum(f"bhqps,{kv}->bhqd", weights.reshape(b, hkv, g * t, per, bs), read(pool_v, c),
                                preferred_element_type=jnp.float32)

    chunks = jnp.max(limit) // chunk + 1  # traced: the loops are not unrolled, and stop after the last key
    rows = (b, hkv, g * t)
    top, total = jax.lax.fori_loop(0, chunks, softmax_stats, (jnp.full(rows, MASK_VALUE, jnp.float32),
                                                              jnp.zeros(rows, jnp.float32)))
    out = jax.lax.fori_loop(0, chunks, values, jnp.zeros(rows + (d,), jnp.float32)).astype(q.dtype)
    return out.reshape(b, hkv, g, t, d).transpose(0, 3, 1, 2, 4).reshape(b, t, hq * d)


def paged_attention_rows(q: Array, pool_k: Array, pool_v: Array, tables: Array, limit: Array, multiplier: float,
                         chunk: int, active: Array) -> Array:
    """`paged_attention` of a decode step one row at a time; a row not `active` [B] (a free slot) computes
    nothing and gets zeros. Every row runs the same one-row program over its own chunks, so its bits depend on
    nothing but its own query and keys, and a free slot in a tile costs nothing."""
    def row(args: tuple[Array, Array, Array, Array]) -> Array:
        qr, table, lim, on = args
        return jax.lax.cond(on, lambda: paged_attention(qr[None], pool_k, pool_v, table[None], lim[None],
                                                        multiplier, chunk)[0],
                            lambda: jnp.zeros(qr.shape[:-2] + (qr.shape[-2] * qr.shape[-1],), q.dtype))
    return jax.lax.map(row, (q, tables, limit, active))
