"""The paged KV memory's host side as data: block tables, sharing, the prefix cache and its LRU eviction."""

from __future__ import annotations

import numpy as np
import pytest

from model_service.kv_blocks import KVBlocks, OutOfBlocks

BS, CHUNK = 4, 8


def blocks(num: int = 12, slots: int = 3, caching: bool = True) -> KVBlocks:
    return KVBlocks(num, BS, slots, table_len=8, chunk=CHUNK, caching=caching)


def test_a_slot_gets_blocks_as_it_grows_and_gives_them_back() -> None:
    kv = blocks()
    kv.assign(0, 5)  # 5 positions: 2 blocks
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
    kv.assign(1, 6)
    table = kv.table()
    assert table.shape == (3, 8) and table.dtype == np.int32
    assert list(table[1, :2]) == list(kv.blocks_of(1))
    assert (table[1, 2:] == kv.scratch).all() and (table[0] == kv.scratch).all() and kv.scratch == 12


def test_running_out_of_blocks_raises_and_changes_nothing() -> None:
    kv = blocks(num=4)
    kv.assign(0, 12)
    with pytest.raises(OutOfBlocks):
        kv.assign(1, 8)
    assert kv.blocks_of(1) == () and kv.available() == 1
    with pytest.raises(OutOfBlocks):
        kv.grow(0, 20)
    assert len(kv.blocks_of(0)) == 3


def test_samples_share_full_prompt_blocks_and_each_own_the_partial_one() -> None:
    kv = blocks()
    kv.assign(0, 10)  # blocks for 0..3, 4..7 full; 8..9 partial
    kv.assign(1, 10, share_from=0, shared_tokens=10)
    a, b = kv.blocks_of(0), kv.blocks_of(1)
    assert a[:2] == b[:2] and a[2] != b[2]
    assert kv.usage().used == 4
    kv.release(0)
    assert kv.usage().used == 3  # the shared blocks are still held by slot 1
    kv.release(1)
    assert kv.usage().used == 0 and kv.available() == 12


def test_a_prompt_reuses_cached_blocks_up_to_a_chunk_boundary_and_leaves_a_token_to_compute() -> None:
    kv = blocks()
    prompt = list(range(100, 121))  # 21 tokens: chunks 0..7, 8..15, 16..20
    assert kv.assign_prompt(0, prompt) == 0
    kv.register(0, prompt, 21)  # blocks 0..4 full (20 tokens) are keyed; the partial one is not
    kv.release(0)
    assert kv.usage().cached == 5
    same = kv.assign_prompt(1, prompt)
    assert same == 16  # 20 cached tokens, cut to the chunk grid
    assert kv.blocks_of(1)[:4] == tuple(kv.table()[1, :4])
    kv.release(1)
    assert kv.assign_prompt(2, prompt[:16]) == 8  # a fully cached prompt still computes its last chunk
    kv.release(2)
    assert kv.assign_prompt(0, [7] + prompt[1:]) == 0  # a different first token shares nothing
    assert kv.usage().queries == 21 + 21 + 16 + 21 and kv.usage().hits == 16 + 8


def test_cached_blocks_are_evicted_least_recently_used_first() -> None:
    kv = blocks(num=6, slots=2)
    first, second = list(range(10, 19)), list(range(50, 59))  # 9 tokens: 2 full blocks + 1
    for prompt in (first, second):
        kv.assign_prompt(0, prompt)
        kv.register(0, prompt, len(prompt))
        kv.release(0)
    assert kv.usage().cached == 4 and kv.usage().free == 2
    kv.assign_prompt(0, second)  # touches `second`'s blocks: `first`'s are now the oldest
    kv.release(0)
    kv.assign(1, 12)  # 3 blocks: the free ones first, then the least recently used cached one
    assert kv.reusable(first) == 0 and kv.reusable(second) == 8
    kv.release(1)


def test_with_caching_off_nothing_is_kept_or_reused() -> None:
    kv = blocks(caching=False)
    prompt = list(range(30))
    kv.assign_prompt(0, prompt)
    kv.register(0, prompt, 30)
    kv.release(0)
    assert kv.assign_prompt(0, prompt) == 0 and kv.usage().cached == 0 and kv.usage().queries == 0


def test_the_same_calls_give_the_same_tables() -> None:
    """Every process of a multi-process replica replays the same calls: their tables must agree."""
    def script(kv: KVBlocks) -> np.ndarray:
        p = list(range(40, 61))
        kv.assign_prompt(0, p)
        kv.register(0, p, 21)
        kv.assign(1, 7)
        kv.grow(1, 13)
        kv.release(0)
        kv.assign_prompt(2, p)
        kv.assign(0, 9, share_from=1, shared_tokens=8)
        return kv.table()

    np.testing.assert_array_equal(script(blocks()), script(blocks()))
