"""Partition rules, shardings of params and KV pools, and agreement across meshes (1,1), (1,8), (2,4)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from model_service.config import MeshConfig
from model_service.model.packed import PackedWeight
from model_service.sharding import fit_spec, make_mesh, spec_for_path
from tests.model.conftest import RowRunner


def test_rules_map_parameter_paths_to_specs() -> None:
    assert spec_for_path("transformer/decoder_layer_3/moe/linear_v/w/experts/7/weight") == P("model", None)
    assert spec_for_path("transformer/decoder_layer_3/moe/linear_1/w/experts/0/scales") == P(None, None)
    assert spec_for_path("transformer/decoder_layer_0/multi_head_attention/key/w/weight") == P("model", None)
    assert spec_for_path("transformer/decoder_layer_0/rms_norm_2/scale") == P(None)
    assert spec_for_path("something/else") == P()


def test_axes_that_do_not_divide_a_dimension_fall_back_to_replication() -> None:
    mesh = make_mesh(MeshConfig(2, 4))
    assert fit_spec(P("data", None, "model"), (1, 5, 8), mesh) == P(None, None, "model")
    assert fit_spec(P("data", None, "model"), (4, 5, 6), mesh) == P("data", None, None)


def test_loaded_weights_and_memory_are_sharded_over_the_mesh(golden_model) -> None:
    loaded = golden_model("1,8", "float32")
    expert = loaded.params["transformer/decoder_layer_0/moe/linear"]["w"].experts[2]
    shardings = loaded.model.params_shardings(loaded.params)
    w_1 = shardings["transformer/decoder_layer_1/moe/linear_1"]["w"].experts[0]
    query = shardings["transformer/decoder_layer_1/multi_head_attention/query"]["w"]
    if isinstance(expert, PackedWeight):  # native products: each model shard's 86 columns padded to 6 blocks
        assert expert.packed.dtype == jnp.int8 and expert.packed.sharding.spec == P("model", None, None)
        assert expert.packed.addressable_shards[0].data.shape == (6, 128, 16)
        assert w_1.packed.spec == P(None, "model", None) and w_1.packed_scales.spec == P("model", None)
        assert query.packed.spec == P("model", None, None)
    else:
        assert expert.weight.dtype == jnp.int8 and expert.weight.sharding.spec == P("model", None)  # [F, D]
        assert expert.weight.addressable_shards[0].data.shape == (688 // 8, 128)
        assert w_1.weight.spec == P("model", None)
        assert query.weight.spec == P("model", None)
    pools = loaded.model.pools_shardings(4)
    # the block pool: kv heads on model, blocks readable by every data shard
    assert pools[0].k.spec == P(None, "model", None, None)


def test_meshes_1x1_1x8_2x4_agree_on_a_prompt_and_decode_rows(golden_model, golden_npz) -> None:
    prompt = golden_npz["fp32"]["p1_prompt"]
    results = []
    for mesh in ("1,1", "1,8", "2,4"):
        runner = RowRunner(golden_model(mesh, "float32"), 4)
        first = runner.run([(2, i, int(t)) for i, t in enumerate(prompt)])
        step = runner.run([(2, len(prompt), 5), (0, 0, 6), (1, 0, 7), (3, 0, 8)])
        results.append((first, step))
    for first, step in results[1:]:
        np.testing.assert_allclose(first, results[0][0], atol=1e-4)
        np.testing.assert_allclose(step, results[0][1], atol=1e-4)
