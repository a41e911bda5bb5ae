"""The grouped native product (kernels.grouped_matmul: row r times weight which[r], an MoE layer's (token, expert)
pairs in one call) against a float64 NumPy reference on every instruction-set path, and bit for bit against
the single-weight product a row would otherwise take, with any other rows, weights and row mask beside it; and
the MoE layer built on it against the conditional-per-expert layer it replaces."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model_service import kernels
from model_service.model.layers import ExpertStack, Products
from model_service.model.moe import ExpertWeights, Routing, experts_by_cond, experts_grouped, grouped_native
from model_service.model.packed import pack_quantized
from tests.kernels.test_native_matmul import ISAS, _reference, _weight

pytestmark = pytest.mark.skipif(not kernels.available(), reason="native kernels not built")
ACTIVATIONS = ["float32", "int8"]


def _packed(rng: np.random.Generator, experts: int, k: int, n: int, blocks: int) -> tuple[list, list]:
    host = [_weight(rng, k, n, blocks) for _ in range(experts)]
    return host, [pack_quantized(q, None) for q in host]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("k,n,blocks", [(64, 48, 1), (37, 45, 1), (8 * 43, 200, 8)])
def test_each_row_matches_a_float64_reference_of_its_own_weight(isa: str, k: int, n: int, blocks: int) -> None:
    rng = np.random.default_rng(k + n)
    host, packed = _packed(rng, 3, k, n, blocks)
    x = rng.standard_normal((11, k)).astype(np.float32)
    which = rng.integers(0, 3, 11).astype(np.int32)
    out = np.asarray(kernels.grouped_matmul(jnp.asarray(x), jnp.asarray(which), [p.packed for p in packed],
                                            [p.packed_scales for p in packed], n, isa))
    for r in range(11):
        ref, bound = _reference(x[r:r + 1], host[which[r]])
        assert np.all(np.abs(out[r] - ref[0]) <= bound[0]), r


@pytest.mark.parametrize("form", ["auto", "rows", "panel"])
@pytest.mark.parametrize("activations", ACTIVATIONS)
@pytest.mark.parametrize("isa", ISAS)
def test_a_row_has_the_bits_of_the_single_weight_product_whatever_shares_the_call(isa: str, activations: str,
                                                                                   form: str) -> None:
    """Whichever form computes the call (auto takes the panel form from 32 rows of one weight on AVX2)."""
    rng = np.random.default_rng(7)
    k, n, blocks, experts, m = 8 * 40, 90, 8, 5, 37
    _, packed = _packed(rng, experts, k, n, blocks)
    weights, scales = [p.packed for p in packed], [p.packed_scales for p in packed]
    x = jnp.asarray(rng.standard_normal((m, k)).astype(np.float32))
    for trial in range(3):
        which = jnp.asarray(rng.integers(0, experts if trial else 1, m).astype(np.int32))  # trial 0: all on one
        mask = jnp.asarray(rng.random(m) < 0.7) if trial else jnp.ones((m,), bool)
        out = np.asarray(kernels.grouped_matmul(x, which, weights, scales, n, isa, rows=mask, form=form,
                                                activations=activations))
        for r in range(m):
            if not mask[r]:
                assert not out[r].any()
                continue
            alone = kernels.matmul(x, weights[int(which[r])], scales[int(which[r])], n, isa,
                                   rows=jnp.arange(m) == r, form="rows", activations=activations)
            assert np.array_equal(np.asarray(alone)[r], out[r]), (trial, r)


@pytest.mark.parametrize("isa", ISAS)
def test_stacks_of_weights_give_the_bits_of_the_same_weights_in_separate_buffers(isa: str) -> None:
    """A layer's experts in one buffer [E, NB, K, 16] (and a second stack beside it, as the experts' two input
    matrices travel): matrix e of the list is the same matrix either way, and so are the bits."""
    rng = np.random.default_rng(11)
    k, n, blocks, m = 8 * 24, 70, 8, 23
    _, first = _packed(rng, 3, k, n, blocks)
    _, second = _packed(rng, 2, k, n, blocks)
    separate = first + second
    stacks = ([jnp.stack([p.packed for p in first]), jnp.stack([p.packed for p in second])],
              [jnp.stack([p.packed_scales for p in first]), jnp.stack([p.packed_scales for p in second])])
    mixed = ([stacks[0][0], *(p.packed for p in second)], [stacks[1][0], *(p.packed_scales for p in second)])
    x = jnp.asarray(rng.standard_normal((m, k)).astype(np.float32))
    which = jnp.asarray(rng.integers(0, len(separate), m).astype(np.int32))
    mask = jnp.asarray(rng.random(m) < 0.8)
    want = np.asarray(kernels.grouped_matmul(x, which, [p.packed for p in separate],
                                             [p.packed_scales for p in separate], n, isa, rows=mask))
    assert len(set(np.asarray(which)[np.asarray(mask)].tolist())) > 2
    for weights, scales in (stacks, mixed):
        got = np.asarray(kernels.grouped_matmul(x, which, weights, scales, n, isa, rows=mask))
        assert np.array_equal(got, want)


def test_a_stack_whose_scales_hold_another_count_of_matrices_is_refused() -> None:
    rng = np.random.default_rng(2)
    _, packed = _packed(rng, 3, 32, 16, 1)
    with pytest.raises(Exception, match=r"stack w \[E, NB, K, 16\] with scales \[E, B, NB\*16\]"):
        jax.block_until_ready(kernels.grouped_matmul(
            jnp.ones((2, 32), jnp.float32), jnp.asarray([0, 1], jnp.int32), [jnp.stack([p.packed for p in packed])],
            [jnp.stack([p.packed_scales for p in packed[:2]])], 16))


def test_a_row_naming_a_weight_that_is_not_given_is_refused() -> None:
    rng = np.random.default_rng(1)
    _, packed = _packed(rng, 2, 32, 16, 1)
    with pytest.raises(Exception, match="names weight 2 of 2"):
        jax.block_until_ready(kernels.grouped_matmul(
            jnp.ones((3, 32), jnp.float32), jnp.asarray([0, 2, 1], jnp.int32), [p.packed for p in packed],
            [p.packed_scales for p in packed], 16))


@pytest.mark.parametrize("products", [Products.NATIVE, Products.NATIVE_INT8])
def test_the_grouped_moe_layer_computes_the_conditional_layers_sum_and_a_row_alone_decides_its_bits(
        products: Products) -> None:
    """Rows that picked the same experts, rows whose two experts come in either order, and an inactive row (zero
    out). Against the conditional-per-expert layer: the same sum (XLA rounds its gated-GELU glue by how it fuses
    each program, so not always the same bits); against itself: a row's bits are the same among other rows and
    in a step of another row count."""
    rng = np.random.default_rng(3)
    experts, d, f, m = 4, 64, 96, 9

    def stack(k: int, n: int, blocks: int) -> ExpertStack:
        return ExpertStack(tuple(pack_quantized(_weight(rng, k, n, blocks), None) for _ in range(experts)))

    w = ExpertWeights(stack(d, f, 1), stack(d, f, 1), stack(f, d, 8))
    assert grouped_native(w)
    x = rng.standard_normal((m, d)).astype(np.float32)
    picks = np.array([[0, 1], [1, 0], [3, 2], [2, 3], [0, 3], [1, 2], [3, 0], [2, 1], [0, 1]], np.int32)
    gates = rng.uniform(0.05, 0.6, (m, 2)).astype(np.float32)
    active = np.array([True] * 7 + [False, True])

    def layer(fn, x: np.ndarray, gates: np.ndarray, picks: np.ndarray, active: np.ndarray) -> np.ndarray:
        return np.asarray(jax.jit(lambda *a: fn(a[0], Routing(a[1], a[2]), w, a[3], products))(
            jnp.asarray(x), jnp.asarray(gates), jnp.asarray(picks), jnp.asarray(active)))

    out = layer(experts_grouped, x, gates, picks, active)
    assert not out[7].any()
    assert np.allclose(out, layer(experts_by_cond, x, gates, picks, active), rtol=1e-5, atol=1e-4)
    # The same rows reversed among 7 others (other picks, one more inactive) in a step of 16 rows.
    others = rng.standard_normal((7, d)).astype(np.float32)
    big = layer(experts_grouped, np.concatenate([x[::-1], others]),
                np.concatenate([gates[::-1], rng.uniform(0.05, 0.6, (7, 2)).astype(np.float32)]),
                np.concatenate([picks[::-1], rng.permuted(np.tile([[0, 1, 2, 3]], (7, 1)), axis=1)[:, :2]]),
                np.concatenate([active[::-1], [True] * 6 + [False]]))
    assert np.array_equal(big[:m][::-1], out)
