"""The generic backend's experts: the Pallas grouped product (interpret mode here) against a float64 reference,
and the expert-sorted MoE (kernel and ragged_dot forms) against moe.experts_by_cond, on small shapes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax import export

from model_service.backend import choose_backend
from model_service.config import MeshConfig
from model_service.kernels.tpu.grouped_matmul import Tiling, fit_tiling, grouped_matmul, plan
from model_service.model.grouped import GroupedExperts, experts_sorted, kernel_layout, logical_weight, sort_pairs
from model_service.model.layers import ExpertStack, Products, QuantizedWeight
from model_service.model.moe import ExpertWeights, Routing, experts_by_cond
from model_service.model.weights import GroupedWeight
from model_service.sharding import make_mesh

SMALL = Tiling(16, 128, 128)


def _bf16_values(a: np.ndarray) -> np.ndarray:
    return a.astype(ml_dtypes.bfloat16).astype(np.float32)


def _matrix(rng: np.random.Generator, g: int, k: int, n: int, blocks: int) -> tuple[np.ndarray, np.ndarray]:
    weight = rng.integers(-127, 128, (g, k, n), dtype=np.int8)
    scales = _bf16_values(rng.uniform(0.5, 1.5, (g, blocks, n)).astype(np.float32) / (127 * np.sqrt(k)))
    return weight, scales


def _reference(x: np.ndarray, weight: np.ndarray, scales: np.ndarray, sizes: np.ndarray, bf16: bool) -> np.ndarray:
    """float64 grouped product; with `bf16` the reference's roundings first (bf16 rows, bf16(int8 * scale))."""
    g, k, n = weight.shape
    blocks = scales.shape[1]
    deq = weight.astype(np.float64).reshape(g, blocks, k // blocks, n) * scales[:, :, None, :].astype(np.float64)
    deq = deq.reshape(g, k, n)
    if bf16:
        deq, x = _bf16_values(deq.astype(np.float32)).astype(np.float64), _bf16_values(x)
    out = np.zeros((x.shape[0], n))
    ends = np.cumsum(sizes)
    for e in range(g):
        out[ends[e] - sizes[e]:ends[e]] = x[ends[e] - sizes[e]:ends[e]].astype(np.float64) @ deq[e]
    return out


CASES = [  # (rows, group sizes): empty groups, one row, every row on one expert, rows past the groups
    (1, [0, 1, 0, 0]),
    (24, [5, 0, 17, 2]),
    (20, [0, 0, 0, 20]),
    (30, [3, 0, 9, 0]),
]


@pytest.mark.parametrize("rows,sizes", CASES)
@pytest.mark.parametrize("k,n,blocks", [(128, 256, 1), (344, 96, 8)])  # column-parallel; row blocks of 43 rows
def test_float32_grouped_product_matches_a_float64_reference_to_float32_precision(rows, sizes, k, n, blocks):
    rng = np.random.default_rng(rows * 7 + blocks)
    weight, scales = _matrix(rng, len(sizes), k, n, blocks)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    sizes = np.array(sizes, np.int32)
    out = np.asarray(grouped_matmul(jnp.asarray(x), jnp.asarray(weight), jnp.asarray(scales), jnp.asarray(sizes),
                                    fit_tiling(rows, k, n, blocks, SMALL), interpret=True))
    want = _reference(x, weight, scales, sizes, bf16=False)
    used = sizes.sum()
    scale = np.abs(want[:used]).max(initial=1e-30)
    np.testing.assert_allclose(out[:used], want[:used], rtol=0, atol=2e-6 * scale)


@pytest.mark.parametrize("rows,sizes", CASES[1:3])
@pytest.mark.parametrize("k,n,blocks", [(128, 256, 1), (344, 96, 8)])
def test_bfloat16_grouped_product_rounds_like_the_reference(rows, sizes, k, n, blocks):
    rng = np.random.default_rng(rows + blocks)
    weight, scales = _matrix(rng, len(sizes), k, n, blocks)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    sizes = np.array(sizes, np.int32)
    out = grouped_matmul(jnp.asarray(x, jnp.bfloat16), jnp.asarray(weight), jnp.asarray(scales), jnp.asarray(sizes),
                         fit_tiling(rows, k, n, blocks, SMALL), interpret=True)
    assert out.dtype == jnp.bfloat16
    want = _bf16_values(_reference(x, weight, scales, sizes, bf16=True).astype(np.float32))
    used = sizes.sum()
    got = np.asarray(out, np.float32)[:used]
    # Only the float32 accumulation's order separates the two before the output's rounding to bfloat16: the
    # rounded values agree (a weight scaled after the dot instead of per element agrees on ~60 % of them).
    np.testing.assert_allclose(got, want[:used], rtol=2 ** -8, atol=0)
    assert np.mean(got == want[:used]) >= 0.99


def test_the_plan_visits_each_groups_row_tiles_once_in_group_order():
    sizes = jnp.array([3, 0, 20, 0, 9], jnp.int32)  # 32 rows, 29 in groups, tiles of 8
    meta = plan(sizes, 32, 8)
    count = int(meta.count)
    visits = list(zip(np.asarray(meta.group)[:count].tolist(), np.asarray(meta.tile)[:count].tolist()))
    assert visits == [(0, 0), (2, 0), (2, 1), (2, 2), (4, 2), (4, 3)]
    assert np.asarray(meta.offsets).tolist() == [0, 3, 3, 23, 23, 32]
    assert int(plan(jnp.zeros(4, jnp.int32), 16, 16).count) == 1  # nothing to do: one visit that stores nothing


def test_a_tiling_that_does_not_divide_the_shapes_is_refused():
    x, w, s = jnp.zeros((16, 128)), jnp.zeros((2, 128, 256), jnp.int8), jnp.ones((2, 1, 256))
    with pytest.raises(ValueError, match="must divide"):
        grouped_matmul(x, w, s, jnp.array([8, 8], jnp.int32), Tiling(16, 128, 96), interpret=True)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("rows,k,n,blocks", [(16, 6144, 32768, 1), (16, 32768, 6144, 8),  # Grok-1 width
                                             (512, 2736, 512, 8), (16, 688, 128, 8)])  # medium, golden: padded
def test_the_kernel_lowers_for_tpu(dtype, rows, k, n, blocks):
    """Pallas' TPU lowering (to Mosaic) runs on CPU too: these shapes pass it (shapes only, no memory). The
    chip's own compiler (libtpu) is not run here."""
    tiling = fit_tiling(rows, k, n, blocks, Tiling(128, 1024, 2048))
    args = (jax.ShapeDtypeStruct((rows, k), dtype), jax.ShapeDtypeStruct((8, k, n), jnp.int8),
            jax.ShapeDtypeStruct((8, blocks, n), jnp.float32), jax.ShapeDtypeStruct((8,), jnp.int32))
    exported = export.export(jax.jit(lambda x, w, s, g: grouped_matmul(x, w, s, g, tiling)), platforms=("tpu",))(*args)
    assert "tpu_custom_call" in exported.mlir_module()


def _experts(rng: np.random.Generator, e: int, d: int, f: int) -> tuple[ExpertWeights, tuple[GroupedWeight, ...]]:
    """Random MoE matrices in both layouts: per-expert QuantizedWeights (cond) and stacked (grouped)."""
    stacked = []
    per_expert = []
    for k, n, blocks in ((d, f, 1), (d, f, 1), (f, d, 8)):
        weight, scales = _matrix(rng, e, k, n, blocks)
        stacked.append(GroupedWeight(jnp.asarray(weight), jnp.asarray(scales)))
        per_expert.append(ExpertStack(tuple(
            QuantizedWeight(jnp.asarray(weight[i].T if blocks == 1 else weight[i]), jnp.asarray(scales[i]))
            for i in range(e))))
    return ExpertWeights(*per_expert), tuple(stacked)


def _routing(rng: np.random.Generator, m: int, e: int, k: int) -> tuple[jax.Array, jax.Array]:
    probs = jax.nn.softmax(jnp.asarray(rng.standard_normal((m, e)) * 2, jnp.float32), axis=-1)
    gates, experts = jax.lax.top_k(probs, k)
    return gates, experts.astype(jnp.int32)


@pytest.mark.parametrize("mode", ["pallas_interpret", "ragged"])
@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 2e-6), (jnp.bfloat16, 2e-2)])
def test_expert_sorted_moe_matches_experts_by_cond_and_leaves_padding_rows_zero(mode, dtype, tol):
    rng = np.random.default_rng(3)
    e, d, f, m = 8, 64, 344, 12
    per_expert, stacked = _experts(rng, e, d, f)
    x = jnp.asarray(rng.standard_normal((m, d)), dtype)
    gates, experts = _routing(rng, m, e, 2)
    active = jnp.asarray(rng.random(m) < 0.7).at[0].set(True).at[1].set(False)
    want = experts_by_cond(x, Routing(gates, experts), per_expert, active, Products.DOT)
    got = jax.jit(lambda x: experts_sorted(x, experts, gates, GroupedExperts(*stacked), active, mode))(x)
    assert got.dtype == dtype
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert not got[~np.asarray(active)].any()
    np.testing.assert_allclose(got, want, rtol=0, atol=tol * np.abs(want).max())


@pytest.mark.parametrize("mode", ["pallas_interpret", "ragged"])
def test_one_row_and_every_row_on_one_expert(mode):
    rng = np.random.default_rng(5)
    e, d, f = 4, 64, 344
    per_expert, stacked = _experts(rng, e, d, f)
    for m, experts in ((1, jnp.array([[2, 0]], jnp.int32)), (9, jnp.tile(jnp.array([[3, 1]], jnp.int32), (9, 1)))):
        x = jnp.asarray(rng.standard_normal((m, d)), jnp.float32)
        gates = jnp.asarray(rng.uniform(0.1, 0.5, (m, 2)), jnp.float32)
        want = experts_by_cond(x, Routing(gates, experts), per_expert, None, Products.DOT)
        got = jax.jit(lambda x, experts, gates: experts_sorted(x, experts, gates, GroupedExperts(*stacked), None,
                                                              mode))(x, experts, gates)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=2e-6 * np.abs(want).max())


def test_padding_rows_select_no_expert_work():
    experts = jnp.array([[1, 0], [3, 1], [2, 2]], jnp.int32)
    pairs = sort_pairs(experts, jnp.ones((3, 2)), jnp.array([True, False, True]), 4)
    assert np.asarray(pairs.group_sizes).tolist() == [1, 1, 2, 0]  # row 1's experts 1 and 3 count nowhere
    assert np.asarray(pairs.order)[-2:].tolist() == [2, 3]  # its pairs sorted after every group
    none = sort_pairs(experts, jnp.ones((3, 2)), jnp.zeros(3, bool), 4)
    assert not np.asarray(none.group_sizes).any()


def test_the_backend_chooses_the_experts_form():
    one, eight = make_mesh(MeshConfig()), make_mesh(MeshConfig(1, 8))
    assert choose_backend("cpu", one, jnp.float32).moe == "cond"
    generic = choose_backend("generic", one, jnp.float32)
    assert generic.moe == "ragged" and generic.stacked_experts  # CPU: XLA's form (the kernel needs a TPU)
    assert choose_backend("generic", eight, jnp.float32).moe == "cond"


def test_on_a_tpu_the_fast_mode_takes_the_kernel_and_the_faithful_mode_the_conditionals(monkeypatch):
    """float32 on a TPU is the faithful mode; the kernel's float32 failed golden parity on the chip, so auto keeps
    the per-expert conditionals there (an explicit --moe pallas still gets the kernel)."""
    from model_service import backend

    monkeypatch.setattr(backend, "platform", lambda mesh: "tpu")
    one = make_mesh(MeshConfig())
    assert choose_backend("generic", one, jnp.bfloat16).moe == "pallas"
    faithful = choose_backend("generic", one, jnp.float32)
    assert faithful.products is Products.EXACT and faithful.moe == "cond"
    assert choose_backend("generic", one, jnp.float32, moe="pallas").moe == "pallas"


def test_row_blocks_and_columns_padded_once_for_the_kernel_give_the_same_experts():
    """kernel_layout pads linear_1's row blocks (here 43 rows each) once, the rows meeting zero columns there,
    and linear's and linear_v's 344 columns to 384 (zero weights and scales; the products sliced back): the
    kernel's experts are the same bits as over the checkpoint's layout."""
    rng = np.random.default_rng(9)
    e, d, f, m = 4, 64, 344, 6
    _, stacked = _experts(rng, e, d, f)
    padded = tuple(kernel_layout(q, "pallas") for q in stacked)
    for q in padded[:2]:  # column-parallel: 344 columns -> 3 x 128
        assert q.weight.shape == (e, d, 384) and q.scales.shape == (e, 1, 384) and q.shape == (e, d, f)
        assert q.cols == f and not np.asarray(q.weight)[..., f:].any() and not np.asarray(q.scales)[..., f:].any()
    assert padded[2].weight.shape == (e, 8 * 128, d) and padded[2].shape == (e, f, d) and padded[2].rows == f
    for q, was in zip(padded, stacked):
        back = logical_weight(q)
        np.testing.assert_array_equal(np.asarray(back.weight), np.asarray(was.weight))
        np.testing.assert_array_equal(np.asarray(back.scales), np.asarray(was.scales))
        assert kernel_layout(was, "ragged") is was and kernel_layout(q, "pallas") is q
    x = jnp.asarray(rng.standard_normal((m, d)), jnp.float32)
    gates, experts = _routing(rng, m, e, 2)
    run = jax.jit(lambda x, w, mode: experts_sorted(x, experts, gates, GroupedExperts(*w), None, mode),
                  static_argnums=2)
    want = np.asarray(run(x, stacked, "ragged"))
    for mode in ("pallas_interpret", "ragged"):
        np.testing.assert_allclose(np.asarray(run(x, padded, mode)), want, rtol=0, atol=2e-6 * np.abs(want).max())
    for dtype in (jnp.float32, jnp.bfloat16):
        unpadded = stacked[:2] + padded[2:]  # the row blocks padded as before, the columns not
        np.testing.assert_array_equal(np.asarray(run(x.astype(dtype), padded, "pallas_interpret")),
                                      np.asarray(run(x.astype(dtype), unpadded, "pallas_interpret")))


@pytest.mark.skipif(jax.default_backend() != "tpu", reason="the compiled kernel needs a TPU (CPU runs it interpreted)")
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("k,n,blocks", [(1024, 2048, 1), (4096, 1024, 8)])
def test_the_compiled_kernel_on_tpu_matches_the_reference(dtype, k, n, blocks):
    rng = np.random.default_rng(k + blocks)
    sizes = np.array([40, 0, 3, 0, 0, 70, 1, 0], np.int32)  # 128 rows: empty groups, a one-row group, a tail
    weight, scales = _matrix(rng, len(sizes), k, n, blocks)
    x = rng.standard_normal((128, k)).astype(np.float32)
    out = grouped_matmul(jnp.asarray(x, dtype), jnp.asarray(weight), jnp.asarray(scales), jnp.asarray(sizes),
                         fit_tiling(128, k, n, blocks, Tiling(64, 512, 1024)))
    used = sizes.sum()
    got = np.asarray(out, np.float32)[:used]
    if dtype == jnp.float32:
        want = _reference(x, weight, scales, sizes, bf16=False)[:used]
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * np.abs(want).max())
    else:
        want = _bf16_values(_reference(x, weight, scales, sizes, bf16=True).astype(np.float32))[:used]
        # On a v5e (JAX 0.10.2) 0.009-0.014 % of the outputs, small ones where the sum cancels, differed from the
        # float64 reference's rounding by more than one bfloat16 step of their own size (at most 2^-9 of the
        # largest output): the MXU adds in another order. One step of the largest output bounds them.
        np.testing.assert_allclose(got, want, rtol=2 ** -8, atol=2 ** -8 * np.abs(want).max())
        assert np.mean(got == want) >= 0.99


def _dots(jaxpr: jax.extend.core.Jaxpr) -> list[jax.extend.core.JaxprEqn]:
    """Every dot (dot_general, ragged_dot_general) in `jaxpr` and the jaxprs nested in it (a pallas_call's too)."""
    out = []
    for eqn in jaxpr.eqns:
        if "dot" in eqn.primitive.name:
            out.append(eqn)
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if isinstance(inner, jax.extend.core.Jaxpr):
                    out += _dots(inner)
    return out


@pytest.mark.parametrize("mode", ["pallas_interpret", "ragged"])
def test_bfloat16_expert_products_are_one_pass_under_the_models_highest_precision(mode):
    """The model traces under default_matmul_precision("highest") (its float32 router); Mosaic's TPU compiler
    refuses a bfloat16 product at HIGHEST ("Bad lhs type", the chip's first grouped run), so the experts' bfloat16
    products (the kernel's, XLA's ragged dot, itself a Mosaic kernel on TPU) say DEFAULT."""
    rng = np.random.default_rng(7)
    _, stacked = _experts(rng, 4, 64, 344)
    x = jnp.asarray(rng.standard_normal((8, 64)), jnp.bfloat16)
    gates, experts = _routing(rng, 8, 4, 2)
    with jax.default_matmul_precision("highest"):
        traced = jax.make_jaxpr(lambda x: experts_sorted(x, experts, gates, GroupedExperts(*stacked), None, mode))(x)
    dots = _dots(traced.jaxpr)
    assert dots
    for eqn in dots:
        if any(v.aval.dtype == jnp.bfloat16 for v in eqn.invars[:2]):
            assert all(p in (None, jax.lax.Precision.DEFAULT) for p in (eqn.params["precision"] or (None,))), eqn


@pytest.mark.parametrize("pairs", [2, 16, 34, 128, 512, 4096])
def test_aligned_rows_give_every_row_tile_to_one_expert(pairs):
    """The kernel's layout: each expert's rows start a row tile of their own, so every tile is visited once (no
    output tile is written by two experts' visits, which relied on the tile staying in the chip's VMEM between
    visits), and every sorted row lands in its own group's tiles."""
    from model_service.model.grouped import TILING, aligned_rows

    rng = np.random.default_rng(pairs)
    for _ in range(20):
        active = int(rng.integers(0, pairs + 1))
        cuts = np.sort(rng.integers(0, active + 1, 7))
        sizes = np.diff(np.concatenate([[0], cuts, [active]])).astype(np.int32)
        a = aligned_rows(jnp.asarray(sizes), pairs, TILING)
        assert a.rows % a.tile == 0 and a.tile <= TILING.rows
        padded = np.asarray(a.group_sizes)
        assert (padded % a.tile == 0).all() and (padded >= sizes).all() and padded.sum() <= a.rows
        starts = np.cumsum(padded) - padded
        dest = np.asarray(a.dest)
        group = np.repeat(np.arange(8), sizes)
        within = np.arange(active) - np.repeat(np.cumsum(sizes) - sizes, sizes)
        np.testing.assert_array_equal(dest[:active], starts[group] + within)
        assert (dest[active:] == a.rows).all()
        p = plan(jnp.asarray(padded), a.rows, a.tile)
        tiles = np.asarray(p.tile)[:int(p.count)]
        if padded.sum():
            assert len(set(tiles.tolist())) == len(tiles)
