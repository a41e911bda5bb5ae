"""`--products int8` (layers.Products.DOT_INT8, the generic backend's opt-in): rows rounded to int8 meet the int8
weights as int8 with int32 sums, in the plain products, the per-expert conditionals, XLA's ragged_dot and the Pallas
grouped kernel (interpret mode on CPU) alike; its error on the golden checkpoint is bounded here."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model_service.backend import choose_backend
from model_service.checkpoint import load_params
from model_service.config import MeshConfig, load_model_config
from model_service.model import GrokModel
from model_service.model.grouped import GroupedExperts, experts_sorted
from model_service.model.layers import Products, int8_product, product, quantize_rows
from model_service.model.moe import ExpertWeights, Routing, experts_by_cond
from model_service.model.weights import ExpertStack, GroupedWeight, QuantizedWeight
from model_service.sharding import make_mesh
from tests.model.conftest import Loaded
from tests.model.test_parity import PROMPTS, _decode_batch, _prefill_all
from tests.procs import GOLDEN


def weight(rng: np.random.Generator, k: int, n: int, blocks: int, lead: tuple[int, ...] = ()) -> tuple:
    """(int8 values, float32 scales [.., blocks, N]) of a [.., K, N] matrix, its scales exact in bfloat16."""
    values = rng.integers(-127, 128, (*lead, k, n)).astype(np.int8)
    scales = (rng.random((*lead, blocks, n)) * 0.01 + 0.001).astype(jnp.bfloat16).astype(np.float32)
    return values, scales


def reference(x: np.ndarray, values: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """float64 product of x [M, K] rounded as quantize_rows rounds it (per row block) with values [K, N]."""
    m, k = x.shape
    blocks = scales.shape[0]
    parts = x.astype(np.float32).reshape(m, blocks, k // blocks)
    top = np.abs(parts).max(-1)
    scale = np.where(top > 0, top / np.float32(127), np.float32(1))
    q = np.clip(np.round(parts / scale[..., None]), -127, 127).astype(np.float64)  # rounded in float32, as the model
    w = values.astype(np.float64).reshape(blocks, k // blocks, -1)
    return sum(np.einsum("mk,kn->mn", q[:, b], w[b]) * scale[:, b:b + 1] * scales[b] for b in range(blocks))


def test_rows_round_to_int8_on_their_own_scale_per_block() -> None:
    # No value lands on a tie (1.0 / (2 / 127) = 63.5 rounded to 64 on CPU, 63 on a TPU, whose float32 division is
    # not IEEE's).
    x = jnp.asarray([[0.0, 0.0, 0.0, 0.0], [1.1, -2.0, 0.5, 4.0], [-127.0, 3.0, 0.0, 0.1]], jnp.float32)
    q, scale = quantize_rows(x, blocks=2)
    assert q.dtype == jnp.int8 and scale.shape == (3, 2)
    top = np.asarray([[0.0, 0.0], [2.0, 4.0], [127.0, 0.1]], np.float32)
    np.testing.assert_array_equal(np.asarray(scale), np.where(top > 0, top / np.float32(127), 1.0))
    np.testing.assert_array_equal(np.asarray(q)[:2], [[0, 0, 0, 0], [70, -127, 16, 127]])
    assert np.abs(np.asarray(q, np.float32) * np.repeat(np.asarray(scale), 2, 1) - np.asarray(x)).max() <= 0.5


@pytest.mark.parametrize("blocks", [1, 8], ids=["column-parallel", "row-parallel"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_a_product_with_int8_rows_is_the_rounded_rows_times_the_weight(blocks: int, dtype) -> None:
    rng = np.random.default_rng(blocks)
    k, n = 256, 64
    values, scales = weight(rng, k, n, blocks)
    stored = QuantizedWeight(jnp.asarray(values.T if blocks == 1 else values), jnp.asarray(scales))
    x = (rng.standard_normal((6, k)) * 3).astype(np.float32)
    x = np.asarray(jnp.asarray(x, dtype), np.float32)  # the rows as the product sees them
    got = product(jnp.asarray(x, dtype), stored, Products.DOT_INT8)
    assert got.dtype == dtype
    want = reference(x, values, scales)
    np.testing.assert_allclose(np.asarray(int8_product(jnp.asarray(x), stored)), want, rtol=1e-5,
                               atol=1e-5 * np.abs(want).max())
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=1e-2 if dtype == jnp.bfloat16 else 1e-5,
                               atol=1e-2 * np.abs(want).max())
    # What the rounding costs against the float product: under 2 % of the largest output here.
    exact = product(jnp.asarray(x), stored, Products.DOT)
    assert np.abs(np.asarray(got, np.float32) - np.asarray(exact)).max() < 0.02 * np.abs(np.asarray(exact)).max()
    # Weights that are not int8 (the table) meet the rows as in DOT.
    table = jnp.asarray(rng.standard_normal((n, k)), jnp.float32)
    np.testing.assert_array_equal(np.asarray(product(jnp.asarray(x), table, Products.DOT_INT8)),
                                  np.asarray(product(jnp.asarray(x), table, Products.DOT)))


def test_every_experts_form_rounds_the_rows_alike() -> None:
    rng = np.random.default_rng(5)
    e, d, f, m = 4, 256, 128, 10
    mats = {"linear": weight(rng, d, f, 1, (e,)), "linear_v": weight(rng, d, f, 1, (e,)),
            "linear_1": weight(rng, f, d, 8, (e,))}
    stacked = GroupedExperts(*(GroupedWeight(jnp.asarray(v), jnp.asarray(s)) for v, s in mats.values()))
    x = jnp.asarray(rng.standard_normal((m, d)), jnp.float32)
    experts = jnp.asarray(rng.integers(0, e, (m, 2)), jnp.int32)
    gates = jnp.asarray(rng.random((m, 2)), jnp.float32)
    ragged = np.asarray(experts_sorted(x, experts, gates, stacked, None, "ragged", int8_rows=True))
    kernel = np.asarray(experts_sorted(x, experts, gates, stacked, None, "pallas_interpret", int8_rows=True))
    per_expert = ExpertWeights(*(ExpertStack(tuple(QuantizedWeight(jnp.asarray(v[i].T if s.shape[1] == 1 else v[i]),
                                                                   jnp.asarray(s[i])) for i in range(e)))
                                 for v, s in mats.values()))
    cond = np.asarray(experts_by_cond(x, Routing(gates, experts), per_expert, None, Products.DOT_INT8))
    scale = np.abs(ragged).max()
    np.testing.assert_allclose(kernel, ragged, rtol=0, atol=1e-6 * scale)
    np.testing.assert_allclose(cond, ragged, rtol=0, atol=1e-5 * scale)
    plain = np.asarray(experts_sorted(x, experts, gates, stacked, None, "ragged"))
    assert 0 < np.abs(ragged - plain).max() < 0.05 * scale  # the rows were rounded, not much


def test_int8_is_the_generic_backends_opt_in() -> None:
    mesh = make_mesh(MeshConfig())
    assert choose_backend("generic", mesh, jnp.bfloat16, products="int8").products is Products.DOT_INT8
    assert choose_backend("generic", mesh, jnp.bfloat16).products is Products.DOT
    with pytest.raises(ValueError, match="native-int8"):
        choose_backend("cpu", mesh, jnp.float32, products="int8")


# Measured on CPU (generic backend, golden checkpoint, teacher-forced steps against the float32 reference's logits):
# int8 rows' mean absolute step error median 0.068 (float32 rows) / 0.078 (bfloat16), 90 % of steps under 0.24 /
# 0.18, the argmax of 91 % / 93 % of the steps the reference's; bfloat16 without int8: 0.046, 0.13, 93 %.
INT8_STEP_MEDIAN, INT8_STEP_MOST, INT8_ARGMAX = 0.1, 0.3, 0.85


def test_golden_with_int8_rows_stays_within_its_measured_error() -> None:
    cfg = load_model_config(str(GOLDEN / "config.json"))
    gold = dict(np.load(GOLDEN / "model_fp32.npz"))
    mesh = make_mesh(MeshConfig())
    model = GrokModel(cfg, mesh, jnp.float32, backend=choose_backend("generic", mesh, jnp.float32, products="int8"))
    params = load_params(str(GOLDEN / "checkpoint"), cfg, mesh, jnp.float32, **model.load_options())
    loaded = Loaded(cfg, model, params, jax.jit(model.forward))
    runner, last = _prefill_all(loaded, gold)
    forced = np.stack([gold[f"p{p}_greedy_tokens"] for p in PROMPTS])
    _, logits = _decode_batch(loaded, gold, runner, forced[:, 0], forced)
    errors = np.concatenate([np.abs(logits[p] - gold[f"p{p}_step_logits"][1:]).mean(-1) for p in PROMPTS])
    agree = np.mean([logits[p].argmax(-1) == gold[f"p{p}_step_logits"][1:].argmax(-1) for p in PROMPTS])
    assert np.median(errors) < INT8_STEP_MEDIAN and np.quantile(errors, 0.9) < INT8_STEP_MOST, errors
    assert agree >= INT8_ARGMAX
    assert max(np.abs(last[p] - gold[f"p{p}_prefill_last_logits"]).max() for p in PROMPTS) < 0.5
    assert np.median(errors) > 1e-3  # the rows were rounded: not the float32 products


@pytest.mark.skipif(jax.default_backend() != "tpu", reason="the compiled kernel needs a TPU (CPU runs it interpreted)")
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_the_compiled_int8_kernel_on_tpu_matches_xla(dtype) -> None:
    rng = np.random.default_rng(7)
    e, d, f, m = 8, 1024, 2048, 64
    mats = (weight(rng, d, f, 1, (e,)), weight(rng, d, f, 1, (e,)), weight(rng, f, d, 8, (e,)))
    stacked = GroupedExperts(*(GroupedWeight(jnp.asarray(v), jnp.asarray(s)) for v, s in mats))
    x = jnp.asarray(rng.standard_normal((m, d)), dtype)
    experts = jnp.asarray(rng.integers(0, e, (m, 2)), jnp.int32)
    gates = jnp.asarray(rng.random((m, 2)), jnp.float32)
    kernel = np.asarray(experts_sorted(x, experts, gates, stacked, None, "pallas", int8_rows=True), np.float32)
    ragged = np.asarray(experts_sorted(x, experts, gates, stacked, None, "ragged", int8_rows=True), np.float32)
    scale = np.abs(ragged).max()
    np.testing.assert_allclose(kernel, ragged, rtol=0, atol=(1e-5 if dtype == jnp.float32 else 1e-2) * scale)
