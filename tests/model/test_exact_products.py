"""Products.EXACT, the faithful float32 mode on matrix units that multiply float32 in one bfloat16 pass (TPU):
rows split into three bfloat16 parts meet int8 (and bfloat16) weights exactly, the rest of the program at the
highest precision. The arithmetic is the same on any platform, so CPU checks it against float64."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model_service.model import GrokModel, Products
from model_service.model.layers import QuantizedWeight, product, split_rows
from model_service.sharding import make_mesh
from model_service.config import MeshConfig

from tests.model.test_parity import F32_ATOL, PROMPTS, _padded


def test_three_bfloat16_parts_add_up_to_the_float32_rows() -> None:
    x = np.random.default_rng(0).standard_normal((64, 300)).astype(np.float32) * np.float32(1e3)
    parts = np.asarray(split_rows(jnp.asarray(x))).astype(np.float32)
    assert parts.shape == (3, 64, 300)
    np.testing.assert_array_equal(parts[0] + (parts[1] + parts[2]), x)


def test_the_parts_are_rounded_to_nearest_and_by_an_op_no_compiler_drops() -> None:
    """The parts are x rounded to bfloat16, then the rest rounded, as a float32 -> bfloat16 conversion rounds; but
    computed with reduce_precision: a float32 -> bfloat16 -> float32 round trip may be dropped as a no-op where
    XLA allows excess precision (its default on TPU: the chip's float32 golden prefill came out one bfloat16 pass
    off, 0.146 in the logits), while reduce_precision is kept."""
    x = np.random.default_rng(1).standard_normal((16, 130)).astype(np.float32)
    parts = np.asarray(split_rows(jnp.asarray(x)))
    hi = x.astype(jnp.bfloat16)
    mid = (x - hi.astype(np.float32)).astype(jnp.bfloat16)
    assert parts.dtype == jnp.bfloat16
    np.testing.assert_array_equal(parts[0].view(np.uint16), hi.view(np.uint16))
    np.testing.assert_array_equal(parts[1].view(np.uint16), mid.view(np.uint16))
    hlo = jax.jit(split_rows).lower(jnp.asarray(x)).as_text()
    assert hlo.count("reduce_precision") == 2
    assert "bf16> -> tensor<16x130xf32>" not in hlo  # no bfloat16 value widened back to float32


def _int8(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    return rng.integers(-127, 128, shape).astype(np.int8)


@pytest.mark.parametrize("blocks", [1, 8])
def test_exact_int8_products_match_float64(blocks: int) -> None:
    rng = np.random.default_rng(blocks)
    m, k, n = 5, 256, 48
    x = rng.standard_normal((m, k)).astype(np.float32)
    scales = rng.uniform(0.001, 0.02, (blocks, n)).astype(np.float32)
    w = _int8(rng, (k, n))
    dense = (w.astype(np.float64).reshape(blocks, k // blocks, n) * scales[:, None, :]).reshape(k, n)
    want = x.astype(np.float64) @ dense
    stored = QuantizedWeight(jnp.asarray(w.T if blocks == 1 else w), jnp.asarray(scales))
    got = np.asarray(jax.jit(lambda a: product(a, stored, Products.EXACT))(jnp.asarray(x)))
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=2e-6 * np.abs(want).max())


def test_exact_bfloat16_table_product_matches_float64() -> None:
    rng = np.random.default_rng(7)
    x = rng.standard_normal((3, 128)).astype(np.float32)
    table = jnp.asarray(rng.standard_normal((500, 128)), jnp.bfloat16)
    want = x.astype(np.float64) @ np.asarray(table, np.float64).T
    got = np.asarray(product(jnp.asarray(x), table, Products.EXACT))
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * np.abs(want).max())


@pytest.mark.parametrize("dtype, products, highest", [(jnp.float32, Products.EXACT, True),
                                                      (jnp.bfloat16, Products.DOT, True),
                                                      (jnp.float32, Products.FUSED_REDUCE, False)])
def test_xla_dot_programs_trace_their_float32_dots_at_highest_precision(golden_cfg, dtype, products,
                                                                         highest) -> None:
    """A TPU's default precision rounds float32 operands to bfloat16: the router (float32 in both modes) would
    then pick other experts than the reference's."""
    model = GrokModel(golden_cfg, make_mesh(MeshConfig(1, 1)), dtype, products)
    with model.precision():
        text = str(jax.make_jaxpr(lambda a, b: a @ b)(jnp.ones((2, 2)), jnp.ones((2, 2))))
    assert ("HIGHEST" in text) == highest


def test_exact_products_reproduce_the_reference_float32_logits(golden_model, golden_npz) -> None:
    """The golden checkpoint's dense pass with Products.EXACT: the reference's float32 logits within the float32
    parity bound."""
    loaded, gold = golden_model("1,1", "float32"), golden_npz["fp32"]
    model = GrokModel(loaded.cfg, loaded.model.mesh, jnp.float32, Products.EXACT)
    tokens = jnp.asarray(np.concatenate([_padded(gold[f"p{p}_prompt"]) for p in PROMPTS]))
    full = np.asarray(jax.jit(model.forward)(loaded.params, tokens))
    for p in PROMPTS:
        n = len(gold[f"p{p}_prompt"])
        np.testing.assert_allclose(full[p, :n], gold[f"p{p}_full_logits"], atol=F32_ATOL, rtol=0)
