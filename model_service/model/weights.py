"""The int8 weight containers of the network (the released checkpoint's QuantizedWeight8bit, kept 8-bit on the
device): what layers.py multiplies by and packed.py repacks for the native kernels, kept apart so that
neither of those two imports the other for its types."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax

Array = jax.Array


class QuantizedWeight(NamedTuple):
    """An int8 matrix kept 8-bit in device memory, stored in the layout its product reads fastest on CPU.

    `scales` is [..., blocks, N]: one block for column-parallel matrices (query/key/value, moe linear and
    linear_v), 8 consecutive row blocks of the contraction dim for row-parallel ones (attention output, moe
    linear_1). Column-parallel weights are stored [..., N, K] (the checkpoint's [..., K, N] transposed once at
    load) and reduced over their minor dim; row-parallel ones keep the checkpoint's [..., K, N] and are reduced
    block by block over a major dim (vectorised across N), so any mesh can apply their block scales.
    Measured for one expert (two column-parallel products, gelu, one row-parallel) on XLA-CPU: 1.8 ms at one
    row, 2.1 ms at eight; with the row-parallel matrix also stored [N, K]: 3.0 / 2.6 ms.
    """

    weight: Array  # int8 [..., N, K] if blocks == 1 else [..., K, N]
    scales: Array  # [..., blocks, N]

    @property
    def blocks(self) -> int:
        return self.scales.shape[-2]

    @property
    def transposed(self) -> bool:
        return self.blocks == 1

    @property
    def shape(self) -> tuple[int, ...]:
        """The reference's logical shape [..., K, N] (haiku checks parameters against it)."""
        *lead, a, b = self.weight.shape
        return (*lead, b, a) if self.transposed else (*lead, a, b)


class ExpertStack(NamedTuple):
    """An MoE matrix [E, K, N] kept as one QuantizedWeight per expert: separate buffers, because XLA copies a
    slice of a stacked array before each expert's product (a 1.4 MB copy per expert matrix per step).

    Packed for the native kernel on one device it is one PackedWeight whose arrays hold all the experts
    ([E, NB, K, 16] and [E, B, N]): the grouped product reads the experts of a stack in place, and a program
    taking a layer's experts as 2 buffers per matrix instead of 2 per expert costs less to launch (PjRt handles
    each argument buffer on every call)."""

    experts: tuple[Any, ...]

    @property
    def stacked(self) -> bool:
        """One buffer holds every expert (a PackedWeight whose arrays have a leading expert dim)."""
        return len(self.experts) == 1 and getattr(self.experts[0], "stacked", False)

    @property
    def count(self) -> int:
        return self.experts[0].packed.shape[0] if self.stacked else len(self.experts)

    def expert(self, e: int) -> Any:
        """Expert e's matrix (of a stack: a slice, which XLA copies; the grouped product reads the stack itself)."""
        return self.experts[0].expert(e) if self.stacked else self.experts[e]

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.count, *self.experts[0].shape)


@dataclasses.dataclass(frozen=True)
class GroupedWeight:
    """An MoE matrix with every expert in one int8 buffer, in the checkpoint's layout, for the grouped products
    of the generic backend (model/grouped.py): each expert's matrix read in place, never sliced or copied.

    `weight` int8 [E, K, N]; `scales` [E, blocks, N] float32: one block for column-parallel matrices (moe linear
    and linear_v), 8 consecutive row blocks of K for the row-parallel one (linear_1). `rows` (static): 0, or the
    logical K when each row block of `weight` is padded with zero rows to a length the TPU kernel's tiles divide
    (grouped.kernel_layout; the weight is then [E, blocks * padded, N]). `cols` (static): 0, or the logical N when
    the columns of `weight` and `scales` are padded with zeros to a multiple of the TPU's 128 lanes
    (grouped.kernel_layout; products then come out with zero columns past `cols`)."""

    weight: Array  # int8 [E, K, N] (or [E, blocks * padded, N], or [E, K, N padded])
    scales: Array  # [E, blocks, N]
    rows: int = 0
    cols: int = 0

    @property
    def blocks(self) -> int:
        return self.scales.shape[-2]

    @property
    def count(self) -> int:
        return self.weight.shape[-3]

    @property
    def shape(self) -> tuple[int, ...]:
        """The reference's logical shape [E, K, N] (haiku checks parameters against it; [layers, E, K, N] stacked)."""
        *lead, k, n = self.weight.shape
        return (*lead, self.rows or k, self.cols or n)


jax.tree_util.register_dataclass(GroupedWeight, data_fields=["weight", "scales"], meta_fields=["rows", "cols"])


@dataclasses.dataclass(frozen=True)
class InLayer:
    """Layer `layer` of a matrix stacked over the scanned layers (a GroupedWeight or an ExpertStack with a leading
    layer axis), left in the stack: its readers take the layer's experts where they multiply them (inside an
    expert's conditional, or through the grouped kernel's index map), since a layer's slice taken before a
    conditional or a custom call is a copy of all its experts every step. `at_layer()` slices it out for readers
    that read every expert anyway (XLA fuses such a slice into its consumer)."""

    stacked: Any  # GroupedWeight [layers, E, K, N] or ExpertStack of [layers, ...] matrices
    layer: Array  # int32 []

    def at_layer(self) -> Any:
        return jax.tree.map(lambda a: a[self.layer], self.stacked)

    def expert(self, e: int) -> Any:
        """Expert e's matrix of this layer (an ExpertStack's: slice it where it is multiplied)."""
        return jax.tree.map(lambda a: a[self.layer], self.stacked.expert(e))

    @property
    def count(self) -> int:
        return self.stacked.count

    @property
    def shape(self) -> tuple[int, ...]:
        """One layer's logical shape [E, K, N] (haiku checks parameters against it)."""
        return jax.eval_shape(lambda s: jax.tree.map(lambda a: a[0], s), self.stacked).shape


jax.tree_util.register_dataclass(InLayer, data_fields=["stacked", "layer"], meta_fields=[])
