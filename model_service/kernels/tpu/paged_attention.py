"""Decode attention over the paged KV pools that reads each row's own blocks and nothing else.

`decode_attention(q, pool_k, pool_v, tables, lengths, ...)`: row r's query q[r] [Hq, D] attends key positions
0..lengths[r]-1 of the blocks tables[r] lists, in the pools' "tokens" layout (kv_memory: a block [block_size, Hkv * D],
a token's keys one lane-dense row), the reference's way: scores times the attention multiplier, capped by
cap * tanh(x / cap), softmax, values -> [R, Hq, D]. A row of length 0 computes nothing and gets zeros.

The pools stay in HBM. Each row walks its blocks `chunk` positions at a time: the chunk's blocks are copied
into VMEM (one DMA a block, the next chunk's copies started before this chunk's scores, and a row's last chunk
starts the next row's first, so the reads overlap the work) and folded into a running maximum, sum and weighted
values (online softmax, float32). So a row reads its
own keys and values once each, up to its length rounded up to a chunk, where XLA's form
(layers.paged_attention over gathered blocks) reads every row up to the step's longest.

Grouped queries meet their keys in one product per chunk without slicing heads out of a lane-dense row: each
query head's D features are spread into its KV head's place in the row (zeros elsewhere, [Hq, Hkv * D]), so one
product scores every head against every key and only its own KV head's features count (exact: the rest are
zeros). That multiplies by Hkv the work of a product the HBM reads bound anyway (a decode step reads ~Hq * 2
bytes per multiply-add; the v5e's matrix unit does ~240 per byte it reads). The values come back the same way,
[Hq, Hkv * D], each row's own D columns kept.

`pool_k` / `pool_v` are either one layer's pool [blocks, block_size, W] or every layer's [layers, blocks,
block_size, W] with `layer` (traced) naming the one to read: a scanned layer's pool is read in place, never
sliced out (a slice would copy the pool every step). Runs on TPU, and anywhere with interpret=True (the tests).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

Array = jax.Array

MASK_VALUE = -1e30  # layers.MASK_VALUE: a score no key reaches (finite, so a masked chunk adds exact zeros)
VMEM_LIMIT = 32 * 1024 * 1024


LANES = 128  # a vector register's lanes


def min_block_size(dtype: jnp.dtype) -> int:
    """The least block size the kernel takes for pools of `dtype`: a block fills whole (8 x 128) tiles of VMEM
    rows, 16 rows of a 16-bit type."""
    return 32 // jnp.dtype(dtype).itemsize


def fills_tiles(q_heads: int, kv_width: int, dtype: jnp.dtype) -> bool:
    """Whether the query heads fill whole tile rows of `dtype` (as a block's positions must) and a position's keys
    (KV heads x head size) whole lanes: the shapes compiled on the chip (Grok-1's 48 heads over 1,024, medium's 16
    over 256), which backend.choose_attention's auto keeps to."""
    return q_heads % min_block_size(dtype) == 0 and kv_width % LANES == 0


@functools.partial(jax.jit, static_argnames=("multiplier", "cap", "chunk", "interpret"))
def decode_attention(q: Array, pool_k: Array, pool_v: Array, tables: Array, lengths: Array, multiplier: float,
                     cap: float, chunk: int, layer: Array | None = None,
                     interpret: bool | pltpu.InterpretParams = False) -> Array:
    """q [R, Hq, D]; pools [blocks, bs, Hkv * D] (or [layers, blocks, bs, Hkv * D] with `layer`); tables [R, n]
    int32 block ids in position order; lengths [R] int32 (0: the row computes nothing) -> [R, Hq, D] in q's
    dtype. `chunk` positions (a multiple of the block size, n * bs a multiple of it) are read at a time.
    `interpret`: Pallas' interpreter (True), or its TPU simulation (InterpretParams: DMAs, semaphores, races)."""
    if pool_k.ndim == 3:
        pool_k, pool_v = pool_k[None], pool_v[None]
    layer = jnp.zeros((), jnp.int32) if layer is None else layer
    r, hq, d = q.shape
    _, _, bs, w = pool_k.shape
    hkv = w // d
    n = tables.shape[1]
    if w % d or hq % hkv:
        raise ValueError(f"pools of width {w} do not hold whole KV heads of {d} features for {hq} query heads")
    if chunk % bs or (n * bs) % chunk:
        raise ValueError(f"chunk {chunk} must be a multiple of the block size {bs} dividing the table ({n} blocks)")
    if bs % min_block_size(pool_k.dtype):
        raise ValueError(f"blocks of {bs} positions: the kernel takes multiples of {min_block_size(pool_k.dtype)} "
                         f"for {jnp.dtype(pool_k.dtype).name} pools")
    pages = chunk // bs
    # The constant masks, built here (no vector division or remainder in the kernel): spread [D, W] sends feature j
    # of a head to every KV head's feature j; own [Hq, W] marks query head h's own KV head's columns.
    spread = (jnp.arange(w)[None, :] % d == jnp.arange(d)[:, None]).astype(jnp.float32)
    own = (jnp.arange(hq)[:, None] // (hq // hkv) == jnp.arange(w)[None, :] // d).astype(jnp.float32)
    chunks = (lengths.astype(jnp.int32) + chunk - 1) // chunk  # [R]: the chunks each row reads
    kernel = functools.partial(_kernel, pages=pages, n=n, rows=r, multiplier=multiplier, cap=cap)
    spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=4,
        grid=(r,),
        in_specs=[pl.BlockSpec((None, hq, d), lambda i, *_: (i, 0, 0)),
                  pl.BlockSpec((d, w), lambda i, *_: (0, 0)),
                  pl.BlockSpec((hq, w), lambda i, *_: (0, 0)),
                  pl.BlockSpec(memory_space=pl.ANY),
                  pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=pl.BlockSpec((None, hq, d), lambda i, *_: (i, 0, 0)),
        scratch_shapes=[pltpu.VMEM((2, pages, bs, w), pool_k.dtype), pltpu.VMEM((2, pages, bs, w), pool_v.dtype),
                        pltpu.SemaphoreType.DMA((2, 2)), pltpu.SMEM((1,), jnp.int32)],
    )
    cost = pl.CostEstimate(flops=4 * r * hq * w * n * bs, transcendentals=2 * r * hq * n * bs,
                           bytes_accessed=2 * r * n * bs * w * pool_k.dtype.itemsize + 2 * q.size * q.dtype.itemsize)
    call = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((r, hq, d), q.dtype),
        grid_spec=spec,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",), vmem_limit_bytes=VMEM_LIMIT),
        interpret=interpret,
        cost_estimate=cost,
    )
    return call(jnp.reshape(layer.astype(jnp.int32), (1,)), tables.astype(jnp.int32).reshape(-1),
                lengths.astype(jnp.int32), chunks, q, spread, own, pool_k, pool_v)


def _kernel(layer_ref, tables_ref, lengths_ref, chunks_ref, q_ref, spread_ref, own_ref, k_hbm, v_hbm, o_ref, k_buf,
            v_buf, sems, first_slot, *, pages: int, n: int, rows: int, multiplier: float, cap: float) -> None:
    row = pl.program_id(0)
    layer = layer_ref[0]
    _, _, bs, w = k_buf.shape
    tokens = pages * bs
    hq = q_ref.shape[0]
    f32 = jnp.float32
    # Named either way: under the forms' default of "highest" (ops/xla.py) a bfloat16 dot left at None would ask
    # Mosaic for a float32 contraction of bfloat16 operands, which it refuses to compile.
    precision = jax.lax.Precision.HIGHEST if k_buf.dtype == f32 else jax.lax.Precision.DEFAULT

    length, chunks = lengths_ref[row], chunks_ref[row]

    def copies(r: Array, c: Array, slot: Array) -> list:
        out = []
        for i in range(pages):
            block = tables_ref[r * n + jnp.minimum(c * pages + i, n - 1)]
            out.append(pltpu.make_async_copy(k_hbm.at[layer, block], k_buf.at[slot, i], sems.at[0, slot]))
            out.append(pltpu.make_async_copy(v_hbm.at[layer, block], v_buf.at[slot, i], sems.at[1, slot]))
        return out

    def start_next_row(slot: Array) -> None:
        """The next row's first chunk into `slot` (the rows run in order: its copies overlap this row's work)."""
        @pl.when((row + 1 < rows) & (chunks_ref[jnp.minimum(row + 1, rows - 1)] > 0))
        def _() -> None:
            for copy in copies(row + 1, jnp.int32(0), slot):
                copy.start()
        first_slot[0] = slot

    # The first row starts its own first chunk; every later row's was started by the row before it, into the slot
    # `first_slot` names.
    @pl.when(row == 0)
    def _() -> None:
        first_slot[0] = 0

        @pl.when(chunks > 0)
        def _() -> None:
            for copy in copies(row, jnp.int32(0), jnp.int32(0)):
                copy.start()

    base = first_slot[0]

    @pl.when(chunks == 0)  # nothing in flight for this row: the next row's first chunk may take its slot now
    def _() -> None:
        start_next_row(base)

    spread, own = spread_ref[...], own_ref[...] > 0
    q = jnp.dot(q_ref[...].astype(f32), spread, precision=jax.lax.Precision.HIGHEST, preferred_element_type=f32)
    q = jnp.where(own, q, 0.0).astype(k_buf.dtype)  # [Hq, W]: exact (each entry one feature times 1)

    def fold(c: Array, carry: tuple[Array, Array, Array]) -> tuple[Array, Array, Array]:
        top, total, acc = carry
        slot = jnp.bitwise_and(base + c, 1)

        @pl.when(c + 1 < chunks)
        def _() -> None:
            for copy in copies(row, c + 1, 1 - slot):
                copy.start()

        @pl.when(c + 1 == chunks)
        def _() -> None:
            start_next_row(1 - slot)

        for copy in copies(row, c, slot):
            copy.wait()
        keys = k_buf[slot].reshape(tokens, w)
        values = v_buf[slot].reshape(tokens, w)
        scores = jax.lax.dot_general(q, keys, (((1,), (1,)), ((), ())), precision=precision,
                                     preferred_element_type=f32)  # [Hq, tokens]
        # Rounded to the keys' dtype as the reference's einsum returns them (bfloat16 scores, then float32).
        scores = scores.astype(k_buf.dtype).astype(f32)
        scores = cap * jnp.tanh(scores * multiplier / cap)
        seen = c * tokens + jax.lax.broadcasted_iota(jnp.int32, (hq, tokens), 1) < length
        scores = jnp.where(seen, scores, MASK_VALUE)
        new_top = jnp.maximum(top, jnp.max(scores, axis=1, keepdims=True))
        scale = jnp.exp(top - new_top)
        weights = jnp.exp(scores - new_top)
        total = total * scale + jnp.sum(weights, axis=1, keepdims=True)
        acc = acc * scale + jnp.dot(weights.astype(values.dtype), values, precision=precision,
                                    preferred_element_type=f32)
        return new_top, total, acc

    init = (jnp.full((hq, 1), MASK_VALUE, f32), jnp.zeros((hq, 1), f32), jnp.zeros((hq, w), f32))
    _, total, acc = jax.lax.fori_loop(0, chunks, fold, init)
    out = jnp.where(own, acc / jnp.where(total > 0, total, 1.0), 0.0)  # [Hq, W]: each head's own D columns
    o_ref[...] = jax.lax.dot_general(out, spread, (((1,), (1,)), ((), ())), precision=jax.lax.Precision.HIGHEST,
                                     preferred_element_type=f32).astype(o_ref.dtype)  # [Hq, D]
