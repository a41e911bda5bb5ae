"""Weights packed for the native CPU kernel (model_service.kernels) and the products that read them.

A PackedWeight holds a matrix as [NB, K, 16]: 16 output columns per contiguous stream, so the kernel reads
each weight once per step with unit stride while every output element stays one in-order chain over K.
It replaces the original (every int8 QuantizedWeight, the float32 router and the embedding table, in the type
the checkpoint stores it: bfloat16 for the released Grok-1, which is held only packed), packed on the host as
the weights load (params.pack_for_native), slab by slab from the checkpoint file without a second copy.

Under a mesh the kernel runs per shard through `shard_map`, split like the weights (sharding.py):
- column-parallel ("columns": query/key/value, the experts' linear / linear_v, N split over `model`; the
  router, replicated): each shard's columns
  are padded to whole 16-column blocks on their own, so the packed rows split evenly over the shards and a
  shard's product is just its columns;
- row-parallel ("rows": the attention output and the experts' linear_1 with 8 row-block scales, the table
  without scales; K split over `model`): each shard holds whole scale blocks of K and returns a partial sum;
  a psum over `model` adds the shards in a fixed order.
Rows are split over `data` when it divides them; the kernel is row-independent, so that changes no bits.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax import shard_map
from jax.sharding import Mesh, PartitionSpec as P

from model_service import kernels
from model_service.file_arrays import FileArray
from model_service.sharding import DATA, MODEL

if TYPE_CHECKING:
    from model_service.model.weights import ExpertStack, QuantizedWeight

Array = jax.Array
LANES = kernels.LANES
COLUMNS, ROWS = "columns", "rows"


@dataclasses.dataclass(frozen=True)
class PackedWeight:
    """A [K, N] matrix packed for the native kernel. `packed` int8 (or float32) [S*NB, K, 16] (S = `shards` when
    split == COLUMNS, else 1), `packed_scales` float32 [blocks, S*NB*16] (zero on padding columns) or None."""

    packed: Any
    packed_scales: Any  # None for unscaled weights (the float32 router, the float32 or bfloat16 table)
    n: int  # logical output columns
    split: str  # COLUMNS or ROWS: which dim the mesh's model axis splits
    shards: int  # how many model-axis shards split that dim (1: the matrix is replicated)
    mesh: Mesh | None  # the mesh the weight was packed for (None: one device)
    table: bool = False  # the embedding table, whose reference shape is [V, D] = [N, K]

    @property
    def shape(self) -> tuple[int, int]:
        """The reference's logical shape [K, N] ([N, K] for the table; haiku checks parameters against it); of
        one matrix for a stack of experts."""
        k = self.packed.shape[-2]
        return (self.n, k) if self.table else (k, self.n)

    @property
    def stacked(self) -> bool:
        """A stack of experts' matrices: packed [E, NB, K, 16], packed_scales [E, B, NB*16] (one device)."""
        return len(self.packed.shape) == 4

    def expert(self, e: int) -> "PackedWeight":
        """Matrix e of a stack."""
        return dataclasses.replace(self, packed=self.packed[e], packed_scales=self.packed_scales[e])

    def rows_of(self, ids: Array) -> Array:
        """The table's rows for token ids [...] -> [..., K] (the embedding lookup on the packed layout); an int8
        table's rows come out float32, each block of K times its scale."""
        rows = self.packed[ids // LANES, :, ids % LANES]
        if self.packed_scales is None:
            return rows
        blocks, k = self.packed_scales.shape[0], rows.shape[-1]
        scales = jnp.moveaxis(self.packed_scales[:, ids], 0, -1)  # [..., blocks]
        blocked = rows.astype(jnp.float32).reshape(*rows.shape[:-1], blocks, k // blocks) * scales[..., None]
        return blocked.reshape(rows.shape)


jax.tree_util.register_dataclass(PackedWeight, data_fields=["packed", "packed_scales"],
                                 meta_fields=["n", "split", "shards", "mesh", "table"])


# What a packer reads from its source at a time: packing holds the packed matrix and one such slab, never a
# second copy of the matrix (a checkpoint's FileArray is read slab by slab straight into the packed layout).
SLAB_BYTES = 32 << 20


def _is_file(src: Any) -> bool:
    return isinstance(src, FileArray)


def _transpose(src: Any) -> Any:
    """A 2-D source (numpy array or FileArray view) with its axes swapped, as a view."""
    return src.swapaxes(0, 1) if _is_file(src) else src.T


def _region(src: Any, rows: slice, cols: slice) -> np.ndarray:
    return src.read((rows, cols)) if _is_file(src) else np.asarray(src[rows, cols])


def _k_major(w_nk: Any) -> bool:
    """Whether an [N, K] source lies in memory or on disk K-major (as the checkpoint's [K, N] int8 does):
    slabs of K are then contiguous reads, slabs of N would be one read per value of K."""
    if _is_file(w_nk):
        return w_nk.axes == (1, 0)
    return w_nk.strides[0] < w_nk.strides[1]


def _pack_into(dst: np.ndarray, w_nk: Any, n0: int, n1: int) -> None:
    """Rows n0..n1 of the [N, K] source packed into dst [ceil((n1 - n0) / 16), K, 16], zero-initialised
    (the padding columns of the last block stay zero): dst[j, k, l] = w_nk[n0 + 16 j + l, k]."""
    n, k = n1 - n0, w_nk.shape[1]

    def put(chunk: np.ndarray, k0: int, k1: int, r0: int) -> None:  # chunk [r, k1 - k0] = rows n0 + r0 ...
        whole = (len(chunk) // LANES) * LANES
        dst[r0 // LANES:(r0 + whole) // LANES, k0:k1] = chunk[:whole].reshape(-1, LANES, k1 - k0).transpose(0, 2, 1)
        if whole < len(chunk):
            dst[(r0 + whole) // LANES, k0:k1, :len(chunk) - whole] = chunk[whole:].T

    itemsize = np.dtype(w_nk.dtype).itemsize
    if _k_major(w_nk):
        step = max(1, SLAB_BYTES // max(1, n * itemsize))
        for k0 in range(0, k, step):
            k1 = min(k, k0 + step)
            put(_region(w_nk, slice(n0, n1), slice(k0, k1)), k0, k1, 0)
        return
    step = max(LANES, SLAB_BYTES // max(1, k * itemsize) // LANES * LANES)
    for r0 in range(0, n, step):
        r1 = min(n, r0 + step)
        put(_region(w_nk, slice(n0 + r0, n0 + r1), slice(0, k)), 0, k, r0)


def _pack(w_nk: Any, scales: np.ndarray | None, shards: int, dtype: Any) -> tuple[np.ndarray, np.ndarray | None]:
    """[N, K] (+ scales [blocks, N]) -> [S * ceil(N / S / 16), K, 16] (+ [blocks, S * ceil(N / S / 16) * 16]),
    each of the S shards of N padded to whole 16-column blocks on its own (zeros)."""
    n, k = w_nk.shape
    per = n // shards
    nb = -(-per // LANES)
    packed = np.zeros((shards * nb, k, LANES), dtype)
    for s in range(shards):
        _pack_into(packed[s * nb:(s + 1) * nb], w_nk, s * per, (s + 1) * per)
    if scales is None:
        return packed, None
    padded = np.zeros((scales.shape[0], shards * nb * LANES), np.float32)
    for s in range(shards):
        padded[:, s * nb * LANES:s * nb * LANES + per] = scales[:, s * per:(s + 1) * per]
    return packed, padded


def pack_quantized(q: "QuantizedWeight", mesh: Mesh | None) -> PackedWeight:
    """A host QuantizedWeight (layers.py layouts; its weight a numpy array or a checkpoint FileArray view) ->
    a host PackedWeight for `mesh`'s model axis."""
    scales = np.asarray(q.scales, np.float32)
    model = mesh.shape[MODEL] if mesh is not None and mesh.size > 1 else 1
    mesh = mesh if mesh is not None and mesh.size > 1 else None
    if q.transposed:  # column-parallel [N, K]: pad each model shard's columns separately
        n = q.weight.shape[0]
        shards = model if n % model == 0 else 1
        packed, packed_scales = _pack(q.weight, scales, shards, np.int8)
        return PackedWeight(packed, packed_scales, n, COLUMNS, shards, mesh)
    k = q.weight.shape[0]  # row-parallel [K, N]: each shard takes whole scale blocks of K
    shards = model if k % model == 0 and scales.shape[0] % model == 0 else 1
    packed, packed_scales = _pack(_transpose(q.weight), scales, 1, np.int8)
    return PackedWeight(packed, packed_scales, q.weight.shape[1], ROWS, shards, mesh)


def pack_float(w_kn: np.ndarray, mesh: Mesh | None, table: bool = False) -> PackedWeight:
    """A host float32 [K, N] matrix -> a PackedWeight without scales. The table ([V, D] given as its transpose
    view [D, V]) splits K (its features) over the model axis, as sharding.py places the embeddings; anything
    else is replicated."""
    w_kn = np.asarray(w_kn, np.float32)
    k, n = w_kn.shape
    model = mesh.shape[MODEL] if mesh is not None and mesh.size > 1 else 1
    shards = model if table and k % model == 0 else 1
    packed, _ = _pack(w_kn.T, None, 1, np.float32)
    return PackedWeight(packed, None, n, ROWS, shards, mesh if mesh is not None and mesh.size > 1 else None, table)


TABLE_BLOCK = 32  # values of D per scale of an int8 table (llama.cpp's Q8_0 block)


def int8_table_ok(d: int) -> bool:
    return d % TABLE_BLOCK == 0


def _pack_int8_table(table: Any, model: int, mesh: Mesh | None) -> PackedWeight:
    """The table rounded to int8 per TABLE_BLOCK values of D (scale max|x| / 127 each, as the checkpoint's own
    int8 matrices): packed int8 [V/16, D, 16] and scales [D / TABLE_BLOCK, V/16 * 16], read slab by slab."""
    v, d = table.shape
    blocks = d // TABLE_BLOCK
    nb = -(-v // LANES)
    packed = np.zeros((nb, d, LANES), np.int8)
    scales = np.zeros((blocks, nb * LANES), np.float32)
    step = max(LANES, SLAB_BYTES // (4 * d) // LANES * LANES)
    for v0 in range(0, v, step):
        v1 = min(v, v0 + step)
        slab = _region(table, slice(v0, v1), slice(0, d)).astype(np.float32).reshape(v1 - v0, blocks, TABLE_BLOCK)
        scale = (np.abs(slab).max(axis=-1) / np.float32(127)).astype(np.float32)  # [rows, blocks]
        safe = np.where(scale > 0, scale, np.float32(1))
        q = np.clip(np.rint(slab / safe[..., None]), -127, 127).astype(np.int8).reshape(v1 - v0, d)
        _pack_into(packed[v0 // LANES:-(-v1 // LANES)], q, 0, v1 - v0)
        scales[:, v0:v1] = scale.T
    shards = model if d % model == 0 and blocks % model == 0 else 1
    return PackedWeight(packed, scales, v, ROWS, shards, mesh, True)


def pack_table(table: Any, mesh: Mesh | None, int8: bool = False) -> PackedWeight:
    """The embedding table [V, D] (numpy or a checkpoint FileArray) -> a PackedWeight of its own type when that
    is bfloat16 (the released checkpoint's: the kernel converts it exactly, so the logits are the bits a float32
    table of the same values gives, from half the bytes), float32 otherwise. Read slab by slab (SLAB_BYTES).
    `int8` (with int8 activations, an opt-in; D a multiple of TABLE_BLOCK): rounded to int8 per TABLE_BLOCK
    values of D, as llama.cpp's Q8_0 output matrix, reading half the bytes of bfloat16 per sampled row."""
    if int8 and int8_table_ok(table.shape[1]):
        model = mesh.shape[MODEL] if mesh is not None and mesh.size > 1 else 1
        return _pack_int8_table(table, model, mesh if mesh is not None and mesh.size > 1 else None)
    dtype = np.dtype(table.dtype)
    dtype = dtype if dtype == np.dtype(ml_dtypes.bfloat16) else np.dtype(np.float32)
    v, d = table.shape
    model = mesh.shape[MODEL] if mesh is not None and mesh.size > 1 else 1
    source = table if np.dtype(table.dtype) == dtype else table.astype(dtype)
    packed, _ = _pack(source, None, 1, dtype)
    return PackedWeight(packed, None, v, ROWS, model if d % model == 0 else 1,
                        mesh if mesh is not None and mesh.size > 1 else None, True)


def pack_experts(stack: "ExpertStack", mesh: Mesh | None) -> "ExpertStack":
    return type(stack)(tuple(pack_quantized(q, mesh) for q in stack.experts))


def _row_spec(m: int, mesh: Mesh) -> str | None:
    data = mesh.shape[DATA]
    return DATA if data > 1 and m % data == 0 else None


def packed_product(x: Array, w: PackedWeight, isa: str | None = None, rows: Array | None = None,
                   activations: str = "float32", fill_unused: bool = True, multiplier: float = 1.0) -> Array:
    """x float32 [M, K] times a PackedWeight -> float32 [M, N], through the native kernel (per shard). `rows`
    bool [M] (default: all): only those rows are computed, the others are zero (undefined with `fill_unused`
    False); `activations` "int8" rounds the rows to int8 first; `multiplier` (an unscaled weight) multiplies
    each computed element after its sum (kernels.matmul)."""
    scaled = w.packed_scales is not None
    mask = jnp.ones((x.shape[0],), jnp.bool_) if rows is None else rows.astype(jnp.bool_)
    if w.mesh is None:
        return kernels.matmul(x, w.packed, w.packed_scales, w.n, isa, rows=mask, activations=activations,
                              fill_unused=fill_unused, multiplier=multiplier)
    operands = (x, mask, w.packed, w.packed_scales) if scaled else (x, mask, w.packed)
    rows_axis, split = _row_spec(x.shape[0], w.mesh), MODEL if w.shards > 1 else None
    if w.split == COLUMNS:
        def columns(xs: Array, ms: Array, ws: Array, ss: Array | None = None) -> Array:
            return kernels.matmul(xs, ws, ss, w.n // w.shards, isa, rows=ms, activations=activations,
                                  fill_unused=fill_unused, multiplier=multiplier)
        specs = (P(rows_axis, None), P(rows_axis), P(split, None, None), P(None, split))
        return shard_map(columns, mesh=w.mesh, in_specs=specs[:len(operands)], out_specs=P(rows_axis, split),
                         check_vma=False)(*operands)

    def row_blocks(xs: Array, ms: Array, ws: Array, ss: Array | None = None) -> Array:
        partial = kernels.matmul(xs, ws, ss, w.n, isa, rows=ms, activations=activations, fill_unused=fill_unused)
        total = jax.lax.psum(partial, MODEL) if split else partial
        return total if multiplier == 1.0 else total * jnp.float32(multiplier)
    specs = (P(rows_axis, split), P(rows_axis), P(None, split, None), P(split, None))
    return shard_map(row_blocks, mesh=w.mesh, in_specs=specs[:len(operands)], out_specs=P(rows_axis, None),
                     check_vma=False)(*operands)


def native_ok(dtype: Any) -> bool:
    """Whether products may run natively for this compute dtype (the kernel takes float32 rows)."""
    return kernels.available() and jnp.dtype(dtype) == jnp.dtype(jnp.float32)
