"""Random request ids and sampling seeds without a system call each.

`uuid.uuid4()` and `secrets.randbits()` read `os.urandom` every time; on this project's development VMs one such
read cost ~0.2 ms (a cProfile of benchmarks.loop_cost: 388 calls, 77 ms), paid per request on a service's event
loop (its id) and on the model's decode thread (its seed). Neither needs a cryptographic generator: an id names a request in logs and traces, a
seed makes a request's draws repeatable. So one generator per process, seeded from the system's entropy at import
and again in a forked child (whose draws must differ from its parent's), serves both. Thread-safe: a draw is one
call into C under the GIL."""

from __future__ import annotations

import os
import random

_generator = random.Random(os.urandom(32))
os.register_at_fork(after_in_child=lambda: _generator.seed(os.urandom(32)))


def random_bits(bits: int) -> int:
    """A random integer of `bits` bits."""
    return _generator.getrandbits(bits)


def random_hex(digits: int) -> str:
    """`digits` random lowercase hex digits."""
    return f"{_generator.getrandbits(4 * digits):0{digits}x}"
