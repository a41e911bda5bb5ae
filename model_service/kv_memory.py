"""Paged KV memory on the device: per-layer pools of fixed-size blocks.

A layer's keys (and values) live in a pool `[blocks + 1, Hkv, block_size, D]`; the last block is scratch:
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
from jax.sharding import Mesh

from model_service.sharding import POOL_SPEC, named


class KVMemory(NamedTuple):
    """One layer's keys and values: a block pool [blocks + 1, Hkv, block_size, D], or (inside a dense pass) the
    sequence's own [B, Hkv, T, D]."""

    k: jax.Array
    v: jax.Array


Pools = tuple[KVMemory, ...]  # one per layer


def init_pools(num_blocks: int, block_size: int, num_layers: int, num_kv_heads: int, key_size: int,
               dtype: jnp.dtype) -> Pools:
    """Zeroed pools of `num_blocks` blocks (+ the scratch block)."""
    shape = (num_blocks + 1, num_kv_heads, block_size, key_size)
    return tuple(KVMemory(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)) for _ in range(num_layers))


def write_tokens(pool: jax.Array, new: jax.Array, blocks: jax.Array, offsets: jax.Array) -> jax.Array:
    """pool <- new [R, Hkv, D]: row r at offset offsets[r] of block blocks[r] (one token per row)."""
    return pool.at[blocks, :, offsets, :].set(new.astype(pool.dtype), mode="promise_in_bounds")


def pools_shardings(mesh: Mesh, num_blocks: int, block_size: int, num_layers: int, num_kv_heads: int,
                    key_size: int) -> Pools:
    """NamedShardings matching `init_pools`: kv heads on `model`; blocks are shared by every data shard."""
    kv = named(mesh, POOL_SPEC, (num_blocks + 1, num_kv_heads, block_size, key_size))
    return tuple(KVMemory(kv, kv) for _ in range(num_layers))
