"""The generic backend's experts: one grouped product per matrix over expert-sorted (row, expert) pairs.

Every (row, selected expert) pair of a step is a row of its own; the pairs are sorted by expert (pairs of rows
not `active` after every group, so they select no expert work), and each of the three matrices is one grouped
product over the stacked experts (weights.GroupedWeight, int8 [E, K, N]): linear and linear_v, the gated GELU,
then linear_1. The outputs are put back in pair order and each row adds its experts' outputs times their gates
in expert order, as moe.experts_by_cond does. Only the experts some active row selected are read.

How the grouped product runs is the backend's choice (backend.Backend.moe):
  "pallas"            the Pallas TPU kernel (kernels/tpu/grouped_matmul.py): int8 stays int8 in HBM and is
                      widened inside the kernel's tiles;
  "pallas_interpret"  the same kernel in Pallas interpret mode (tests on CPU);
  "ragged"            XLA's jax.lax.ragged_dot over the dequantised experts (other single devices: CI's generic
                      backend on CPU).
For the kernel a row-parallel matrix whose row blocks its tiles cannot divide, and a column-parallel one whose
columns are not a multiple of the TPU's 128 lanes (medium's 2,736: the chip copied both stacked matrices whole every
step, 0.27 ms each, to lay them out for the kernel), are padded with zeros once when the engine lays out its
parameters (kernel_layout), not on every call; and each expert's rows start a row tile of their own
(aligned_rows: every tile holds one expert's rows, so no output tile is written by two experts' visits; the
padding rows are zero, each expert's weights are still read once a tile, as before).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from model_service.kernels.tpu.grouped_matmul import Tiling, fit_tiling, grouped_matmul
from model_service.model.layers import quantize_rows
from model_service.model.weights import GroupedWeight, InLayer
import model_service.model.transcendental as transcendental

Array = jax.Array

GROUPED_MOE = ("pallas", "pallas_interpret", "ragged")
TILING = Tiling(rows=128, k=1024, n=2048)  # the kernel's default tiles (benchmarks/moe_probe.py measures others)


class GroupedExperts(NamedTuple):
    """Each a GroupedWeight, or (scanned layers) a layer InLayer of the stacked ones."""

    linear: GroupedWeight | InLayer  # gelu branch [E, D, F]
    linear_v: GroupedWeight | InLayer  # linear branch [E, D, F]
    linear_1: GroupedWeight | InLayer  # output [E, F, D], 8 row-block scales


class Pairs(NamedTuple):
    """A step's (row, expert) pairs sorted by expert."""

    order: Array  # [P] pair index (row * k + j) of each sorted position
    inverse: Array  # [P] sorted position of each pair
    group_sizes: Array  # [E] int32 active pairs per expert (inactive pairs come after every group)
    gates: Array  # [M, k] each row's gates, its experts in expert order
    used: Array  # [M, k] bool: the pair belongs to an active row


def sort_pairs(experts: Array, gates: Array, active: Array | None, num_experts: int) -> Pairs:
    """experts, gates [M, k] (routing) and active [M] bool (None: every row) -> the pairs sorted by expert."""
    m, k = experts.shape
    within = jnp.argsort(experts, axis=-1)  # a row's experts in expert order: the order its outputs are added
    experts = jnp.take_along_axis(experts, within, axis=-1)
    gates = jnp.take_along_axis(gates, within, axis=-1)
    used = jnp.ones((m, k), bool) if active is None else jnp.broadcast_to(active[:, None], (m, k))
    key = jnp.where(used, experts, num_experts).reshape(m * k)
    order = jnp.argsort(key, stable=True).astype(jnp.int32)
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(m * k, dtype=jnp.int32))
    sizes = jnp.sum(key[None, :] == jnp.arange(num_experts, dtype=key.dtype)[:, None], axis=1).astype(jnp.int32)
    return Pairs(order, inverse, sizes, gates, used)


def dequantize_stacked(q: GroupedWeight, dtype: jnp.dtype) -> Array:
    """dtype(int8) * dtype(scale) for every expert: [E, K, N] (the reference's dequantisation)."""
    e, k, n = q.weight.shape
    b = q.blocks
    w = q.weight.astype(dtype).reshape(e, b, k // b, n) * q.scales[:, :, None, :].astype(dtype)
    return w.reshape(e, k, n)


ALIGN = 128  # rows of a row block the kernel's K tiles need (its tiles divide it; lanes of the rows' tiles)


def _pads_rows(q: GroupedWeight) -> bool:
    return not q.rows and q.blocks > 1 and (q.weight.shape[-2] // q.blocks) % ALIGN != 0


def _pads_cols(q: GroupedWeight) -> bool:
    return not q.cols and q.blocks == 1 and q.weight.shape[-1] % ALIGN != 0


def pads(q: GroupedWeight, mode: str) -> bool:
    """Whether kernel_layout changes q for `mode`."""
    return mode in ("pallas", "pallas_interpret") and (_pads_rows(q) or _pads_cols(q))


def kernel_layout(q: GroupedWeight, mode: str) -> GroupedWeight:
    """q as `mode` reads it best: for the Pallas kernel a row-parallel matrix whose row blocks are not a multiple
    of ALIGN rows has each padded with zero rows, and a column-parallel one whose columns are not a multiple of
    ALIGN gets zero columns (and zero scales), once (host numpy or device arrays), where the chip would otherwise
    lay them out again on every call (medium's linear_1: blocks of 342 rows; linear and linear_v: 2,736 columns).
    Anything else comes back as it is."""
    if not pads(q, mode):
        return q
    *lead, k, n = q.weight.shape  # [E, K, N], or stacked over the layers [layers, E, K, N]
    xp = np if isinstance(q.weight, np.ndarray) else jnp
    keep = ((0, 0),) * len(lead)
    if _pads_rows(q):
        per = k // q.blocks
        padded = xp.pad(q.weight.reshape(*lead, q.blocks, per, n), keep + ((0, 0), (0, -per % ALIGN), (0, 0)))
        return GroupedWeight(padded.reshape(*lead, -1, n), q.scales, rows=k)
    extra = ((0, 0), (0, -n % ALIGN))
    return GroupedWeight(xp.pad(q.weight, keep + extra), xp.pad(q.scales, keep + extra), cols=n)


def logical_weight(q: GroupedWeight) -> GroupedWeight:
    """q without kernel_layout's padding (the checkpoint's [E, K, N])."""
    if q.cols:
        return GroupedWeight(q.weight[..., :q.cols], q.scales[..., :q.cols])
    if not q.rows:
        return q
    *lead, k, n = q.weight.shape
    per = q.rows // q.blocks
    blocks = q.weight.reshape(*lead, q.blocks, k // q.blocks, n)[..., :per, :]
    return GroupedWeight(blocks.reshape(*lead, q.rows, n), q.scales)


def _pad_rows_like(x: Array, q: GroupedWeight) -> Array:
    """Rows x [P, K] with zero columns where kernel_layout padded q's row blocks."""
    if not q.rows:
        return x
    per, padded = q.rows // q.blocks, q.weight.shape[-2] // q.blocks
    return jnp.pad(x.reshape(x.shape[0], q.blocks, per), ((0, 0), (0, 0), (0, padded - per))).reshape(x.shape[0], -1)


def _ragged_int8(rows: Array, q: GroupedWeight, group_sizes: Array) -> Array:
    """Products.DOT_INT8 through XLA's ragged_dot: the rows rounded to int8 per row block (layers.quantize_rows),
    int8 times int8 with int32 sums one row block at a time, each block's sums times its rows' scales and their
    group's column scales, added in block order -> float32 [P, N]."""
    e, k, n = q.weight.shape
    blocks = q.blocks
    per = k // blocks
    xq, xs = quantize_rows(rows, blocks)
    group = jnp.minimum(jnp.searchsorted(jnp.cumsum(group_sizes), jnp.arange(rows.shape[0]), side="right"), e - 1)
    out = None
    for b in range(blocks):
        sums = jax.lax.ragged_dot(xq[:, b * per:(b + 1) * per], q.weight[:, b * per:(b + 1) * per], group_sizes,
                                  preferred_element_type=jnp.int32, precision=jax.lax.Precision.DEFAULT)
        part = sums.astype(jnp.float32) * xs[:, b:b + 1] * q.scales[group, b].astype(jnp.float32)
        out = part if out is None else out + part
    assert out is not None
    return out


def grouped_product(rows: Array, q: GroupedWeight | InLayer, group_sizes: Array, mode: str,
                    tiling: Tiling = TILING, int8_rows: bool = False) -> Array:
    """Sorted rows [P, K] times their groups' matrices -> [P, N] in rows' dtype (rows past the groups: undefined
    with the kernel, zero with ragged_dot). A layer of stacked experts (InLayer) is read in place by the kernel
    (its experts from the stack's layer * E on), sliced out for ragged_dot (which widens every expert anyway).
    `int8_rows` (Products.DOT_INT8): the rows rounded to int8 meet the int8 matrices as they are (int32 sums)."""
    if isinstance(q, InLayer) and mode == "ragged":
        q = q.at_layer()
    whole = q.stacked if isinstance(q, InLayer) else q
    rows = _pad_rows_like(rows, whole)
    cols = whole.cols
    if mode == "ragged" and int8_rows:
        out = _ragged_int8(rows, q, group_sizes).astype(rows.dtype)
        return out[:, :cols] if cols else out
    if mode == "ragged":
        # float32: not one bfloat16 pass on a TPU; bfloat16: one pass, said explicitly, since the model traces under
        # "highest" and the TPU's ragged dot (a Mosaic kernel) refuses that for bfloat16 operands
        precision = jax.lax.Precision.HIGHEST if rows.dtype == jnp.float32 else jax.lax.Precision.DEFAULT
        out = jax.lax.ragged_dot(rows, dequantize_stacked(q, rows.dtype), group_sizes, precision=precision)
        return out[:, :cols] if cols else out
    if mode not in ("pallas", "pallas_interpret"):
        raise ValueError(f"grouped experts run as one of {GROUPED_MOE}, got {mode!r}")
    first = None
    if isinstance(q, InLayer):  # [layers, E, ...] -> [layers * E, ...]: a reshape, no copy
        first, q = q.layer * q.count, q.stacked
        q = GroupedWeight(q.weight.reshape(-1, *q.weight.shape[-2:]), q.scales.reshape(-1, *q.scales.shape[-2:]),
                          q.rows, q.cols)
    p, k = rows.shape
    fitted = fit_tiling(p, k, q.weight.shape[-1], q.blocks, tiling, granule=granule(int8_rows))
    lhs, int8 = rows, {}
    if int8_rows:  # the kernel takes the rounded rows and their scales, and gives rows' dtype
        lhs, row_scales = quantize_rows(rows, q.blocks)
        int8 = {"row_scales": row_scales, "out_dtype": rows.dtype}
    out = grouped_matmul(lhs, q.weight, q.scales, group_sizes, fitted, interpret=mode == "pallas_interpret",
                         first_group=first, **int8)
    return out[:, :cols] if cols else out


def granule(int8_rows: bool) -> int:
    """The kernel's row tiles are multiples of this: 16 rows, 32 of int8 rows (a TPU packs 32 int8 rows a tile)."""
    return 32 if int8_rows else 16


class Aligned(NamedTuple):
    """Sorted pairs laid out for the kernel: each group's rows from a multiple of `tile`."""

    dest: Array  # [P] int32: the aligned row of each sorted position (rows past every group: `rows`, dropped)
    group_sizes: Array  # [E] int32: each group's rows rounded up to whole tiles
    rows: int  # rows of the aligned layout (static: P + E * (tile - 1), in whole tiles)
    tile: int


def aligned_rows(group_sizes: Array, pairs: int, tiling: Tiling, granule: int = 16) -> Aligned:
    """Where each of `pairs` sorted rows (groups of `group_sizes`, then rows in none) goes when every group starts a
    row tile of its own; the tile is the kernel's (fit_tiling's rows for `pairs` rows)."""
    tile = min(tiling.rows, -(-pairs // granule) * granule)
    e = group_sizes.shape[0]
    sizes = group_sizes.astype(jnp.int32)
    padded = -(-sizes // tile) * tile
    rows = -(-(pairs + e * (tile - 1)) // tile) * tile
    ends = jnp.cumsum(sizes)
    s = jnp.arange(pairs, dtype=jnp.int32)
    g = jnp.searchsorted(ends, s, side="right").astype(jnp.int32)  # E: past every group
    gc = jnp.minimum(g, e - 1)
    dest = (jnp.cumsum(padded) - padded)[gc] + s - (ends - sizes)[gc]
    return Aligned(jnp.where(g < e, dest, rows).astype(jnp.int32), padded, rows, tile)


def experts_sorted(x: Array, experts: Array, gates: Array, w: GroupedExperts, active: Array | None,
                   mode: str, tiling: Tiling = TILING, int8_rows: bool = False) -> Array:
    """sum_k gate_k * expert_k(x) for every row of x [M, D] (experts, gates [M, k]); rows not `active` [M]
    (None: all active) compute nothing and come out zero. `tiling`: the kernel's tiles (fitted to each matrix);
    `int8_rows`: the rows meet the int8 matrices rounded to int8 (Products.DOT_INT8)."""
    m, k = experts.shape
    pairs = sort_pairs(experts, gates, active, w.linear.count)
    rows = x[pairs.order // k]  # [P, D] sorted by expert
    sizes = pairs.group_sizes
    if mode != "ragged":  # the kernel: each group from a tile of its own
        aligned = aligned_rows(sizes, m * k, tiling, granule(int8_rows))
        rows = jnp.zeros((aligned.rows, rows.shape[1]), rows.dtype).at[aligned.dest].set(rows, mode="drop")
        sizes, tiling = aligned.group_sizes, tiling._replace(rows=aligned.tile)
    a = grouped_product(rows, w.linear, sizes, mode, tiling, int8_rows)
    b = grouped_product(rows, w.linear_v, sizes, mode, tiling, int8_rows)
    y = grouped_product(transcendental.gelu(a) * b, w.linear_1, sizes, mode, tiling, int8_rows)  # [P, D]
    if mode != "ragged":
        y = y.at[aligned.dest].get(mode="fill", fill_value=0)  # back to sorted order; rows in no group: 0
    y = y[pairs.inverse].reshape(m, k, -1)  # pair order: row-major, a row's experts in expert order
    # Rows of inactive pairs may hold anything (the kernel never writes them): select, never multiply, them away.
    # The barrier keeps XLA from contracting a gate's multiply and the add after it (experts_by_cond's roundings).
    terms = jax.lax.optimization_barrier(jnp.where(pairs.used[..., None], y * pairs.gates.astype(x.dtype)[..., None],
                                                   0.0))
    out = jnp.zeros_like(x)
    for j in range(k):
        out = out + terms[:, j]
    return out
