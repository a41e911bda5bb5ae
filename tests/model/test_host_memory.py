"""The model service keeps its steps' freed buffers: no page faults per decode step.

Without `host_memory.keep_freed_memory`, a golden engine whose longest prompt step was shorter than its
context took 4,000-13,000 minor page faults per decode step (glibc's mmap threshold had never been raised)
and ran at half speed; this test counts faults, not time, so it does not depend on the machine's load.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
GOLDEN = ROOT.parent / "shared" / "golden"

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
config = ServerConfig(config=sys.argv[1], checkpoint=sys.argv[2], slots=4, dtype="float32", mesh=MeshConfig(1, 1))
engine = build_engine(config, resolve(config))
d = Driver(engine)
prompt = list(range(3, 36))
for slot in range(4):
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


def test_decode_steps_do_not_fault_in_fresh_pages() -> None:
    out = subprocess.run([sys.executable, "-c", PROBE, str(GOLDEN / "config.json"), str(GOLDEN / "checkpoint")],
                         cwd=ROOT, capture_output=True, text=True, timeout=600,
                         env={"PATH": "/usr/bin:/bin", "XLA_FLAGS": "", "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-3000:]
    faults = json.loads(out.stdout.strip().splitlines()[-1])["faults_per_step"]
    # Kept buffers: a handful of faults per step at most (measured 0-70); unmapped ones: thousands.
    assert faults < 500, f"{faults:.0f} minor page faults per decode step: freed buffers went back to the kernel"
