"""Keep the C allocator from handing XLA:CPU's per-step buffers back to the kernel after every step.

XLA:CPU allocates each program's temporaries with the C library's malloc. glibc serves blocks above its
mmap threshold (128 KiB at start) with a fresh mmap and unmaps them when freed; it raises that threshold
only after such a block has been freed. Until then every decode step maps, faults in page by page (the
kernel zeroes each page) and unmaps its temporaries. Measured on the golden config: 4,000-13,000 minor page
faults per decode step and twice the step time. Whether a process ran in that mode depended on accidents
of its start: a prefill bucket as long as the context freed a block big enough to raise the threshold, so
a model service started with `--buckets 32,64` served at half the speed of one with the default buckets.

`keep_freed_memory()` fixes both thresholds at start (glibc's `mallopt`), so freed blocks stay in the
process for the next step whatever ran before. The cost is resident memory: up to `trim_threshold` bytes
of freed heap are kept instead of returned. A user who tuned the allocator (MALLOC_* variables) or
replaced it (LD_PRELOAD, e.g. jemalloc or tcmalloc) is left alone.
"""

from __future__ import annotations

import ctypes
import logging
import os

log = logging.getLogger(__name__)

# glibc's mallopt parameters (malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3

# The largest mmap threshold glibc accepts on 64-bit (HEAP_MAX_SIZE / 2): blocks up to this size come from
# the heap and are reused; larger ones (KV memory, weights) are long-lived anyway.
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 512 << 20

_USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "GLIBC_TUNABLES")


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
    ok = bool(libc.mallopt(M_MMAP_THRESHOLD, ctypes.c_int(mmap_threshold))) and bool(
        libc.mallopt(M_TRIM_THRESHOLD, ctypes.c_int(trim_threshold)))
    if not ok:
        log.warning("could not set the host allocator's thresholds (mallopt refused them)")
    return ok
