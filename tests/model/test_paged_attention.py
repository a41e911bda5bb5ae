"""Decode attention over the paged pool, one row at a time (layers.paged_attention_rows): each row against a
float64 NumPy reference of the reference's attention (capped logits, softmax over the visible keys), a row's
bits independent of the other rows and of free slots, and free slots all zero."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from model_service.model.layers import ATTN_LOGIT_CAP, paged_attention, paged_attention_rows

HQ, HKV, D, BS, CHUNK, TABLE = 4, 2, 8, 4, 8, 6  # 6 blocks of 4 = 24 positions per row, keys read 8 at a time
MULT = 0.125


def _pool(rng: np.random.Generator, blocks: int) -> tuple[np.ndarray, np.ndarray]:
    shape = (blocks + 1, HKV, BS, D)  # + the scratch block
    return rng.standard_normal(shape).astype(np.float32), rng.standard_normal(shape).astype(np.float32)


def _reference(q: np.ndarray, k: np.ndarray, v: np.ndarray, table: np.ndarray, limit: int) -> np.ndarray:
    """q [HQ, D] of one decode row; its keys are positions 0..limit of the blocks in `table`."""
    keys = k[table].transpose(1, 0, 2, 3).reshape(HKV, -1, D)[:, :limit + 1].astype(np.float64)
    vals = v[table].transpose(1, 0, 2, 3).reshape(HKV, -1, D)[:, :limit + 1].astype(np.float64)
    out = []
    for h in range(HQ):
        g = h // (HQ // HKV)
        logits = keys[g] @ q[h].astype(np.float64) * MULT
        logits = ATTN_LOGIT_CAP * np.tanh(logits / ATTN_LOGIT_CAP)
        w = np.exp(logits - logits.max())
        out.append((w / w.sum()) @ vals[g])
    return np.concatenate(out)


def test_each_row_matches_the_reference_and_free_slots_are_zero() -> None:
    rng = np.random.default_rng(0)
    k, v = _pool(rng, 24)
    rows = 5
    tables = rng.permutation(24)[:rows * 4].reshape(rows, 4)
    tables = np.concatenate([tables, np.full((rows, TABLE - 4), 24)], axis=1).astype(np.int32)  # rest: scratch
    limits = np.array([0, 3, 9, 15, 12], np.int32)
    active = np.array([True, True, False, True, True])
    q = rng.standard_normal((rows, 1, HQ, D)).astype(np.float32)
    fn = jax.jit(paged_attention_rows, static_argnums=(5, 6))
    out = np.asarray(fn(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(tables),
                        jnp.asarray(limits[:, None]), MULT, CHUNK, jnp.asarray(active)))
    assert out.shape == (rows, 1, HQ * D)
    for r in range(rows):
        if not active[r]:
            assert np.all(out[r] == 0)
            continue
        ref = _reference(q[r, 0], k, v, tables[r], int(limits[r]))
        np.testing.assert_allclose(out[r, 0], ref, rtol=2e-5, atol=2e-6)


def test_a_rows_bits_do_not_depend_on_the_other_rows() -> None:
    rng = np.random.default_rng(1)
    k, v = _pool(rng, 24)
    tables = rng.integers(0, 24, (8, TABLE)).astype(np.int32)
    limits = rng.integers(0, TABLE * BS, (8, 1)).astype(np.int32)
    q = rng.standard_normal((8, 1, HQ, D)).astype(np.float32)
    fn = jax.jit(paged_attention_rows, static_argnums=(5, 6))
    together = np.asarray(fn(q, k, v, tables, limits, MULT, CHUNK, jnp.ones(8, bool)))
    for r in range(8):
        alone = np.asarray(fn(q[r:r + 1], k, v, tables[r:r + 1], limits[r:r + 1], MULT, CHUNK, jnp.ones(1, bool)))
        np.testing.assert_array_equal(together[r], alone[0])
        others = rng.random(8) < 0.5  # any mix of free slots around it
        others[r] = True
        mixed = np.asarray(fn(q, k, v, tables, limits, MULT, CHUNK, jnp.asarray(others)))
        np.testing.assert_array_equal(mixed[r], together[r])
    # and the one-row program is exactly paged_attention of that row
    one = np.asarray(jax.jit(paged_attention, static_argnums=(5, 6))(q[:1], k, v, tables[:1], limits[:1], MULT, CHUNK))
    np.testing.assert_array_equal(together[0], one[0])
