"""Grouped product of expert-sorted rows with int8 expert matrices that stay int8 in HBM (megablox's design).

`grouped_matmul(x, weight, scales, group_sizes)`: rows x [P, K] sorted by group, the first group_sizes[0] rows
belonging to group 0 and so on (rows past the groups' total belong to none: their output is undefined), times
weight int8 [G, K, N] with scales [G, B, N] (B = 1: one scale per column; B = 8: row-parallel, 8 consecutive
row blocks of K each with their own column scales, as layers.QuantizedWeight) -> [P, N] in x's dtype.

The grid runs over (N tiles, visits, K tiles), a visit being one (group, row tile) pair with rows of that group:
the scalar-prefetched group metadata (`plan`) sends each visit's weight tiles to the group's matrix, so only the
matrices of groups that hold rows are read, each once per row tile, int8 from HBM to VMEM, and widened there.
`first_group` (traced) reads the groups' matrices from weight[first_group:]: a scanned layer's experts inside the
experts of every layer stacked [layers * G, K, N], never sliced out (a slice would be a copy of all its experts).
Accumulation is float32. How a tile is widened follows the reference's rounding:
- bfloat16 rows: each weight element dequantised as bf16(bf16(int8) * bf16(scale)) (the reference's per-element
  rounding), then a bf16 dot with float32 accumulation;
- float32 rows: int8 values are exact in bfloat16, so each row tile is split into three bfloat16 parts
  (hi + mid + lo == x to float32's 24 bits) and multiplied in three MXU passes against the widened tile, the
  scales applied after in float32: a float32 product to ~1e-6 relative, where XLA's default float32 dot on TPU
  rounds x to bfloat16 once.
- int8 rows (Products.DOT_INT8, an opt-in that changes results): rows already rounded to int8 with their float32
  scales [P, B] (one per row and row block, layers.quantize_rows) meet the int8 tile as they are, int8 times int8
  with int32 sums on the matrix unit (twice its bfloat16 rate on a v5e), each K tile's sums then times the column
  scales and the rows' scales of its block, in float32.
Runs on TPU, and anywhere with interpret=True (the tests).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

Array = jax.Array

SUB_ROWS = 512  # weight rows widened at a time inside a K tile (bounds the widened temporaries in VMEM)
VMEM_LIMIT = 64 * 1024 * 1024  # v5e has 128 MiB of VMEM; the default scoped limit (16 MiB) is too small for big tiles


class Tiling(NamedTuple):
    rows: int  # tm: rows per tile (a multiple of 16 on TPU, or all the rows)
    k: int  # tk: contraction per tile (divides K, and K / B for row-parallel matrices)
    n: int  # tn: output columns per tile (divides N)


class Plan(NamedTuple):
    """Which (group, row tile) each visit computes, and where each group's rows are (scalar-prefetched)."""

    offsets: Array  # [G + 1] int32: group g holds rows offsets[g]..offsets[g + 1]
    group: Array  # [visits] int32: the group of each visit
    tile: Array  # [visits] int32: the row tile of each visit
    count: Array  # [] int32: visits to run (at least 1)


def plan(group_sizes: Array, rows: int, tm: int) -> Plan:
    """Visits for groups of `group_sizes` [G] rows over `rows` rows in tiles of tm: each non-empty group visits
    the row tiles its rows touch, in group order (so one tile's visits are consecutive). Empty groups cost
    nothing; with no row in any group one visit still runs (it stores nothing)."""
    g = group_sizes.shape[0]
    sizes = group_sizes.astype(jnp.int32)
    ends = jnp.cumsum(sizes)
    starts = ends - sizes
    first = starts // tm
    visits = jnp.where(sizes > 0, (ends + tm - 1) // tm - first, 0)  # [G]
    visit_end = jnp.cumsum(visits)
    most = rows // tm + g - 1
    i = jnp.arange(most, dtype=jnp.int32)
    group = jnp.minimum(jnp.searchsorted(visit_end, i, side="right"), g - 1).astype(jnp.int32)
    tile = jnp.minimum(first[group] + i - (visit_end[group] - visits[group]), rows // tm - 1).astype(jnp.int32)
    offsets = jnp.concatenate([jnp.zeros(1, jnp.int32), ends])
    return Plan(offsets, group, tile, jnp.maximum(visit_end[-1], 1))


def _split3(x: Array) -> tuple[Array, Array, Array]:
    """float32 x -> bfloat16 (hi, mid, lo) with hi + mid + lo == x to float32's precision."""
    hi = x.astype(jnp.bfloat16)
    rest = x - hi.astype(jnp.float32)
    mid = rest.astype(jnp.bfloat16)
    lo = (rest - mid.astype(jnp.float32)).astype(jnp.bfloat16)
    return hi, mid, lo


def _dot(a: Array, b: Array) -> Array:
    # bfloat16 operands, one pass: the precision is explicit because the model traces under "highest" (its float32
    # router), which Mosaic refuses for bfloat16 operands ("Bad lhs type") and which one pass already is here.
    return jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32,
                               precision=jax.lax.Precision.DEFAULT)


def _tile_product(x_ref: pl.Ref, w_ref: pl.Ref, scale: Array, tk: int) -> Array:
    """One K tile: rows [tm, tk] times the int8 tile [tk, tn] widened in slices of SUB_ROWS -> float32 [tm, tn].
    bfloat16 rows meet the dequantised tile (scale inside); float32 rows the plain int8 values (scale after)."""
    total = None
    for s in range(0, tk, SUB_ROWS):
        width = min(SUB_ROWS, tk - s)
        w = w_ref[s:s + width, :].astype(jnp.int32).astype(jnp.float32)  # int8 [width, tn], widened exactly
        x = x_ref[:, s:s + width]
        if x.dtype == jnp.bfloat16:
            wd = (w * scale).astype(jnp.bfloat16)  # bf16(int8) * bf16(scale): the exact product rounded once
            part = _dot(x, wd)
        else:
            wb = w.astype(jnp.bfloat16)  # exact
            hi, mid, lo = _split3(x.astype(jnp.float32))
            part = _dot(lo, wb) + _dot(mid, wb) + _dot(hi, wb)
        total = part if total is None else total + part
    assert total is not None
    return total


def _kernel(offsets: pl.Ref, group: pl.Ref, tile: pl.Ref, matrix: pl.Ref, x_ref: pl.Ref, w_ref: pl.Ref,
            s_ref: pl.Ref, out_ref: pl.Ref, acc_ref: pl.Ref, *, tk: int, k_tiles: int, block_rows: int) -> None:
    v, kk = pl.program_id(1), pl.program_id(2)
    blocks = s_ref.shape[0]
    scales = s_ref[...].astype(jnp.bfloat16).astype(jnp.float32)  # [B, tn]: the reference's bf16(scale)
    if blocks == 1:
        scale = scales
    else:  # the tile lies in one row block
        pick = _block_pick(kk, block_rows, tk, scales.shape, 0)
        scale = jnp.sum(jnp.where(pick, scales, 0.0), axis=0, keepdims=True)
    bf16 = x_ref.dtype == jnp.bfloat16

    @pl.when(kk == 0)
    def _zero() -> None:
        acc_ref[...] = jnp.zeros_like(acc_ref)

    part = _tile_product(x_ref, w_ref, scale, tk)
    acc_ref[...] += part if bf16 or blocks == 1 else part * scale

    @pl.when(kk == k_tiles - 1)
    def _store() -> None:
        acc = acc_ref[...]
        if not bf16 and blocks == 1:
            acc = acc * scale
        g = group[v]
        row = jax.lax.broadcasted_iota(jnp.int32, acc.shape, 0) + tile[v] * acc.shape[0]
        mine = (row >= offsets[g]) & (row < offsets[g + 1])
        # A row tile shared by two groups is visited once per group in a row: the block stays in VMEM between
        # the visits, each writing only its own group's rows.
        kept = out_ref[...].astype(jnp.float32)  # selected in float32, as megablox does (v5e has no bf16 VPU)
        out_ref[...] = jnp.where(mine, acc.astype(out_ref.dtype).astype(jnp.float32), kept).astype(out_ref.dtype)


def _block_pick(kk: Array, block_rows: int, tk: int, shape: tuple[int, int], axis: int) -> Array:
    """Which row block K tile kk lies in, as a mask over `axis` (the blocks) of `shape` (tk divides K / B: block b
    holds K tiles b * per .. (b + 1) * per - 1; no scalar division on the chip's scalar unit)."""
    per = block_rows // tk
    b = jax.lax.broadcasted_iota(jnp.int32, shape, axis)
    return (b * per <= kk) & (kk < (b + 1) * per)


def _int8_kernel(offsets: pl.Ref, group: pl.Ref, tile: pl.Ref, matrix: pl.Ref, x_ref: pl.Ref, w_ref: pl.Ref,
                 s_ref: pl.Ref, xs_ref: pl.Ref, out_ref: pl.Ref, acc_ref: pl.Ref, *, tk: int, k_tiles: int,
                 block_rows: int) -> None:
    """int8 rows [tm, tk] times the int8 tile [tk, tn]: int32 sums per K tile, then float32 times the tile's block's
    column scales [1, tn] and the rows' scales of that block [tm, 1]."""
    v, kk = pl.program_id(1), pl.program_id(2)
    blocks = s_ref.shape[0]
    scales = s_ref[...].astype(jnp.float32)  # [B, tn]
    row_scales = xs_ref[...]  # [tm, B] float32
    if blocks == 1:
        scale, row_scale = scales, row_scales
    else:
        scale = jnp.sum(jnp.where(_block_pick(kk, block_rows, tk, scales.shape, 0), scales, 0.0), axis=0,
                        keepdims=True)
        row_scale = jnp.sum(jnp.where(_block_pick(kk, block_rows, tk, row_scales.shape, 1), row_scales, 0.0),
                            axis=1, keepdims=True)

    @pl.when(kk == 0)
    def _zero() -> None:
        acc_ref[...] = jnp.zeros_like(acc_ref)

    total = None
    for s in range(0, tk, SUB_ROWS):
        width = min(SUB_ROWS, tk - s)
        part = jax.lax.dot_general(x_ref[:, s:s + width], w_ref[s:s + width, :], (((1,), (0,)), ((), ())),
                                   preferred_element_type=jnp.int32, precision=jax.lax.Precision.DEFAULT)
        total = part if total is None else total + part
    assert total is not None
    acc_ref[...] += total.astype(jnp.float32) * scale * row_scale

    @pl.when(kk == k_tiles - 1)
    def _store() -> None:
        acc = acc_ref[...]
        g = group[v]
        row = jax.lax.broadcasted_iota(jnp.int32, acc.shape, 0) + tile[v] * acc.shape[0]
        mine = (row >= offsets[g]) & (row < offsets[g + 1])
        kept = out_ref[...].astype(jnp.float32)
        out_ref[...] = jnp.where(mine, acc.astype(out_ref.dtype).astype(jnp.float32), kept).astype(out_ref.dtype)


def _check(x: Array, weight: Array, scales: Array, tiling: Tiling) -> None:
    p, k = x.shape
    g, k2, n = weight.shape
    if weight.dtype != jnp.int8 or k2 != k or scales.shape[0] != g or scales.shape[2] != n:
        raise ValueError(f"grouped_matmul needs int8 weight [G, K, N] and scales [G, B, N] for rows [P, K]: got "
                         f"rows {x.shape}, weight {weight.dtype} {weight.shape}, scales {scales.shape}")
    if x.dtype not in (jnp.float32, jnp.bfloat16, jnp.int8):
        raise ValueError(f"grouped_matmul multiplies float32, bfloat16 or int8 rows, got {x.dtype}")
    blocks = scales.shape[1]
    tm, tk, tn = tiling
    if p % tm or k % tk or n % tn or (k // blocks) % tk:
        raise ValueError(f"tiling {tiling} must divide rows {p}, K {k} (and K / {blocks} = {k // blocks}) and N {n}")


def fit_tiling(rows: int, k: int, n: int, blocks: int, want: Tiling, granule: int = 16) -> Tiling:
    """`want` fitted to the shapes: tm a multiple of `granule` (16; int8 rows 32) up to `want.rows` (rows are padded
    to whole tiles), tk and tn halved until they divide K / blocks and N (if none of at least 128 does: the whole
    dimension, after `grouped_matmul` pads each row block of a row-parallel matrix to a multiple of 128 rows)."""
    tm = min(want.rows, -(-rows // granule) * granule)

    def divisor(size: int, target: int) -> int:
        t = min(target, size)
        while t >= 128 and size % t:
            t //= 2
        return t if t >= 128 and size % t == 0 else size

    per_block = k // blocks
    if blocks > 1 and per_block % 128:
        per_block += -per_block % 128
    return Tiling(tm, divisor(per_block, want.k), divisor(n, want.n))


def _pad_blocks(x: Array, weight: Array, blocks: int, to: int) -> tuple[Array, Array]:
    """Each of the `blocks` row blocks of weight [G, K, N] (and column blocks of x [P, K]) padded with zeros to
    `to` rows, so that a K tile never straddles two blocks' scales (small, unaligned shapes only: a copy)."""
    g, k, n = weight.shape
    per = k // blocks
    w = jnp.pad(weight.reshape(g, blocks, per, n), ((0, 0), (0, 0), (0, to - per), (0, 0)))
    xs = jnp.pad(x.reshape(x.shape[0], blocks, per), ((0, 0), (0, 0), (0, to - per)))
    return xs.reshape(x.shape[0], blocks * to), w.reshape(g, blocks * to, n)


@functools.partial(jax.jit, static_argnames=("tiling", "interpret", "out_dtype"))
def grouped_matmul(x: Array, weight: Array, scales: Array, group_sizes: Array, tiling: Tiling,
                   interpret: bool = False, first_group: Array | None = None, row_scales: Array | None = None,
                   out_dtype: jnp.dtype | None = None) -> Array:
    """x [P, K] (rows sorted by group) times int8 weight [G, K, N] with scales [G, B, N] -> [P, N] in x's dtype;
    rows past sum(group_sizes) come out undefined. `tiling` comes from fit_tiling for these shapes. With
    `first_group` (int32 []), group g's matrix is weight[first_group + g] (weight holds more than G). int8 rows x
    take their float32 `row_scales` [P, B] and give `out_dtype` (float32 or bfloat16; tiles of 32 rows)."""
    p, k = x.shape
    blocks = scales.shape[1]
    if (x.dtype == jnp.int8) != (row_scales is not None):
        raise ValueError("int8 rows take their row_scales [P, B] (layers.quantize_rows); float rows take none")
    if blocks > 1 and (k // blocks) % tiling.k:
        x, weight = _pad_blocks(x, weight, blocks, -(-(k // blocks) // tiling.k) * tiling.k)
    rows = -(-p // tiling.rows) * tiling.rows
    if rows != p:
        x = jnp.pad(x, ((0, rows - p), (0, 0)))
        if row_scales is not None:
            row_scales = jnp.pad(row_scales, ((0, rows - p), (0, 0)))
    first = jnp.zeros((), jnp.int32) if first_group is None else first_group.astype(jnp.int32)
    out = jnp.dtype(out_dtype or (jnp.float32 if x.dtype == jnp.int8 else x.dtype))
    return _call(x, weight, scales, group_sizes, first, tiling, interpret, row_scales, out)[:p]


def _call(x: Array, weight: Array, scales: Array, group_sizes: Array, first: Array, tiling: Tiling,
          interpret: bool, row_scales: Array | None, out_dtype: jnp.dtype) -> Array:
    _check(x, weight, scales, tiling)
    p, k = x.shape
    _, _, n = weight.shape
    blocks = scales.shape[1]
    tm, tk, tn = tiling
    meta = plan(group_sizes, p, tm)
    matrix = meta.group + first  # [visits]: the weight's matrix each visit reads
    int8_rows = row_scales is not None
    kernel = functools.partial(_kernel if not int8_rows else _int8_kernel, tk=tk, k_tiles=k // tk,
                               block_rows=k // blocks)
    in_specs = [
        pl.BlockSpec((tm, tk), lambda j, v, kk, offsets, group, tile, matrix: (tile[v], kk)),
        pl.BlockSpec((None, tk, tn), lambda j, v, kk, offsets, group, tile, matrix: (matrix[v], kk, j)),
        pl.BlockSpec((None, blocks, tn), lambda j, v, kk, offsets, group, tile, matrix: (matrix[v], 0, j)),
    ]
    operands = [x, weight, scales]
    if int8_rows:
        in_specs.append(pl.BlockSpec((tm, blocks), lambda j, v, kk, offsets, group, tile, matrix: (tile[v], 0)))
        operands.append(row_scales.astype(jnp.float32))
    spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=4,
        grid=(n // tn, meta.count, k // tk),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((tm, tn), lambda j, v, kk, offsets, group, tile, matrix: (tile[v], j)),
        scratch_shapes=[pltpu.VMEM((tm, tn), jnp.float32)],
    )
    passes = 1 if x.dtype != jnp.float32 else 3
    cost = pl.CostEstimate(flops=2 * p * k * n * passes, transcendentals=0,
                           bytes_accessed=weight.size // weight.shape[0] * 2 + x.size * x.itemsize * (n // tn))
    call = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((p, n), out_dtype),
        grid_spec=spec,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary", "arbitrary"),
                                             vmem_limit_bytes=VMEM_LIMIT),
        interpret=interpret,
        cost_estimate=cost,
    )
    return call(meta.offsets, meta.group, meta.tile, matrix, *operands)
