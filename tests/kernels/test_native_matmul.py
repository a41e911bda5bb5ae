"""The native kernel (model_service.kernels) against a float64 NumPy reference, on every instruction-set path
this CPU supports and in both forms (rows, panel), and its batch invariance: a row's bits never depend on the
other rows, the row count, the thread count, the path or the form.

Tolerance: the kernel sums K float32 products in order, so |error| <= K * 2^-24 * sum_k |x_k w_k| * scale
(the textbook bound for a recursive float32 dot product, plus one rounding per scale block); every check
below uses exactly that bound.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from model_service import kernels
from model_service.model.layers import Products, QuantizedWeight, product
from model_service.model.packed import pack_quantized

pytestmark = pytest.mark.skipif(not kernels.available(), reason="native kernels not built")
ISAS = list(kernels.supported_isas()) if kernels.available() else []
FORMS = ["rows", "panel"]
EPS32 = 2.0**-24


def _weight(rng: np.random.Generator, k: int, n: int, blocks: int) -> QuantizedWeight:
    """A host QuantizedWeight in layers.py's layout: [N, K] for one block, [K, N] for row-block scales."""
    w = rng.integers(-127, 128, (k, n), dtype=np.int8)
    s = rng.uniform(0.5, 2.0, (blocks, n)).astype(np.float32) / 127
    return QuantizedWeight(w.T.copy() if blocks == 1 else w, s)


def _reference(x: np.ndarray, q: QuantizedWeight) -> tuple[np.ndarray, np.ndarray]:
    """float64 product and the error bound of a float32 in-order one."""
    w = (q.weight.T if q.transposed else q.weight).astype(np.float64)  # [K, N]
    k, blocks = w.shape[0], q.scales.shape[0]
    scale = np.repeat(q.scales.astype(np.float64), k // blocks, axis=0)  # [K, N]
    ref = x.astype(np.float64) @ (w * scale)
    bound = (k + blocks + 1) * EPS32 * (np.abs(x).astype(np.float64) @ np.abs(w * scale))
    return ref, bound


@functools.cache
def _program(n: int, isa: str, threads: int, form: str) -> Any:
    return jax.jit(lambda a, w, s: kernels.matmul(a, w, s, n, isa, threads, form=form))


def _native(x: np.ndarray, q: QuantizedWeight, isa: str, threads: int = 0, form: str = "auto") -> np.ndarray:
    p = pack_quantized(q, None)
    return np.asarray(_program(p.n, isa, threads, form)(x, p.packed, p.packed_scales))


# K past one panel slice (256) with a short last slice, scale blocks that end inside a slice, column counts
# that end inside a 16-column block and inside a 4-block panel.
SHAPES = [(64, 48, 1), (37, 45, 1), (1, 1, 1), (512, 2736 // 8, 1), (600, 200, 1), (8 * 13, 21, 8),
          (8 * 43, 512, 8), (16, 17, 8), (8 * 100, 90, 8)]


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("k,n,blocks", SHAPES)
def test_each_path_matches_a_float64_reference_within_the_float32_bound(isa: str, form: str, k: int, n: int,
                                                                        blocks: int) -> None:
    rng = np.random.default_rng(k * 1000 + n)
    q = _weight(rng, k, n, blocks)
    x = rng.standard_normal((13, k)).astype(np.float32)
    ref, bound = _reference(x, q)
    out = _native(x, q, isa, form=form)
    assert out.shape == (13, n) and out.dtype == np.float32
    assert np.all(np.abs(out - ref) <= bound), np.max(np.abs(out - ref) / np.maximum(bound, 1e-30))


@pytest.mark.parametrize("k,n,blocks", [(8 * 21, 77, 1), (8 * 21, 77, 8), (600, 200, 1), (8 * 100, 90, 8)])
def test_every_path_and_form_gives_the_same_bits(k: int, n: int, blocks: int) -> None:
    rng = np.random.default_rng(blocks + k)
    q = _weight(rng, k, n, blocks)
    x = rng.standard_normal((19, k)).astype(np.float32)
    want = _native(x, q, "scalar")
    for isa in ISAS:
        for form in FORMS:
            np.testing.assert_array_equal(_native(x, q, isa, form=form), want, err_msg=f"{isa} {form}")


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("blocks", [1, 8])
def test_a_row_is_bit_identical_to_itself_computed_alone_for_any_row_count(isa: str, threads: int, blocks: int) -> None:
    rng = np.random.default_rng(7)
    k, n = 8 * 40, 100
    q = _weight(rng, k, n, blocks)
    x = rng.standard_normal((17, k)).astype(np.float32)
    alone = np.concatenate([_native(x[i:i + 1], q, isa, 1, "rows") for i in range(17)])
    p = pack_quantized(q, None)
    for form in ("auto", *FORMS):
        # Each row count is its own kernel call (its own tiling of the rows); one program holds all 17 calls, so
        # the test compiles once per form instead of once per row count.
        every = jax.jit(lambda a, w, s, form=form: [kernels.matmul(a[:m], w, s, p.n, isa, threads, form=form)
                                                     for m in range(1, 18)])
        for m, out in enumerate(every(x, p.packed, p.packed_scales), start=1):
            np.testing.assert_array_equal(np.asarray(out), alone[:m], err_msg=f"{m} rows {form}")


@pytest.mark.parametrize("isa", ISAS)
def test_a_row_keeps_its_bits_among_up_to_256_rows_with_any_mask(isa: str) -> None:
    """The sizes the engine's tiles of rows reach: a one-row call against calls of 64 and 256 rows (the panel
    form under auto for float32, both forms forced) with random subsets marked."""
    rng = np.random.default_rng(17)
    k, n = 8 * 40, 70
    q = _weight(rng, k, n, 8)
    p = pack_quantized(q, None)
    x = rng.standard_normal((256, k)).astype(np.float32)
    alone = np.concatenate([_native(x[i:i + 1], q, isa, 1, "rows") for i in range(0, 256, 37)])
    for m, form in ((64, "panel"), (256, "rows"), (256, "panel"), (256, "auto")):
        used = rng.random(m) < 0.6
        used[0] = True
        fn = jax.jit(lambda a, u: kernels.matmul(a, p.packed, p.packed_scales, p.n, isa, rows=u, form=form))
        out = np.asarray(fn(x[:m], used))
        picked = [i for i in range(0, m, 37) if used[i]]
        np.testing.assert_array_equal(out[picked], alone[[i // 37 for i in picked]], err_msg=f"{m} {form}")
        assert np.all(out[~used] == 0)


def _plain(rng: np.random.Generator, k: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """A float32 [N, K] matrix whose values are bfloat16 numbers, and it packed [NB, K, 16] (zero padded)."""
    w = rng.standard_normal((n, k)).astype(ml_dtypes.bfloat16).astype(np.float32)
    nb = -(-n // 16)
    packed = np.zeros((nb * 16, k), np.float32)
    packed[:n] = w
    return w, packed.reshape(nb, 16, k).transpose(0, 2, 1).copy()


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("k,n", [(40, 300), (600, 70)])
def test_float32_and_bfloat16_weights_match_numpy(isa: str, form: str, k: int, n: int) -> None:
    rng = np.random.default_rng(3)
    w, packed = _plain(rng, k, n)
    x = rng.standard_normal((11, k)).astype(np.float32)
    ref = x.astype(np.float64) @ w.T.astype(np.float64)
    bound = (k + 1) * EPS32 * (np.abs(x) @ np.abs(w.T))
    for weights in (packed, packed.astype(ml_dtypes.bfloat16)):
        out = np.asarray(jax.jit(lambda a, b: kernels.matmul(a, b, None, n, isa, form=form))(x, weights))
        assert np.all(np.abs(out - ref) <= bound), weights.dtype


def test_a_bfloat16_table_gives_the_bits_of_a_float32_table_of_the_same_values() -> None:
    """The conversion is exact, so storing the table as the checkpoint does (bfloat16) changes no logit."""
    rng = np.random.default_rng(4)
    k, n = 300, 90
    _, packed = _plain(rng, k, n)
    x = rng.standard_normal((20, k)).astype(np.float32)
    want = np.asarray(kernels.matmul(jnp.asarray(x), jnp.asarray(packed), None, n, "scalar"))
    half = jnp.asarray(packed.astype(ml_dtypes.bfloat16))
    for isa in ISAS:
        for m in (1, 20):
            for form in FORMS:
                got = np.asarray(kernels.matmul(jnp.asarray(x[:m]), half, None, n, isa, form=form))
                np.testing.assert_array_equal(got, want[:m], err_msg=f"{isa} {m} {form}")


def test_an_unscaled_weight_of_another_type_is_refused() -> None:
    with pytest.raises(TypeError, match="float32 or bfloat16"):
        kernels.matmul(jnp.zeros((1, 8)), jnp.zeros((1, 8, 16), jnp.float16), None, 16)


@pytest.mark.parametrize("blocks", [1, 8])
def test_product_of_a_packed_weight_matches_the_xla_product(blocks: int) -> None:
    rng = np.random.default_rng(11)
    q = _weight(rng, 8 * 24, 90, blocks)
    x = rng.standard_normal((6, 8 * 24)).astype(np.float32)
    packed = jax.tree.map(jnp.asarray, pack_quantized(q, None))
    native = np.asarray(jax.jit(lambda a, w: product(a, w, Products.NATIVE))(x, packed))
    xla = np.asarray(jax.jit(lambda a, w: product(a, w, Products.FUSED_REDUCE))(x, jax.tree.map(jnp.asarray, q)))
    ref, bound = _reference(x, q)
    assert np.all(np.abs(native - ref) <= bound) and np.all(np.abs(xla - ref) <= 2 * bound)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("blocks", [1, 8])
def test_only_the_marked_rows_are_computed_and_their_bits_do_not_change(isa: str, blocks: int) -> None:
    rng = np.random.default_rng(13)
    k, n = 8 * 19, 100
    q = _weight(rng, k, n, blocks)
    p = pack_quantized(q, None)
    x = rng.standard_normal((9, k)).astype(np.float32)
    full = _native(x, q, isa)
    fn = jax.jit(lambda a, m: kernels.matmul(a, p.packed, p.packed_scales, p.n, isa, rows=m))
    for used in (np.zeros(9, bool), np.eye(9, dtype=bool)[4], rng.random(9) < 0.5, np.ones(9, bool)):
        out = np.asarray(fn(x, used))
        np.testing.assert_array_equal(out[used], full[used], err_msg=str(used))
        assert np.all(out[~used] == 0), used


@pytest.mark.parametrize("plain", [False, True])
def test_rows_left_unfilled_do_not_change_the_computed_ones(plain: bool) -> None:
    """fill_unused=False (the head: a free slot's [V] row is never read) only skips writing zeros."""
    rng = np.random.default_rng(15)
    k, n = 8 * 19, 100
    x = rng.standard_normal((9, k)).astype(np.float32)
    used = rng.random(9) < 0.5
    if plain:
        w, scales = rng.standard_normal((7, k, 16)).astype(np.float32), None
    else:
        p = pack_quantized(_weight(rng, k, n, 8), None)
        w, scales = p.packed, p.packed_scales
    filled, unfilled = (np.asarray(jax.jit(lambda a, m, f=f: kernels.matmul(a, w, scales, n, rows=m, fill_unused=f))(
        x, used)) for f in (True, False))
    np.testing.assert_array_equal(unfilled[used], filled[used])
    assert not filled[~used].any()


def test_float32_weights_honour_the_row_mask() -> None:
    rng = np.random.default_rng(14)
    k, n = 40, 50
    packed = rng.standard_normal((4, k, 16)).astype(np.float32)
    x = rng.standard_normal((5, k)).astype(np.float32)
    used = np.array([False, True, False, True, True])
    full = np.asarray(jax.jit(lambda a: kernels.matmul(a, packed, None, n))(x))
    out = np.asarray(jax.jit(lambda a, m: kernels.matmul(a, packed, None, n, rows=m))(x, used))
    np.testing.assert_array_equal(out[used], full[used])
    assert np.all(out[~used] == 0)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
@pytest.mark.parametrize("form", FORMS)
def test_a_multiplier_gives_the_bits_of_multiplying_the_product_after_it(isa: str, dtype: Any, form: str) -> None:
    """The unembedding's output multiplier inside the kernel: each computed element times float32(m), exactly as
    XLA's multiply after the product rounds it; the rows not computed stay zero (or unwritten)."""
    rng = np.random.default_rng(16)
    k, n, m = 8 * 37, 16 * 9 + 5, 0.5773502691896257  # a column count inside a block, a chunk boundary
    w = rng.standard_normal((10, k, 16)).astype(dtype)
    x = rng.standard_normal((11, k)).astype(np.float32) * 3
    used = rng.random(11) < 0.6
    after = np.asarray(jax.jit(lambda a, r: kernels.matmul(a, w, None, n, isa, rows=r, form=form)
                               * jnp.float32(m))(x, used))
    inside = np.asarray(jax.jit(lambda a, r: kernels.matmul(a, w, None, n, isa, rows=r, form=form,
                                                            multiplier=m))(x, used))
    np.testing.assert_array_equal(inside, after)
    assert not inside[~used].any()
    unfilled = np.asarray(jax.jit(lambda a, r: kernels.matmul(a, w, None, n, isa, rows=r, form=form, multiplier=m,
                                                              fill_unused=False))(x, used))
    np.testing.assert_array_equal(unfilled[used], after[used])
    with pytest.raises(ValueError, match="unscaled"):
        p = pack_quantized(_weight(rng, k, n, 8), None)
        kernels.matmul(x, p.packed, p.packed_scales, n, isa, multiplier=m)
