"""Attention through the Pallas decode kernel (kernels/tpu/paged_attention.py): a step's single rows (decodes) read
their own sequence's blocks and nothing else; runs of rows (prompt chunks, a decode and its drafts) attend as the
batched form does (model/segments.py), each block of rows reading its sequence's keys once."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from model_service.kernels.tpu.paged_attention import decode_attention, min_block_size
from model_service.kv_memory import LayerPool
from model_service.model.layers import ATTN_LOGIT_CAP
from model_service.model.segments import attend_segments

Array = jax.Array


@dataclass(frozen=True)
class PallasAttention:
    """The batched form (ops.xla.BatchedAttention) with its single rows through the Pallas kernel; `interpret` runs
    the kernel in Pallas interpret mode (tests on CPU). Its pools are the batched form's ("tokens")."""

    interpret: bool = False
    kv_layout: str = "tokens"

    def attend(self, q: Array, pool_k: Array, pool_v: Array, tables: Array, seq: Array, positions: Array,
               active: Array, multiplier: float, chunk: int) -> Array:
        layer = pool_k.layer if isinstance(pool_k, LayerPool) else None

        def single(rows: Array, own: Array, at: Array, taken: Array) -> Array:
            out = decode_attention(rows, _layer_of(pool_k), _layer_of(pool_v), own, jnp.where(taken, at + 1, 0),
                                   multiplier, ATTN_LOGIT_CAP, chunk, layer=layer, interpret=self.interpret)
            return out.reshape(out.shape[0], -1)

        return attend_segments(q, pool_k, pool_v, tables, seq, positions, active, multiplier, chunk, single=single)

    def min_block_size(self, dtype: Any) -> int:
        return min_block_size(dtype)


def _layer_of(pool: Array | LayerPool) -> Array:
    """The array the kernel reads: a scanned layer's pool stays stacked (the kernel indexes the layer)."""
    return pool.stacked if isinstance(pool, LayerPool) else pool
