"""Weights packed for the native CPU kernel (model_service.kernels) and the products that read them.

A PackedWeight holds a matrix as [NB, K, 16]: 16 output columns per contiguous stream, so the kernel reads
each weight once per step with unit stride while every output element stays one in-order chain over K.
It replaces the original (every int8 QuantizedWeight, the float32 router and a float32 embedding table, which
is held only packed), packed on the host as the weights load (params.pack_for_native).

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
import numpy as np
from jax import shard_map
from jax.sharding import Mesh, PartitionSpec as P

from model_service import kernels
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
    packed_scales: Any  # None for float32 weights (the router, the embedding table)
    n: int  # logical output columns
    split: str  # COLUMNS or ROWS: which dim the mesh's model axis splits
    shards: int  # how many model-axis shards split that dim (1: the matrix is replicated)
    mesh: Mesh | None  # the mesh the weight was packed for (None: one device)
    table: bool = False  # the embedding table, whose reference shape is [V, D] = [N, K]

    @property
    def shape(self) -> tuple[int, int]:
        """The reference's logical shape [K, N] ([N, K] for the table; haiku checks parameters against it)."""
        k = self.packed.shape[1]
        return (self.n, k) if self.table else (k, self.n)

    def rows_of(self, ids: Array) -> Array:
        """The table's rows for token ids [...] -> [..., K] (the embedding lookup on the packed layout)."""
        return self.packed[ids // LANES, :, ids % LANES]


jax.tree_util.register_dataclass(PackedWeight, data_fields=["packed", "packed_scales"],
                                 meta_fields=["n", "split", "shards", "mesh", "table"])


def _pack_blocks(w_nk: np.ndarray, scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[N, K] int8 + [blocks, N] -> [ceil(N/16), K, 16] + [blocks, ceil(N/16)*16], padding with zeros."""
    n, k = w_nk.shape
    nb = -(-n // LANES)
    w = np.zeros((nb * LANES, k), w_nk.dtype)
    w[:n] = w_nk
    s = np.zeros((scales.shape[0], nb * LANES), np.float32)
    s[:, :n] = scales
    return np.ascontiguousarray(w.reshape(nb, LANES, k).transpose(0, 2, 1)), s


def pack_quantized(q: "QuantizedWeight", mesh: Mesh | None) -> PackedWeight:
    """A host QuantizedWeight (layers.py layouts) -> a host PackedWeight for `mesh`'s model axis."""
    weight, scales = np.asarray(q.weight), np.asarray(q.scales, np.float32)
    model = mesh.shape[MODEL] if mesh is not None and mesh.size > 1 else 1
    mesh = mesh if mesh is not None and mesh.size > 1 else None
    if q.transposed:  # column-parallel [N, K]: pad each model shard's columns separately
        n = weight.shape[0]
        shards = model if n % model == 0 else 1
        parts = [_pack_blocks(w, s) for w, s in zip(np.split(weight, shards), np.split(scales, shards, axis=1))]
        return PackedWeight(np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts], axis=1),
                            n, COLUMNS, shards, mesh)
    k = weight.shape[0]  # row-parallel [K, N]: each shard takes whole scale blocks of K
    shards = model if k % model == 0 and scales.shape[0] % model == 0 else 1
    packed, packed_scales = _pack_blocks(weight.T, scales)
    return PackedWeight(packed, packed_scales, weight.shape[1], ROWS, shards, mesh)


def pack_float(w_kn: np.ndarray, mesh: Mesh | None, table: bool = False) -> PackedWeight:
    """A host float32 [K, N] matrix -> a PackedWeight without scales. The table ([V, D] given as its transpose
    view [D, V]) splits K (its features) over the model axis, as sharding.py places the embeddings; anything
    else is replicated."""
    w_kn = np.asarray(w_kn, np.float32)
    k, n = w_kn.shape
    model = mesh.shape[MODEL] if mesh is not None and mesh.size > 1 else 1
    shards = model if table and k % model == 0 else 1
    packed, _ = _pack_blocks(w_kn.T, np.zeros((0, n), np.float32))
    return PackedWeight(packed, None, n, ROWS, shards, mesh if mesh is not None and mesh.size > 1 else None, table)


def pack_experts(stack: "ExpertStack", mesh: Mesh | None) -> "ExpertStack":
    return type(stack)(tuple(pack_quantized(q, mesh) for q in stack.experts))


def _row_spec(m: int, mesh: Mesh) -> str | None:
    data = mesh.shape[DATA]
    return DATA if data > 1 and m % data == 0 else None


def packed_product(x: Array, w: PackedWeight, isa: str | None = None, rows: Array | None = None) -> Array:
    """x float32 [M, K] times a PackedWeight -> float32 [M, N], through the native kernel (per shard). `rows`
    bool [M] (default: all): only those rows are computed, the others are zero (kernels.matmul)."""
    scaled = w.packed_scales is not None
    mask = jnp.ones((x.shape[0],), jnp.bool_) if rows is None else rows.astype(jnp.bool_)
    if w.mesh is None:
        return kernels.matmul(x, w.packed, w.packed_scales, w.n, isa, rows=mask)
    operands = (x, mask, w.packed, w.packed_scales) if scaled else (x, mask, w.packed)
    rows_axis, split = _row_spec(x.shape[0], w.mesh), MODEL if w.shards > 1 else None
    if w.split == COLUMNS:
        def columns(xs: Array, ms: Array, ws: Array, ss: Array | None = None) -> Array:
            return kernels.matmul(xs, ws, ss, w.n // w.shards, isa, rows=ms)
        specs = (P(rows_axis, None), P(rows_axis), P(split, None, None), P(None, split))
        return shard_map(columns, mesh=w.mesh, in_specs=specs[:len(operands)], out_specs=P(rows_axis, split),
                         check_vma=False)(*operands)

    def row_blocks(xs: Array, ms: Array, ws: Array, ss: Array | None = None) -> Array:
        partial = kernels.matmul(xs, ws, ss, w.n, isa, rows=ms)
        return jax.lax.psum(partial, MODEL) if split else partial
    specs = (P(rows_axis, split), P(rows_axis), P(None, split, None), P(split, None))
    return shard_map(row_blocks, mesh=w.mesh, in_specs=specs[:len(operands)], out_specs=P(rows_axis, None),
                     check_vma=False)(*operands)


def native_ok(dtype: Any) -> bool:
    """Whether products may run natively for this compute dtype (the kernel takes float32 rows)."""
    return kernels.available() and jnp.dtype(dtype) == jnp.dtype(jnp.float32)
