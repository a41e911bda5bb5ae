"""Run a command as on a host that allows no TCP or UDP socket (the TPU host used for development).

    python scripts/no_tcp.py -- python -m benchmarks.layers --stack demo --uds --in-process-apart

There, socket(AF_INET or AF_INET6) fails with EAFNOSUPPORT and only unix sockets work. This reproduces it
with a small LD_PRELOAD library (built here with the system C compiler into a cache folder) whose socket()
refuses those two families and passes every other call on; the command and every process it starts
inherit it. Exits with the command's status; 3 when no C compiler or dynamic loader allows the shim
(the tests then skip, saying so).
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence

SOURCE = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <sys/socket.h>

/* The host has no TCP/IP: every IPv4 or IPv6 socket is refused, as the kernel refuses an unknown family. */
int socket(int domain, int type, int protocol) {
    static int (*real)(int, int, int);
    if (domain == AF_INET || domain == AF_INET6) {
        errno = EAFNOSUPPORT;
        return -1;
    }
    if (!real) real = (int (*)(int, int, int))dlsym(RTLD_NEXT, "socket");
    return real(domain, type, protocol);
}
"""


class ShimUnavailable(RuntimeError):
    """The shim cannot be built or loaded here (no C compiler, not a glibc system)."""


def shim(cache: pathlib.Path | None = None) -> pathlib.Path:
    """The shared library's path, built once per source version into `cache` (default: the temp folder)."""
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        raise ShimUnavailable("no C compiler (cc or gcc) to build the no-TCP shim")
    folder = cache or pathlib.Path(tempfile.gettempdir()) / f"grok-no-tcp-{os.getuid()}"
    folder.mkdir(parents=True, exist_ok=True)
    library = folder / f"no_tcp_{hashlib.sha256(SOURCE.encode()).hexdigest()[:12]}.so"
    if library.exists():
        return library
    source = folder / "no_tcp.c"
    source.write_text(SOURCE)
    partial = folder / f"{library.name}.{os.getpid()}"
    built = subprocess.run([compiler, "-shared", "-fPIC", "-O2", "-o", str(partial), str(source), "-ldl"],
                           capture_output=True, text=True)
    if built.returncode != 0:
        raise ShimUnavailable(f"{compiler} could not build the no-TCP shim: {built.stderr.strip()[-500:]}")
    partial.replace(library)  # atomic: two builders at once both end with a whole file
    return library


def environment(library: pathlib.Path, base: Mapping[str, str] = os.environ) -> dict[str, str]:
    """`base` with the shim preloaded (after anything already preloaded)."""
    preload = " ".join(p for p in (base.get("LD_PRELOAD", ""), str(library)) if p)
    return {**base, "LD_PRELOAD": preload}


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["--"]:
        args = args[1:]
    if not args:
        print("usage: python scripts/no_tcp.py -- COMMAND [ARGS...]", file=sys.stderr)
        return 2
    try:
        library = shim()
    except ShimUnavailable as error:
        print(f"no_tcp: {error}", file=sys.stderr)
        return 3
    return subprocess.run(args, env=environment(library)).returncode


if __name__ == "__main__":
    sys.exit(main())
