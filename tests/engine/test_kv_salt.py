"""Prefix-cache isolation (docs/reliability.md, round three): a block registered under one salt (a tenant's API key digest and
its cache_salt) is found only under that salt; the unsalted cache is one more tenant."""

from __future__ import annotations

import pytest

from model_service.kv_blocks import KVBlocks
from model_service.requests import GenerationRequest
from tests.engine.conftest import Runner
from tests.engine.fake_engine import FakeEngine
from tests.engine.test_scheduler import Collector, prompt_tokens

BS = 4
PROMPT = list(range(100, 125))  # 25 tokens: 6 full blocks of reusable prefix (24 tokens, one left to compute)


def cached_under(salt: bytes) -> KVBlocks:
    """A pool whose only cached prompt is PROMPT, computed in slot 0 under `salt` and then released."""
    kv = KVBlocks(16, BS, 2, table_len=8)
    assert kv.assign_prompt(0, PROMPT, len(PROMPT), salt=salt) == 0
    kv.register(0, PROMPT, len(PROMPT), salt=salt)
    kv.release(0)
    return kv


@pytest.mark.parametrize("salt", [b"", b"tenant-a", bytes(32)])
def test_the_same_salt_shares_the_prefix(salt: bytes) -> None:
    kv = cached_under(salt)
    assert kv.reusable(PROMPT, salt=salt) == 24
    held = kv.assign_prompt(1, PROMPT, len(PROMPT), salt=salt)
    assert held == 24 and kv.usage().hits == 24


@pytest.mark.parametrize("first,second", [
    (b"tenant-a", b"tenant-b"), (b"", b"tenant-a"), (b"tenant-a", b""), (b"a", b"a\x00"), (bytes(16), bytes(17))])
def test_two_salts_never_share_a_block(first: bytes, second: bytes) -> None:
    kv = cached_under(first)
    cached = set(kv._key_of)  # the blocks the first tenant's prompt left in the cache
    assert kv.reusable(PROMPT, salt=second) == 0
    assert kv.assign_prompt(1, PROMPT, len(PROMPT), salt=second) == 0 and kv.usage().hits == 0
    assert kv.usage().cached == 6  # the first tenant's 6 full blocks stay cached, none taken
    assert not cached & set(kv.blocks_of(1))  # every block of the second tenant's prompt is a fresh one


def test_a_salted_prompt_keeps_its_own_blocks_beside_the_unsalted_copy() -> None:
    kv = cached_under(b"tenant-a")
    kv.assign_prompt(1, PROMPT, len(PROMPT))
    kv.register(1, PROMPT, len(PROMPT))  # the same tokens, unsalted: registered as blocks of their own
    kv.release(1)
    assert kv.reusable(PROMPT, salt=b"tenant-a") == 24 and kv.reusable(PROMPT) == 24
    salted = kv.assign_prompt(0, PROMPT, len(PROMPT), salt=b"tenant-a")
    plain = kv.assign_prompt(1, PROMPT, len(PROMPT))
    assert salted == plain == 24
    assert not set(kv.blocks_of(0)) & set(kv.blocks_of(1))


def test_through_the_scheduler_only_the_same_tenant_skips_the_cached_prompt(running: Runner) -> None:
    engine = FakeEngine(slots=2, block_size=4, max_rows=32)
    sched = running(engine)
    prompt = tuple(range(10, 30))  # 20 tokens: 4 full blocks reusable, the last block computed again
    computed = []
    for salt in (b"a", b"b", b"a", b""):
        before = len(engine.steps)
        done = Collector()
        sched.submit(GenerationRequest("t", prompt, max_tokens=1, cache_salt=salt), done)
        done.wait()
        computed.append(sum(len(t) for t in prompt_tokens(engine)[before:]))
    assert computed == [20, 20, 4, 20]  # tenant a's second request reused its own 16 cached positions only
