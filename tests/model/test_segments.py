"""The accelerators' attention over a step's runs of rows (model/segments.py): each row gets what attending alone
over its own sequence's keys gives, whatever runs, decodes and padding share its step."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model_service.model.layers import paged_attention
from model_service.model.segments import attend_segments, capacities, runs

HKV, HQ, D, BS, CHUNK = 2, 4, 8, 4, 8


def rows_of(chunks: list[tuple[int, int, int]], total: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(seq, positions, active) for a step of `chunks` (slot, first position, rows) in order, padded to `total`."""
    seq, pos = np.zeros(total, np.int32), np.zeros(total, np.int32)
    row = 0
    for slot, start, n in chunks:
        seq[row:row + n], pos[row:row + n] = slot, np.arange(start, start + n)
        row += n
    return seq, pos, np.arange(total) < row


def alone(q, pool_k, pool_v, tables, seq, pos, active):
    """Every row on its own: its query over its own sequence's keys up to its position."""
    out = paged_attention(q[:, None], pool_k, pool_v, tables[seq], pos[:, None], 0.125, CHUNK)[:, 0]
    return jnp.where(active[:, None], out, 0)


STEPS = [
    [(0, 40, 1), (1, 3, 1), (2, 17, 1)],  # decodes only
    [(3, 0, 70)],  # one prompt chunk over three blocks (the last one partial)
    [(0, 40, 1), (1, 9, 5), (2, 0, 33), (3, 12, 30)],  # a decode, a decode with drafts, two chunks across blocks
    [(2, 5, 2), (0, 60, 1), (3, 30, 31), (1, 0, 1)],  # runs in any order, a one-row prompt chunk
]


@pytest.mark.parametrize("part_blocks", [1, 3, None], ids=["parts-of-1", "parts-of-3", "default-parts"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("chunks", STEPS, ids=["decodes", "prompt", "mixed", "unordered"])
def test_each_row_gets_its_own_attention(chunks, dtype, part_blocks, monkeypatch):
    """Whatever shares its step, and however the blocks are cut into parts (segments.PART_BLOCKS: each part's key
    loop stops at its own furthest row's keys), each row gets its own attention."""
    if part_blocks is not None:
        monkeypatch.setattr("model_service.model.segments.PART_BLOCKS", part_blocks)
    rng = np.random.default_rng(len(chunks))
    slots, table_len, total = 4, 32, 96
    blocks = slots * table_len
    pool_k = jnp.asarray(rng.standard_normal((blocks + 1, BS, HKV * D)), dtype)
    pool_v = jnp.asarray(rng.standard_normal((blocks + 1, BS, HKV * D)), dtype)
    tables = jnp.asarray(rng.permutation(blocks).reshape(slots, table_len), jnp.int32)
    q = jnp.asarray(rng.standard_normal((total, HQ, D)), dtype)
    seq, pos, active = (jnp.asarray(a) for a in rows_of(chunks, total))
    got = jax.jit(lambda *a: attend_segments(*a, 0.125, CHUNK, block_rows=16))(q, pool_k, pool_v, tables, seq, pos,
                                                                               active)
    want = jax.jit(alone)(q, pool_k, pool_v, tables, seq, pos, active)
    tol = 1e-6 if dtype == jnp.float32 else 1e-2
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=tol, atol=tol)
    assert not np.asarray(got)[~np.asarray(active)].any()


def test_runs_split_where_the_sequence_or_the_position_breaks():
    seq, pos, active = rows_of([(1, 4, 3), (2, 0, 1), (2, 7, 2), (1, 7, 1)], 10)
    run, offset, length = (np.asarray(a) for a in runs(jnp.asarray(seq), jnp.asarray(pos), jnp.asarray(active)))
    assert run[:7].tolist() == [0, 0, 0, 1, 2, 2, 3]
    assert offset[:7].tolist() == [0, 1, 2, 0, 0, 1, 0]
    assert length[:7].tolist() == [3, 3, 3, 1, 2, 2, 1]


def test_the_blocks_hold_any_step_the_planner_builds():
    # a step of R rows over S slots: one run a slot, runs of one row in lanes, longer runs in blocks
    for r, s in ((16, 4), (64, 64), (1024, 64), (96, 4)):
        lanes, blocks = capacities(r, s, 16)
        rng = np.random.default_rng(r)
        for _ in range(50):
            lengths = rng.multinomial(r - rng.integers(0, r // 4), np.ones(s) / s)
            assert sum(1 for n in lengths if n == 1) <= lanes
            assert sum(-(-n // 16) for n in lengths if n > 1) <= blocks

