"""The training network and its export: the same function as the served network, int8 in the released layout."""

from __future__ import annotations

import dataclasses
import pathlib

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from model_service.checkpoint import read_tensor
from model_service.config import MeshConfig, ModelConfig, load_model_config
from model_service.model import GrokModel
from model_service.model.params import FINAL_NORM, tensor_specs
from model_service.sharding import make_mesh
from demo_build import export, network
from demo_build.loop import TrainConfig, make_step, optimizer
from tests.procs import ROOT


@pytest.fixture(scope="module")
def cfg() -> ModelConfig:
    return load_model_config(str(ROOT / "configs" / "demo.json"))


@pytest.fixture(scope="module")
def params(cfg: ModelConfig) -> dict:
    """Float weights of the demo config, perturbed away from the init so every norm and router matters."""
    p = network.init_params(cfg, jax.random.PRNGKey(3))
    keys = iter(jax.random.split(jax.random.PRNGKey(4), 1000))
    p = jax.tree.map(lambda x: x * (1 + 0.3 * jax.random.normal(next(keys), x.shape)), p)
    p[FINAL_NORM]["scale"] = p[FINAL_NORM]["scale"] * 10  # logits of golden's size (std > 1)
    return p


def test_training_forward_equals_the_served_network_on_the_same_float_weights(cfg: ModelConfig, params: dict) -> None:
    tokens = np.random.default_rng(0).integers(3, cfg.vocab_size, (2, 40)).astype(np.int32)
    tokens[1, 5] = cfg.pad_token  # a pad key is masked in both
    served = GrokModel(cfg, make_mesh(MeshConfig()), jnp.float32)
    want = np.asarray(jax.jit(served.forward)(params, jnp.asarray(tokens)))
    got = np.asarray(jax.jit(lambda p, t: network.forward(cfg, p, t))(params, jnp.asarray(tokens)))
    assert want.std() > 1.0  # logits that differ per token, so agreement means something
    # The project's float32 parity tolerance (golden): equivalent programs differ by rounding only.
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


def test_optimizer_steps_lower_the_loss_on_a_repeated_batch(cfg: ModelConfig) -> None:
    small = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, num_layers=1))
    train_cfg = TrainConfig(steps=20, warmup_steps=2, learning_rate=3e-3)
    opt = optimizer(train_cfg)
    p = network.init_params(small, jax.random.PRNGKey(0))
    state = opt.init(p)
    step = make_step(small, opt)
    tokens = jnp.asarray(np.random.default_rng(1).integers(3, small.vocab_size, (2, 17)), jnp.int32)
    losses = []
    for _ in range(8):
        p, state, loss = step(p, state, tokens)
        losses.append(float(loss))
    assert losses[-1] < losses[0] - 1.0, losses


def test_export_writes_int8_in_the_released_layout_within_half_a_step(cfg: ModelConfig, params: dict,
                                                                      tmp_path: pathlib.Path) -> None:
    export.write_trained_checkpoint(tmp_path, cfg, params)
    for i, spec in enumerate(tensor_specs(cfg)):
        leaf = read_tensor(tmp_path / "ckpt-0" / f"tensor{i:05d}_000")
        value = np.asarray(params[spec.module][spec.name], np.float32)
        if not spec.quantized:
            assert leaf.dtype == np.float32 and np.array_equal(leaf, value), spec.ckpt_path
            continue
        weight, scales = leaf
        assert weight.dtype == np.int8 and scales.dtype == ml_dtypes.bfloat16, spec.ckpt_path
        assert scales.shape == (*spec.shape[:-2], spec.blocks, spec.shape[-1])  # 1 column block or 8 row blocks
        k = spec.shape[-2]
        per_row = np.repeat(scales.astype(np.float32), k // spec.blocks, axis=-2)  # [..., K, N]
        error = np.abs(weight * per_row - value)
        assert np.all(error <= 0.5 * per_row * 1.01), spec.ckpt_path
        assert np.abs(weight).max() >= 126  # the largest weight of a block uses the whole int8 range
