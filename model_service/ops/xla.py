"""XLA's forms of the backend's operations (ops.base): products, unembedding, attention and experts as XLA programs.

  CpuForms     Products.FUSED_REDUCE: a multiply fused with the reduction, int8 converted inside (XLA:CPU);
  MatrixForms  Products.DOT / EXACT: dot_general on a matrix unit (EXACT: float32 rows carried to float32 accuracy,
               the faithful mode on a TPU), traced at XLA's highest matmul precision;
  RowAttention each row its own one-row program over its own keys (a row's bits its own; idle rows cost nothing);
  BatchedAttention  all rows at once, a run of rows of one sequence reading its keys once per block of rows
               (segments.attend_segments: the accelerators');
  CondExperts  one conditional per expert, taken only where an active row selected it; a dense pass groups its
               (token, expert) pairs by expert (moe.grouped_experts);
  SearchNucleus  the sampler's nucleus threshold by XLA's search, its draw's noise over the whole row.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

import model_service.model.transcendental as transcendental
from model_service.model.layers import Products, paged_attention_rows, product
from model_service.model.moe import ExpertWeights, Routing, experts_by_cond, grouped_experts, pick_tile
from model_service.model.packed import PackedWeight
from model_service.model.segments import attend_segments
from model_service.ops.base import Forms
from model_service.sampling_ops import _search_threshold_probs, categorical

Array = jax.Array


def rows_unembed(forms: Forms, h: Array, table: Any, multiplier: float, used: Array | None,
                 fill_unused: bool) -> Array:
    """The unembedding through `forms.product` over a float32 (or packed) table; in bfloat16 the product and the
    multiplier round to the compute dtype as the reference's do."""
    table = table if isinstance(table, PackedWeight) else table.astype(jnp.float32)
    if h.dtype != jnp.float32:
        out = forms.product(h.astype(jnp.float32), table, used, fill_unused)
        return (out.astype(h.dtype) * jnp.asarray(multiplier, h.dtype)).astype(jnp.float32)
    # In the product: natively the kernel multiplies only the computed rows (free slots cost no pass over [V]).
    return forms.product(h, table, used, fill_unused, multiplier=multiplier)


@dataclass(frozen=True)
class CpuForms:
    """XLA's forms on a CPU (Products.FUSED_REDUCE: layers.product), at XLA's default precision."""

    products: Products = Products.FUSED_REDUCE

    def product(self, x: Array, w: Any, used: Array | None = None, fill_unused: bool = True,
                multiplier: float = 1.0) -> Array:
        return product(x, w, self.products, used, fill_unused, multiplier)

    def unembed(self, h: Array, table: Any, multiplier: float, used: Array | None, fill_unused: bool) -> Array:
        return rows_unembed(self, h, table, multiplier, used, fill_unused)

    def router_logits(self, x: Array, router_w: Any) -> Array:
        # A router packed for the native kernel (NativeForms, or these forms over the service's packed parameters in
        # the parity checks) is stored as the kernel reads it; a loaded one [D, E] is transposed to the [N, K] form.
        w = router_w if isinstance(router_w, PackedWeight) else router_w.astype(jnp.float32).T
        return self.product(x.astype(jnp.float32), w)

    def embed(self, table: Any, tokens: Array) -> Array:
        # A table packed for the native kernel (params laid out for native products, met by these forms: the parity
        # checks run XLA's forms over the service's loaded parameters) is read from its packing, exactly.
        return table.rows_of(tokens) if isinstance(table, PackedWeight) else jnp.take(table, tokens, axis=0)

    def precision(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()


@dataclass(frozen=True)
class MatrixForms(CpuForms):
    """XLA's dots (Products.DOT, or EXACT: the faithful float32 mode on a TPU)."""

    products: Products = Products.DOT

    def unembed(self, h: Array, table: Any, multiplier: float, used: Array | None, fill_unused: bool) -> Array:
        if isinstance(table, PackedWeight):
            return rows_unembed(self, h, table, multiplier, used, fill_unused)
        # The table as stored meets the rows with float32 accumulation (a float32 copy of a bfloat16 table would be
        # written and read again every step); EXACT splits float32 rows (layers.product).
        if h.dtype == jnp.float32:
            return self.product(h, table, multiplier=multiplier)
        out = jnp.einsum("...k,nk->...n", h, table.astype(h.dtype), preferred_element_type=jnp.float32)
        return (out.astype(h.dtype) * jnp.asarray(multiplier, h.dtype)).astype(jnp.float32)

    def precision(self) -> contextlib.AbstractContextManager[None]:
        """A float32 dot not carried exactly by layers.product (attention in float32, the router in either dtype)
        runs at XLA's highest precision, as the reference's float32 does (a TPU's default would round its operands
        to bfloat16: the router then picks other experts); bfloat16 dots are one pass at any setting. EXACT also
        takes the accurate transcendentals (transcendental.py)."""
        if self.products is Products.EXACT:
            stack = contextlib.ExitStack()
            stack.enter_context(jax.default_matmul_precision("highest"))
            stack.enter_context(transcendental.accurate())
            return stack
        return jax.default_matmul_precision("highest")


@dataclass(frozen=True)
class RowAttention:
    """Every row runs the same one-row program (layers.paged_attention_rows): its bits depend only on its own query
    and keys, and rows not active cost nothing (the CPU's XLA form)."""

    kv_layout: str = "heads"

    def attend(self, q: Array, pool_k: Array, pool_v: Array, tables: Array, seq: Array, positions: Array,
               active: Array, multiplier: float, chunk: int) -> Array:
        own, limit = tables[seq], positions[:, None]  # [R, table_len], [R, 1]
        return paged_attention_rows(q[:, None], pool_k, pool_v, own, limit, multiplier, chunk, active)[:, 0]

    def min_block_size(self, dtype: Any) -> int:
        return 1


@dataclass(frozen=True)
class BatchedAttention:
    """All rows at once (segments.attend_segments: the accelerators'); cheaper where wide products are, without the
    per-row promise. Its pools keep a token's keys in one lane-dense row ("tokens")."""

    kv_layout: str = "tokens"

    def attend(self, q: Array, pool_k: Array, pool_v: Array, tables: Array, seq: Array, positions: Array,
               active: Array, multiplier: float, chunk: int) -> Array:
        return attend_segments(q, pool_k, pool_v, tables, seq, positions, active, multiplier, chunk)

    def min_block_size(self, dtype: Any) -> int:
        return 1


@dataclass(frozen=True)
class CondExperts:
    """A paged step: one conditional per expert over one buffer per expert (moe.experts_by_cond); a dense pass: the
    pairs sorted by expert in tiles (moe.grouped_experts)."""

    def __call__(self, x: Array, routing: Routing, w: ExpertWeights, active: Array | None, forms: Forms,
                 mesh: Any) -> Array:
        if active is not None:
            return experts_by_cond(x, routing, w, active, forms.products)
        tile = pick_tile(x.shape[0], routing.experts.shape[-1], w.linear.shape[0])
        return grouped_experts(x, routing, w, tile, forms.products)


@dataclass(frozen=True)
class SearchNucleus:
    """A large vocabulary's nucleus threshold by a search (sampling_ops._search_threshold_probs: 32 masked sums),
    the draw's noise for every entry of the row."""

    vectorised = False

    def threshold(self, row: Array, probs: Array, top_p: Array) -> Array:
        return _search_threshold_probs(row, probs, top_p)

    def draw(self, key: Array, row: Array) -> Array:
        return categorical(key, row[None])


@dataclass(frozen=True)
class BatchedDraws(SearchNucleus):
    """The accelerators' sampler: a step's draws all at once, one stage at a time, each stage only where a draw uses
    it (sampling_vectorised.py); a caller sampling one draw at a time gets the search's threshold and draw."""

    vectorised = True
