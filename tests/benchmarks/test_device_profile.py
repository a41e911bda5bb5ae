"""benchmarks.device_profile on CPU (what CI can run): a decode point's step, its back-to-back figure and its
device ops, attributed to the source lines of the compiled step program."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

from benchmarks.device_profile import _op_name, op_sources
from tests.benchmarks.recorded import recorded
from tests.procs import GOLDEN

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_op_names_and_sources_come_from_the_hlo_text():
    assert _op_name("%fusion.287 = f32[64,131072]{1,0} fusion(x)") == "fusion.287"
    text = "\n".join([
        "HloModule m", "FileNames", '1 "/x/model_service/model/layers.py"', "FunctionNames", '1 "paged_attention"',
        "FileLocations", "1 {file_name_id=1 function_name_id=1 line=289 end_line=289 column=1 end_column=2}",
        "StackFrames", "1 {file_location_id=1 parent_frame_id=1}", "",
        '  %dot.3 = f32[2,2]{1,0} dot(%a, %b), metadata={op_name="jit(f)/dot_general" stack_frame_id=1}',
        '  %add.1 = f32[2]{0} add(%c, %d), metadata={op_name="jit(f)/outer/add"}'])
    assert op_sources([text]) == {"dot.3": "layers.py:289 paged_attention", "add.1": "outer/add"}


def test_a_decode_and_a_mixed_point_are_timed_and_their_ops_attributed(tmp_path):
    out = tmp_path / "p.json"
    run = subprocess.run([sys.executable, "-m", "benchmarks.device_profile", "--config", str(GOLDEN / "config.json"),
                          "--dtype", "float32", "--streams", "2", "--mixed", "2+1x4", "--backend", "generic",
                          "--moe", "cond", "--runs", "2", "--steps", "1", "--top", "5", "--out", str(out)],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    point, mixed = json.loads(out.read_text())["points"]
    assert mixed["name"] == "mixed-2+1x4" and recorded(mixed["step_ms"], mixed["pipelined_ms"], mixed["busy_ms"])
    assert point["name"] == "decode-2" and recorded(point["step_ms"], point["pipelined_ms"], point["busy_ms"])
    assert point["ops_per_step"] > 0 and len(point["top_ops"]) == 5
    assert set(point["host_phases_ms"]) == {"batch", "dispatch", "device", "fetch"}
    assert recorded(*point["host_phases_ms"].values())
    assert any(name.endswith(".py") for name in point["by_file"])  # ops traced back to the model's source files
