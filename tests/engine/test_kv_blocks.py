"""The paged KV memory's host side as data: block tables, sharing, the prefix cache and its LRU eviction."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest

from model_service import kv_blocks
from model_service.kv_blocks import KVBlocks, OutOfBlocks

BS = 4


def blocks(num: int = 12, slots: int = 3, caching: bool = True) -> KVBlocks:
    return KVBlocks(num, BS, slots, table_len=8, caching=caching)


def take(kv: KVBlocks, slot: int, positions: int) -> None:
    """Blocks for `positions` positions of a sequence nothing is cached for."""
    kv.assign_prompt(slot, [7] * positions, positions, reuse=False)


def test_a_slot_gets_blocks_as_it_grows_and_gives_them_back() -> None:
    kv = blocks()
    take(kv, 0, 5)  # 5 positions: 2 blocks
    assert len(kv.blocks_of(0)) == 2 and kv.available() == 10
    kv.grow(0, 8)
    assert len(kv.blocks_of(0)) == 2  # still fits
    kv.grow(0, 9)
    assert len(kv.blocks_of(0)) == 3 and kv.capacity(0) == 12
    kv.release(0)
    assert kv.available() == 12 and kv.blocks_of(0) == ()
    assert kv.usage().used == 0


def test_the_table_points_past_a_sequence_at_the_scratch_block() -> None:
    kv = blocks()
    take(kv, 1, 6)
    table = kv.table()
    assert table.shape == (3, 8) and table.dtype == np.int32
    assert list(table[1, :2]) == list(kv.blocks_of(1))
    assert (table[1, 2:] == kv.scratch).all() and (table[0] == kv.scratch).all() and kv.scratch == 12


def test_running_out_of_blocks_raises_and_changes_nothing() -> None:
    kv = blocks(num=4)
    take(kv, 0, 12)
    with pytest.raises(OutOfBlocks):
        take(kv, 1, 8)
    assert kv.blocks_of(1) == () and kv.available() == 1
    with pytest.raises(OutOfBlocks):
        kv.grow(0, 20)
    assert len(kv.blocks_of(0)) == 3


def test_samples_share_full_prompt_blocks_and_each_own_the_rest() -> None:
    kv = blocks()
    take(kv, 0, 10)  # blocks for 0..3, 4..7 full; 8..9 partial
    kv.share(1, 0, 8, 10)
    a, b = kv.blocks_of(0), kv.blocks_of(1)
    assert a[:2] == b[:2] and a[2] != b[2]
    assert kv.usage().used == 4
    kv.release(0)
    assert kv.usage().used == 3  # the shared blocks are still held by slot 1
    kv.release(1)
    assert kv.usage().used == 0 and kv.available() == 12


def test_a_prompt_reuses_its_cached_full_blocks_and_leaves_a_token_to_compute() -> None:
    kv = blocks()
    prompt = list(range(100, 121))  # 21 tokens: 5 full blocks and one
    assert kv.assign_prompt(0, prompt, 22) == 0
    kv.register(0, prompt, 21)  # blocks 0..4 full (20 tokens) are keyed; the partial one is not
    kv.release(0)
    assert kv.usage().cached == 5
    assert kv.cost(prompt, 22) == 6  # 6 blocks: 5 cached ones nobody holds (taken from the pool) and a new one
    assert kv.assign_prompt(1, prompt, 22) == 20  # any whole number of blocks: the cache is not cut to a grid
    assert kv.blocks_of(1)[:5] == tuple(kv.table()[1, :5])
    kv.release(1)
    assert kv.assign_prompt(2, prompt[:16], 17) == 12  # a fully cached prompt still computes its last block
    kv.release(2)
    assert kv.assign_prompt(0, [7] + prompt[1:], 22) == 0  # a different first token shares nothing
    assert kv.usage().queries == 21 + 21 + 16 + 21 and kv.usage().hits == 20 + 12
    kv.release(0)
    assert kv.assign_prompt(1, prompt, 22, reuse=False) == 0  # prompt logprobs: every row computed


def test_cached_blocks_are_evicted_least_recently_used_first() -> None:
    kv = blocks(num=6, slots=2)
    first, second = list(range(10, 19)), list(range(50, 59))  # 9 tokens: 2 full blocks + 1
    for prompt in (first, second):
        kv.assign_prompt(0, prompt, 9)
        kv.register(0, prompt, len(prompt))
        kv.release(0)
    assert kv.usage().cached == 4 and kv.usage().free == 2
    kv.assign_prompt(0, second, 9)  # touches `second`'s blocks: `first`'s are now the oldest
    kv.release(0)
    take(kv, 1, 12)  # 3 blocks: the free ones first, then the least recently used cached one
    assert kv.reusable(first) == 0 and kv.reusable(second) == 8  # `first` lost its first block
    kv.release(1)


def test_with_caching_off_nothing_is_kept_or_reused() -> None:
    kv = blocks(caching=False)
    prompt = list(range(30))
    kv.assign_prompt(0, prompt, 30)
    kv.register(0, prompt, 30)
    kv.release(0)
    assert kv.assign_prompt(0, prompt, 30) == 0 and kv.usage().cached == 0 and kv.usage().queries == 0


class Hashes:
    """Counts the block hashes KVBlocks computes once `start()`ed."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count, self._monkeypatch = 0, monkeypatch

    def start(self) -> None:
        chain = kv_blocks._chain

        def counted(previous: bytes, tokens: Sequence[int]) -> bytes:
            self.count += 1
            return chain(previous, tokens)

        self._monkeypatch.setattr(kv_blocks, "_chain", counted)


@pytest.fixture
def hashes(monkeypatch: pytest.MonkeyPatch) -> Hashes:
    return Hashes(monkeypatch)


def test_a_prompt_registered_chunk_by_chunk_hashes_each_block_once_and_keys_what_one_registration_would(
        hashes: Hashes) -> None:
    # A long prompt is registered after every chunk the scheduler computes: hashing it again from its first block
    # each time made a 6,000-token prompt's registrations quadratic (~0.7 ms a step at its end).
    prompt = [3 + (i * 7) % 1000 for i in range(1000)]
    once = KVBlocks(num_blocks=80, block_size=16, slots=2, table_len=64)
    once.assign_prompt(0, prompt, 1001, reuse=False)
    once.register(0, prompt, 1000, salt=b"s")
    hashes.start()
    kv = KVBlocks(num_blocks=80, block_size=16, slots=2, table_len=64)
    kv.assign_prompt(0, prompt, 1001, reuse=False)
    for computed in (*range(24, 1000, 24), 1000):
        kv.register(0, prompt, computed, salt=b"s")
    assert hashes.count == 1000 // 16
    assert kv._key_of == once._key_of and kv._block_of == once._block_of
    # A new sequence in the slot starts its chain again.
    kv.release(0)
    other = [5] * 64
    kv.assign_prompt(0, other, 65, reuse=False)
    kv.register(0, other, 64)
    assert kv.reusable(other + [1]) == 64


def test_a_queued_prompt_looked_up_every_step_hashes_each_block_once(hashes: Hashes) -> None:
    # Every step the scheduler asks how much of each queued prompt the cache serves and what admitting it costs;
    # hashing a long cached prefix again each time cost ~1.2 ms per queued 4,000-token prompt a step.
    kv = KVBlocks(num_blocks=200, block_size=16, slots=2, table_len=64)
    shared = [3 + (i * 7) % 1000 for i in range(640)]
    kv.assign_prompt(0, shared + [1], 641, reuse=False)
    kv.register(0, shared + [1], 640)
    kv.release(0)
    hashes.start()
    queued = [tuple(shared + [9, 9, n]) for n in range(3)]
    for _ in range(5):  # five steps
        for prompt in queued:
            assert kv.reusable(prompt) == 640 and kv.cost(prompt, len(prompt) + 1) == 41  # 40 evictable + 1
            assert kv.reusable(prompt, salt=b"other") == 0
    assert hashes.count == len(queued) * (640 // 16 + 1)  # each prompt's blocks under "" once, one block under "other"
    kv.assign_prompt(1, queued[0], len(queued[0]) + 1)  # admitted: it takes the cached blocks
    assert kv.blocks_of(1)[:40] == tuple(kv._block_of[k] for k in kv._chain_keys(b"", queued[0])[:40])
