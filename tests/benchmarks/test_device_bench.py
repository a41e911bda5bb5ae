"""benchmarks.device on CPU (CI has no accelerator): the golden config at tiny shapes, each point's bound from the
config (one checked by hand), the JSON's keys, and a parity failure that fails the run."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys
from typing import Any

import numpy as np
import pytest

from benchmarks import device, device_bounds, device_report
from model_service.config import load_model_config
from tests.procs import GOLDEN, ROOT, SHARED
from tests.benchmarks.recorded import recorded

TINY = ["--config", f"golden={GOLDEN / 'config.json'}", "--dtype", "float32", "--streams", "1,2",
        "--prompt-rows", "2x4", "--long-prompt", "200", "--runs", "2", "--prompt-runs", "2", "--long-runs", "1",
        "--sets", "golden", "--parity-dtypes", "float32"]


def run_device(args: list[str], out: pathlib.Path) -> tuple[int, dict[str, Any], str]:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "-m", "benchmarks.device", *args, "--out", str(out)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=900)
    printed = json.loads(run.stdout[run.stdout.index("{"):]) if "{" in run.stdout else {}
    assert printed == json.loads(out.read_text()), run.stderr[-3000:]
    return run.returncode, printed, run.stderr


@pytest.fixture(scope="module")
def passing(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, dict[str, Any], str]:
    return run_device(["--points", "parity,golden", *TINY], tmp_path_factory.mktemp("device") / "device.json")


def test_a_device_run_reports_parity_points_bounds_and_provenance(passing: tuple[int, dict[str, Any], str]) -> None:
    rc, report, stderr = passing
    assert rc == 0, stderr[-3000:]
    assert report["failures"] == []
    for key in ("date", "git", "versions", "device", "arms", "settings", "configs", "parity", "groups", "points",
                "programs"):
        assert key in report, key
    assert report["versions"]["jax"] and "libtpu" in report["versions"] and len(report["git"]["commit"]) == 40
    assert report["device"]["platform"] == "cpu"
    [case] = report["parity"]
    assert (case["set"], case["dtype"], case["pass"]) == ("golden", "float32", True)
    assert all(p["greedy_ids_equal"] and p["steps_max_error"] <= 1e-4 for p in case["prompts"])
    [group] = report["groups"]
    assert recorded(group["compile_total_s"], group["compile_s"]["step"])
    assert [p["name"] for p in report["points"]] == ["prompts-2x4", "decode-1", "decode-2", "long-200"]
    # golden's context (128) raised to hold the long prompt and its draw, in a file that lived for the run
    assert report["configs"]["golden"]["sequence_len"] == 256 == group["engine"]["sequence_len"]
    long = next(p for p in report["points"] if p["name"] == "long-200")
    assert long["steps"] == -(-200 // group["engine"]["max_rows"])
    for p in report["points"]:
        assert recorded(p["ms"], p["first_s"]) and p["arm"] == "now"


def test_each_point_is_judged_against_the_bound_its_config_gives(passing: tuple[int, dict[str, Any], str]) -> None:
    _, report, _ = passing
    cfg = load_model_config(str(GOLDEN / "config.json"))  # the bounds do not depend on the context
    for p in report["points"]:
        work = device_bounds.Work(p["rows"], p["draws"], p["kv_tokens"], p["keys_seen"])
        expected = device_bounds.bound(cfg, work, 4)
        assert p["bound"].keys() == expected.keys()
        for key, value in expected.items():
            assert p["bound"][key] == (pytest.approx(value) if not isinstance(value, str) else value), key
        assert p["over_bound"] == pytest.approx(p["ms"] / p["bound"]["bound_ms"])
    decode = next(p for p in report["points"] if p["name"] == "decode-1")
    # By hand (golden: 2 layers, d 128, ffn 688, 8 experts top-2, 16 q / 8 kv heads of 8, vocab 512, float32):
    # one row selects 2 experts a layer; the table is read whole; each held token keeps 2 x 2 x 8 x 8 floats.
    assert decode["bound"]["bytes"]["experts_int8"] == 2 * 2 * 3 * 128 * 688
    assert decode["bound"]["bytes"]["attention_int8"] == 2 * (2 * 128 * 128 + 2 * 128 * 64)
    assert decode["bound"]["bytes"]["table"] == 512 * 128 * 4
    assert decode["bound"]["bytes"]["kv"] == decode["kv_tokens"] * 2 * 2 * 8 * 8 * 4
    assert decode["bound"]["read_ms"] == pytest.approx(decode["bound"]["total_bytes"] / 819e9 * 1e3)
    prompts = next(p for p in report["points"] if p["name"] == "prompts-2x4")
    assert (prompts["rows"], prompts["draws"], prompts["keys_seen"]) == (8, 2, 2 * (4 * 5 / 2))


def test_the_table_keys_each_point_and_merging_runs_keeps_every_one(passing: tuple[int, dict[str, Any], str],
                                                                     tmp_path: pathlib.Path) -> None:
    _, report, _ = passing
    decode = next(p for p in report["points"] if p["name"] == "decode-1")
    row = report["table"]["golden_float32_decode_1"]
    assert (row["ms"], row["bound_ms"], row["over_bound"]) == (decode["ms"], decode["bound"]["bound_ms"],
                                                               decode["over_bound"])
    assert row["pipelined_ms"] == decode["pipelined_ms"] and "golden_float32_compile" in report["table"]
    other = json.loads(json.dumps(report))  # a second call's run: another config, a parity failure
    for p in other["points"] + other["groups"]:
        p["config"] = "wide"
    other["failures"] = ["parity/golden_wide (now): failed"]
    (tmp_path / "a.json").write_text(json.dumps(report))
    (tmp_path / "b.json").write_text(json.dumps(other))
    assert device.main(["--merge", str(tmp_path / "a.json"), str(tmp_path / "b.json"),
                        "--out", str(tmp_path / "m.json")]) == 1  # a failure in any run fails the merge
    merged = json.loads((tmp_path / "m.json").read_text())
    assert len(merged["points"]) == 2 * len(report["points"]) and len(merged["parity"]) == 2
    assert merged["table"]["wide_float32_decode_1"] == row and merged["failures"] == other["failures"]
    assert merged["settings"] == [report["settings"]] * 2
    # merged again with a third call's run: every run's settings and provenance are kept, none nested
    (tmp_path / "c.json").write_text(json.dumps(report | {"date": "third", "failures": []}))
    device.main(["--merge", str(tmp_path / "m.json"), str(tmp_path / "c.json"), "--out", str(tmp_path / "m2.json")])
    again = json.loads((tmp_path / "m2.json").read_text())
    assert again["settings"] == [report["settings"]] * 3
    assert [m["date"] for m in again["merged_from"]] == [report["date"]] * 2 + ["third"]


def test_a_parity_failure_fails_the_run_and_is_reported(tmp_path: pathlib.Path) -> None:
    shared = tmp_path / "shared"
    shutil.copytree(GOLDEN, shared / "golden")
    recorded = dict(np.load(GOLDEN / "model_fp32.npz"))
    recorded["p1_greedy_tokens"][5] = (recorded["p1_greedy_tokens"][5] + 1) % 512  # a reference the model misses
    np.savez(shared / "golden" / "model_fp32.npz", **recorded)
    rc, report, stderr = run_device(["--points", "parity", *TINY, "--shared", str(shared)], tmp_path / "d.json")
    assert rc == 1, stderr[-3000:]
    [case] = report["parity"]
    assert case["pass"] is False
    assert [p["first_wrong_step"] for p in case["prompts"]] == [None, 5, None, None]
    assert len(report["failures"]) == 1 and "parity golden float32 failed" in report["failures"][0]
    assert "FAILED: parity/golden" in stderr


def test_bounds_at_grok1_width_match_the_figures_the_issue_reads_from_the_config() -> None:
    cfg = load_model_config(str(SHARED / "bench" / "grok1-width-1layer.json"))
    one = device_bounds.bound(cfg, device_bounds.Work(1, 1, 33, 33), 2)
    assert one["bytes"]["experts_int8"] == pytest.approx(1.21e9, rel=0.01)  # 2 experts of 3 x 6144 x 32768 int8
    assert one["bytes"]["table"] == 131072 * 6144 * 2
    assert one["bound_by"] == "memory" and one["read_ms"] == pytest.approx(3.56, rel=0.02)
    eight = device_bounds.bound(cfg, device_bounds.Work(8, 8, 8 * 33, 8 * 33), 2)
    assert eight["experts_per_layer"] == pytest.approx(8 * (1 - 0.75**8))
    prompts = device_bounds.bound(cfg, device_bounds.Work(256, 8, 256, 8 * 32 * 33 / 2), 2)
    assert prompts["experts_per_layer"] == pytest.approx(8.0)
    assert prompts["total_flops"] == pytest.approx(0.67e12, rel=0.02)
    assert prompts["flop_ms"] == pytest.approx(prompts["total_flops"] / 197e12 * 1e3)


def test_derived_configs_take_their_layers_and_a_context_for_the_long_prompt(tmp_path: pathlib.Path) -> None:
    source = SHARED / "bench" / "grok1-width-1layer.json"
    path = device.derived_config(source, {"num_layers": 2}, 2048, tmp_path, "two")
    data = json.loads(path.read_text())
    assert data["model"]["num_layers"] == 2 and data["sequence_len"] == 2176
    assert device.derived_config(source, {}, 0, tmp_path, "same") == source


def test_comparison_gives_the_last_checkout_over_the_first_per_point() -> None:
    points = [{"config": "medium", "dtype": "bfloat16", "name": "decode-1", "arm": arm, "ms": ms}
              for arm, ms in (("before", 4.0), ("after", 1.0))]
    [row] = device_report.comparison(points, ["before", "after"])
    assert row["ratio"] == 0.25 and row["ratio_is"] == "after / before"


@pytest.mark.parametrize("argv,message", [(["--points", "nope"], "unknown point"),
                                          (["--repo", "x=/nonexistent"], "no model_service/"),
                                          (["--dtype", "float16"], "float32 and/or bfloat16")])
def test_bad_flags_stop_with_a_message(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stop:
        device.parse(argv)
    assert stop.value.code == 2 and message in capsys.readouterr().err


def test_the_default_run_plans_parity_and_three_configs_and_notes_a_missing_golden_set(tmp_path: pathlib.Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "golden").symlink_to(GOLDEN)
    (shared / "bench").symlink_to(SHARED / "bench")
    args, arms = device.parse(["--shared", str(shared)])
    programs, notes, configs = device.plan(args, tmp_path)
    assert arms == {"now": ROOT}
    assert [p.name for p in programs] == ["parity/golden", "points/medium/bfloat16", "points/grok1-1layer/bfloat16",
                                          "points/grok1-2layer/bfloat16"]
    assert len(notes) == 1 and "golden_wide" in notes[0]
    two = json.loads(pathlib.Path(configs["grok1-2layer"]["ran_from"]).read_text())
    assert two["model"]["num_layers"] == 2 and two["sequence_len"] == 2176 == configs["medium"]["sequence_len"]
    points = programs[1].args
    assert points[points.index("--streams") + 1] == "1,8,64" and points[points.index("--long-prompt") + 1] == "2048"
    quick, _ = device.parse(["--quick", "--shared", str(shared)])
    assert [p.name for p in device.plan(quick, tmp_path)[0]] == ["parity/golden", "points/medium/bfloat16",
                                                                 "points/grok1-1layer/bfloat16"]
