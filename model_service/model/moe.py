"""The mixture-of-experts block: a float32 router and gated-GELU int8 experts computed only where selected.

Tokens are grouped by expert, and experts nobody selected cost nothing:
- a step's rows, on one device with native products: every (row, selected expert) pair in two grouped native
  calls per layer (experts_grouped);
- a step's rows otherwise: one conditional per expert, run only if an active row selected it, converting that
  expert's int8 weights once for all rows (the step is bound by weight reads at this size);
- prefill: the (token, expert) pairs are sorted by expert and cut into tiles of `tile` rows that each belong to
  one expert; a loop runs over the used tiles only, multiplying only routed rows.
A row adds its experts' outputs in expert order.
Those are the CPU backend's forms (backend.Backend.moe "cond"); the generic backend's (stacked experts, one grouped
product per matrix, for a step's rows and prefill alike) are in grouped.py; on a mesh with an expert axis ("expert")
each expert group runs these conditionals over its own experts (expert_parallel.py). MoELayer calls the backend's
choice among them through ops.Ops.moe (model_service/ops/). Under scanned layers
(transformer.scan_layers) the matrices come as a layer of the stacked ones (weights.InLayer): a conditional takes
its expert's slice inside its branch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

import haiku as hk
import jax
import jax.numpy as jnp

from jax.sharding import Mesh

from model_service import kernels
from model_service.model.layers import ExpertStack, Products, QuantizedWeight, product, row_sum
from model_service.model.packed import PackedWeight
import model_service.model.transcendental as transcendental
from model_service.model.weights import InLayer

if TYPE_CHECKING:
    from model_service.ops.base import Ops

Array = jax.Array


class Routing(NamedTuple):
    gates: Array  # [M, k] float32 router probabilities of the selected experts (not renormalised)
    experts: Array  # [M, k] int32


def route(x: Array, router_w: "Array | PackedWeight", k: int, ops: "Ops") -> Routing:
    """Softmax over experts in float32, then the top-k probabilities and their experts. x [M, D], router_w [D, E].
    Ops.row_sums: the softmax's sum by layers.row_sum (see rms_norm)."""
    logits = ops.router_logits(x, router_w)  # [M, E] float32
    if ops.row_sums:  # jax.nn.softmax's formula, its sum in a fixed order
        e = transcendental.exp(logits - jnp.max(logits, axis=-1, keepdims=True))
        probabilities = e / row_sum(e)[:, None]
    else:
        probabilities = transcendental.softmax(logits, axis=-1)
    gates, experts = jax.lax.top_k(probabilities, k)
    return Routing(gates, experts.astype(jnp.int32))


class ExpertWeights(NamedTuple):
    """Per-expert int8 matrices (or plain float [E, K, N] arrays when haiku initialises shapes)."""

    linear: ExpertStack | InLayer | Array  # gelu branch [E, D, F]
    linear_v: ExpertStack | InLayer | Array  # linear branch [E, D, F]
    linear_1: ExpertStack | InLayer | Array  # output [E, F, D], 8 row-block scales


class _Tiles(NamedTuple):
    expert: Array  # [n_tiles] expert of each tile
    first_row: Array  # [n_tiles] index into the sorted pair list of the tile's first row
    end_row: Array  # [n_tiles] one past the expert's last pair
    used: Array  # [] number of tiles that hold any pair


def _plan_tiles(sorted_experts: Array, num_experts: int, tile: int, n_tiles: int) -> _Tiles:
    counts = jnp.bincount(sorted_experts, length=num_experts)  # [E]
    group_start = jnp.cumsum(counts) - counts
    tiles_per = (counts + tile - 1) // tile
    tile_end = jnp.cumsum(tiles_per)  # [E]
    t = jnp.arange(n_tiles)
    expert = jnp.minimum(jnp.searchsorted(tile_end, t, side="right"), num_experts - 1)
    first_tile = tile_end[expert] - tiles_per[expert]
    first_row = group_start[expert] + (t - first_tile) * tile
    return _Tiles(expert, first_row, group_start[expert] + counts[expert], tile_end[-1])


def _expert_rows(x: Array, w: ExpertWeights, e: int, products: Products, used: Array | None = None) -> Array:
    """gelu(x W) * (x V) U for one (static) expert e. x [R, D] -> [R, D]. Rows not `used` [R] (bool) are not
    computed by native products (zero out); XLA's forms compute every row."""
    def pick(q: ExpertStack | InLayer | QuantizedWeight | Array) -> Any:
        if isinstance(q, (ExpertStack, InLayer)):
            return q.expert(e)
        if isinstance(q, QuantizedWeight):
            return QuantizedWeight(q.weight[e], q.scales[e])
        return jnp.swapaxes(q[e], 0, 1)  # plain [E, K, N] (haiku shape checks) -> [N, K]
    h = transcendental.gelu(product(x, pick(w.linear), products, used)) * product(x, pick(w.linear_v), products, used)
    return product(h, pick(w.linear_1), products, used)


def _expert_rows_dynamic(x: Array, w: ExpertWeights, e: Array, products: Products, used: Array) -> Array:
    """The same for a traced expert index: a switch over static experts keeps weights unsliced."""
    def branch(i: int) -> Any:
        return lambda xs, us: _expert_rows(xs, w, i, products, us)
    return jax.lax.switch(e, [branch(i) for i in range(w.linear.shape[0])], x, used)


def grouped_experts(x: Array, routing: Routing, w: ExpertWeights, tile: int,
                    products: Products = Products.DOT) -> Array:
    """sum_k gate_k * expert_k(x) for every row of x [M, D], computing only selected (row, expert) pairs."""
    m, k = routing.experts.shape
    num_experts = w.linear.shape[0]
    n_pairs = m * k
    flat_experts = routing.experts.reshape(n_pairs)
    order = jnp.argsort(flat_experts, stable=True)  # pairs sorted by expert
    pair_token = order // k
    pair_gate = routing.gates.reshape(n_pairs)[order]
    n_tiles = min(-(-n_pairs // tile) + num_experts, n_pairs)
    plan = _plan_tiles(flat_experts[order], num_experts, tile, n_tiles)
    rows = jnp.arange(tile)

    def body(i: Array, out: Array) -> Array:
        r = plan.first_row[i] + rows
        valid = r < plan.end_row[i]
        r = jnp.minimum(r, n_pairs - 1)
        tok = pair_token[r]
        gate = jnp.where(valid, pair_gate[r], 0.0).astype(x.dtype)
        y = _expert_rows_dynamic(x[tok], w, plan.expert[i], products, valid)  # [tile, D]
        return out.at[tok].add(jnp.where(valid[:, None], y * gate[:, None], 0.0))

    return jax.lax.fori_loop(0, plan.used, body, jnp.zeros_like(x))


def experts_by_cond(x: Array, routing: Routing, w: ExpertWeights, active: Array | None = None,
                    products: Products = Products.FUSED_REDUCE) -> Array:
    """Decode: one conditional per expert, taken only if some active row selected it.

    Weights are sliced statically (no copies) and each used expert's int8 weights are converted once for all
    rows; a row that did not pick the expert adds an exact zero (not gate 0 times its output, which could be
    non-finite). At this size the step is bound by weight reads. `active` [M] bool: False rows (free decode
    slots, whose outputs are discarded) never make an expert run. Each row is computed independently, so an
    active row's result does not depend on which experts run.
    """
    out = jnp.zeros_like(x)
    for e in range(w.linear.shape[0]):
        hit = routing.experts == e  # [M, k]
        if active is not None:
            hit = hit & active[:, None]
        gate = row_sum(jnp.where(hit, routing.gates, 0.0)).astype(x.dtype)  # [M]
        picked = jnp.any(hit, axis=-1)  # [M]

        def run(operands: tuple[Array, Array], e: int = e, gate: Array = gate, picked: Array = picked) -> Array:
            rows, acc = operands
            y = _expert_rows(rows, w, e, products, picked) * gate[:, None]
            return acc + jnp.where(picked[:, None], y, 0.0)

        out = jax.lax.cond(jnp.any(picked), run, lambda operands: operands[1], (x, out))
    return out


def grouped_native(w: ExpertWeights) -> bool:
    """Whether the experts are int8 matrices packed for the native kernel on one device (experts_grouped)."""
    first = w.linear.experts[0] if isinstance(w.linear, ExpertStack) else None
    return isinstance(first, PackedWeight) and first.mesh is None and first.packed_scales is not None


def experts_grouped(x: Array, routing: Routing, w: ExpertWeights, active: Array, products: Products) -> Array:
    """experts_by_cond's sum in two native calls instead of a conditional per expert.

    Each (row, selected expert) pair is a row of its own; the first call multiplies every pair by its expert's
    two input matrices, the second the gated-GELU result by its output matrix (kernels.grouped_matmul), so the
    threads share the selected experts' weights out among themselves (one row meeting two experts keeps two
    cores reading). A row's pairs are taken in expert order, each output times its gate rounded to float32, and
    added to zero in that order; pairs of rows not `active` are not computed (their rows come out zero).
    """
    m, k = routing.experts.shape
    n = w.linear.count
    order = jnp.argsort(routing.experts, axis=-1)
    experts = jnp.take_along_axis(routing.experts, order, axis=-1).reshape(m * k)
    gates = jnp.take_along_axis(routing.gates, order, axis=-1).astype(x.dtype)  # [M, k]
    used = jnp.repeat(active, k)  # [M * k]
    pairs = jnp.repeat(x.astype(jnp.float32), k, axis=0)  # [M * k, D]
    activations = "int8" if products.int8 else "float32"

    def call(rows: Array, which: Array, mask: Array, stacks: tuple[ExpertStack, ...]) -> Array:
        weights = [q for stack in stacks for q in stack.experts]  # a stack's buffers hold its experts in order
        return kernels.grouped_matmul(rows, which, [q.packed for q in weights], [q.packed_scales for q in weights],
                                      weights[0].n, rows=mask, activations=activations)

    both = call(jnp.concatenate([pairs, pairs]), jnp.concatenate([experts, experts + n]),
                jnp.concatenate([used, used]), (w.linear, w.linear_v)).astype(x.dtype)
    h = transcendental.gelu(both[:m * k]) * both[m * k:]
    y = call(h.astype(jnp.float32), experts, used, (w.linear_1,)).astype(x.dtype).reshape(m, k, -1)
    # Each gated output rounded on its own before the adds: the barrier keeps XLA from contracting a multiply
    # and the add after it into one fused multiply-add, which it does or not by how it fuses the program.
    terms = jax.lax.optimization_barrier(jnp.where(used.reshape(m, k, 1), y * gates[..., None], 0.0))
    out = jnp.zeros_like(x)
    for j in range(k):
        out = out + terms[:, j]
    return out


def pick_tile(m: int, k: int, num_experts: int) -> int:
    """Rows per tile for grouped_experts: ~2x the mean group size as a power of two, between 16 and 64
    (measured on 2 CPU cores: fewer, fuller tiles win until the product itself dominates)."""
    if m <= 8:
        return m
    mean_group = -(-m * k // num_experts)
    return int(min(64, max(16, 1 << (2 * mean_group - 1).bit_length())))


class MoELayer(hk.Module):
    """Haiku module `moe` (experts under moe/linear, moe/linear_v, moe/linear_1)."""

    def __init__(self, num_experts: int, ffn_size: int, mesh: Mesh | None = None, name: str = "moe") -> None:
        super().__init__(name=name)
        self.num_experts = num_experts
        self.ffn_size = ffn_size
        self.mesh = mesh

    def __call__(self, x: Array, routing: Routing, active: Array | None, ops: "Ops") -> Array:
        """x [B, T, D] -> [B, T, D]. `active` [B] bool (a paged step: T == 1) masks free slots' rows. The experts
        run as the backend's form (Ops.moe: ops/xla.py, ops/native.py, ops/grouped.py)."""
        b, t, d = x.shape
        e, f = self.num_experts, self.ffn_size
        w = ExpertWeights(
            ParamHolder("linear").get("w", (e, d, f)),
            ParamHolder("linear_v").get("w", (e, d, f)),
            ParamHolder("linear_1").get("w", (e, f, d)),
        )
        rows_active = None if active is None else active.reshape(b * t)
        return ops.moe(x.reshape(b * t, d), routing, w, rows_active, self.mesh).reshape(b, t, d)


class ParamHolder(hk.Module):
    """A named scope holding parameters, so paths match the reference's (e.g. `.../moe/linear/w`)."""

    def get(self, name: str, shape: tuple[int, ...], dtype: jnp.dtype = jnp.float32) -> jax.Array:
        return hk.get_parameter(name, shape, dtype, init=hk.initializers.Constant(0))
