"""Paged KV memory on the device: per-layer pools of fixed-size blocks plus each slot's next position.

A layer's keys (and values) live in a pool `[blocks + 1, Hkv, block_size, D]`; the last block is scratch:
every table entry a sequence does not use points at it, so a write meant for nothing lands there. Which
blocks hold a slot's positions is the host's business (kv_blocks.py): every call that reads or writes the
pool takes the block tables `[slots, table_len]` int32 as an argument. Attention gathers a slot's first
blocks up to a length bucket, so a step reads what the sequences hold, not the configured context.

Layout (one layer; a slot holding 40 tokens with 16-token blocks, table [7, 2, 9, S, S, ...]):

    pool.k  block 0 |................|      slot positions  0..15 -> block 7
            block 2 |################|                     16..31 -> block 2
            block 7 |################|                     32..39 -> block 9 (offsets 0..7)
            block 9 |########........|      table entries past the sequence -> S (scratch)
            ...
            block S |  scratch       |

A dense prefill result (one prompt, `[N, Hkv, T, D]`) is copied into a slot's blocks with `insert`.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding

from model_service.sharding import POOL_SPEC, POSITIONS_SPEC, named


class KVMemory(NamedTuple):
    """One layer's keys and values: a block pool [blocks + 1, Hkv, block_size, D], or (inside a dense prefill)
    the prompt's own [N, Hkv, T, D]."""

    k: jax.Array
    v: jax.Array


class Memory(NamedTuple):
    """All layers' pools and the position each slot writes next (= tokens already in its blocks)."""

    layers: tuple[KVMemory, ...]
    positions: jax.Array  # [B] int32


def init_memory(slots: int, num_blocks: int, block_size: int, num_layers: int, num_kv_heads: int, key_size: int,
                dtype: jnp.dtype) -> Memory:
    """Zeroed pools of `num_blocks` blocks (+ the scratch block) and `slots` positions at 0."""
    shape = (num_blocks + 1, num_kv_heads, block_size, key_size)
    layers = tuple(KVMemory(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)) for _ in range(num_layers))
    return Memory(layers, jnp.zeros((slots,), jnp.int32))


def write_blocks(pool: jax.Array, new: jax.Array, blocks: jax.Array) -> jax.Array:
    """pool <- new [Hkv, n * block_size, D] (consecutive positions from a block boundary) into `blocks` [n]."""
    h, t, d = new.shape
    bs = pool.shape[2]
    rows = new.reshape(h, t // bs, bs, d).swapaxes(0, 1).astype(pool.dtype)  # [n, Hkv, bs, D]
    return pool.at[blocks].set(rows, mode="promise_in_bounds")


def write_tokens(pool: jax.Array, new: jax.Array, blocks: jax.Array, offsets: jax.Array) -> jax.Array:
    """pool <- new [R, Hkv, D]: row r at offset offsets[r] of block blocks[r] (one decode token per row)."""
    return pool.at[blocks, :, offsets, :].set(new.astype(pool.dtype), mode="promise_in_bounds")


def gather(pool: jax.Array, tables: jax.Array) -> jax.Array:
    """tables [R, n] block ids -> [R, Hkv, n * block_size, D]: each row's positions in order."""
    r, n = tables.shape
    _, h, bs, d = pool.shape
    blocks = pool[tables]  # [R, n, Hkv, bs, D]
    return blocks.swapaxes(1, 2).reshape(r, h, n * bs, d)


def insert(memory: Memory, prefix: Memory, slot: jax.Array, table: jax.Array, row: jax.Array | int = 0) -> Memory:
    """Copy row `row` of a dense prefix (N rows of T positions) into the blocks `table` [table_len] lists for
    `slot`; the slot's position becomes that row's. Entries past the prompt's blocks point at scratch."""
    bs = memory.layers[0].k.shape[2]
    t = prefix.layers[0].k.shape[2]
    n = -(-t // bs)
    if n > table.shape[0]:
        raise ValueError(f"prefix of length {t} does not fit a block table of {table.shape[0]} blocks of {bs}")
    row = jnp.asarray(row, jnp.int32)

    def put(pool: jax.Array, src: jax.Array) -> jax.Array:
        one = jax.lax.dynamic_index_in_dim(src, row, axis=0, keepdims=False)  # [Hkv, T, D]
        one = jnp.pad(one, ((0, 0), (0, n * bs - t), (0, 0)))
        return write_blocks(pool, one, table[:n])

    layers = tuple(KVMemory(put(m.k, p.k), put(m.v, p.v)) for m, p in zip(memory.layers, prefix.layers))
    positions = memory.positions.at[slot].set(prefix.positions[row].astype(jnp.int32))
    return Memory(layers, positions)


def memory_shardings(mesh: Mesh, slots: int, num_blocks: int, block_size: int, num_layers: int, num_kv_heads: int,
                     key_size: int) -> Memory:
    """NamedShardings matching `init_memory`: kv heads on `model`; blocks are shared by every data shard."""
    kv = named(mesh, POOL_SPEC, (num_blocks + 1, num_kv_heads, block_size, key_size))
    pos: NamedSharding = named(mesh, POSITIONS_SPEC, (slots,))
    return Memory(tuple(KVMemory(kv, kv) for _ in range(num_layers)), pos)
