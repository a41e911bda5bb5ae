"""Experts on their own mesh axis (model/expert_parallel.py): parity with the reference's recorded outputs on
meshes DATA,EXPERT,MODEL = (1,4,2), (1,8,1), (2,4,1); each expert's weights on one expert group; one reduction
per layer. (1,1,8) is the (1,8) mesh of test_parity.py."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from model_service.backend import choose_backend
from model_service.checkpoint import load_params
from model_service.config import MeshConfig
from model_service.model import GrokModel, TokenRows
from model_service.model.weights import GroupedWeight
from model_service.sharding import EXPERT, make_mesh, spec_for_path
from tests.model.conftest import Loaded
from tests.model.test_parity import F32_ATOL, PROMPTS, _decode_batch, _prefill_all
from tests.procs import GOLDEN

EXPERT_MESHES = ["1,4,2", "1,8,1", "2,4,1"]


@pytest.mark.parametrize("mesh", EXPERT_MESHES)
def test_float32_greedy_ids_and_logits_match_reference_with_an_expert_axis(golden_model, golden_npz, mesh):
    loaded, gold = golden_model(mesh, "float32"), golden_npz["fp32"]
    assert loaded.model.moe == "expert"
    runner, prefilled = _prefill_all(loaded, gold)
    for p in PROMPTS:
        np.testing.assert_allclose(prefilled[p], gold[f"p{p}_prefill_last_logits"], atol=F32_ATOL, rtol=0)
    tokens, logits = _decode_batch(loaded, gold, runner, np.array([prefilled[p].argmax() for p in PROMPTS]))
    for p in PROMPTS:
        np.testing.assert_array_equal(tokens[p], gold[f"p{p}_greedy_tokens"], err_msg=f"prompt {p}")
        np.testing.assert_allclose(logits[p], gold[f"p{p}_step_logits"][1:], atol=F32_ATOL, rtol=0)


def test_bfloat16_confident_greedy_ids_match_reference_with_an_expert_axis(golden_model, golden_npz):
    loaded, gold = golden_model("1,4,2", "bfloat16"), golden_npz["bf16"]
    runner, prefilled = _prefill_all(loaded, gold)
    tokens, _ = _decode_batch(loaded, gold, runner, np.array([prefilled[p].argmax() for p in PROMPTS]))
    for p in PROMPTS:
        confident = np.cumprod(gold[f"p{p}_top2_margin"] >= 0.3).astype(bool)
        np.testing.assert_array_equal(tokens[p][confident], gold[f"p{p}_greedy_tokens"][confident])


def test_each_experts_weights_live_on_one_expert_group_only(golden_model):
    loaded = golden_model("1,4,2", "float32")
    mesh = loaded.model.mesh
    groups = mesh.shape[EXPERT]
    stacks = [leaf for module, leaves in loaded.params.items() if "/moe/" in module + "/"
              for leaf in leaves.values() if isinstance(leaf, GroupedWeight)]
    assert len(stacks) == 3 * loaded.cfg.model.num_layers
    per_group = loaded.cfg.model.num_experts // groups
    group_of = {d: g for g in range(groups) for d in mesh.devices[:, g, :].flat}
    for q in stacks:
        for array in (q.weight, q.scales):
            for shard in array.addressable_shards:
                first = group_of[shard.device] * per_group
                assert shard.index[0] == slice(first, first + per_group), (shard.device, shard.index)
                assert shard.data.shape[0] == per_group


def test_a_step_on_the_expert_axis_reduces_once_per_layer(golden_model):
    """On (1,8,1) nothing but the experts is split: the step's program holds one all-reduce per layer (the
    tensor-parallel experts of a (1,8) mesh reduce once per expert that runs)."""
    loaded = golden_model("1,8,1", "float32")
    model, n = loaded.model, 8
    rows = TokenRows(jnp.zeros(n, jnp.int32), jnp.arange(n, dtype=jnp.int32), jnp.zeros(n, jnp.int32),
                     jnp.ones(n, bool), jnp.asarray(model.dense_tables(1)))
    pools = model.init_pools(model.blocks_per_sequence)
    text = jax.jit(lambda p, pl, r: model.rows(p, pl, r, n)).lower(loaded.params, pools, rows).compile().as_text()
    collectives = re.findall(r"= \S+ (all-reduce|all-gather|all-to-all|reduce-scatter)(?:-start)?\(", text)
    assert collectives == ["all-reduce"] * loaded.cfg.model.num_layers


def test_the_generic_backend_on_an_expert_mesh_reproduces_the_greedy_ids(golden_cfg, golden_npz):
    """What an accelerator slice runs (XLA's dots, batched attention), with the experts over 4 groups and the batch
    over 2 data shards."""
    mesh = make_mesh(MeshConfig.parse("2,4,1"))
    model = GrokModel(golden_cfg, mesh, jnp.float32, backend=choose_backend("generic", mesh, jnp.float32))
    assert model.moe == "expert" and model.backend.name == "generic"
    params = load_params(str(GOLDEN / "checkpoint"), golden_cfg, mesh, jnp.float32, stacked=True,
                         stack_layers=model.scan_layers)
    loaded, gold = Loaded(golden_cfg, model, params, jax.jit(model.forward)), golden_npz["fp32"]
    runner, prefilled = _prefill_all(loaded, gold)
    tokens, _ = _decode_batch(loaded, gold, runner, np.array([prefilled[p].argmax() for p in PROMPTS]))
    for p in PROMPTS:
        np.testing.assert_array_equal(tokens[p], gold[f"p{p}_greedy_tokens"], err_msg=f"prompt {p}")


def test_rules_split_the_stacked_experts_over_the_expert_axis_and_their_hidden_units_over_model():
    layer = "transformer/decoder_layer_3/moe"
    assert spec_for_path(f"{layer}/linear/w/weight") == P("expert", None, "model")  # [E, D, F]
    assert spec_for_path(f"{layer}/linear_v/w/scales") == P("expert", None, "model")  # [E, 1, F]
    assert spec_for_path(f"{layer}/linear_1/w/weight") == P("expert", "model", None)  # [E, F, D]
    assert spec_for_path(f"{layer}/linear_1/w/scales") == P("expert", "model", None)  # [E, 8, D]
    assert spec_for_path(f"{layer}/linear/w/experts/3/weight") == P("model", None)  # per expert: as before
