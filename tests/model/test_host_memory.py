"""The model service keeps its steps' freed buffers: no page faults per decode step.

Without `host_memory.keep_freed_memory`, a golden engine whose longest prompt step was shorter than its
context took 4,000-13,000 minor page faults per decode step (glibc's mmap threshold had never been raised)
and ran at half speed. With only the thresholds raised, an engine whose step needs more than 64 MiB of
temporaries (golden_wide's 131,072-token vocabulary over 16 slots) still mapped and unmapped them at every
step: a thread's arena maps such a block whatever the threshold. These tests count faults, not time, so they
do not depend on the machine's load.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
GOLDEN = ROOT.parent / "shared" / "golden"
GOLDEN_WIDE = ROOT.parent / "shared" / "golden_wide"

# Runs in a fresh process: the allocator's state is per process and must not have been warmed by other tests.
PROBE = """
import json, resource, sys
from model_service.__main__ import prepare_process
prepare_process()
from model_service.config import MeshConfig
from model_service.loading import ServerConfig, build_engine, resolve
from model_service.sampling_settings import SamplingSettings
from tests.engine.drive import Driver
from model_service.step_batch import SlotStart
slots = int(sys.argv[3])
config = ServerConfig(config=sys.argv[1], checkpoint=sys.argv[2], slots=slots, dtype="float32", mesh=MeshConfig(1, 1))
engine = build_engine(config, resolve(config))
d = Driver(engine)
prompt = list(range(3, 36))
for slot in range(4):  # 4 of the slots decode, the others are idle
    d.step([(slot, p, t) for p, t in enumerate(prompt)], [(len(prompt) - 1, slot)],
           [SlotStart(slot, slot, SamplingSettings(), tuple(prompt))])
def step(i):
    d.step([(slot, len(prompt) + i, None) for slot in range(4)], [(slot, slot) for slot in range(4)])
for i in range(5):
    step(i)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
steps = 40
for i in range(steps):
    step(5 + i)
print(json.dumps({"faults_per_step": (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / steps}))
"""


@pytest.mark.parametrize("golden,slots", [(GOLDEN, 4), (GOLDEN_WIDE, 16)], ids=["golden", "golden_wide-16-slots"])
def test_decode_steps_do_not_fault_in_fresh_pages(golden: pathlib.Path, slots: int) -> None:
    out = subprocess.run([sys.executable, "-c", PROBE, str(golden / "config.json"), str(golden / "checkpoint"),
                          str(slots)],
                         cwd=ROOT, capture_output=True, text=True, timeout=600,
                         env={"PATH": "/usr/bin:/bin", "XLA_FLAGS": "", "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-3000:]
    faults = json.loads(out.stdout.strip().splitlines()[-1])["faults_per_step"]
    # Kept buffers: a handful of faults per step at most (measured 0-70); unmapped ones: thousands.
    assert faults < 500, f"{faults:.0f} minor page faults per decode step: freed buffers went back to the kernel"
