"""The network with the generic backend's stacked experts: loaded in the checkpoint's layout, and computing what
the per-expert (cond) form computes, in prefill (dense forward) and in serving steps with padding rows."""

from __future__ import annotations

import dataclasses
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model_service.backend import choose_backend
from model_service.checkpoint import load_params, random_leaves, random_params, write_checkpoint
from model_service.config import MeshConfig, ModelConfig, load_model_config
from model_service.model import GrokModel, Products
from model_service.model.weights import GroupedWeight
from model_service.sharding import make_mesh
from tests.model.conftest import Loaded, RowRunner
from tests.procs import GOLDEN

_GOLDEN = load_model_config(str(GOLDEN / "config.json"))
TINY = dataclasses.replace(_GOLDEN, vocab_size=64, sequence_len=24, model=dataclasses.replace(
    _GOLDEN.model, emb_size=32, num_layers=2, num_q_heads=4, num_kv_heads=2, widening_factor=2))
MOE = "transformer/decoder_layer_0/moe"


def _model(cfg: ModelConfig, moe: str) -> GrokModel:
    """The generic backend with `moe`, its layers unrolled: these tests hold and compare per-layer trees (the
    scanned layers' stacks are tests/model/test_scan_layers.py's)."""
    mesh = make_mesh(MeshConfig())
    backend = dataclasses.replace(choose_backend("generic", mesh, jnp.float32, layers="unroll"), moe=moe)
    return GrokModel(cfg, mesh, jnp.float32, Products.DOT, block_size=8, key_chunk=16, backend=backend)


def test_stacked_experts_load_in_the_checkpoint_layout(tmp_path: pathlib.Path) -> None:
    mesh = make_mesh(MeshConfig(1, 2))
    write_checkpoint(tmp_path / "a", TINY, random_leaves(TINY, seed=4))
    loaded = load_params(str(tmp_path / "a"), TINY, mesh, jnp.float32, stacked=True)
    drawn = random_params(TINY, mesh, jnp.float32, seed=4, stacked=True)
    w = loaded[f"{MOE}/linear_1"]["w"]
    assert isinstance(w, GroupedWeight) and w.shape == (8, 48, 32) and w.blocks == 8
    for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(drawn)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    per_expert = load_params(str(tmp_path / "a"), TINY, mesh, jnp.float32)
    restacked = _model(TINY, "ragged").pack_params(per_expert)
    for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(restacked)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.fixture(scope="module")
def cond() -> Loaded:
    model = _model(TINY, "cond")
    return Loaded(TINY, model, random_params(TINY, model.mesh, jnp.float32, seed=11), jax.jit(model.forward))


@pytest.mark.parametrize("moe", ["ragged", "pallas_interpret"])
def test_grouped_experts_compute_what_the_per_expert_form_computes(cond: Loaded, moe: str) -> None:
    model = _model(TINY, moe)
    grouped = Loaded(TINY, model, random_params(TINY, model.mesh, jnp.float32, seed=11, stacked=True),
                     jax.jit(model.forward))
    tokens = jnp.asarray(np.random.default_rng(0).integers(3, 64, (2, 12)), jnp.int32)
    want, got = (np.asarray(m.forward(m.params, tokens)) for m in (cond, grouped))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
    # A serving step: rows of two sequences, the padding rows (valid False) in between compute nothing.
    rows = [(0, i, int(t)) for i, t in enumerate(np.asarray(tokens[0, :5]))] + [(1, 0, 7), (1, 1, 9), (0, 0, 5)]
    valid = [True] * 5 + [True, True, False]
    want, got = (RowRunner(m, 2, tile=8).run(rows, valid, hidden=True) for m in (cond, grouped))
    np.testing.assert_allclose(got[:7], want[:7], rtol=0, atol=1e-5 * np.abs(want).max())


def test_grouped_experts_refuse_per_expert_weights_with_the_fix() -> None:
    model = _model(TINY, "ragged")
    params = random_params(TINY, model.mesh, jnp.float32, seed=1)
    with pytest.raises(ValueError, match="stacked=True"):
        model.forward(params, jnp.ones((1, 4), jnp.int32))
