"""The faithful mode's transcendental functions (model/transcendental.py): XLA's most accurate forms asked for
while a Products.EXACT program is traced (float32 on a TPU, whose own tanh, exp and log are approximations), and
jax's own functions, bit for bit, everywhere else."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model_service.backend import choose_backend
from model_service.config import MeshConfig
from model_service.model import GrokModel, Products, transcendental as tr
from model_service.sharding import make_mesh

FUNCTIONS = {"tanh": (tr.tanh, jnp.tanh), "exp": (tr.exp, jnp.exp), "gelu": (tr.gelu, jax.nn.gelu),
             "softmax": (tr.softmax, jax.nn.softmax), "log_softmax": (tr.log_softmax, jax.nn.log_softmax)}


@pytest.mark.parametrize("name", sorted(FUNCTIONS))
def test_outside_accurate_they_are_jaxs_own_functions_bit_for_bit(name: str) -> None:
    ours, theirs = FUNCTIONS[name]
    x = jnp.asarray(np.random.default_rng(0).uniform(-6, 6, (8, 300)).astype(np.float32))
    np.testing.assert_array_equal(np.asarray(jax.jit(ours)(x)).view(np.uint32),
                                  np.asarray(jax.jit(theirs)(x)).view(np.uint32))
    assert "result_accuracy" not in jax.jit(ours).lower(x).as_text()


def _softmax64(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


FLOAT64 = {"tanh": np.tanh, "exp": np.exp, "softmax": _softmax64,
           "gelu": lambda x: 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3))),
           "log_softmax": lambda x: np.log(_softmax64(x))}


@pytest.mark.parametrize("name", sorted(FUNCTIONS))
def test_under_accurate_xla_is_asked_for_its_most_accurate_forms(name: str) -> None:
    """Within 2e-6 of float64 (relative to the largest value) on any backend: a v5e's own tanh is 7.8e-5 off, its
    accurate one 3.0e-7 (exp 5.2e-6 and 1.2e-7)."""
    ours, _ = FUNCTIONS[name]
    x = np.random.default_rng(1).uniform(-6, 6, (8, 300)).astype(np.float32)
    with tr.accurate():  # a new function to trace (jit's cache keys on the function, not on this context)
        text = jax.jit(lambda v: ours(v)).lower(jnp.asarray(x)).as_text()
        got = np.asarray(jax.jit(lambda v: ours(v))(jnp.asarray(x)), np.float64)
    assert "result_accuracy_mode<HIGHEST>" in text
    want = FLOAT64[name](x.astype(np.float64))
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=2e-6 * np.abs(want).max())


def test_accurate_inverse_frequencies_are_the_float64_values_rounded_once() -> None:
    with tr.accurate():
        got = np.asarray(tr.inverse_frequencies(10000.0, 128))
    e = (np.arange(0, 128, 2, dtype=np.float32) / np.float32(128)).astype(np.float64)
    power = (10000.0 ** e).astype(np.float32)
    np.testing.assert_array_equal(got, np.float32(1.0) / power)
    plain = np.asarray(tr.inverse_frequencies(10000.0, 128))  # jax.numpy's power (a v5e's: ~60 ulps off)
    np.testing.assert_allclose(plain, got, rtol=1e-5, atol=0)


@pytest.mark.parametrize("products, accurate", [(Products.EXACT, True), (Products.DOT, False),
                                                (Products.FUSED_REDUCE, False)])
def test_the_faithful_mode_traces_accurate_tanh_and_exp(golden_cfg, products: Products, accurate: bool) -> None:
    """On a v5e the float32 golden logits came out ~1e-3 from the reference's (tanh 1,287 ulps off there, exp 71):
    enough to flip the router's near-tie at the 64-token prompt's position 33."""
    mesh = make_mesh(MeshConfig(1, 1))  # unrolled layers: the reference's parameter layout, on any platform
    model = GrokModel(golden_cfg, mesh, jnp.float32, products,
                      backend=choose_backend("generic", mesh, jnp.float32, layers="unroll", moe="cond"))
    text = str(jax.make_jaxpr(model.forward)(model.init_param_shapes(), jnp.zeros((1, 8), jnp.int32)))
    assert ("tanh[accuracy=AccuracyMode.HIGHEST]" in text) == accurate
    assert ("exp[accuracy=AccuracyMode.HIGHEST]" in text) == accurate
    assert "tanh[" in text or "tanh " in text
