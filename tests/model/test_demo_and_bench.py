"""The random-checkpoint command (demo_build.random_checkpoint), run as a real process (the step benchmark is
tested in tests/benchmarks)."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np

from model_service.checkpoint import load_params
from model_service.config import MeshConfig, load_model_config
from model_service.model import GrokModel
from model_service.sharding import make_mesh
from tests.procs import ROOT


def test_random_checkpoint_command_writes_random_weights_whose_outputs_vary(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "ckpt"
    run = subprocess.run([sys.executable, "-m", "demo_build.random_checkpoint", "--config", "configs/demo.json",
                          "--out", str(out), "--seed", "1"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "RANDOM" in (out / "RANDOM_WEIGHTS.txt").read_text()
    cfg = load_model_config(str(ROOT / "configs" / "demo.json"))
    mesh = make_mesh(MeshConfig())
    params = load_params(str(out), cfg, mesh, jnp.float32)
    tokens = np.random.default_rng(0).integers(3, cfg.vocab_size, (1, 32)).astype(np.int32)
    logits = np.asarray(jax.jit(GrokModel(cfg, mesh, jnp.float32).forward)(params, jnp.asarray(tokens)))[0]
    # Random, not degenerate: finite logits that differ within every row, and greedy choices that differ from
    # position to position (no bound on their spread: that depends on the init scale, not on randomness).
    assert np.isfinite(logits).all() and (logits.std(-1) > 0).all()
    assert len(set(logits.argmax(-1).tolist())) > 16


def test_random_checkpoint_command_rejects_a_bad_config(tmp_path: pathlib.Path) -> None:
    run = subprocess.run([sys.executable, "-m", "demo_build.random_checkpoint", "--config", "nope",
                          "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "neither a preset" in run.stderr
