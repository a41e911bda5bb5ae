"""Child processes of the stack's launchers, benchmarks and tests: one way to start, wait for and stop them.

`start_module` runs `python -m MODULE` (optionally under serving_common.with_parent, so the kernel
SIGTERMs it when the launcher dies, and in its own session, so a terminal's Ctrl-C reaches only the
launcher); `wait_serving` polls its grpc.health.v1 until SERVING; `terminate` stops it the way an
orchestrator does: SIGTERM, then SIGKILL after a grace period. `free_port` picks a port for it;
`tcp_endpoint` / `unix_endpoint` give a child's listening flags and the address clients dial, on a TCP port or
on a unix socket file (`--uds`, serving_common.uds).
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
from dataclasses import dataclass
from typing import IO, Any

from serving_common.healthcheck import check
from serving_common.tls import ChannelTLS


PORT_SLICES = 16  # processes that pick ports at once each take theirs from one slice of the range below
PORT_SLICE_SIZE = 1024
_picked: dict[int, int] = {}  # slice -> how many ports this process has tried from it


def ephemeral_low() -> int:
    """The lowest port the kernel assigns by itself (to bind(0) and to every outgoing connection)."""
    try:
        return int(pathlib.Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default; macOS and Windows start higher still


def port_slice() -> int:
    """This process's slice: a pytest-xdist worker's number (gwN), else one of the upper half by process id."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if worker.startswith("gw") and worker[2:].isdigit():
        return int(worker[2:]) % (PORT_SLICES // 2)
    return PORT_SLICES // 2 + os.getpid() % (PORT_SLICES // 2)


def bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("", port))  # every address: a port another process holds on any of them is taken
        except OSError:
            return False
    return True


def free_port() -> int:
    """A TCP port on this host that is free now and that no one will be handed by the kernel before the child
    binds it.

    Choosing with bind(0) races: the port is released before the child binds it, and the kernel may give it
    meanwhile to any outgoing connection or other bind(0) on the box. So the port comes from below the
    kernel's ephemeral range, from this process's own slice of it (two test workers never pick the same one),
    in turn, skipping any port that cannot be bound now. Where the ephemeral range leaves no room below it,
    falls back to bind(0)."""
    first = ephemeral_low() - PORT_SLICES * PORT_SLICE_SIZE
    if first < 1024:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return int(s.getsockname()[1])
    index = port_slice()
    base = first + index * PORT_SLICE_SIZE
    start = _picked.setdefault(index, os.getpid() * 7919 % PORT_SLICE_SIZE)  # a restarted worker starts elsewhere
    for step in range(PORT_SLICE_SIZE):
        port = base + (start + step) % PORT_SLICE_SIZE
        if bindable(port):
            _picked[index] = start + step + 1
            return port
    raise RuntimeError(f"no free TCP port in {base}..{base + PORT_SLICE_SIZE - 1}")


@dataclass(frozen=True)
class Endpoint:
    """Where a child service listens: the flags that say so, the address clients dial, a name for its files."""

    address: str  # "127.0.0.1:PORT" or "unix:PATH"
    args: tuple[str, ...]  # ("--host", H, "--port", P) or ("--uds", PATH)
    label: str  # the port or the socket's file name (log file names)


def tcp_endpoint(port: int | None = None, host: str = "127.0.0.1") -> Endpoint:
    """HOST:PORT, a free port unless given."""
    port = port or free_port()
    return Endpoint(f"{host}:{port}", ("--host", host, "--port", str(port)), str(port))


def unix_endpoint(directory: pathlib.Path, name: str) -> Endpoint:
    """The socket file `directory/name.sock` (a short directory: a socket path has at most 107 bytes)."""
    path = str(directory / f"{name}.sock")
    return Endpoint(f"unix:{path}", ("--uds", path), f"{name}.sock")


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
