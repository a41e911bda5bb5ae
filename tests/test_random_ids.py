"""Request ids and sampling seeds come from a generator seeded once from the system's entropy, not a system call
each: on the development VMs one `os.urandom` cost ~0.2 ms, paid per request on the
event loop (the id) and on the decode thread (the seed)."""

from __future__ import annotations

import os
import random
import re
import subprocess
import sys

import pytest

from model_service.requests import GenerationRequest, RequestHandle
from serving_common import logs, randomness


@pytest.fixture
def urandom_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    real = os.urandom

    def counted(n: int) -> bytes:
        calls.append(n)
        return real(n)

    monkeypatch.setattr(os, "urandom", counted)
    monkeypatch.setattr(random, "_urandom", counted)  # SystemRandom's (secrets') own reference
    return calls


def test_request_ids_make_no_system_call_each_and_differ(urandom_calls: list[int]) -> None:
    ids = [logs.new_request_id() for _ in range(1000)] + [logs.new_request_id(given="\x00bad")]
    ids += [logs.new_request_id((("x-request-id", "caf\u00e9"),))]
    assert urandom_calls == []
    assert len(set(ids)) == len(ids) and all(re.fullmatch("[0-9a-f]{16}", i) for i in ids)


def test_seeds_make_no_system_call_each_and_are_kept(urandom_calls: list[int]) -> None:
    requests = [RequestHandle(GenerationRequest(f"r{i}", (1, 2)), lambda *_: None, lambda _: None, lambda: 0)
                for i in range(200)]
    seeds = [r.draw_seed() for r in requests]
    assert urandom_calls == []
    assert [r.draw_seed() for r in requests] == seeds  # a preempted request draws with the same seed again
    assert len(set(seeds)) > 190 and all(0 <= s < 2**32 for s in seeds)


def test_a_forked_child_draws_other_values_than_its_parent() -> None:
    code = ("import os, sys\nfrom serving_common import randomness\nr, w = os.pipe()\npid = os.fork()\n"
            "if pid == 0:\n    os.write(w, str(randomness.random_bits(64)).encode()); os._exit(0)\n"
            "os.waitpid(pid, 0)\nprint(os.read(r, 64).decode(), randomness.random_bits(64))\n")
    child, parent = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                                   cwd=os.path.dirname(os.path.dirname(__file__))).stdout.split()
    assert child != parent


def test_hex_ids_have_the_length_asked() -> None:
    assert [len(randomness.random_hex(n)) for n in (1, 16, 31)] == [1, 16, 31]
