"""Paged KV memory on the device: per-layer pools of fixed-size blocks.

A layer's keys (and values) live in a pool `[blocks + 1, Hkv, block_size, D]` ("heads": the CPU's layout, its
native kernel's) or `[blocks + 1, block_size, Hkv * D]` ("tokens": the accelerators'; a TPU tiles the last two
dimensions by 8 x 128, so a key size under 128 in the heads layout is padded or, as XLA lays it out, copied
whole into another layout on every step: medium's 8 layers spent 3.9 of 5.7 ms a step so on a v5e; a token's
keys are one row here, written in one piece). Under the scanned layers (Backend.scan_layers) every layer's pool is
one array `[layers, blocks + 1, ...]`, read and written in place one layer at a time through `LayerPool`.
The last block is scratch:
every table entry a sequence does not use points at it, and rows that hold no token write there. Which
blocks hold a sequence's positions is the scheduler's business (kv_blocks.py): every step takes the block
tables `[slots, table_len]` int32 as an argument, and each token row writes its key and value at its own
position of its own sequence, then reads that sequence's keys through its table.

Layout (one layer; a sequence holding 40 tokens with 16-token blocks, table [7, 2, 9, S, S, ...]):

    pool.k  block 0 |................|      positions  0..15 -> block 7
            block 2 |################|                16..31 -> block 2
            block 7 |################|                32..39 -> block 9 (offsets 0..7)
            block 9 |########........|      table entries past the sequence -> S (scratch)
            ...
            block S |  scratch       |
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from model_service.sharding import POOL_SPEC, TOKEN_POOL_SPEC, named

LAYOUTS = ("heads", "tokens")


class KVMemory(NamedTuple):
    """One layer's keys and values: a block pool (either layout), or (inside a dense pass) the sequence's own
    [B, Hkv, T, D]."""

    k: jax.Array
    v: jax.Array


Pools = tuple[KVMemory, ...] | KVMemory  # one per layer, or (stacked) every layer's in one KVMemory [layers, ...]


class LayerPool(NamedTuple):
    """Layer `layer` of pools stacked over the layers [layers, blocks + 1, ...], standing for that layer's pool:
    its shape is one layer's, and write_tokens / read_blocks index the stack (a scanned layer never slices its
    pool out, which would copy it)."""

    stacked: jax.Array
    layer: jax.Array  # int32 []

    @property
    def shape(self) -> tuple[int, ...]:
        return self.stacked.shape[1:]

    @property
    def ndim(self) -> int:
        return self.stacked.ndim - 1

    @property
    def dtype(self) -> jnp.dtype:
        return self.stacked.dtype


def pool_shape(num_blocks: int, block_size: int, num_kv_heads: int, key_size: int,
               layout: str = "heads") -> tuple[int, ...]:
    if layout not in LAYOUTS:
        raise ValueError(f"KV layout must be one of {LAYOUTS}, got {layout!r}")
    if layout == "tokens":
        return (num_blocks + 1, block_size, num_kv_heads * key_size)
    return (num_blocks + 1, num_kv_heads, block_size, key_size)


def init_pools(num_blocks: int, block_size: int, num_layers: int, num_kv_heads: int, key_size: int,
               dtype: jnp.dtype, layout: str = "heads", stacked: bool = False) -> Pools:
    """Zeroed pools of `num_blocks` blocks (+ the scratch block) in `layout`; `stacked`: in one KVMemory."""
    shape = pool_shape(num_blocks, block_size, num_kv_heads, key_size, layout)
    if stacked:
        return KVMemory(jnp.zeros((num_layers, *shape), dtype), jnp.zeros((num_layers, *shape), dtype))
    return tuple(KVMemory(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)) for _ in range(num_layers))


def block_size_of(pool: jax.Array) -> int:
    """Tokens a block of `pool` (either layout) holds."""
    return pool.shape[1] if pool.ndim == 3 else pool.shape[2]


def write_tokens(pool: jax.Array | LayerPool, new: jax.Array, blocks: jax.Array,
                 offsets: jax.Array) -> jax.Array | LayerPool:
    """pool <- new [R, Hkv, D]: row r at offset offsets[r] of block blocks[r] (one token per row)."""
    if isinstance(pool, LayerPool):
        return pool._replace(stacked=_write(pool.stacked, (pool.layer,), new, blocks, offsets))
    return _write(pool, (), new, blocks, offsets)


def _write(pool: jax.Array, lead: tuple[jax.Array, ...], new: jax.Array, blocks: jax.Array,
           offsets: jax.Array) -> jax.Array:
    if pool.ndim - len(lead) == 3:  # tokens layout: a token's keys are one row
        return pool.at[(*lead, blocks, offsets)].set(new.reshape(new.shape[0], -1).astype(pool.dtype),
                                                     mode="promise_in_bounds")
    return pool.at[(*lead, blocks, slice(None), offsets, slice(None))].set(new.astype(pool.dtype),
                                                                         mode="promise_in_bounds")


def read_blocks(pool: jax.Array | LayerPool, ids: jax.Array, num_kv_heads: int) -> jax.Array:
    """The blocks `ids` [...] of `pool` with the heads apart: [..., Hkv, block_size, D] (heads layout) or
    [..., block_size, Hkv, D] (tokens layout)."""
    got = pool.stacked[pool.layer, ids] if isinstance(pool, LayerPool) else pool[ids]
    if pool.ndim == 4:
        return got
    *lead, bs, width = got.shape
    return got.reshape(*lead, bs, num_kv_heads, width // num_kv_heads)


def pools_shardings(mesh: Mesh, num_blocks: int, block_size: int, num_layers: int, num_kv_heads: int,
                    key_size: int, layout: str = "heads", stacked: bool = False) -> Pools:
    """NamedShardings matching `init_pools`: kv heads on `model`; blocks are shared by every data shard (and the
    stacked pools' layer axis unsharded)."""
    spec = TOKEN_POOL_SPEC if layout == "tokens" else POOL_SPEC
    shape = pool_shape(num_blocks, block_size, num_kv_heads, key_size, layout)
    if stacked:
        kv = named(mesh, P(None, *spec), (num_layers, *shape))
        return KVMemory(kv, kv)
    kv = named(mesh, spec, shape)
    return tuple(KVMemory(kv, kv) for _ in range(num_layers))
