"""One process at a time compiles a given set of programs into a shared compilation cache.

Replicas that share a cache (compose's named volume under `--scale model=2`, a ReadWriteMany volume in
Kubernetes, the test suite's processes) and start together would each compile the same programs, and on a
small CPU slow each other down while they do. Before it compiles, a process takes an exclusive lock named by
what its programs depend on; another process with the same programs waits for it, then reads them from the
cache in a second. Processes with other programs never wait for each other. The wait is bounded: after
`wait_seconds`, or where the file system offers no locks, a process compiles on its own as it would without
the lock. The lock is the kernel's (flock), so a holder that dies releases it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import logging
import os
import time
from collections.abc import Iterator

log = logging.getLogger(__name__)

LOCK_FOLDER = "grok-compile-locks"  # inside the cache directory; JAX's entries are files beside it
WAIT_SECONDS = 900.0  # a whole Grok-1 compile on a slow host; past this the waiter compiles anyway
POLL_SECONDS = 0.2


def lock_path(cache_dir: str, key: str) -> str:
    return os.path.join(cache_dir, LOCK_FOLDER, hashlib.sha256(key.encode()).hexdigest()[:32] + ".lock")


@contextlib.contextmanager
def compiling_alone(cache_dir: str | None, key: str, wait_seconds: float = WAIT_SECONDS,
                    poll_seconds: float = POLL_SECONDS) -> Iterator[None]:
    """Hold the lock of `key` in `cache_dir` (no cache: nothing to share, no lock) while the body compiles."""
    if not cache_dir:
        yield
        return
    path = lock_path(cache_dir, key)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    except OSError as e:
        log.warning("compiling without the cache's compile lock", extra={"path": path, "error": str(e)})
        yield
        return
    try:
        _acquire(fd, path, wait_seconds, poll_seconds)
        yield
    finally:
        os.close(fd)  # releases the lock


def _acquire(fd: int, path: str, wait_seconds: float, poll_seconds: float) -> bool:
    """Take the lock, waiting up to `wait_seconds` for a holder; False when compiling without it."""
    started = time.monotonic()
    waiting = False
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EAGAIN, errno.EACCES):  # no locks on this file system (ENOLCK, ENOTSUP)
                log.warning("compiling without the cache's compile lock", extra={"path": path, "error": str(e)})
                return False
        else:
            if waiting:
                log.info("the other process finished compiling; reading its programs from the cache",
                         extra={"waited_seconds": round(time.monotonic() - started, 2)})
            return True
        if not waiting:
            log.info("another process is compiling the same programs into the cache; waiting for it",
                     extra={"path": path})
            waiting = True
        if time.monotonic() - started >= wait_seconds:
            log.warning("the other process is still compiling; compiling here too",
                        extra={"waited_seconds": round(time.monotonic() - started, 2)})
            return False
        time.sleep(poll_seconds)
