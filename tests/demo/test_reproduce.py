"""The training script reproduces the committed run: the same seed gives the same loss curve.

CI reruns the first PREFIX_STEPS steps of the committed schedule (the whole run takes minutes, too long for
every CI run); `make demo-check` reruns all of it and compares the final losses (docs/demo.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.procs import ROOT

PREFIX_STEPS = 20
# Same program, same seed: a full rerun on the training machine was bit-identical (make demo-check); the
# tolerance leaves room for another CPU's floating-point rounding.
LOSS_TOLERANCE = 0.01


def test_training_script_reproduces_the_committed_loss_curve_from_its_seed(record: dict) -> None:
    env = {**os.environ, "XLA_FLAGS": "", "JAX_PLATFORMS": "cpu"}  # as `make demo` runs: one default device
    run = subprocess.run([sys.executable, "-m", "demo_build", "--stop-after", str(PREFIX_STEPS)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    log = json.loads(run.stdout.strip().splitlines()[-1])["log"]
    recorded = [entry for entry in record["log"] if entry["step"] <= PREFIX_STEPS]
    assert [e["step"] for e in log] == [e["step"] for e in recorded] and recorded
    for got, want in zip(log, recorded):
        assert got["loss"] == pytest.approx(want["loss"], abs=LOSS_TOLERANCE), got["step"]
    assert recorded[-1]["loss"] < recorded[0]["loss"]  # the prefix covers real learning, not only the init


def test_training_command_refuses_to_run_without_an_output_folder() -> None:
    run = subprocess.run([sys.executable, "-m", "demo_build"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 2 and "--out is required" in run.stderr
