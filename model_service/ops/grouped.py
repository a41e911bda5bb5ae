"""The stacked experts' forms of the backend's operations (ops.base): each MoE matrix's experts in one int8 buffer
(weights.GroupedWeight), multiplied as one grouped product over expert-sorted rows (model/grouped.py: the Pallas
TPU kernel, its interpret mode, XLA's ragged_dot) or, on a mesh with an expert axis, each expert group running its
own experts' conditionals with one reduction a layer (model/expert_parallel.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax

from model_service.model.expert_parallel import experts_parallel
from model_service.model.grouped import GroupedExperts, experts_sorted
from model_service.model.layers import Products
from model_service.model.moe import ExpertWeights, Routing, experts_by_cond
from model_service.model.params import experts_layout, relayout
from model_service.model.weights import GroupedWeight, InLayer
from model_service.ops.base import Forms, Params, relaid

Array = jax.Array


def _require_stacked(w: ExpertWeights, moe: str) -> None:
    if not all(isinstance(q.stacked if isinstance(q, InLayer) else q, GroupedWeight) for q in w):
        raise ValueError(f"moe {moe!r} multiplies stacked experts (weights.GroupedWeight): load them with "
                         "checkpoint.load_params(..., stacked=True) or lay them out with GrokModel.pack_params")


@dataclass(frozen=True)
class SortedExperts:
    """One grouped product per matrix over the expert-sorted (row, expert) pairs, run as `mode`
    (model.grouped.GROUPED_MOE), for a step's rows and a dense pass alike."""

    mode: str

    def __call__(self, x: Array, routing: Routing, w: ExpertWeights, active: Array | None, forms: Forms,
                 mesh: Any) -> Array:
        _require_stacked(w, self.mode)
        return experts_sorted(x, routing.experts, routing.gates, GroupedExperts(*w), active, self.mode,
                              int8_rows=forms.products is Products.DOT_INT8)


@dataclass(frozen=True)
class ParallelExperts:
    """Each expert group of the mesh's expert axis runs moe.experts_by_cond over its own stacked experts, then one
    psum a layer (expert_parallel.experts_parallel)."""

    def __call__(self, x: Array, routing: Routing, w: ExpertWeights, active: Array | None, forms: Forms,
                 mesh: Any) -> Array:
        _require_stacked(w, "expert")
        if mesh is None:
            raise ValueError("moe 'expert' splits the experts over a mesh: pass MoELayer its mesh")

        def local(rows: Array, experts: Array, gates: Array, used: Array | None, stacks: Any) -> Array:
            return experts_by_cond(rows, Routing(gates, experts), ExpertWeights(*stacks), used, forms.products)
        sliced = tuple(q.at_layer() if isinstance(q, InLayer) else q for q in w)
        return experts_parallel(mesh, x, routing.experts, routing.gates, active, sliced, local)


@dataclass(frozen=True)
class Stacked:
    """Each MoE matrix's experts in one buffer, as the grouped form `moe` reads it (params.experts_layout)."""

    moe: str

    def lay_out(self, params: Params, mesh: Any) -> Params:
        return relaid(params, mesh, lambda module, leaf: relayout(leaf, self.moe),
                      lambda module, leaf: experts_layout(leaf, self.moe))

    def load_options(self) -> dict[str, bool]:
        return {"pack": False, "int8_table": False, "stacked": True}
