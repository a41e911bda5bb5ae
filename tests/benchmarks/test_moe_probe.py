"""benchmarks.moe_probe runs on CPU (the kernel in interpret mode) and reports each form beside cond's output."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from benchmarks.moe_probe import probe, selected_bytes
from model_service.kernels.tpu.grouped_matmul import Tiling


def test_the_probe_times_every_form_and_checks_it_against_cond() -> None:
    results = probe("tiny", 128, 344, 4, 2, [3], jnp.dtype(jnp.float32), [Tiling(16, 128, 128)], 1,
                    "pallas_interpret")
    assert [r["form"] for r in results] == ["pallas (16, 128, 128)", "ragged", "cond"]
    for r in results:
        assert "error" not in r and r["ms"] > 0 and r["max_diff_vs_cond"] < 1e-5, r


def test_selected_bytes_count_each_selected_expert_once() -> None:
    one = (128 * 344 + 344 * 4) * 2 + 344 * 128 + 8 * 128 * 4  # linear, linear_v, linear_1 and their scales
    assert selected_bytes(np.array([[1, 3], [3, 1]]), 128, 344) == 2 * one
