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

log = logging.getLogger(__name__)

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
        libc = ctypes.CDLL(None)
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
