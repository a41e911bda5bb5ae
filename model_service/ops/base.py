"""The interface the model calls for every operation whose form differs per backend (the backend seam's other half:
backend.py chooses, this carries out).

An `Ops` value is five parts, each chosen once (ops.for_backend) from the chosen Backend and never asked what it is:
  forms      how token rows meet a weight (`product`), the table's rows (`embed`) and the head's unembedding
             product (`unembed`), and the matmul precision programs are traced under (`precision`): ops/xla.py
             (XLA's fused-reduce forms on CPU, its dots on a matrix unit), ops/native.py (the native kernels);
  attention  each token row's attention over its sequence's keys in the paged pools (`attend`), and the pools' layout
             that form reads: ops/native.py (the native kernel), ops/xla.py (one row at a time, or batched),
             ops/pallas.py (batched, its decodes through the Pallas kernel);
  experts    the mixture of experts over a step's rows (`moe`): ops/xla.py (a conditional per expert),
             ops/native.py (the native grouped kernel), ops/grouped.py (the stacked experts' grouped products: Pallas,
             ragged_dot, expert parallel);
  layout     the parameters laid out for those forms (`lay_out`): ops/native.py (packed for the kernels),
             ops/grouped.py (experts stacked), or as loaded;
  sampling   how a step's draws are sampled (sampling.sample_tokens): one at a time with a nucleus threshold and
             kept-entry draw of ops/xla.py (XLA's search, the whole row's noise) or ops/native.py (the native
             kernels); or all at once, stage by stage (ops/xla.py BatchedDraws: the accelerators').
Every choice is made while a program is traced (plain Python attributes of frozen values): a step pays nothing for it.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import jax
import numpy as np

from model_service.model.layers import Products
from model_service.sharding import params_shardings

Array = jax.Array
Params = dict[str, dict[str, Any]]


class Forms(Protocol):
    products: Products

    def product(self, x: Array, w: Any, used: Array | None = None, fill_unused: bool = True,
                multiplier: float = 1.0) -> Array:
        """x [..., K] times a weight -> [..., N] in x's dtype (layers.product's contract)."""

    def unembed(self, h: Array, table: Any, multiplier: float, used: Array | None, fill_unused: bool) -> Array:
        """Normed rows h [..., D] times the tied table [V, D] -> float32 logits [..., V], times `multiplier`."""

    def router_logits(self, x: Array, router_w: Any) -> Array:
        """Rows x [M, D] times the router's weight [D, E] (as loaded, or packed) in float32 -> logits [M, E]."""

    def embed(self, table: Any, tokens: Array) -> Array:
        """The table's rows of `tokens` [...] -> [..., D] (in the table's type, float32 from a packed table)."""

    def precision(self) -> contextlib.AbstractContextManager[None]:
        """The matmul precision this backend's programs are traced under."""


class Attention(Protocol):
    kv_layout: str  # kv_memory.LAYOUTS: the pools' layout this form reads

    def attend(self, q: Array, pool_k: Array, pool_v: Array, tables: Array, seq: Array, positions: Array,
               active: Array, multiplier: float, chunk: int) -> Array:
        """q [R, Hq, D]; row r of sequence seq[r] at positions[r] sees that sequence's key positions 0..positions[r]
        through tables [S, table_len]; rows not `active` [R] get zeros -> [R, Hq * D]."""

    def min_block_size(self, dtype: Any) -> int:
        """The least KV block size (positions) this form reads in pools of `dtype`."""


class Experts(Protocol):
    def __call__(self, x: Array, routing: Any, w: Any, active: Array | None, forms: Forms, mesh: Any) -> Array:
        """x [M, D], routing (moe.Routing [M, k]), the layer's moe.ExpertWeights, active [M] bool (a paged step)
        or None (a dense pass) -> sum_k gate_k * expert_k(x) [M, D]; rows not active compute nothing."""


class Nucleus(Protocol):
    vectorised: bool  # the step's draws sampled all at once, stage by stage (sampling_vectorised.py), not one by one

    def threshold(self, row: Array, probs: Array, top_p: Array) -> Array:
        """A large vocabulary's nucleus threshold: row [V] float32, its softmax probs [V], top_p [] -> [] (the
        reference's rule: sampling_ops._sort_threshold's value)."""

    def draw(self, key: Array, row: Array) -> Array:
        """`sampling_ops.categorical(key, row[None])` of one filtered row [V], bit for bit -> [] int32."""


class Layout(Protocol):
    def lay_out(self, params: Params, mesh: Any) -> Params:
        """`params` laid out for these forms (each changed leaf a copy placed like a loaded one); trees already
        laid out come back as they are."""

    def load_options(self) -> dict[str, bool]:
        """checkpoint.load_params' options that lay the leaves out so as they load (`pack`, `int8_table`,
        `stacked`)."""


@dataclass(frozen=True)
class Stored:
    """Parameters as the checkpoint loads them (XLA's forms read them so)."""

    def lay_out(self, params: Params, mesh: Any) -> Params:
        return params

    def load_options(self) -> dict[str, bool]:
        return {"pack": False, "int8_table": False, "stacked": False}


def relaid(params: Params, mesh: Any, change: Callable[[str, Any], bool],
           convert: Callable[[str, Any], Any]) -> Params:
    """`params` with each leaf for which change(module, leaf) holds replaced by convert(module, host copy), placed
    as params_shardings places it."""
    out: Params = {}
    for module, leaves in params.items():
        out[module] = dict(leaves)
        for name, leaf in leaves.items():
            if change(module, leaf):
                host = {module: {name: convert(module, jax.tree.map(np.asarray, leaf))}}
                out[module][name] = jax.device_put(host, params_shardings(host, mesh))[module][name]
    return out


@dataclass(frozen=True)
class Ops:
    """What the model calls (see the module docstring). `row_sums`: sums over a row's features (norms, the router's
    softmax) in layers.row_sum's fixed order, so a row's bits do not depend on the rows beside it (the per-row
    forms on one device); `head_row_sums` the same for the head's final norm."""

    forms: Forms
    attention: Attention
    experts: Experts
    layout: Layout
    sampling: Nucleus
    row_sums: bool = False
    head_row_sums: bool = False

    @property
    def products(self) -> Products:
        return self.forms.products

    @property
    def kv_layout(self) -> str:
        return self.attention.kv_layout

    def product(self, x: Array, w: Any, used: Array | None = None, fill_unused: bool = True,
                multiplier: float = 1.0) -> Array:
        return self.forms.product(x, w, used, fill_unused, multiplier)

    def unembed(self, h: Array, table: Any, multiplier: float, used: Array | None = None,
                fill_unused: bool = True) -> Array:
        return self.forms.unembed(h, table, multiplier, used, fill_unused)

    def router_logits(self, x: Array, router_w: Any) -> Array:
        return self.forms.router_logits(x, router_w)

    def precision(self) -> contextlib.AbstractContextManager[None]:
        return self.forms.precision()

    def embed(self, table: Any, tokens: Array) -> Array:
        return self.forms.embed(table, tokens)

    def attend(self, q: Array, pool_k: Array, pool_v: Array, tables: Array, seq: Array, positions: Array,
               active: Array, multiplier: float, chunk: int) -> Array:
        return self.attention.attend(q, pool_k, pool_v, tables, seq, positions, active, multiplier, chunk)

    def min_block_size(self, dtype: Any) -> int:
        return self.attention.min_block_size(dtype)

    def moe(self, x: Array, routing: Any, w: Any, active: Array | None, mesh: Any) -> Array:
        return self.experts(x, routing, w, active, self.forms, mesh)

    def lay_out(self, params: Params, mesh: Any) -> Params:
        return self.layout.lay_out(params, mesh)

    def dense(self) -> "Ops":
        """The operations of a dense pass over whole sequences (GrokModel.forward, the parity checks): XLA's own
        sums (row sums serve the paged step's row programs)."""
        return dataclasses.replace(self, row_sums=False)
