"""Keep the C allocator from handing XLA:CPU's per-step buffers back to the kernel after every step.

XLA:CPU allocates each program's temporaries with the C library's malloc, from the calling thread's arena.
glibc serves blocks above its mmap threshold (128 KiB at start, 32 MiB at most) with a fresh mmap and unmaps
them when freed, and a thread's arena (a heap of at most 64 MiB) maps anything larger on its own whatever the
threshold. So every decode step whose temporaries exceed those sizes maps, faults in page by page (the kernel
zeroes each page) and unmaps them again. Measured: on the golden config 4,000-13,000 minor page faults per
decode step and twice the step time; on the medium config with 16 slots one 64 MiB arena mapped and unmapped
per step (~2,900 faults, 5 ms of a 20 ms step, and the cost grew with the slots, idle or not).

`keep_freed_memory()` fixes glibc's settings at start (`mallopt`), before JAX starts its threads: one arena
(every thread allocates from the main heap, which grows to any size), no mmap (blocks of any size come from
that heap and go back to it), and a high trim threshold, so freed blocks stay in the process for the next
step whatever ran before. The cost is resident memory: up to `trim_threshold` bytes of freed heap are kept
instead of returned. A user who tuned the allocator (MALLOC_* variables) or replaced it (LD_PRELOAD, e.g.
jemalloc or tcmalloc) is left alone.
"""

from __future__ import annotations

import ctypes
import logging
import os
import time
from typing import Any

log = logging.getLogger(__name__)


def accelerator_expected() -> str | None:
    """The accelerator JAX will compute on, told without starting JAX (which must not start before
    jax.distributed does): JAX_PLATFORMS when set (its first platform, None for cpu), else "tpu" where libtpu is
    installed and a TPU device file exists, "gpu" where a CUDA plugin is installed and an NVIDIA device exists."""
    import glob
    import importlib.util

    chosen = os.environ.get("JAX_PLATFORMS", "").split(",")[0].strip().lower()
    if chosen:
        return None if chosen == "cpu" else chosen
    if importlib.util.find_spec("libtpu") and (glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*")):
        return "tpu"
    cuda = any(importlib.util.find_spec(m) for m in ("jax_cuda12_plugin", "jax_cuda13_plugin"))
    if cuda and os.path.exists("/dev/nvidiactl"):
        return "gpu"
    return None


# glibc's mallopt parameters (malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_MMAP_MAX = -4
M_ARENA_MAX = -8

# The largest mmap threshold glibc accepts on 64-bit (HEAP_MAX_SIZE / 2): blocks up to this size come from
# the heap and are reused; larger ones (KV memory, weights) are long-lived anyway.
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 512 << 20

_USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_",
                  "MALLOC_ARENA_MAX", "GLIBC_TUNABLES")


def _glibc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.gnu_get_libc_version  # glibc only: musl and others have no such symbol and other defaults
        libc.mallopt
    except (OSError, AttributeError):
        return None
    return libc


def keep_freed_memory(mmap_threshold: int = MMAP_THRESHOLD, trim_threshold: int = TRIM_THRESHOLD) -> bool:
    """Fix glibc's mmap and trim thresholds for this process; True when they were set. Call it once at the
    start of a process that runs JAX on CPU, before the first computation."""
    if any(os.environ.get(name) for name in _USER_SETTINGS) or "malloc" in os.environ.get("LD_PRELOAD", ""):
        log.info("host allocator left as configured (MALLOC_*, GLIBC_TUNABLES or LD_PRELOAD is set)")
        return False
    libc = _glibc()
    if libc is None:
        return False
    # One arena and no mmap: a block larger than a thread arena's heap would otherwise be mapped afresh at every
    # step; the threshold stays set for a libc that ignores the other two.
    settings = ((M_ARENA_MAX, 1), (M_MMAP_MAX, 0), (M_MMAP_THRESHOLD, mmap_threshold),
                (M_TRIM_THRESHOLD, trim_threshold))
    ok = all([bool(libc.mallopt(param, ctypes.c_int(value))) for param, value in settings])
    if not ok:
        log.warning("could not set the host allocator's thresholds (mallopt refused them)")
    return ok


# Transparent huge pages for the weights and the step's buffers. Every token's step reads all of a layer's used
# weights and the whole unembedding table from memory, and in 4 KiB pages those reads pay a page-table walk
# every 4 KiB: on a 2-core AMD EPYC (Zen 4) one thread read a 134 MB buffer in 8.97 ms in 4 KiB pages and in
# 5.02 ms in 2 MiB pages. The weights and the programs' buffers come from the C heap (keep_freed_memory: no
# mmap), which Linux backs with huge pages only where told to (THP "madvise", the usual setting). So once the
# programs have run, the heap and the weights' buffers are marked (MADV_HUGEPAGE) and collapsed into huge pages
# at once (MADV_COLLAPSE, Linux 6.1+; on older kernels khugepaged collapses marked memory in the background).
# Only whole 2 MiB pages inside those ranges are touched; their contents stay as they were.
MADV_HUGEPAGE = 14
MADV_COLLAPSE = 25
HUGE_PAGE = 2 << 20


def _inside(start: int, end: int) -> tuple[int, int] | None:
    """The whole huge pages inside [start, end), or None."""
    lo, hi = -(-start // HUGE_PAGE) * HUGE_PAGE, end // HUGE_PAGE * HUGE_PAGE
    return (lo, hi) if hi > lo else None


def buffer_ranges(tree: Any) -> list[tuple[int, int]]:
    """The whole huge pages inside the host buffers of `tree`'s arrays (every addressable shard of every jax
    Array leaf on a CPU device)."""
    import jax

    spans = []
    for leaf in jax.tree_util.tree_leaves(tree):
        if isinstance(leaf, jax.Array):
            for shard in leaf.addressable_shards:
                if shard.device.platform == "cpu":
                    start = shard.data.unsafe_buffer_pointer()
                    spans.append(_inside(start, start + shard.data.nbytes))
    return [s for s in spans if s is not None]


def heap_ranges(maps: str = "/proc/self/maps") -> list[tuple[int, int]]:
    """The whole huge pages inside the process's C heap (its "[heap]" mappings)."""
    spans = []
    try:
        with open(maps) as f:
            for line in f:
                fields = line.split()
                if len(fields) >= 6 and fields[5] == "[heap]" and fields[1].startswith("rw"):
                    start, end = (int(x, 16) for x in fields[0].split("-"))
                    spans.append(_inside(start, end))
    except OSError:
        return []
    return [s for s in spans if s is not None]


def merged(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted [start, end) ranges with overlapping and touching ones joined."""
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(spans):
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def huge_page_bytes(smaps: str = "/proc/self/smaps_rollup") -> int:
    """The process's anonymous memory in transparent huge pages (0 where Linux does not say)."""
    try:
        with open(smaps) as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("AnonHugePages:"))
    except (OSError, StopIteration, ValueError):
        return 0


def huge_pages(tree: Any) -> dict[str, Any]:
    """Back the C heap and the CPU buffers of `tree` (the weights) with transparent huge pages; call it once the
    programs have run (their buffers are then in the heap). Returns what was done: bytes marked, the process's
    bytes in huge pages before and after, seconds, and the errors met (none where it all worked). A 2 MiB page
    that cannot be collapsed (memory the kernel will not move) stays as it was; the others still are."""
    libc = _glibc()
    if libc is None or not os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled"):
        return {"marked_bytes": 0, "seconds": 0.0, "errors": ["no transparent huge pages"]}
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    start, before = time.monotonic(), huge_page_bytes()
    marked = 0
    errors: set[str] = set()
    for lo, hi in merged(buffer_ranges(tree) + heap_ranges()):
        if libc.madvise(lo, hi - lo, MADV_HUGEPAGE) != 0:
            errors.add(f"MADV_HUGEPAGE: {os.strerror(ctypes.get_errno())}")
            continue
        marked += hi - lo
        if libc.madvise(lo, hi - lo, MADV_COLLAPSE) != 0:
            # The kernel goes on past a page it cannot collapse (EINVAL also: a kernel before 6.1, where
            # khugepaged collapses the marked memory in the background; EAGAIN / ENOMEM: no free huge page).
            errors.add(f"MADV_COLLAPSE: {os.strerror(ctypes.get_errno())}")
    return {"marked_bytes": marked, "huge_bytes_before": before, "huge_bytes": huge_page_bytes(),
            "seconds": round(time.monotonic() - start, 3), "errors": sorted(errors)}
