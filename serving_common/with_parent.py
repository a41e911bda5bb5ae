"""`python -m serving_common.with_parent PID COMMAND...`: become COMMAND, to be SIGTERMed when PID dies.

A launcher (scripts/run_stack.py) starts each service through this, so the services stop (draining
as on any SIGTERM) when the launcher dies however it dies, SIGKILL included, instead of holding their
ports forever. Linux keeps the parent-death signal across exec; elsewhere COMMAND runs without it.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Sequence

PR_SET_PDEATHSIG = 1


def set_parent_death_signal(sig: int) -> bool:
    """Ask the kernel to send `sig` when the parent exits; False where that is not supported."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) < 2 or not args[0].isdigit():
        print("usage: python -m serving_common.with_parent PARENT_PID COMMAND [ARGS...]", file=sys.stderr)
        return 2
    set_parent_death_signal(signal.SIGTERM)
    if os.getppid() != int(args[0]):  # the parent died before the signal was armed
        return 1
    os.execvp(args[1], args[1:])
    return 127  # pragma: no cover - execvp does not return


if __name__ == "__main__":
    sys.exit(main())
