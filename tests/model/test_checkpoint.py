"""The released checkpoint format: restricted reading, the bfloat16 dtype trap, writing, mismatch messages."""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import pickle
import subprocess
import sys

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from model_service.checkpoint import CheckpointError, load_params, random_leaves, read_tensor, \
    write_checkpoint
from model_service.config import MeshConfig, load_model_config
from model_service.model import GrokModel, QuantizedWeight
from model_service.model.layers import ExpertStack
from model_service.model.params import tensor_specs
from model_service.sharding import make_mesh
from tests.procs import GOLDEN, ROOT

TINY = dataclasses.replace(
    load_model_config(str(GOLDEN / "config.json")), vocab_size=64,
    model=dataclasses.replace(load_model_config(str(GOLDEN / "config.json")).model, emb_size=32, num_layers=1,
                              num_q_heads=4, num_kv_heads=2, widening_factor=2))


class _RunsCommand:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_pickle_that_would_run_a_command_is_refused_and_nothing_runs(tmp_path: pathlib.Path) -> None:
    marker = tmp_path / "pwned"
    evil = tmp_path / "tensor00000_000"
    evil.write_bytes(pickle.dumps(_RunsCommand(str(marker)), protocol=4))
    with pytest.raises(CheckpointError, match=r"refused to unpickle global (posix|os)\.system"):
        read_tensor(evil)
    assert not marker.exists()


def test_pickle_with_other_globals_or_object_arrays_is_refused(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "t"
    path.write_bytes(pickle.dumps({"a": 1}.keys.__self__.__class__, protocol=4))  # the dict type itself
    with pytest.raises(CheckpointError, match="refused"):
        read_tensor(path)
    path.write_bytes(pickle.dumps(np.array([1, "x"], dtype=object), protocol=4))
    with pytest.raises(CheckpointError, match="refused"):
        read_tensor(path)


def test_golden_tensors_load_and_leave_the_global_bfloat16_dtype_usable() -> None:
    before = np.dtype(ml_dtypes.bfloat16).flags
    leaf = read_tensor(GOLDEN / "checkpoint" / "ckpt-0" / "tensor00005_000")
    assert isinstance(leaf, tuple) and leaf[0].dtype == np.int8 and leaf[1].dtype == ml_dtypes.bfloat16
    assert leaf[0].shape == (128, 64) and leaf[1].shape == (1, 64)
    assert np.dtype(ml_dtypes.bfloat16).flags == before
    assert jnp.zeros(2, jnp.bfloat16).dtype == jnp.bfloat16
    assert jnp.asarray(leaf[1]).dtype == jnp.bfloat16


def test_tensor_order_names_and_shapes_match_the_golden_manifest(golden_cfg) -> None:
    manifest = json.loads((GOLDEN / "checkpoint" / "manifest.json").read_text())["tensors"]
    specs = tensor_specs(golden_cfg)
    assert [t["name"] for t in manifest] == [s.ckpt_path for s in specs]
    for t, s in zip(manifest, specs):
        assert tuple(t.get("weight_shape", t.get("shape"))) == s.shape
        if s.quantized:
            assert tuple(t["scales_shape"]) == s.scales_shape


def test_haiku_parameter_tree_of_the_network_matches_the_checkpoint_layout(golden_cfg) -> None:
    model = GrokModel(golden_cfg, make_mesh(MeshConfig()), jnp.float32)
    shapes = model.init_param_shapes()
    flat = {f"{module}/{name}": leaf.shape for module, d in shapes.items() for name, leaf in d.items()}
    assert flat == {f"{s.module}/{s.name}": s.shape for s in tensor_specs(golden_cfg)}


def test_written_checkpoint_reads_back_identical_arrays(tmp_path: pathlib.Path) -> None:
    leaves = list(random_leaves(TINY, seed=3))
    write_checkpoint(tmp_path, TINY, leaves)
    for i, leaf in enumerate(leaves):
        back = read_tensor(tmp_path / "ckpt-0" / f"tensor{i:05d}_000")
        for a, b in zip(leaf if isinstance(leaf, tuple) else (leaf,), back if isinstance(back, tuple) else (back,)):
            assert a.dtype == b.dtype and a.shape == b.shape
            np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))


def test_written_files_load_with_the_standard_unpickler_in_a_fresh_process(tmp_path: pathlib.Path) -> None:
    write_checkpoint(tmp_path, TINY, random_leaves(TINY, seed=5))
    script = ("import pickle, sys, warnings; warnings.simplefilter('ignore')\n"
              "class QuantizedWeight8bit: pass\n"
              "o = pickle.load(open(sys.argv[1], 'rb')); print(o.weight.dtype, o.weight.shape, o.scales.dtype)")
    out = subprocess.run([sys.executable, "-c", script, str(tmp_path / "ckpt-0" / "tensor00002_000")],
                         capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["int8", "(8,", "32,", "48)", "bfloat16"]


def test_load_progress_reports_every_tensor(tmp_path: pathlib.Path) -> None:
    write_checkpoint(tmp_path, TINY, random_leaves(TINY, seed=6))
    seen: list[tuple[int, int]] = []
    params = load_params(str(tmp_path), TINY, make_mesh(MeshConfig()), jnp.float32, progress=lambda d, t: seen.append((d, t)))
    n = len(tensor_specs(TINY))
    assert seen == [(i, n) for i in range(1, n + 1)]
    w = params["transformer/decoder_layer_0/moe/linear"]["w"]
    assert isinstance(w, ExpertStack) and len(w.experts) == 8 and w.shape == (8, 32, 48)
    assert w.experts[3].weight.dtype == jnp.int8 and w.experts[3].weight.shape == (48, 32)  # stored [out, in]
    q = params["transformer/decoder_layer_0/multi_head_attention/query"]["w"]
    assert isinstance(q, QuantizedWeight) and q.weight.dtype == jnp.int8 and q.shape == (32, 32)


def test_name_mismatch_lists_what_is_missing_on_each_side(tmp_path: pathlib.Path) -> None:
    write_checkpoint(tmp_path, TINY, random_leaves(TINY, seed=7))
    two_layers = dataclasses.replace(TINY, model=dataclasses.replace(TINY.model, num_layers=2))
    with pytest.raises(CheckpointError) as err:
        load_params(str(tmp_path), two_layers, make_mesh(MeshConfig()), jnp.float32)
    text = str(err.value)
    assert "Params missing in checkpoint" in text and "decoder_layer_1/router/w" in text
    assert "Params missing in code: []" in text


def test_missing_files_without_manifest_are_listed_by_name(tmp_path: pathlib.Path) -> None:
    write_checkpoint(tmp_path, TINY, random_leaves(TINY, seed=8))
    (tmp_path / "manifest.json").unlink()
    (tmp_path / "ckpt-0" / "tensor00003_000").unlink()
    with pytest.raises(CheckpointError, match=r"tensor00003_000 \(params/transformer/decoder_layer_0/moe/linear_1/w\)"):
        load_params(str(tmp_path), TINY, make_mesh(MeshConfig()), jnp.float32)


def test_shape_mismatch_names_the_tensor_and_both_shapes(tmp_path: pathlib.Path) -> None:
    write_checkpoint(tmp_path, TINY, random_leaves(TINY, seed=9))
    (tmp_path / "manifest.json").unlink()
    wider = dataclasses.replace(TINY, vocab_size=96)
    with pytest.raises(CheckpointError, match=r"in_out_embed/embeddings\): checkpoint has array \(64, 32\), "
                                              r"the config expects array \(96, 32\)"):
        load_params(str(tmp_path), wider, make_mesh(MeshConfig()), jnp.float32)


def test_quantize_uses_the_released_block_layout_and_rounds_to_the_nearest_step() -> None:
    from model_service.model.params import quantize
    w = np.random.default_rng(0).standard_normal((2, 16, 8)).astype(np.float32)
    q, scales = quantize(w, blocks=8)
    assert q.dtype == np.int8 and scales.dtype == ml_dtypes.bfloat16 and scales.shape == (2, 8, 8)
    s = scales.astype(np.float32)
    np.testing.assert_allclose(s, (np.abs(w.reshape(2, 8, 2, 8)).max(2) / 127).astype(ml_dtypes.bfloat16).astype(np.float32))
    back = q.reshape(2, 8, 2, 8).astype(np.float32) * s[:, :, None, :]
    assert np.all(np.abs(back - w.reshape(2, 8, 2, 8)) <= s[:, :, None, :] * 0.5 + 1e-6)
