"""Child processes of the stack's launchers, benchmarks and tests: one way to start, wait for and stop them.

`start_module` runs `python -m MODULE` (optionally under serving_common.with_parent, so the kernel
SIGTERMs it when the launcher dies, and in its own session, so a terminal's Ctrl-C reaches only the
launcher); `wait_serving` polls its grpc.health.v1 until SERVING; `terminate` stops it the way an
orchestrator does: SIGTERM, then SIGKILL after a grace period. `free_port` picks a port for it.
"""

from __future__ import annotations

import os
import pathlib
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import IO, Any

from serving_common.healthcheck import check
from serving_common.tls import ChannelTLS


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the child binds it; a race is possible but rare)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_module(module: str, args: Sequence[str], *, stdout: IO[Any] | int, cwd: pathlib.Path,
                 env: Mapping[str, str] | None = None, with_parent: bool = False,
                 new_session: bool = False, text: bool = False) -> subprocess.Popen[Any]:
    """`python -m module args` with unbuffered output to `stdout` (stderr joined to it).

    `with_parent`: the child is SIGTERMed (and drains) when this process dies, SIGKILL included.
    `new_session`: the child gets its own session, so a terminal's Ctrl-C reaches only this process.
    """
    guard = [sys.executable, "-m", "serving_common.with_parent", str(os.getpid())] if with_parent else []
    return subprocess.Popen([*guard, sys.executable, "-m", module, *args], cwd=cwd, stdout=stdout,
                            stderr=subprocess.STDOUT, text=text, start_new_session=new_session,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})


def wait_serving(proc: subprocess.Popen[Any], address: str, timeout: float, *, name: str, service: str = "",
                 tls: ChannelTLS | None = None, interval: float = 0.2,
                 log_tail: Callable[[], str] = lambda: "") -> float:
    """Seconds until `proc` reports SERVING on `address`; RuntimeError if it exits first, TimeoutError after
    `timeout` (both with `log_tail()` appended)."""
    began = time.monotonic()
    while time.monotonic() - began < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode}{log_tail()}")
        if check(address, service, timeout=1.0, tls=tls):
            return time.monotonic() - began
        time.sleep(interval)
    raise TimeoutError(f"{name} not SERVING after {timeout:.0f}s{log_tail()}")


def terminate(proc: subprocess.Popen[Any], timeout: float) -> int:
    """SIGTERM `proc` (it should drain), SIGKILL it if still alive after `timeout` s; its exit code."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode
