"""Roofline byte counts against the real parameter tree; result provenance and the --compare table."""

from __future__ import annotations

import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from benchmarks import results, roofline
from model_service.checkpoint import random_params
from model_service.config import MeshConfig, load_model_config
from model_service.sharding import make_mesh
from tests.procs import GOLDEN, ROOT


def test_weight_bytes_from_the_config_equal_the_loaded_parameter_tree() -> None:
    cfg = load_model_config(str(GOLDEN / "config.json"))
    params = random_params(cfg, make_mesh(MeshConfig()), jnp.float32, 0)
    loaded = sum(leaf.nbytes for leaf in jax.tree.leaves(params))
    assert roofline.weight_bytes(cfg) == loaded


def test_expected_experts_is_top_k_for_one_token_and_approaches_all_for_a_large_batch() -> None:
    cfg = load_model_config(str(GOLDEN / "config.json"))  # 8 experts, top-2
    assert roofline.expected_experts(cfg, 1) == pytest.approx(2.0)
    assert roofline.expected_experts(cfg, 8) == pytest.approx(8 * (1 - 0.75**8))
    assert 7.99 < roofline.expected_experts(cfg, 64) <= 8


def test_kv_and_embedding_bytes_grow_with_the_batch_and_weights_do_not() -> None:
    cfg = load_model_config(str(GOLDEN / "config.json"))
    one, eight = roofline.step_bytes(cfg, 1, 2.0), roofline.step_bytes(cfg, 8, 2.0)
    assert eight["kv_cache"] == 8 * one["kv_cache"] == 8 * (2 * 2 * 8 * 128 * 8 * 4)
    assert eight["unembedding"] == one["unembedding"] == 512 * 128 * 4
    assert eight["moe_int8"] == one["moe_int8"] == 2 * 2 * 3 * 128 * cfg.model.ffn_size


def test_roofline_divides_bytes_by_the_measured_bandwidth() -> None:
    cfg = load_model_config(str(GOLDEN / "config.json"))
    row = roofline.roofline(cfg, 1, {"f32_sum_gb_s": 10.0, "int8_convert_sum_gb_s": 5.0}, measured_ms=2.0)
    total = sum(row["bytes"].values())
    assert row["roofline_ms"] == pytest.approx(total / 10e9 * 1e3)
    int8 = row["bytes"]["attention_int8"] + row["bytes"]["moe_int8"]
    assert row["int8_aware_bound_ms"] == pytest.approx(((total - int8) / 10e9 + int8 / 5e9) * 1e3)
    assert row["measured_over_roofline"] == pytest.approx(2.0 / row["roofline_ms"])


def test_provenance_names_the_git_revision_and_the_machine() -> None:
    info = results.provenance()
    assert len(info["git"]["commit"]) == 40
    assert info["machine"]["cpus"] >= 1 and len(info["machine"]["load_avg"]) == 3


def summary(points: dict[str, dict[str, float]]) -> dict:
    return {"points": [{"key": k, "median": v} for k, v in points.items()]}


def test_compare_gives_b_over_a_for_shared_points_only() -> None:
    a = summary({"w/c1": {"output_throughput": 100.0, "median_ttft_ms": 20.0}, "w/c8": {"output_throughput": 1.0}})
    b = summary({"w/c1": {"output_throughput": 150.0, "median_ttft_ms": 10.0}, "w/c4": {"output_throughput": 9.0}})
    rows = results.compare(a, b)
    assert {(r["metric"], r["ratio"]) for r in rows} == {("output_throughput", 1.5), ("median_ttft_ms", 0.5)}
    assert all(r["point"] == "w/c1" for r in rows)


def test_compare_command_prints_the_ratio_table(tmp_path) -> None:  # type: ignore[no-untyped-def]
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(summary({"w/c1": {"request_throughput": 2.0}})))
    b.write_text(json.dumps(summary({"w/c1": {"request_throughput": 3.0}})))
    run = subprocess.run([sys.executable, "-m", "benchmarks", "--compare", str(a), str(b)], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    line = next(x for x in run.stdout.splitlines() if "request_throughput" in x)
    assert line.split()[-3:] == ["2.000", "3.000", "1.500"]


def test_step_tool_prints_timings_as_json() -> None:
    run = subprocess.run([sys.executable, "-m", "benchmarks.step", "--config", str(GOLDEN / "config.json"),
                          "--batch", "2", "--prompt-len", "8", "--runs", "2"], cwd=ROOT, capture_output=True,
                         text=True, timeout=300, env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"})
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["batch"] == 2 and result["dtype"] == "float32"
    for key in ("prefill_compile_s", "prefill_ms", "decode_compile_s", "decode_step_ms"):
        assert result[key] > 0
    # Both numbers are printed rounded (the step to 0.001 ms, the rate to 0.01): the bound is what that rounding
    # allows, which at a sub-millisecond step is several tokens per second.
    step_ms = result["decode_step_ms"]
    expected = 2 / step_ms * 1e3
    assert abs(result["decode_tokens_per_s"] - expected) <= expected * 0.0005 / step_ms + 0.01


