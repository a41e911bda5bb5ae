"""The native kernel (model_service.kernels) against a float64 NumPy reference, on every instruction-set path
this CPU supports, and its batch invariance: a row's bits never depend on the other rows, the row count, the
thread count or the path.

Tolerance: the kernel sums K float32 products in order, so |error| <= K * 2^-24 * sum_k |x_k w_k| * scale
(the textbook bound for a recursive float32 dot product, plus one rounding per scale block); every check
below uses exactly that bound.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model_service import kernels
from model_service.model.layers import Products, QuantizedWeight, product
from model_service.model.packed import pack_quantized

pytestmark = pytest.mark.skipif(not kernels.available(), reason="native kernels not built")
ISAS = list(kernels.supported_isas()) if kernels.available() else []
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


def _native(x: np.ndarray, q: QuantizedWeight, isa: str, threads: int = 0) -> np.ndarray:
    p = pack_quantized(q, None)
    fn = jax.jit(lambda a, w, s: kernels.matmul(a, w, s, p.n, isa, threads))
    return np.asarray(fn(x, p.packed, p.packed_scales))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("k,n,blocks", [(64, 48, 1), (37, 45, 1), (1, 1, 1), (512, 2736 // 8, 1),
                                        (8 * 13, 21, 8), (8 * 43, 512, 8), (16, 17, 8)])
def test_each_path_matches_a_float64_reference_within_the_float32_bound(isa: str, k: int, n: int, blocks: int) -> None:
    rng = np.random.default_rng(k * 1000 + n)
    q = _weight(rng, k, n, blocks)
    x = rng.standard_normal((5, k)).astype(np.float32)
    ref, bound = _reference(x, q)
    out = _native(x, q, isa)
    assert out.shape == (5, n) and out.dtype == np.float32
    assert np.all(np.abs(out - ref) <= bound), np.max(np.abs(out - ref) / np.maximum(bound, 1e-30))


@pytest.mark.parametrize("blocks", [1, 8])
def test_every_path_gives_the_same_bits(blocks: int) -> None:
    rng = np.random.default_rng(blocks)
    q = _weight(rng, 8 * 21, 77, blocks)
    x = rng.standard_normal((9, 8 * 21)).astype(np.float32)
    outs = {isa: _native(x, q, isa) for isa in ISAS}
    for isa, out in outs.items():
        np.testing.assert_array_equal(out, outs["scalar"], err_msg=isa)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("blocks", [1, 8])
def test_a_row_is_bit_identical_to_itself_computed_alone_for_any_row_count(isa: str, threads: int, blocks: int) -> None:
    rng = np.random.default_rng(7)
    k, n = 8 * 19, 100
    q = _weight(rng, k, n, blocks)
    x = rng.standard_normal((17, k)).astype(np.float32)
    alone = np.concatenate([_native(x[i:i + 1], q, isa, 1) for i in range(17)])
    for m in range(1, 18):
        np.testing.assert_array_equal(_native(x[:m], q, isa, threads), alone[:m], err_msg=f"{m} rows")


@pytest.mark.parametrize("isa", ISAS)
def test_float32_weights_match_numpy(isa: str) -> None:
    rng = np.random.default_rng(3)
    k, n = 40, 300
    w = rng.standard_normal((n, k)).astype(np.float32)
    nb = -(-n // 16)
    packed = np.zeros((nb * 16, k), np.float32)
    packed[:n] = w
    packed = packed.reshape(nb, 16, k).transpose(0, 2, 1).copy()
    x = rng.standard_normal((3, k)).astype(np.float32)
    out = np.asarray(jax.jit(lambda a, b: kernels.matmul(a, b, None, n, isa))(x, packed))
    ref = x.astype(np.float64) @ w.T.astype(np.float64)
    assert np.all(np.abs(out - ref) <= (k + 1) * EPS32 * (np.abs(x) @ np.abs(w.T)))


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
