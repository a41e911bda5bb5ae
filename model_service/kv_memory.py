"""KV memory: per-layer key/value caches plus each slot's next position, as immutable pytrees.

Each batch slot decodes at its own position. One row of a prefill result (any length <= sequence_len) is copied
into a slot with `insert`, which also resets that slot's position to the prompt length.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding

from model_service.sharding import KV_SPEC, POSITIONS_SPEC, named


class KVMemory(NamedTuple):
    """One layer's cache."""

    k: jax.Array  # [B, Hkv, S, D] (heads before positions: attention reads it without a transpose)
    v: jax.Array  # [B, Hkv, S, D]


class Memory(NamedTuple):
    """All layers' caches and the position each slot writes next (= tokens already in its cache)."""

    layers: tuple[KVMemory, ...]
    positions: jax.Array  # [B] int32


def init_memory(batch: int, sequence_len: int, num_layers: int, num_kv_heads: int, key_size: int,
                dtype: jnp.dtype) -> Memory:
    """Zeroed memory for `batch` slots of `sequence_len` positions."""
    shape = (batch, num_kv_heads, sequence_len, key_size)
    layers = tuple(KVMemory(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)) for _ in range(num_layers))
    return Memory(layers, jnp.zeros((batch,), jnp.int32))


def insert(memory: Memory, prefix: Memory, slot: jax.Array, row: jax.Array | int = 0) -> Memory:
    """Copy row `row` of `prefix` (N rows of length T <= S) into `slot` of `memory`; the slot's position becomes
    that row's."""
    s, t = memory.layers[0].k.shape[2], prefix.layers[0].k.shape[2]
    if t > s:
        raise ValueError(f"prefix of length {t} does not fit memory of length {s}")
    slot = jnp.asarray(slot, jnp.int32)
    row = jnp.asarray(row, jnp.int32)

    def put(dst: jax.Array, src: jax.Array) -> jax.Array:
        one = jax.lax.dynamic_slice_in_dim(src, row, 1, axis=0)
        return jax.lax.dynamic_update_slice(dst, one.astype(dst.dtype), (slot, 0, 0, 0))

    layers = tuple(KVMemory(put(m.k, p.k), put(m.v, p.v)) for m, p in zip(memory.layers, prefix.layers))
    positions = memory.positions.at[slot].set(prefix.positions[row].astype(jnp.int32))
    return Memory(layers, positions)


def memory_shardings(mesh: Mesh, batch: int, sequence_len: int, num_layers: int, num_kv_heads: int,
                     key_size: int) -> Memory:
    """NamedShardings matching `init_memory`: batch on `data`, kv heads on `model`."""
    kv = named(mesh, KV_SPEC, (batch, num_kv_heads, sequence_len, key_size))
    pos: NamedSharding = named(mesh, POSITIONS_SPEC, (batch,))
    return Memory(tuple(KVMemory(kv, kv) for _ in range(num_layers)), pos)
