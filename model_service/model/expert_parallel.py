"""Experts on their own mesh axis: each expert group computes its own experts' rows, then one reduction a layer.

On a mesh with an `expert` axis (sharding.EXPERT) the stacked experts (weights.GroupedWeight [E, K, N]) are split
over it (sharding.EXPERT_SPECS): expert group g holds experts g * E/G .. (g + 1) * E/G - 1, their hidden units
split over `model`. The step's rows reach every expert group (activations replicated over `expert`, split over
`data` where the rows divide it); under shard_map each device runs moe.experts_by_cond over its own experts (a
conditional per local expert, taken only if some active row selected it) for its hidden units, and one psum over
(expert, model) adds the groups' partial outputs: one reduction per layer, not one per expert as the
tensor-parallel experts of a (data, model) mesh cost. A row adds its experts' outputs in expert order within a
group; across groups the psum adds them (for two selected experts, a + b either way: the same bits).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from model_service.model.weights import ExpertStack, GroupedWeight, QuantizedWeight
from model_service.sharding import DATA, EXPERT, EXPERT_SPECS, MODEL, fit_spec

Array = jax.Array

MOE = "expert"  # backend.Backend.moe on a mesh with an expert axis


def expert_groups(mesh: Mesh) -> int:
    """The expert axis' size (1 on a mesh without one)."""
    return dict(mesh.shape).get(EXPERT, 1)


def as_quantized(weight: Array, scales: Array) -> QuantizedWeight:
    """One expert's local matrix [K, N] with its scales [blocks, N] in layers.QuantizedWeight's layout: a single
    block (column-parallel, or a row-parallel shard holding one row block) is stored [N, K] and scaled per column
    after the reduction, which for one row block is the same product."""
    return QuantizedWeight(weight.swapaxes(0, 1), scales) if scales.shape[0] == 1 else QuantizedWeight(weight, scales)


def _stack(q: GroupedWeight) -> ExpertStack:
    return ExpertStack(tuple(as_quantized(q.weight[e], q.scales[e]) for e in range(q.count)))


# moe.experts_by_cond's signature over plain arrays: (rows [M, D], experts [M, k], gates [M, k], active [M] or
# None, the three matrices' ExpertStacks) -> [M, D]; passed in so that this module does not import moe.
LocalExperts = Callable[[Array, Array, Array, "Array | None", tuple[ExpertStack, ...]], Array]


def _local(compute: LocalExperts, x: Array, experts: Array, gates: Array, active: Array | None,
           w: tuple[GroupedWeight, GroupedWeight, GroupedWeight]) -> Array:
    """One device: its experts' share of each row's output [M, D] (zeros for rows that picked none of them)."""
    per_group = w[0].count
    first = jax.lax.axis_index(EXPERT) * per_group
    local = experts - first  # [M, k]
    local = jnp.where((local >= 0) & (local < per_group), local, -1)  # -1 matches no local expert
    out = compute(x, local, gates, active, tuple(_stack(q) for q in w))
    return jax.lax.psum(out, (EXPERT, MODEL))


def experts_parallel(mesh: Mesh, x: Array, experts: Array, gates: Array, active: Array | None,
                     w: tuple[GroupedWeight, GroupedWeight, GroupedWeight], compute: LocalExperts) -> Array:
    """sum_k gate_k * expert_k(x) for rows x [M, D] (experts, gates [M, k]; rows not `active` [M] compute nothing)
    with the experts split over the mesh's expert axis (see the module docstring); `compute` runs one device's
    experts (moe.experts_by_cond)."""
    m = x.shape[0]
    rows = P(DATA) if m % dict(mesh.shape)[DATA] == 0 else P()
    names = ("linear", "linear_v", "linear_1")
    w_specs = tuple(GroupedWeight(fit_spec(EXPERT_SPECS[(n, "weight")], q.weight.shape, mesh),  # type: ignore[arg-type]
                                  fit_spec(EXPERT_SPECS[(n, "scales")], q.scales.shape, mesh))
                    for n, q in zip(names, w))
    if any(q.rows or q.cols for q in w):
        raise ValueError("expert-parallel experts read the checkpoint's [E, K, N] layout, not the TPU kernel's padded "
                         "one (grouped.kernel_layout)")

    def run(x: Array, experts: Array, gates: Array, active: Any, w: Any) -> Array:
        return _local(compute, x, experts, gates, active, w)

    active_spec = None if active is None else rows
    fn = jax.shard_map(run, mesh=mesh, in_specs=(rows, rows, rows, active_spec, w_specs), out_specs=rows,
                       check_vma=False)
    return fn(x, experts, gates, active, tuple(w))
