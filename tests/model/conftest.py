"""Session fixtures for the network tests: golden config/checkpoint loaded once per (mesh, dtype), jitted once.

bfloat16 parity follows golden/README.md: XLA must not skip explicit roundings; tests/conftest.py sets
--xla_allow_excess_precision=false (and 8 CPU devices) before any JAX backend starts.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model_service.checkpoint import load_params, random_params
from model_service.config import MeshConfig, ModelConfig, load_model_config
from model_service.model import GrokModel, Products, choose_products
from model_service.sharding import make_mesh
from tests.procs import GOLDEN


@dataclass
class Loaded:
    """A model with its parameters on one mesh in one dtype, and its jitted entry points."""

    cfg: ModelConfig
    model: GrokModel
    params: Any
    prefill: Callable[..., Any]
    decode: Callable[..., Any]
    insert: Callable[..., Any]
    forward: Callable[..., Any]


@pytest.fixture(scope="session")
def golden_cfg() -> ModelConfig:
    return load_model_config(str(GOLDEN / "config.json"))


@pytest.fixture(scope="session")
def golden_npz() -> dict[str, dict[str, np.ndarray]]:
    return {name: dict(np.load(GOLDEN / f"model_{name}.npz")) for name in ("fp32", "bf16")}


_CACHE: dict[tuple[str, str], Loaded] = {}


def products_under_test(mesh: Any, dtype: Any) -> Products:
    """The products the model tests run with: GROK_MODEL_PRODUCTS (auto | native | xla, as the service's
    --products), default auto (the native kernel on CPU in float32 where it built)."""
    return choose_products(os.environ.get("GROK_MODEL_PRODUCTS", "auto"), mesh, jnp.dtype(dtype))


@pytest.fixture(scope="session")
def golden_model(golden_cfg: ModelConfig) -> Callable[[str, str], Loaded]:
    """golden_model("1,8", "float32") -> Loaded, built once per combination for the whole session."""
    def get(mesh: str, dtype: str) -> Loaded:
        key = (mesh, dtype)
        if key not in _CACHE:
            m = make_mesh(MeshConfig.parse(mesh))
            model = GrokModel(golden_cfg, m, jnp.dtype(dtype), products_under_test(m, dtype))
            params = load_params(str(GOLDEN / "checkpoint"), golden_cfg, m, jnp.dtype(dtype),
                                 pack=model.products is Products.NATIVE)
            _CACHE[key] = Loaded(golden_cfg, model, params, jax.jit(model.prefill), jax.jit(model.decode),
                                 jax.jit(model.insert), jax.jit(model.forward))
        return _CACHE[key]
    return get


def tiny_config(golden: ModelConfig) -> ModelConfig:
    return dataclasses.replace(golden, vocab_size=64, sequence_len=24, model=dataclasses.replace(
        golden.model, emb_size=32, num_layers=2, num_q_heads=4, num_kv_heads=2, widening_factor=2))


@pytest.fixture(scope="session")
def tiny(golden_cfg: ModelConfig) -> Loaded:
    cfg = tiny_config(golden_cfg)
    mesh = make_mesh(MeshConfig())
    model = GrokModel(cfg, mesh, jnp.float32, products_under_test(mesh, jnp.float32))
    params = random_params(cfg, mesh, jnp.float32, seed=11, pack=model.products is Products.NATIVE)
    return Loaded(cfg, model, params, jax.jit(model.prefill), jax.jit(model.decode), jax.jit(model.insert),
                  jax.jit(model.forward))
