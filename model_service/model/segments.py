"""The accelerators' attention over the paged pools (ops.xla.BatchedAttention): a step's rows read a sequence's keys
once per block of rows where rows share one.

A step's rows are runs of consecutive positions of one sequence each (model_service/plan.py: a decode row, a
decode and its drafts, a prompt chunk; one run per slot), padding last. Attending row by row
(`layers.paged_attention` with one query a row) reads a run's keys once per row: a 1,024-row prompt chunk at
position 2,048 read 1,024 x 2,048 keys a layer, three times. Here a run longer than one row is cut into blocks of
`block_rows` consecutive rows, and each block reads its sequence's keys once for all its rows (one wide product
per key chunk); single rows (decodes) still read their own keys. Both go through `layers.paged_attention`, so
each row's result is the same computation on its own keys (masked by its own position).

Shapes are static per row count R, for S slots: single rows are gathered into min(R, S) lanes; blocks number at
most ceil(R / block_rows) + min(S, R // 2) (each run adds at most one partial block, and runs in blocks are two
rows or more). Neither bound holds if a slot has two runs in one step, which the planner never builds.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from model_service.model.layers import paged_attention

Array = jax.Array

BLOCK_ROWS = 32  # rows of one run that share their keys' reads
PART_BLOCKS = 8  # blocks attended together: each part's key loop stops at its own furthest key


def capacities(rows: int, slots: int, block_rows: int = BLOCK_ROWS) -> tuple[int, int]:
    """(single-row lanes, blocks) for a step of `rows` rows over `slots` slots."""
    return min(rows, slots), -(-rows // block_rows) + min(slots, rows // 2)


def runs(seq: Array, positions: Array, active: Array) -> tuple[Array, Array, Array]:
    """Per row: its run's index (runs numbered in row order), its offset in the run, and its run's length.
    A run starts where the sequence changes or its position does not follow the previous row's."""
    run, first, length = _runs(seq, positions, active)
    return run, jnp.arange(seq.shape[0]) - first[run], length[run]


def _runs(seq: Array, positions: Array, active: Array) -> tuple[Array, Array, Array]:
    """Per row its run's index; per run index its first row and its length (rows; 0 past the last run)."""
    r = seq.shape[0]
    follows = jnp.concatenate([jnp.zeros((1,), bool), (seq[1:] == seq[:-1]) & (positions[1:] == positions[:-1] + 1)])
    starts = active & ~follows
    run = jnp.cumsum(starts) - 1
    run = jnp.where(active, run, r - 1)  # padding: a run index no active row can reach (there are fewer runs)
    first = jax.ops.segment_min(jnp.where(active, jnp.arange(r), r), run, num_segments=r)
    length = jax.ops.segment_sum(active.astype(jnp.int32), run, num_segments=r)
    return run, first, length


Single = Callable[[Array, Array, Array, Array], Array]  # (q [L, Hq, D], tables [L, n], positions [L], taken [L])


def attend_segments(q: Array, pool_k: Array, pool_v: Array, tables: Array, seq: Array, positions: Array,
                    active: Array, multiplier: float, chunk: int, block_rows: int = BLOCK_ROWS,
                    single: Single | None = None) -> Array:
    """q [R, Hq, D]; row r of sequence seq[r] at positions[r] sees that sequence's key positions
    0..positions[r] through tables [S, table_len]; rows not `active` get zeros. -> [R, Hq * D]. `single(q, tables,
    positions, taken)` attends the single rows gathered into lanes (each lane's query, its sequence's table, its
    position; lanes not `taken` hold no row and their output is dropped) -> [L, Hq * D]: by default
    layers.paged_attention, one query a row."""
    r, hq, d = q.shape
    lanes, blocks = capacities(r, tables.shape[0], block_rows)
    run, first, run_length = _runs(seq, positions, active)
    offset, length = jnp.arange(r) - first[run], run_length[run]
    lone_rows = active & (length == 1)
    grouped = active & (length > 1)

    # Single rows, gathered into `lanes` (the rest of the lanes see position 0 of slot 0 and are dropped).
    pick = jnp.nonzero(lone_rows, size=lanes, fill_value=r)[0]
    taken = pick < r
    pick_ = jnp.where(taken, pick, 0)

    def alone() -> Array:
        if single is not None:
            return single(q[pick_], tables[seq[pick_]], positions[pick_], taken)
        return paged_attention(q[pick_][:, None], pool_k, pool_v, tables[seq[pick_]],
                               jnp.where(taken, positions[pick_], 0)[:, None], multiplier, chunk)[:, 0]

    lone = jax.lax.cond(  # a step of prompt chunks alone skips it, as a step of decodes skips the blocks below
        jnp.any(lone_rows), alone, lambda: jnp.zeros((lanes, hq * d), q.dtype))

    # Runs of two rows or more, cut into blocks: a run's blocks follow the blocks of the runs before it. Every
    # index below is gathered, none scattered: a TPU scatters one update at a time, and a step's padding rows all
    # point at one place.
    per_run = jnp.where(run_length > 1, -(-run_length // block_rows), 0)  # blocks of each run (by run index)
    ends = jnp.cumsum(per_run)  # blocks of the runs up to each one
    # each block's run: blocks x rows comparisons (at most ~100 x 1,024), no loop in the step program
    owner = jnp.minimum(jnp.searchsorted(ends, jnp.arange(blocks), side="right", method="compare_all"), r - 1)
    within = jnp.arange(blocks) - (ends[owner] - per_run[owner])  # its place among its run's blocks
    start = first[owner] + within * block_rows  # its first row
    lane_ids = jnp.arange(block_rows)[None, :]
    held = (jnp.arange(blocks) < ends[-1])[:, None] & (
        within[:, None] * block_rows + lane_ids < run_length[owner][:, None])
    at_ = jnp.where(held, jnp.minimum(start[:, None] + lane_ids, r - 1), 0)  # [blocks, block_rows] rows
    block_seq = seq[jnp.minimum(start, r - 1)]
    limit = jnp.where(held, positions[at_], 0)

    def part(first: int, count: int) -> Array:  # blocks first..first+count-1; a part holding no row skips
        ids = slice(first, first + count)
        return jax.lax.cond(
            jnp.any(held[ids]), lambda: paged_attention(q[at_[ids]], pool_k, pool_v, tables[block_seq[ids]],
                                                        limit[ids], multiplier, chunk),
            lambda: jnp.zeros((count, block_rows, hq * d), q.dtype))

    # A step with a run longer than a part (a long prompt chunk) attends its blocks in parts of PART_BLOCKS, each
    # part's key loop as long as its own furthest row needs (one loop to the step's furthest key made a chunk's
    # first blocks pay for its last); shorter runs (a decode and its drafts, short chunks) keep one loop, a step
    # without runs neither. Each row still gets its own attention (a chunk past its keys adds nothing); XLA may
    # round a part's smaller batch differently in the last place, as it does between row buckets.
    step = min(PART_BLOCKS, blocks)
    branches = [lambda: jnp.zeros((blocks, block_rows, hq * d), q.dtype),
                lambda: paged_attention(q[at_], pool_k, pool_v, tables[block_seq], limit, multiplier, chunk)]
    if blocks > step:
        branches.append(lambda: jnp.concatenate([part(b, min(step, blocks - b)) for b in range(0, blocks, step)]))
    longest = jnp.max(jnp.where(grouped, length, 0))  # 0: no run of two rows or more
    which = (longest > 0).astype(jnp.int32) + (longest > step * block_rows).astype(jnp.int32)
    shared = jax.lax.switch(jnp.minimum(which, len(branches) - 1), branches)  # [blocks, block_rows, Hq * D]

    # Each row reads its result from its lane or its block (rows in neither, padding, get zeros).
    lane_of = jnp.clip(jnp.cumsum(lone_rows) - 1, 0, lanes - 1)  # the lanes hold the single rows in row order
    in_blocks = jnp.clip((ends - per_run)[run] * block_rows + offset, 0, blocks * block_rows - 1)
    from_blocks = jnp.where(grouped[:, None], shared.reshape(-1, hq * d)[in_blocks], jnp.zeros((), q.dtype))
    return jnp.where(lone_rows[:, None], lone[lane_of], from_blocks)
