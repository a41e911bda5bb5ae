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
