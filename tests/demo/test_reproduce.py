"""The training script reproduces its runs: the same seed gives the same loss curve.

CI reruns the first PREFIX_STEPS steps of the small `cpu` preset on the CPU and compares them with
cpu_prefix.json beside this file (recorded by the committed run of that preset). The embedded default may be
the larger `tpu` preset, trained on an accelerator chip in bfloat16 passes: a CPU can neither afford its steps
in CI nor round like the chip, so `make demo-tpu-check` on a chip reproduces that one (docs/demo.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from demo_build.record import corpus_sha256
from demo_build.train_tokenizer import CORPUS_DIR
from tests.procs import ROOT

PREFIX_STEPS = 20
# Same program, same seed: a full rerun on the training machine was bit-identical (make demo-check); the
# tolerance leaves room for another CPU's floating-point rounding.
LOSS_TOLERANCE = 0.01


REFERENCE = json.loads((ROOT / "tests" / "demo" / "cpu_prefix.json").read_text())


def test_cpu_prefix_reference_is_the_committed_cpu_runs_when_demo_holds_one(record: dict) -> None:
    # The reference cannot drift from the record while demo/ holds the cpu preset's model; edit the small corpus
    # and both change together (make demo).
    assert REFERENCE["corpus_sha256"] == corpus_sha256(CORPUS_DIR)
    if record["corpus"]["sha256"] == REFERENCE["corpus_sha256"]:
        assert [e for e in record["log"] if e["step"] <= PREFIX_STEPS] == REFERENCE["log"]


def test_training_script_reproduces_the_cpu_presets_recorded_loss_curve_from_its_seed() -> None:
    env = {**os.environ, "XLA_FLAGS": "", "JAX_PLATFORMS": "cpu"}  # as `make demo` runs: one default device
    run = subprocess.run([sys.executable, "-m", "demo_build", "--preset", "cpu", "--stop-after", str(PREFIX_STEPS)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    log = json.loads(run.stdout.strip().splitlines()[-1])["log"]
    recorded = REFERENCE["log"]
    assert [e["step"] for e in log] == [e["step"] for e in recorded] and recorded
    for got, want in zip(log, recorded):
        assert got["loss"] == pytest.approx(want["loss"], abs=LOSS_TOLERANCE), got["step"]
    assert recorded[-1]["loss"] < recorded[0]["loss"]  # the prefix covers real learning, not only the init


def test_training_command_refuses_to_run_without_an_output_folder() -> None:
    run = subprocess.run([sys.executable, "-m", "demo_build"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 2 and "--out is required" in run.stderr
