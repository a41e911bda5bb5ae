"""The generic backend's scanned layers (Backend.scan_layers): the parameters and the KV pools stacked along a
leading layer axis, one loop body whatever the depth, computing what the unrolled layers compute."""

from __future__ import annotations

import dataclasses
import pathlib
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from benchmarks.scan_copies import IN_PLACE, layer_weight_bytes, materialised, step_program, while_loops
from model_service import backend as backend_module
from model_service.backend import choose_backend
from model_service.checkpoint import load_params, random_leaves, random_params, write_checkpoint
from model_service.config import MeshConfig, ModelConfig, load_model_config
from model_service.engine import Engine
from model_service.kv_memory import KVMemory, LayerPool, init_pools, read_blocks, write_tokens
from model_service.model import GrokModel, TokenRows
from model_service.model import transformer as transformer_module
from model_service.model.stacking import put_layer, stacked_module
from model_service.sharding import LAYER_STACK, make_mesh
from tests.model import test_parity
from tests.model.conftest import Loaded
from tests.procs import GOLDEN

_GOLDEN = load_model_config(str(GOLDEN / "config.json"))


def _tiny(layers: int) -> ModelConfig:
    return dataclasses.replace(_GOLDEN, vocab_size=64, sequence_len=32, model=dataclasses.replace(
        _GOLDEN.model, emb_size=32, num_layers=layers, num_q_heads=4, num_kv_heads=2, widening_factor=2))


def _model(cfg: ModelConfig, layers: str, mesh: str = "1,1") -> GrokModel:
    m = make_mesh(MeshConfig.parse(mesh))
    return GrokModel(cfg, m, jnp.float32, block_size=8, backend=choose_backend("generic", m, jnp.float32,
                                                                              layers=layers))


def _params(model: GrokModel, seed: int = 3) -> dict:
    return random_params(model.cfg, model.mesh, jnp.float32, seed, stacked=model.backend.stacked_experts,
                         stack_layers=model.scan_layers)


def _rows(model: GrokModel, n: int = 8) -> TokenRows:
    """n rows of one prompt (sequence 0), then its keys read back."""
    return TokenRows(jnp.arange(3, 3 + n, dtype=jnp.int32), jnp.arange(n, dtype=jnp.int32), jnp.zeros(n, jnp.int32),
                     jnp.ones(n, bool), jnp.asarray(model.dense_tables(2)))


def _step(model: GrokModel) -> jax.stages.Wrapped:
    return jax.jit(lambda params, pools, rows: model.rows(params, pools, rows, 8), donate_argnums=(1,))


def test_the_scanned_step_program_stays_the_same_size_at_any_depth_and_the_unrolled_one_grows() -> None:
    size = {}
    for layers in ("scan", "unroll"):
        for depth in (2, 8):
            model = _model(_tiny(depth), layers)
            pools = model.init_pools(2 * model.blocks_per_sequence)
            size[layers, depth] = len(_step(model).lower(_params(model), pools, _rows(model)).as_text())
    assert size["scan", 8] < 1.02 * size["scan", 2]
    assert size["unroll", 8] > 3 * size["unroll", 2]


def test_scanned_layers_compute_what_the_unrolled_layers_compute() -> None:
    """Not the same bits on CPU (XLA compiles a loop's body apart, and runs its products on one thread): within
    1e-5 of the largest value, the same greedy tokens."""
    cfg = _tiny(3)
    tokens = jnp.asarray(np.random.default_rng(0).integers(3, 64, (2, 12)), jnp.int32)
    out = {}
    for layers in ("scan", "unroll"):
        model = _model(cfg, layers)
        params = _params(model)
        pools = model.init_pools(2 * model.blocks_per_sequence)
        h, pools = _step(model)(params, pools, _rows(model))
        again, _ = _step(model)(params, pools, _rows(model)._replace(tokens=jnp.full(8, 5, jnp.int32)))
        out[layers] = [np.asarray(a) for a in (jax.jit(model.forward)(params, tokens), h, again)]
    for got, want in zip(out["scan"], out["unroll"]):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
    np.testing.assert_array_equal(out["scan"][0].argmax(-1), out["unroll"][0].argmax(-1))


@pytest.mark.parametrize("mesh", ["1,1", "1,8"])
def test_the_scanned_layers_pass_the_golden_parity_tests(golden_npz, mesh: str) -> None:
    """tests/model/test_parity.py's checks, run on the generic backend (its layers scanned) where CI has no
    accelerator: float32 logits within 1e-4 and the greedy ids; bfloat16's criteria."""
    def golden_model(mesh: str, dtype: str) -> Loaded:
        m = make_mesh(MeshConfig.parse(mesh))
        model = GrokModel(_GOLDEN, m, jnp.dtype(dtype), backend=choose_backend("generic", m, jnp.dtype(dtype)))
        assert model.scan_layers
        params = load_params(str(GOLDEN / "checkpoint"), _GOLDEN, m, jnp.dtype(dtype),
                             stacked=model.backend.stacked_experts, stack_layers=model.scan_layers)
        return Loaded(_GOLDEN, model, params, jax.jit(model.forward))

    test_parity.test_float32_prefill_full_logits_and_greedy_match_reference(golden_model, golden_npz, mesh)
    test_parity.test_bfloat16_prefill_logits_and_confident_greedy_steps_match_reference(golden_model, golden_npz, mesh)


@pytest.mark.parametrize("mesh", ["1,2", "2,2,2"])
def test_layers_load_into_stacks_that_hold_each_layers_tensor_on_the_per_layer_shardings(
        tmp_path: pathlib.Path, mesh: str) -> None:
    cfg = _tiny(3)
    write_checkpoint(tmp_path, cfg, random_leaves(cfg, seed=5))
    model = _model(cfg, "scan", mesh)
    stacked = load_params(str(tmp_path), cfg, model.mesh, jnp.float32, stacked=True, stack_layers=True)
    per_layer = load_params(str(tmp_path), cfg, model.mesh, jnp.float32, stacked=True)
    assert sorted(m for m in stacked if not m.startswith(LAYER_STACK)) == ["language_model/in_out_embed",
                                                                         "language_model/rms_norm"]
    for module, leaves in per_layer.items():
        found = stacked_module(module)
        for name, leaf in leaves.items():
            stack = stacked[found[1]][name] if found else stacked[module][name]
            for one, many in zip(jax.tree.leaves(leaf), jax.tree.leaves(stack)):
                np.testing.assert_array_equal(np.asarray(many[found[0]]) if found else np.asarray(many),
                                              np.asarray(one))
                if found:  # the layer axis leads, unsharded; the rest as the layer's own
                    assert many.sharding.spec == P(None, *one.sharding.spec)
    # GrokModel.pack_params stacks a per-layer tree the same way
    restacked = model.pack_params(per_layer)
    for a, b in zip(jax.tree.leaves(stacked), jax.tree.leaves(restacked)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_each_layer_is_written_into_its_stack_in_place() -> None:
    """The stack is donated to each write: loading never holds a stacked parameter twice."""
    params: dict = {}
    mesh = make_mesh(MeshConfig())
    put_layer(params, "transformer/decoder_layer_0/router", "w", jnp.ones((4, 2)), 3, mesh)
    first = params[f"{LAYER_STACK}router"]["w"]
    put_layer(params, "transformer/decoder_layer_2/router", "w", jnp.full((4, 2), 2.0), 3, mesh)
    assert first.is_deleted()
    np.testing.assert_array_equal(params[f"{LAYER_STACK}router"]["w"], np.stack([np.ones((4, 2)), np.zeros((4, 2)),
                                                                               np.full((4, 2), 2.0)]))
    assert not put_layer(params, "language_model/rms_norm", "scale", jnp.ones(4), 3, mesh)


@pytest.mark.parametrize("layout", ["tokens", "heads"])
def test_a_layer_of_the_stacked_pools_is_written_and_read_as_a_pool_of_its_own(layout: str) -> None:
    stacked = init_pools(6, 4, 3, 2, 8, jnp.float32, layout, stacked=True).k
    new = jnp.asarray(np.random.default_rng(0).standard_normal((5, 2, 8)), jnp.float32)
    blocks, offsets, ids = jnp.array([0, 3, 3, 6, 2]), jnp.array([1, 0, 3, 2, 3]), jnp.array([[3, 0], [6, 2]])
    got = write_tokens(LayerPool(stacked, jnp.int32(1)), new, blocks, offsets)
    want = write_tokens(stacked[1], new, blocks, offsets)
    np.testing.assert_array_equal(got.stacked[1], want)
    assert not np.asarray(got.stacked[0]).any() and not np.asarray(got.stacked[2]).any()
    np.testing.assert_array_equal(read_blocks(got, ids, 2), read_blocks(want, ids, 2))


def test_the_pools_are_stacked_with_the_layer_axis_unsharded() -> None:
    cfg = _tiny(3)
    model = _model(cfg, "scan", "1,2")
    pools = model.init_pools(4)
    t = cfg.model
    assert isinstance(pools, KVMemory) and pools.k.shape == (3, 5, 8, t.num_kv_heads * t.key_size)
    assert model.pools_shardings(4).k.spec == P(None, None, None, "model")
    assert len(_model(cfg, "unroll").init_pools(4)) == 3


def test_the_unrolled_layers_refuse_a_scanned_tree_and_the_scanned_ones_a_per_layer_tree() -> None:
    cfg = _tiny(2)
    scan, unroll = _model(cfg, "scan"), _model(cfg, "unroll")
    tokens = jnp.ones((1, 4), jnp.int32)
    with pytest.raises(ValueError, match="stack_layers=True"):
        scan.forward(_params(unroll), tokens)
    with pytest.raises(ValueError):
        unroll.forward(_params(scan), tokens)


def test_the_cpu_backend_keeps_its_layers_unrolled() -> None:
    mesh = make_mesh(MeshConfig())
    assert not choose_backend("cpu", mesh, jnp.float32).scan_layers
    assert choose_backend("generic", mesh, jnp.float32).scan_layers
    with pytest.raises(ValueError, match="generic"):
        choose_backend("cpu", mesh, jnp.float32, layers="scan")


def test_auto_scans_the_generic_layers_off_cpu_except_over_an_expert_axis() -> None:
    """--layers auto scans wherever the generic backend runs (measured on a TPU v5e: faster to compile, steps as
    fast); on an accelerator's expert mesh it unrolls (a scanned step would slice each layer's experts out)."""
    mesh = make_mesh(MeshConfig())
    with mock.patch.object(backend_module, "platform", return_value="tpu"):
        assert choose_backend("generic", mesh, jnp.bfloat16).scan_layers
        assert not choose_backend("generic", mesh, jnp.bfloat16, layers="unroll").scan_layers
        assert not backend_module.scan_layers("auto", mesh, "expert")
        assert backend_module.scan_layers("scan", mesh, "expert")
    assert backend_module.scan_layers("auto", mesh, "expert")  # on CPU: as the tests have always run it


def _engine(cfg: ModelConfig, layers: str, moe: str, dtype: jnp.dtype) -> Engine:
    m = make_mesh(MeshConfig())
    model = GrokModel(cfg, m, dtype, backend=choose_backend("generic", m, dtype, slots=16, moe=moe, layers=layers))
    params = random_params(cfg, m, dtype, 0, stacked=model.backend.stacked_experts, stack_layers=model.scan_layers)
    return Engine(model, params, cfg, m, 16)


def _grok_like(layers: int) -> ModelConfig:
    """Grok-1's shape at a small width: 8 experts (2 selected), widening 8, 128-wide heads, grouped kv heads."""
    return dataclasses.replace(_GOLDEN, vocab_size=512, sequence_len=64, model=dataclasses.replace(
        _GOLDEN.model, emb_size=256, num_layers=layers, num_q_heads=2, num_kv_heads=1, key_size=128,
        widening_factor=8, num_experts=8, num_selected_experts=2))


@pytest.mark.parametrize("moe", ["cond", "ragged"])
def test_the_scanned_step_reads_each_layers_weights_in_place_and_updates_the_pools_in_place(moe: str) -> None:
    """Issue 61: the scanned step program (a decode bucket, 2 layers) writes no int8 array as large as one of a
    layer's matrices (a layer's slice of a stacked weight taken before a conditional or a custom call would be
    one, every layer of every step), and the stacked pools are written only in place: donated, aliased to the
    output, and no instruction but an in-place update writes an array of their shape."""
    engine = _engine(_grok_like(2), "scan", moe, jnp.float32)
    compiled = step_program(engine, 16)
    written = materialised(compiled.as_text())
    _, smallest = layer_weight_bytes(engine.params, LAYER_STACK)
    assert smallest >= 256 * 128  # the smallest layer matrix (key or value: [256, 128] int8)
    assert [w for w in written if w.dtype == "s8" and w.bytes >= smallest] == []
    pools = engine.init_state().pools
    assert compiled.memory_analysis().alias_size_in_bytes >= sum(a.nbytes for a in jax.tree.leaves(pools))
    shape = tuple(pools.k.shape)
    copies = [w for w in written if w.shape == shape and w.opcode not in IN_PLACE]
    assert copies == []


def test_the_layer_copy_check_sees_a_layers_experts_sliced_before_their_conditionals() -> None:
    """The check above fails where it should: each layer's experts sliced out of the stacks at the top of the
    loop's body (before the conditionals that multiply them, instead of inside them) are written as int8 copies."""
    engine = _engine(_grok_like(2), "scan", "cond", jnp.float32)
    sliced_early = lambda stacked, layer: jax.tree.map(lambda a: a[layer], stacked)  # noqa: E731
    with mock.patch.object(transformer_module, "InLayer", sliced_early):
        written = materialised(step_program(engine, 16).as_text())
    _, smallest = layer_weight_bytes(engine.params, LAYER_STACK)
    assert [w for w in written if w.dtype == "s8" and w.bytes >= smallest]


def test_a_scan_over_one_layer_compiles_to_the_unrolled_layers_program() -> None:
    """XLA removes a loop that runs once: at one layer the scanned step holds no layer loop and needs the
    unrolled step's temporaries (to a few scalars' bytes), so a difference between the two at one layer is not
    the loop's (issue 61)."""
    compiled = {layers: step_program(_engine(_grok_like(1), layers, "cond", jnp.float32), 16)
                for layers in ("scan", "unroll")}
    assert while_loops(compiled["scan"].as_text()) == while_loops(compiled["unroll"].as_text())
    temp = {layers: c.memory_analysis().temp_size_in_bytes for layers, c in compiled.items()}
    assert abs(temp["scan"] - temp["unroll"]) <= 1024
    deeper = step_program(_engine(_grok_like(2), "scan", "cond", jnp.float32), 16)
    assert while_loops(deeper.as_text()) == while_loops(compiled["scan"].as_text()) + 1
