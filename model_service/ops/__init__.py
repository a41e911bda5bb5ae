"""The backend's operations as one value the model calls (ops.base.Ops), derived from the chosen Backend here and
nowhere else: model/ (the network), the engine and the sampler call `ops.product`, `ops.attend`, `ops.moe`,
`ops.unembed`, `ops.lay_out`, `ops.sampling`, ... and never ask which backend they run on. Implementations:
ops/native.py (the CPU's native kernels), ops/xla.py (XLA's forms: CPU fused reductions, matrix-unit dots, per-row
and batched attention, per-expert conditionals), ops/grouped.py (stacked experts: Pallas, ragged_dot, expert
parallel), ops/pallas.py (decode attention through the Pallas kernel).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from jax.sharding import Mesh

from model_service.model.expert_parallel import MOE as EXPERT_MOE
from model_service.model.grouped import GROUPED_MOE
from model_service.model.layers import Products
from model_service.ops.base import Attention, Experts, Forms, Layout, Nucleus, Ops, Stored
from model_service.ops.grouped import ParallelExperts, SortedExperts, Stacked
from model_service.ops.native import KernelNucleus, NativeAttention, NativeExperts, NativeForms, Packed
from model_service.ops.pallas import PallasAttention
from model_service.ops.xla import (BatchedAttention, BatchedDraws, CondExperts, CpuForms, MatrixForms, RowAttention,
                                  SearchNucleus)

if TYPE_CHECKING:
    from model_service.backend import Backend

__all__ = ["Ops", "for_backend", "for_shapes"]

ATTENTION_MODES = ("native", "rows", "batched", "pallas", "pallas_interpret")  # backend.Backend.attention


def _forms(products: Products) -> Forms:
    if products.native:
        return NativeForms(products)
    return CpuForms(products) if products is Products.FUSED_REDUCE else MatrixForms(products)


def _attention(mode: str) -> Attention:
    if mode not in ATTENTION_MODES:
        raise ValueError(f"attention must be one of {ATTENTION_MODES}, got {mode!r}")
    if mode.startswith("pallas"):
        return PallasAttention(interpret=mode == "pallas_interpret")
    return {"native": NativeAttention, "rows": RowAttention, "batched": BatchedAttention}[mode]()


def _experts(moe: str, products: Products) -> Experts:
    if moe in GROUPED_MOE:
        return SortedExperts(moe)
    if moe == EXPERT_MOE:
        return ParallelExperts()
    if moe != "cond":
        raise ValueError(f"moe must be 'cond', {EXPERT_MOE!r} or one of {GROUPED_MOE}, got {moe!r}")
    return NativeExperts() if products.native else CondExperts()


def _layout(products: Products, moe: str) -> Layout:
    if products.native:
        return Packed(products.int8, stacked=moe != "cond")
    return Stacked(moe) if moe != "cond" else Stored()


def _sampling(backend: "Backend") -> Nucleus:
    if backend.native_sampling:
        return KernelNucleus()
    return BatchedDraws() if backend.vectorised_sampling else SearchNucleus()


def for_backend(backend: "Backend", mesh: Mesh) -> Ops:
    """The operations of `backend` on `mesh`. A row's bits are its own (row_sums) where the products and attention
    compute each row alone: the native products with per-row attention, on one device (under a mesh the features
    are sharded). The head's final norm takes that order on
    one device whatever the products: the draws program runs the head over [P, D], P a draw per slot (times
    1 + the drafts with speculative decoding), and XLA:CPU sums 4,096 elements or more in another order
    (YNNPACK's): at 512 features P = 4 and P = 20 parted."""
    products, one = backend.products, mesh.size == 1
    return Ops(_forms(products), _attention(backend.attention), _experts(backend.moe, products),
               _layout(products, backend.moe), _sampling(backend),
               row_sums=products.native and one and backend.attention != "batched", head_row_sums=one)


def for_shapes() -> Ops:
    """Operations for tracing parameter shapes alone (haiku's init): XLA's dots, conditionals, no layout."""
    return Ops(MatrixForms(Products.DOT), RowAttention(), CondExperts(), Stored(), SearchNucleus())
