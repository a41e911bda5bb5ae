"""The int8 weight containers of the network (the released checkpoint's QuantizedWeight8bit, kept 8-bit on the
device): what layers.py multiplies by and packed.py repacks for the native kernels, kept apart so that
neither of those two imports the other for its types."""

from __future__ import annotations

from typing import NamedTuple

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
    slice of a stacked array before each expert's product (a 1.4 MB copy per expert matrix per step)."""

    experts: tuple[QuantizedWeight, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        return (len(self.experts), *self.experts[0].shape)
