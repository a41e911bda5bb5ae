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
from model_service.backend import choose_products
from model_service.model import GrokModel, Products, TokenRows
from model_service.sharding import make_mesh
from tests.procs import GOLDEN


@dataclass
class Loaded:
    """A model with its parameters on one mesh in one dtype, and its jitted dense pass."""

    cfg: ModelConfig
    model: GrokModel
    params: Any
    forward: Callable[..., Any]


Row = tuple[int, int, int]  # (sequence, position, token)
_JITTED: dict[tuple[int, int], tuple[Callable[..., Any], Callable[..., Any]]] = {}


class RowRunner:
    """GrokModel.rows over dense block tables (sequence i owns blocks i * blocks_per_sequence on): run lists of
    token rows, in tiles of `tile`, and get each row's logits; the pools carry over between calls."""

    def __init__(self, loaded: Loaded, sequences: int, tile: int = 8, params: Any = None) -> None:
        model = loaded.model
        self.model, self.params, self.tile = model, loaded.params if params is None else params, tile
        self.tables = jnp.asarray(model.dense_tables(sequences))
        self.pools = model.init_pools(sequences * model.blocks_per_sequence)
        key = (id(model), tile)
        if key not in _JITTED:  # one compiled program per model, tile and shape for the whole session
            _JITTED[key] = (jax.jit(lambda p, pools, rows, tiles: model.rows(p, pools, rows, tile, tiles)),
                            jax.jit(model.head))
        self._rows, self._head = _JITTED[key]

    def run(self, rows: list[Row], valid: list[bool] | None = None, size: int | None = None,
            tiles: int | None = None, hidden: bool = False) -> np.ndarray:
        """Logits [len(rows), V] of the rows (padded to `size` rows, default whole tiles); rows not `valid` are
        padding (they write nothing and get zeros with native products). `hidden`: their last hidden states
        [len(rows), D] instead (GrokModel.rows' output, before the head)."""
        n = size or -(-len(rows) // self.tile) * self.tile
        seq, pos, tok = (np.zeros(n, np.int32) for _ in range(3))
        ok = np.zeros(n, bool)
        for i, (s, p, t) in enumerate(rows):
            seq[i], pos[i], tok[i], ok[i] = s, p, t, True if valid is None else valid[i]
        h, self.pools = self._rows(self.params, self.pools, TokenRows(jnp.asarray(tok), jnp.asarray(pos),
                                   jnp.asarray(seq), jnp.asarray(ok), self.tables), tiles)
        if hidden:
            return np.asarray(h)[:len(rows)]
        return np.asarray(self._head(self.params, h, jnp.asarray(ok)))[:len(rows)]


@pytest.fixture(scope="session")
def golden_cfg() -> ModelConfig:
    return load_model_config(str(GOLDEN / "config.json"))


@pytest.fixture(scope="session")
def golden_npz() -> dict[str, dict[str, np.ndarray]]:
    return {name: dict(np.load(GOLDEN / f"model_{name}.npz")) for name in ("fp32", "bf16")}


_CACHE: dict[tuple[str, str], Loaded] = {}


def skip_without_devices(mesh: MeshConfig) -> None:
    """Skip a test whose mesh needs more devices than the platform has (one TPU chip; CPU tests force 8)."""
    if mesh.size > jax.device_count():
        pytest.skip(f"mesh {mesh.data},{mesh.model} needs {mesh.size} devices; {jax.devices()[0].platform} has "
                    f"{jax.device_count()}")


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
            skip_without_devices(MeshConfig.parse(mesh))
            m = make_mesh(MeshConfig.parse(mesh))
            model = GrokModel(golden_cfg, m, jnp.dtype(dtype), products_under_test(m, dtype))
            params = load_params(str(GOLDEN / "checkpoint"), golden_cfg, m, jnp.dtype(dtype),
                                 pack=model.products.native, stacked=model.backend.stacked_experts,
                                 stack_layers=model.scan_layers)
            _CACHE[key] = Loaded(golden_cfg, model, params, jax.jit(model.forward))
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
    params = random_params(cfg, mesh, jnp.float32, seed=11, pack=model.products.native,
                           stacked=model.backend.stacked_experts, stack_layers=model.scan_layers)
    return Loaded(cfg, model, params, jax.jit(model.forward))
