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
import platform
import re
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


# ---- huge pages for the weights and the heap ------------------------------------------------------------------

HUGE = 2 << 20


def _collapses() -> bool:
    """The kernel has transparent huge pages and collapses memory on request (MADV_COLLAPSE: Linux 6.1+)."""
    release = tuple(int(x) for x in re.findall(r"\d+", platform.release())[:2])
    return pathlib.Path("/sys/kernel/mm/transparent_hugepage/enabled").exists() and release >= (6, 1)


def _huge_bytes_in(lo: int, hi: int) -> int:
    """AnonHugePages of this process's mappings that overlap [lo, hi) (whole mappings: an upper bound)."""
    total, inside = 0, False
    for line in pathlib.Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start < hi and end > lo
        elif inside and line.startswith("AnonHugePages:"):
            total += int(line.split()[1]) * 1024
    return total


def test_buffer_ranges_are_the_whole_huge_pages_inside_each_buffer() -> None:
    import jax.numpy as jnp
    import numpy as np

    from model_service.host_memory import buffer_ranges

    arrays = [jnp.asarray(np.arange(n, dtype=np.float32)) for n in (3 << 20, 1000)]  # 12 MiB, 4 KB
    spans = buffer_ranges({"a": arrays[0], "b": arrays[1], "not an array": 7})
    start = arrays[0].unsafe_buffer_pointer()
    assert len(spans) == 1  # the 4 KB buffer holds no whole huge page
    lo, hi = spans[0]
    assert lo % HUGE == 0 and hi % HUGE == 0
    assert start <= lo < hi <= start + arrays[0].nbytes
    assert lo - start < HUGE and start + arrays[0].nbytes - hi < HUGE  # nothing whole left out


def test_heap_ranges_and_merging(tmp_path: pathlib.Path) -> None:
    from model_service.host_memory import heap_ranges, merged

    maps = tmp_path / "maps"
    maps.write_text(
        "55e1c0a01000-55e1c1000000 rw-p 00000000 00:00 0                          [heap]\n"
        "55e1c1000000-55e1c1200000 rw-p 00000000 00:00 0                          [heap]\n"
        "7f0000000000-7f0000400000 rw-p 00000000 00:00 0 \n"
        "7f1000000000-7f1000400000 r--p 00000000 fe:00 5341526                    /usr/lib/libc.so.6\n")
    start = 0x55e1c0a01000
    first = (-(-start // HUGE) * HUGE, 0x55e1c1000000)
    assert heap_ranges(str(maps)) == [first, (0x55e1c1000000, 0x55e1c1200000)]  # anonymous and file maps: no
    assert merged(heap_ranges(str(maps))) == [(first[0], 0x55e1c1200000)]
    assert merged([(0, 4), (10, 12), (2, 6), (6, 8)]) == [(0, 8), (10, 12)]
    assert heap_ranges(str(tmp_path / "missing")) == []


def test_huge_pages_back_the_weights_and_keep_their_values() -> None:
    import jax.numpy as jnp
    import numpy as np

    from model_service.host_memory import buffer_ranges, huge_pages

    values = np.random.default_rng(0).standard_normal(6 << 20).astype(np.float32)  # 24 MiB
    weights = {"w": jnp.asarray(values)}
    done = huge_pages(weights)
    np.testing.assert_array_equal(np.asarray(weights["w"]), values)  # the same bits
    if not _collapses():  # a kernel before 6.1, or one without huge pages: the call says so, and goes on
        assert done["errors"], done
        return
    (lo, hi), = buffer_ranges(weights)
    assert done["marked_bytes"] >= hi - lo
    assert _huge_bytes_in(lo, hi) >= (hi - lo) // 2, done  # most of the buffer now in huge pages


def test_buffer_ranges_cover_every_shard_of_a_sharded_weight() -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec

    from model_service.host_memory import buffer_ranges

    devices = jax.devices()  # 8 host devices under tests/conftest.py; any number works
    mesh = jax.sharding.Mesh(np.array(devices), ("model",))
    w = jax.device_put(jnp.zeros((len(devices), 3 << 20), jnp.float32), NamedSharding(mesh, PartitionSpec("model")))
    spans = buffer_ranges(w)
    assert len(spans) == len(devices)  # one 12 MiB shard per device, each holding whole huge pages
    for shard in w.addressable_shards:
        start = shard.data.unsafe_buffer_pointer()
        assert any(start <= lo < hi <= start + shard.data.nbytes for lo, hi in spans)


@pytest.mark.parametrize("platforms,want", [("cpu", None), ("tpu", "tpu"), ("cuda,cpu", "cuda"), ("CPU", None)])
def test_the_accelerator_is_told_from_jax_platforms_without_starting_jax(monkeypatch, platforms, want):
    from model_service.host_memory import accelerator_expected

    monkeypatch.setenv("JAX_PLATFORMS", platforms)
    assert accelerator_expected() == want


@pytest.mark.parametrize("platforms,kept", [("cpu", True), ("tpu", False)])
def test_the_allocator_is_set_for_cpu_work_only(monkeypatch, platforms, kept):
    """One malloc arena keeps XLA:CPU's step buffers; on a TPU host it would serialise the accelerator compiler's
    threads' allocations (suspected: the chip compiled medium's programs in 114 s in a process without these
    settings, and had not finished after 228 s in one with them)."""
    from model_service import host_memory
    from model_service.__main__ import prepare_process

    calls = []
    monkeypatch.setattr(host_memory, "keep_freed_memory", lambda: calls.append(1) or True)
    monkeypatch.setenv("JAX_PLATFORMS", platforms)
    monkeypatch.setenv("NPROC", "2")
    prepare_process()
    assert bool(calls) is kept
