"""Unix domain sockets for the services' listeners (`--uds PATH`, the gateway's `--http-uds PATH`).

Where TCP is not allowed (the TPU host used for development) or not wanted (one host's co-located
services, a pod's sidecars), every service can listen on a socket file instead of HOST:PORT, and every
client dials it as `unix:PATH` (gRPC's target syntax; `unix:///abs/path` works too).

gRPC core unlinks whatever socket is at the path before it binds a unix port, so a second server would
silently take a running server's socket over (a taken TCP port is refused instead). `claim` therefore
checks the path first and refuses, naming it, when:
- a server is listening there (in use);
- a socket file is there that nobody listens on (stale: a server that was killed); the message says to
  remove it, as nothing here can tell whose it was;
- any other file is there (never replaced).
The file is created owner-only (0600: the services have no authentication of their own; give access
with the directory) and removed when the process exits, if it is still the one this process made.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import http.client
import os
import socket
import stat
from collections.abc import Iterator
from dataclasses import dataclass

# sun_path holds 108 bytes on Linux (104 on macOS), the terminating NUL included.
MAX_PATH_BYTES = 107
OWNER_ONLY = 0o600


def target(path: str) -> str:
    """The gRPC target of a socket file: `unix:PATH` (relative to the working directory unless absolute)."""
    return f"unix:{path}"


def path_of(address: str) -> str | None:
    """The socket file a `unix:PATH` or `unix:///PATH` address names; None for any other address."""
    if not address.startswith("unix:"):
        return None
    rest = address[len("unix:"):]
    return "/" + rest.lstrip("/") if rest.startswith("//") else rest


def tcp_refused(host: str) -> str | None:
    """Why this host cannot make a TCP socket for `host` at all (socket() itself refused: a host with no TCP/IP,
    such as the TPU host used for development), or None where it can."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        socket.socket(family, socket.SOCK_STREAM).close()
    except OSError as error:
        return error.strerror or str(error)
    return None


def no_tcp(listener: str, reason: str, instead: str) -> str:
    """The message for a TCP `listener` on a host that allows none, saying what to use `instead`."""
    return f"{listener}: this host allows no TCP sockets (socket() failed: {reason}); {instead}"


GRPC_INSTEAD = "listen on a unix socket file with --uds PATH instead (clients dial unix:PATH)"


def listening(path: str, timeout: float = 1.0) -> bool:
    """Whether a server accepts connections on the socket file `path` now."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(timeout)
        try:
            probe.connect(path)
        except OSError:
            return False
    return True


def check_free(path: str, flag: str) -> None:
    """OSError naming `flag` and `path` unless a socket can be created at `path` without replacing anything."""
    if not path:
        raise OSError(f"{flag}: the socket path is empty")
    if len(os.fsencode(path)) > MAX_PATH_BYTES:
        raise OSError(f"{flag}: {path!r} is {len(os.fsencode(path))} bytes long; a unix socket path may have at "
                      f"most {MAX_PATH_BYTES}: use a shorter one")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise OSError(f"{flag}: the directory of {path!r} does not exist (create {parent!r} first)")
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise OSError(f"{flag}: {path!r} exists and is not a socket; it is never replaced: choose another path "
                      "or remove that file")
    if listening(path):
        raise OSError(f"{flag}: {path!r} is in use: another server is listening on it")
    raise OSError(f"{flag}: {path!r} is a stale socket file (nobody is listening on it: a server that was "
                  "killed?); remove it and start again")


@contextlib.contextmanager
def owner_only() -> Iterator[None]:
    """Files created inside are owner-only (the process umask, restored after): the socket is never open to
    others, not even between its creation and a chmod."""
    previous = os.umask(0o177)
    try:
        yield
    finally:
        os.umask(previous)


@dataclass(frozen=True)
class SocketFile:
    """A socket file this process created; `remove()` deletes it only while it is still that file."""

    path: str
    device: int
    inode: int

    @classmethod
    def created(cls, path: str) -> SocketFile:
        """Record the socket just bound at `path`, make sure it is owner-only, and remove it at exit."""
        os.chmod(path, OWNER_ONLY)
        info = os.stat(path)
        made = cls(path, info.st_dev, info.st_ino)
        atexit.register(made.remove)
        return made

    def remove(self) -> None:
        try:
            info = os.lstat(self.path)
        except FileNotFoundError:
            return  # gRPC removes its own at server stop
        # A file put there since (inode numbers are reused) is left alone; another socket at the same inode is
        # as far as a check can go without holding the directory.
        if stat.S_ISSOCK(info.st_mode) and (info.st_dev, info.st_ino) == (self.device, self.inode):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)


def bind_unix(path: str, flag: str) -> tuple[socket.socket, SocketFile]:
    """A listening-ready AF_UNIX stream socket bound at `path` (checked with `check_free`, owner-only)."""
    check_free(path, flag)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        with owner_only():
            sock.bind(path)
    except OSError as error:
        sock.close()
        if error.errno == errno.EADDRINUSE:
            raise OSError(f"{flag}: {path!r} is in use") from None
        raise OSError(f"{flag}: could not bind {path!r} ({error.strerror or error})") from None
    return sock, SocketFile.created(path)


class UnixHTTPConnection(http.client.HTTPConnection):
    """HTTP over a unix socket file (the Docker API's usual transport; a /metrics served with --metrics-uds)."""

    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self.path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self.path)
