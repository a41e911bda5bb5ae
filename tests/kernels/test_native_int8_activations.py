"""The native int8-activation product (kernels.matmul(..., activations="int8"), an opt-in) against NumPy on
every instruction-set path this CPU supports, and its batch invariance.

NumPy rounds the rows as the kernel documents (per 32 values of K inside each scale block, step max|x| / 127,
round half to even), so the integer sums are known exactly; the kernel then adds each sub-block's sum times
its step in float32 in order, one fused multiply-add per sub-block: |error| <= (subs + blocks + 1) * 2^-24 *
sum |terms| against the float64 sum of the same terms (the textbook bound for a float32 chain). Against the
unrounded product, rounding moves each value by at most half a step: |x w - q d w| <= d / 2 * |w|.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import numpy as np
import pytest

from model_service import kernels
from model_service.model.layers import QuantizedWeight
from model_service.model.packed import pack_quantized

pytestmark = pytest.mark.skipif(not kernels.available(), reason="native kernels not built")
ISAS = list(kernels.supported_isas()) if kernels.available() else []
EPS32 = 2.0**-24
SUB = 32


def _weight(rng: np.random.Generator, k: int, n: int, blocks: int) -> QuantizedWeight:
    w = rng.integers(-127, 128, (k, n), dtype=np.int8)
    s = rng.uniform(0.5, 2.0, (blocks, n)).astype(np.float32) / 127
    return QuantizedWeight(w.T.copy() if blocks == 1 else w, s)


def _spans(k: int, blocks: int) -> list[tuple[int, int, int]]:
    """(scale block, first k, end k) of each sub-block, in order."""
    kb = k // blocks
    return [(b, b * kb + s, min(b * kb + s + SUB, (b + 1) * kb)) for b in range(blocks) for s in range(0, kb, SUB)]


def _rounded(x: np.ndarray, k: int, blocks: int) -> list[tuple[int, int, int, np.ndarray, np.ndarray]]:
    """Per sub-block: (block, k0, k1, q int64 [M, len], step float32 [M]) as the kernel rounds them."""
    out = []
    for b, k0, k1 in _spans(k, blocks):
        part = x[:, k0:k1]
        step = (np.max(np.abs(part), axis=1) / np.float32(127)).astype(np.float32)
        inverse = np.where(step > 0, np.float32(1) / np.where(step > 0, step, 1), 0).astype(np.float32)
        q = np.clip(np.rint(part * inverse[:, None]), -127, 127).astype(np.int64)
        out.append((b, k0, k1, q, step))
    return out


def _reference(x: np.ndarray, q: QuantizedWeight) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(float64 sum of the kernel's terms, its float32 bound, the unrounded float64 product, the rounding bound)."""
    w = (q.weight.T if q.transposed else q.weight).astype(np.int64)  # [K, N]
    k, blocks = w.shape[0], q.scales.shape[0]
    scales = q.scales.astype(np.float64)
    ref = np.zeros((x.shape[0], w.shape[1]))
    size = np.zeros_like(ref)
    rounding = np.zeros_like(ref)
    for b, k0, k1, qs, step in _rounded(x, k, blocks):
        term = (qs @ w[k0:k1]).astype(np.float64) * step[:, None].astype(np.float64) * scales[b]
        ref += term
        size += np.abs(term)
        rounding += (step[:, None].astype(np.float64) / 2) * (np.ones((1, k1 - k0)) @ np.abs(w[k0:k1])) * scales[b]
    subs = len(_spans(k, blocks))
    exact = x.astype(np.float64) @ (w * np.repeat(scales, k // blocks, axis=0))
    return ref, (subs + blocks + 1) * EPS32 * size, exact, rounding


@functools.cache
def _program(n: int, isa: str, threads: int) -> Any:
    return jax.jit(lambda a, w, s, m: kernels.matmul(a, w, s, n, isa, threads, rows=m, activations="int8"))


def _native(x: np.ndarray, q: QuantizedWeight, isa: str, threads: int = 0, used: np.ndarray | None = None) -> np.ndarray:
    p = pack_quantized(q, None)
    used = np.ones(x.shape[0], bool) if used is None else used
    return np.asarray(_program(p.n, isa, threads)(x, p.packed, p.packed_scales, used))


# Sub-blocks cut short by a scale block (K / blocks not a multiple of 32, nor of 4: 13, 342), one column, column
# counts ending inside a 16-column block and inside a pair of blocks, K past many sub-blocks.
SHAPES = [(64, 48, 1), (37 * 4, 45, 1), (4, 1, 1), (1, 3, 1), (2736, 40, 8), (8 * 13, 21, 8), (600, 200, 1), (256, 50, 8),
          (8 * 100, 90, 8), (512, 2736 // 8, 1)]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("k,n,blocks", SHAPES)
def test_each_path_matches_numpy_within_the_float32_bound_and_the_rounding(isa: str, k: int, n: int,
                                                                          blocks: int) -> None:
    rng = np.random.default_rng(k * 1000 + n)
    q = _weight(rng, k, n, blocks)
    x = rng.standard_normal((13, k)).astype(np.float32)
    x[3] = 0.0  # a row of zeros: step 0, every value rounds to 0
    x[5, : min(k, 40)] *= 1e4  # one sub-block of large values beside small ones
    ref, bound, exact, rounding = _reference(x, q)
    out = _native(x, q, isa)
    assert out.shape == (13, n) and out.dtype == np.float32
    assert np.all(np.abs(out - ref) <= bound), np.max(np.abs(out - ref) / np.maximum(bound, 1e-30))
    assert np.all(np.abs(out - exact) <= rounding + bound)
    assert np.all(out[3] == 0)


# Whole sub-blocks (K per scale block a multiple of 32: the AVX-512 path's loop over whole sub-blocks) with 1-4
# column blocks left for the last tile, and short ones (its general loop), and blocks of one sub-block (a table's).
@pytest.mark.parametrize("k,n,blocks", [(8 * 21, 77, 1), (2736, 40, 8), (600, 200, 1), (8 * 13, 33, 8), (192, 70, 6),
                                        (768, 77, 1), (768, 30, 3), (1024, 150, 4), (96, 60, 1)])
def test_every_path_gives_the_bits_of_the_scalar_path(k: int, n: int, blocks: int) -> None:
    rng = np.random.default_rng(blocks + k)
    q = _weight(rng, k, n, blocks)
    x = rng.standard_normal((19, k)).astype(np.float32)
    want = _native(x, q, "scalar")
    for isa in ISAS:
        np.testing.assert_array_equal(_native(x, q, isa), want, err_msg=isa)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("blocks", [1, 8])
def test_a_row_keeps_its_bits_alone_and_among_up_to_256_rows_with_any_mask(isa: str, blocks: int) -> None:
    rng = np.random.default_rng(7 + blocks)
    k, n = 8 * 40, 70
    q = _weight(rng, k, n, blocks)
    x = rng.standard_normal((256, k)).astype(np.float32)
    alone = np.concatenate([_native(x[i:i + 1], q, isa, 1) for i in range(0, 256, 37)])
    for m, threads in ((1, 2), (7, 1), (64, 2), (256, 1), (256, 2)):
        used = rng.random(m) < 0.6
        used[0] = True
        out = _native(x[:m], q, isa, threads, used)
        picked = [i for i in range(0, m, 37) if used[i]]
        np.testing.assert_array_equal(out[picked], alone[[i // 37 for i in picked]], err_msg=f"{m} rows")
        assert np.all(out[~used] == 0)


def test_non_finite_values_round_without_crashing_and_stay_in_their_sub_block() -> None:
    """inf or NaN in a sub-block makes its step non-finite (NaN out, as a float32 product would give); the
    row's other sub-blocks still round by their own steps, and other rows are unaffected."""
    rng = np.random.default_rng(5)
    k, n = 128, 32
    q = _weight(rng, k, n, 1)
    x = rng.standard_normal((3, k)).astype(np.float32)
    x[1, 0] = np.inf
    x[2, 70] = np.nan
    x[2, 100] = -np.inf
    x[2, 3] = 3e38  # x / step near the float32 limit
    clean = _native(x[:1], q, ISAS[-1])
    out = _native(x, q, ISAS[-1])
    np.testing.assert_array_equal(out[:1], clean)
    for isa in ISAS:  # every path rounds (and skips NaN) alike: the same bits, NaN where scalar has NaN
        np.testing.assert_array_equal(_native(x, q, isa), _native(x, q, "scalar"), err_msg=isa)


def test_an_unknown_activation_type_is_refused() -> None:
    p = pack_quantized(_weight(np.random.default_rng(1), 32, 16, 1), None)
    with pytest.raises(ValueError, match="activations"):
        kernels.matmul(np.zeros((1, 32), np.float32), p.packed, p.packed_scales, p.n, activations="int4")


def _table(rng: np.random.Generator, v: int, d: int) -> np.ndarray:
    import ml_dtypes

    return (rng.standard_normal((v, d)) * 0.02).astype(ml_dtypes.bfloat16)


def test_an_int8_table_is_rounded_per_32_features_and_its_rows_read_back_dequantised() -> None:
    from model_service.model.packed import TABLE_BLOCK, pack_table

    rng = np.random.default_rng(21)
    v, d = 75, 96  # a vocabulary ending inside a 16-column block
    table = _table(rng, v, d)
    p = pack_table(table, None, int8=True)
    assert p.packed.dtype == np.int8 and p.packed_scales.shape == (d // TABLE_BLOCK, 80)
    values = table.astype(np.float32).reshape(v, d // TABLE_BLOCK, TABLE_BLOCK)
    step = np.max(np.abs(values), axis=-1) / np.float32(127)
    np.testing.assert_array_equal(p.packed_scales[:, :v], step.T)
    rows = np.asarray(jax.jit(jax.tree.map(jax.numpy.asarray, p).rows_of)(np.arange(v)))
    # half a step, plus the float32 rounding of q * step
    assert np.all(np.abs(rows.reshape(values.shape) - values) <= step[..., None] / 2 + np.abs(values) * 2.0**-22)
    q = np.clip(np.rint(values / step[..., None]), -127, 127)
    np.testing.assert_array_equal(rows, (q * step[..., None]).reshape(v, d).astype(np.float32))


@pytest.mark.parametrize("mesh_shape", ["1,8", "2,4"])
def test_an_int8_table_under_a_mesh_gives_the_one_device_rows_and_logits(mesh_shape: str) -> None:
    """The rows exactly; the logits up to the order in which the shards' partial sums over their scale blocks
    are added (the psum over `model`), as for every row-parallel product."""
    from model_service.config import MeshConfig
    from model_service.model.layers import Products, product
    from model_service.model.packed import pack_table
    from model_service.sharding import make_mesh, params_shardings

    rng = np.random.default_rng(22)
    v, d = 300, 256  # 8 scale blocks of 32 features: one per shard of 8
    table = _table(rng, v, d)
    x = rng.standard_normal((5, d)).astype(np.float32)
    ids = np.array([0, 17, 299, 150])
    one = jax.tree.map(jax.numpy.asarray, pack_table(table, None, int8=True))
    want_rows = np.asarray(one.rows_of(ids))
    want = np.asarray(jax.jit(product, static_argnums=2)(x, one, Products.NATIVE_INT8))
    mesh = make_mesh(MeshConfig.parse(mesh_shape))
    tree = {"language_model/in_out_embed": {"embeddings": pack_table(table, mesh, int8=True)}}
    placed = jax.device_put(tree, params_shardings(tree, mesh))["language_model/in_out_embed"]["embeddings"]
    assert placed.shards == mesh.shape["model"]
    np.testing.assert_array_equal(np.asarray(jax.jit(placed.rows_of)(ids)), want_rows)
    got = np.asarray(jax.jit(product, static_argnums=2)(x, placed, Products.NATIVE_INT8))
    np.testing.assert_allclose(got, want, rtol=0, atol=8 * 2.0**-24 * np.abs(want).max() * d)
