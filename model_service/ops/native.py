"""The CPU's native kernels (model_service.kernels) behind the backend's operations (ops.base).

  NativeForms      Products.NATIVE / NATIVE_INT8: weights packed at load (packed.PackedWeight) multiplied by the
                   kernel, each row alone by construction; the rest as XLA's CPU forms (ops.xla.CpuForms);
  NativeAttention  kernels.attention over the "heads" pools, float32, one device;
  NativeExperts    a step's (row, selected expert) pairs in two grouped kernel calls (moe.experts_grouped) where
                   the experts are packed on one device; otherwise ops.xla.CondExperts;
  Packed           the packable leaves (params.packable) packed for the kernel (params.pack_for_native);
  KernelNucleus    the sampler's nucleus threshold from one kernel call (kernels.nucleus_threshold: the same
                   threshold as XLA's search except where a float32 sum lands within rounding of 1 - top_p) and the
                   draw's noise for the kept entries only (sampling_ops.categorical_kept, bit for bit the whole row's).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from model_service import kernels
from model_service.kernels import attention as kernel_attention
from model_service.model.layers import Products
from model_service.model.moe import ExpertWeights, Routing, experts_grouped, grouped_native
from model_service.model.params import pack_for_native, packable
from model_service.ops.base import Forms, Params, relaid
from model_service.ops.xla import CondExperts, CpuForms
from model_service.sampling_ops import categorical_kept

Array = jax.Array


@dataclass(frozen=True)
class NativeForms(CpuForms):
    """Packed weights through the native kernel (layers.product takes a PackedWeight there); NATIVE_INT8 rounds the
    rows to int8 where they meet an int8 weight."""

    products: Products = Products.NATIVE


@dataclass(frozen=True)
class NativeAttention:
    """The native kernel (kernels.attention): each row alone by construction while the rows of one sequence share
    their key loads."""

    kv_layout: str = "heads"

    def attend(self, q: Array, pool_k: Array, pool_v: Array, tables: Array, seq: Array, positions: Array,
               active: Array, multiplier: float, chunk: int) -> Array:
        out = kernel_attention.paged_attention(q.astype(jnp.float32), pool_k, pool_v, tables, seq, positions, active,
                                               multiplier)
        return out.astype(q.dtype)

    def min_block_size(self, dtype: Any) -> int:
        return 1


@dataclass(frozen=True)
class NativeExperts(CondExperts):
    def __call__(self, x: Array, routing: Routing, w: ExpertWeights, active: Array | None, forms: Forms,
                 mesh: Any) -> Array:
        if active is not None and grouped_native(w):
            return experts_grouped(x, routing, w, active, forms.products)
        return super().__call__(x, routing, w, active, forms, mesh)


@dataclass(frozen=True)
class Packed:
    """Leaves packed for the kernel; `int8_table` rounds the table to int8 (NATIVE_INT8, packed.pack_table).
    `stacked`: the experts load stacked (a mesh with an expert axis: ops.grouped.ParallelExperts reads them so;
    GroupedWeight leaves are not packable, so they stay as loaded)."""

    int8_table: bool = False
    stacked: bool = False

    def lay_out(self, params: Params, mesh: Any) -> Params:
        return relaid(params, mesh, packable, lambda module, leaf: pack_for_native(module, leaf, mesh,
                                                                                   self.int8_table))

    def load_options(self) -> dict[str, bool]:
        return {"pack": True, "int8_table": self.int8_table, "stacked": self.stacked}


@dataclass(frozen=True)
class KernelNucleus:
    """The nucleus threshold and the kept entries' list from the native kernels (one device, float32 logits)."""

    vectorised = False

    def threshold(self, row: Array, probs: Array, top_p: Array) -> Array:
        return kernels.nucleus_threshold(row, probs, top_p)

    def draw(self, key: Array, row: Array) -> Array:
        return categorical_kept(key, row)
