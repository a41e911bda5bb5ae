"""Issue 62: building the engine holds, at its peak, little more than what the engine keeps. Each case loads as the
model service does (loading.load_engine) in a process of its own (benchmarks.build_memory) and compares the host's
peak resident memory over what the process held before loading with the bytes of the params and KV pools.

The config's experts dominate its weights (a 1,024-token vocabulary, 1,024 wide, 2 layers: 268 MB of int8 MoE
matrices of 45 MB each, 283 MB held), so a transient copy of a layer's tensors shows. Measured on CPU (bfloat16):
before the fix the generic backend peaked at 1.82x (random) and 1.66x (checkpoint) what it keeps (each MoE matrix
placed whole, then copied into its layer stack; random experts listed and stacked into a second copy); after it
1.39x and 1.25x, the cpu backend 1.15x and 1.13x. What remains is about 70 MB that does not grow with the layers
(the runtime's and the compiler's own memory: 68-71 MB at 1, 2 and 4 layers) and, for random weights, the one MoE
matrix drawn on the host before it is placed. The bound, 1.5x, sits between the two.
"""

from __future__ import annotations

import json
import pathlib

import pytest

from benchmarks.build_memory import run_case
from demo_build.random_checkpoint import write_random_checkpoint

BOUND = 1.5


@pytest.fixture(scope="module")
def wide(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """(config file, checkpoint directory) of the expert-heavy config."""
    where = tmp_path_factory.mktemp("build-memory")
    cfg = {
        "vocab_size": 1024, "pad_token": 0, "eos_token": 2, "sequence_len": 256, "embedding_init_scale": 1.0,
        "output_multiplier_scale": 0.5773502691896257, "embedding_multiplier_scale": 78.38367176906169,
        "model": {"emb_size": 1024, "widening_factor": 8, "key_size": 128, "num_q_heads": 8, "num_kv_heads": 8,
                  "num_layers": 2, "attn_output_multiplier": 0.08838834764831845, "shard_activations": True,
                  "num_experts": 8, "num_selected_experts": 2, "data_axis": "data", "model_axis": "model"}}
    config = where / "config.json"
    config.write_text(json.dumps(cfg))
    write_random_checkpoint(str(config), where / "ckpt", seed=0)
    return str(config), str(where / "ckpt")


@pytest.mark.parametrize("source", ["random", "checkpoint"])
@pytest.mark.parametrize("backend", ["generic", "cpu"])
def test_peak_over_held(wide: tuple[str, str], backend: str, source: str) -> None:
    config, checkpoint = wide
    report = run_case(config, checkpoint if source == "checkpoint" else None, backend, "bfloat16")
    assert "error" not in report, report.get("error")
    assert report["held"]["total"] > 250e6, report  # the experts are there (the bound means something)
    assert report["host_peak_over_held"] <= BOUND, report


@pytest.mark.parametrize("scan", [True, False])
def test_experts_load_padded_for_the_kernel_and_the_engine_keeps_them(tmp_path: pathlib.Path, scan: bool) -> None:
    """With the Pallas kernel's layout the experts load padded (grouped.kernel_layout's zeros, expert by expert
    into the layer stacks) from a checkpoint and from random weights, the same bits as kernel_layout applied to the
    unpadded load, and GrokModel.pack_params keeps every leaf as loaded (no second copy of the tree)."""
    import dataclasses

    import jax
    import jax.numpy as jnp
    import numpy as np

    from model_service.backend import choose_backend
    from model_service.checkpoint import load_params, random_leaves, random_params, write_checkpoint
    from model_service.config import MeshConfig
    from model_service.model import GrokModel, Products
    from model_service.model.grouped import kernel_layout
    from model_service.model.stacking import stack_params
    from model_service.model.weights import GroupedWeight
    from model_service.sharding import make_mesh
    from tests.model.test_grouped_model import TINY

    mesh = make_mesh(MeshConfig())
    write_checkpoint(tmp_path, TINY, random_leaves(TINY, 5))
    kw = {"stacked": True, "stack_layers": scan}
    padded = load_params(str(tmp_path), TINY, mesh, jnp.float32, moe="pallas_interpret", **kw)
    drawn = random_params(TINY, mesh, jnp.float32, 5, moe="pallas_interpret", **kw)
    plain = load_params(str(tmp_path), TINY, mesh, jnp.float32, stacked=True)
    want = {m: {n: kernel_layout(jax.tree.map(np.asarray, leaf), "pallas_interpret")
                if isinstance(leaf, GroupedWeight) else leaf for n, leaf in leaves.items()}
            for m, leaves in plain.items()}
    if scan:
        want = stack_params(want, TINY.model.num_layers, mesh)
    grouped = [leaf for leaves in padded.values() for leaf in leaves.values() if isinstance(leaf, GroupedWeight)]
    assert grouped and all(g.rows or g.cols for g in grouped)  # TINY's widths do pad
    assert jax.tree.structure(padded) == jax.tree.structure(want) == jax.tree.structure(drawn)
    for a, b, c in zip(jax.tree.leaves(padded), jax.tree.leaves(want), jax.tree.leaves(drawn)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        np.testing.assert_array_equal(np.asarray(a), np.asarray(c))
    backend = dataclasses.replace(choose_backend("generic", mesh, jnp.float32, layers="scan" if scan else "unroll"),
                                  moe="pallas_interpret")
    model = GrokModel(TINY, mesh, jnp.float32, Products.DOT, block_size=8, key_chunk=16, backend=backend)
    kept = model.pack_params(padded)
    assert all(a is b for a, b in zip(jax.tree.leaves(kept), jax.tree.leaves(padded)))
