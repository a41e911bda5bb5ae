"""Weights packed for the native CPU kernel (model_service.kernels) and the products that read them.

A PackedWeight holds a matrix as [NB, K, 16]: 16 output columns per contiguous stream, so the kernel reads
each weight once per step with unit stride while every output element stays one in-order chain over K.
It replaces the original (every int8 QuantizedWeight, the float32 router and the embedding table, in the type
the checkpoint stores it: bfloat16 for the released Grok-1, which is held only packed, in 13 bits a value where
it can be: pack_bf16_in_13), packed on the host as the weights load (params.pack_for_native), slab by slab from
the checkpoint file without a second copy.

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

import concurrent.futures
import dataclasses
import logging
import os
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

log = logging.getLogger(__name__)
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
    # A bfloat16 table held in 13 bits a value (pack_bf16_in_13): `packed` uint8 [NB, K / 4, 104] and these 32
    # high bytes; None for every other weight.
    dictionary: Any = None

    @property
    def shape(self) -> tuple[int, int]:
        """The reference's logical shape [K, N] ([N, K] for the table; haiku checks parameters against it); of
        one matrix for a stack of experts."""
        k = self.packed.shape[-2] * (GROUP_13 if self.dictionary is not None else 1)
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
        if self.dictionary is not None:
            return _rows_of_13(self.packed, self.dictionary, ids)
        rows = self.packed[ids // LANES, :, ids % LANES]
        if self.packed_scales is None:
            return rows
        blocks, k = self.packed_scales.shape[0], rows.shape[-1]
        scales = jnp.moveaxis(self.packed_scales[:, ids], 0, -1)  # [..., blocks]
        blocked = rows.astype(jnp.float32).reshape(*rows.shape[:-1], blocks, k // blocks) * scales[..., None]
        return blocked.reshape(rows.shape)


jax.tree_util.register_dataclass(PackedWeight, data_fields=["packed", "packed_scales", "dictionary"],
                                 meta_fields=["n", "split", "shards", "mesh", "table"])


# bfloat16 in 13 bits (the kernel's kBf16In13, native/matmul.h): per column block and 4 values of k, 64 values in
# 104 bytes: the low bytes at their positions, 32 bytes of 4-bit dictionary indexes (byte j: position j low,
# j + 32 high), 8 bytes of the indexes' fifth bits (little-endian bit p: position p). Value (k = 4 g + t, column c)
# sits at position POSITIONS_13[t, c], the order the AVX-512 unpacking yields.
GROUP_13 = 4  # values of k per group
GROUP_13_BYTES = kernels.GROUP_13_BYTES
DICTIONARY_13 = kernels.DICTIONARY_13
POSITIONS_13 = np.array([[16 * (c // 4) + 2 * (c % 4) + t % 2 + 8 * (t // 2) for c in range(LANES)]
                         for t in range(GROUP_13)], np.int64)  # [t, c]


def _grouped(values: np.ndarray) -> np.ndarray:
    """[16 NB, K] -> [NB, K / 4, 64]: each block's 16 rows (columns of the product) and 4 values of k in group order.
    POSITIONS_13 in mixed radix: position = 16 c1 + 8 t1 + 2 c0 + t0 for column c = 4 c1 + c0, k = 4 g + 2 t1 + t0."""
    rows, k = values.shape
    blocks = values.reshape(rows // LANES, 4, 4, k // GROUP_13, 2, 2)  # [NB, c1, c0, g, t1, t0]
    return np.ascontiguousarray(blocks.transpose(0, 3, 1, 4, 2, 5)).reshape(rows // LANES, k // GROUP_13, 64)


def _write_13(dst: np.ndarray, bits: np.ndarray, index: np.ndarray) -> None:
    """One slab of rows (bits uint16 [16 NB, K], their dictionary indexes uint8) into dst uint8 [NB, K / 4, 104]."""
    both = _grouped((bits & 0xFF) | (index.astype(np.uint16) << 8))  # low byte and index, moved once
    dst[..., :64] = both & 0xFF
    index = (both >> 8).astype(np.uint8)
    dst[..., 64:96] = (index[..., :32] & 15) | ((index[..., 32:] & 15) << 4)
    dst[..., 96:] = np.packbits(index >> 4, axis=-1, bitorder="little")


def pack_bf16_in_13(table: Any) -> tuple[np.ndarray, np.ndarray] | None:
    """A bfloat16 table [V, D] (numpy or a checkpoint FileArray), D % 4 == 0 -> (packed uint8 [ceil(V / 16), D / 4,
    104], dictionary uint8 [32]): the same values in 13 bits each instead of 16, exactly; None when the table holds
    more than 32 distinct high bytes (sign and the exponent's top 7 bits). Read slab by slab; the dictionary lists
    the high bytes in the order they first appear (each slab's new ones ascending)."""
    v, d = table.shape
    nb = -(-v // LANES)
    out = np.empty((nb, d // GROUP_13, GROUP_13_BYTES), np.uint8)
    workers = max(1, min(4, os.cpu_count() or 1))  # slabs rearranged beside the reading of the next
    unknown = 255
    lookup = np.full(256, unknown, np.uint8)  # high byte -> its index in the dictionary
    dictionary: list[int] = []
    step = max(LANES, SLAB_BYTES // (2 * d) // LANES * LANES)
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        pending: list[concurrent.futures.Future[None]] = []
        for v0 in range(0, v, step):
            v1 = min(v, v0 + step)
            bits = _region(table, slice(v0, v1), slice(0, d)).view(np.uint16)
            if (v1 - v0) % LANES:  # the last block's missing columns are zeros
                bits = np.concatenate([bits, np.zeros((LANES - (v1 - v0) % LANES, d), np.uint16)])
            high = (bits >> 8).astype(np.uint8)
            index = lookup[high]
            if np.any(index == unknown):  # high bytes not seen before (counted only then: a count is slow)
                for byte in np.flatnonzero(np.bincount(high[index == unknown], minlength=256)):
                    if len(dictionary) == DICTIONARY_13:
                        return None
                    lookup[byte] = len(dictionary)
                    dictionary.append(int(byte))
                index = lookup[high]
            pending.append(pool.submit(_write_13, out[v0 // LANES:v0 // LANES + len(bits) // LANES], bits, index))
            while len(pending) > workers:  # at most this many slabs held at once
                pending.pop(0).result()
        for job in pending:
            job.result()
    padded = np.zeros(DICTIONARY_13, np.uint8)
    padded[:len(dictionary)] = dictionary
    return out, padded


def _rows_of_13(packed: Array, dictionary: Array, ids: Array) -> Array:
    """The bfloat16 rows [..., K] of token ids [...] of a table held in 13 bits (the embedding lookup)."""
    groups = packed[ids // LANES]  # [..., K / 4, 104]
    at = jnp.asarray(POSITIONS_13.T)[ids % LANES]  # [..., 4]: each t's position in the group
    pick = lambda offsets: jnp.take_along_axis(groups, offsets[..., None, :], axis=-1).astype(jnp.uint16)
    low = pick(at)
    nibble = (pick(64 + at % 32) >> (4 * (at // 32))[..., None, :].astype(jnp.uint16)) & 15
    fifth = (pick(96 + at // 8) >> (at % 8)[..., None, :].astype(jnp.uint16)) & 1
    high = dictionary[(nibble | (fifth << 4)).astype(jnp.int32)].astype(jnp.uint16)
    bits = ((high << 8) | low).reshape(*ids.shape, -1)  # [..., K]: k = 4 g + t
    return jax.lax.bitcast_convert_type(bits, jnp.bfloat16)


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


def pack_table(table: Any, mesh: Mesh | None, int8: bool = False, in_13_bits: bool | None = None) -> PackedWeight:
    """The embedding table [V, D] (numpy or a checkpoint FileArray) -> a PackedWeight of its own type when that
    is bfloat16 (the released checkpoint's: the kernel converts it exactly, so the logits are the bits a float32
    table of the same values gives, from half the bytes), float32 otherwise. Read slab by slab (SLAB_BYTES).
    A bfloat16 table is held in 13 bits a value where it can be (`in_13_bits`, default kernels.table_in_13_bits():
    pack_bf16_in_13 needs at most 32 distinct high bytes and each model shard's D a multiple of 4): the same
    values and logits from 19 % fewer bytes read per sampled row.
    `int8` (with int8 activations, an opt-in; D a multiple of TABLE_BLOCK): rounded to int8 per TABLE_BLOCK
    values of D, as llama.cpp's Q8_0 output matrix, reading half the bytes of bfloat16 per sampled row."""
    if int8 and int8_table_ok(table.shape[1]):
        model = mesh.shape[MODEL] if mesh is not None and mesh.size > 1 else 1
        return _pack_int8_table(table, model, mesh if mesh is not None and mesh.size > 1 else None)
    dtype = np.dtype(table.dtype)
    dtype = dtype if dtype == np.dtype(ml_dtypes.bfloat16) else np.dtype(np.float32)
    v, d = table.shape
    model = mesh.shape[MODEL] if mesh is not None and mesh.size > 1 else 1
    shards = model if d % model == 0 else 1
    mesh = mesh if mesh is not None and mesh.size > 1 else None
    in_13_bits = kernels.table_in_13_bits() if in_13_bits is None else in_13_bits
    if in_13_bits and dtype == np.dtype(ml_dtypes.bfloat16) and (d // shards) % GROUP_13 == 0:
        held = pack_bf16_in_13(table)
        if held is not None:
            log.info("embedding table held in 13 bits a value: %.2f GB instead of %.2f GB of bfloat16",
                     held[0].nbytes / 1e9, 2 * v * d / 1e9)
            return PackedWeight(held[0], None, v, ROWS, shards, mesh, True, held[1])
        log.info("the embedding table has more than %d distinct high bytes: held as bfloat16", DICTIONARY_13)
    source = table if np.dtype(table.dtype) == dtype else table.astype(dtype)
    packed, _ = _pack(source, None, 1, dtype)
    return PackedWeight(packed, None, v, ROWS, shards, mesh, True)


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
                              fill_unused=fill_unused, multiplier=multiplier, dictionary=w.dictionary)
    operands = (x, mask, w.packed, w.packed_scales) if scaled else (x, mask, w.packed)
    rows_axis, split = _row_spec(x.shape[0], w.mesh), MODEL if w.shards > 1 else None
    if w.split == COLUMNS:
        def columns(xs: Array, ms: Array, ws: Array, ss: Array | None = None) -> Array:
            return kernels.matmul(xs, ws, ss, w.n // w.shards, isa, rows=ms, activations=activations,
                                  fill_unused=fill_unused, multiplier=multiplier)
        specs = (P(rows_axis, None), P(rows_axis), P(split, None, None), P(None, split))
        return shard_map(columns, mesh=w.mesh, in_specs=specs[:len(operands)], out_specs=P(rows_axis, split),
                         check_vma=False)(*operands)

    held = w.dictionary is not None  # a table in 13 bits: its dictionary (on every shard) in the scales' place
    if held:
        operands = (x, mask, w.packed, w.dictionary)

    def row_blocks(xs: Array, ms: Array, ws: Array, extra: Array | None = None) -> Array:
        scales, dictionary = (None, extra) if held else (extra, None)
        partial = kernels.matmul(xs, ws, scales, w.n, isa, rows=ms, activations=activations,
                                 fill_unused=fill_unused, dictionary=dictionary)
        total = jax.lax.psum(partial, MODEL) if split else partial
        return total if multiplier == 1.0 else total * jnp.float32(multiplier)
    specs = (P(rows_axis, split), P(rows_axis), P(None, split, None), P(None) if held else P(split, None))
    return shard_map(row_blocks, mesh=w.mesh, in_specs=specs[:len(operands)], out_specs=P(rows_axis, None),
                     check_vma=False)(*operands)


def native_ok(dtype: Any) -> bool:
    """Whether products may run natively for this compute dtype (the kernel takes float32 rows)."""
    return kernels.available() and jnp.dtype(dtype) == jnp.dtype(jnp.float32)
