"""Native paged attention (model_service/kernels/attention.py): each instruction-set path against a float64
NumPy reference of the reference's attention and against XLA's layers.paged_attention_rows; a row's bits
identical to itself computed alone whatever else is in the call; the three paths identical to each other; the
vectorised exp and cap against float64; unmarked rows zero; invalid input refused."""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model_service import kernels
from model_service.kernels import attention
from model_service.model.layers import ATTN_LOGIT_CAP, paged_attention_rows

pytestmark = pytest.mark.skipif(not attention.available(), reason="native kernels not built")
ISAS = list(kernels.supported_isas()) if attention.available() else []
MULT = 0.35


class Case:
    """A pool of NBLK blocks, S sequences with shuffled tables, R rows (sequence, limit, query)."""

    def __init__(self, seed: int, hq: int = 4, hkv: int = 2, d: int = 8, bs: int = 4, s: int = 3, table: int = 6,
                 r: int = 7, dtype: type = np.float32, scale: float = 3.0) -> None:
        rng = np.random.default_rng(seed)
        self.hq, self.hkv, self.d, self.bs, self.table = hq, hkv, d, bs, table
        nblk = s * table + 2
        self.k = rng.standard_normal((nblk, hkv, bs, d)).astype(np.float32)
        self.v = rng.standard_normal((nblk, hkv, bs, d)).astype(np.float32)
        if dtype != np.float32:  # values exactly representable in bfloat16, so the reference sees the same numbers
            self.k = np.asarray(jnp.asarray(self.k, jnp.bfloat16).astype(jnp.float32))
            self.v = np.asarray(jnp.asarray(self.v, jnp.bfloat16).astype(jnp.float32))
        self.dtype = dtype
        self.tables = rng.permutation(nblk)[:s * table].reshape(s, table).astype(np.int32)
        self.seq = rng.integers(0, s, r).astype(np.int32)
        self.limit = rng.integers(0, table * bs, r).astype(np.int32)
        # Logits of a few units at any D (float32 rounding then stays within the tolerances XLA meets too);
        # a large `scale` drives most of them into the cap.
        self.q = (rng.standard_normal((r, hq, d)) * scale * np.sqrt(8 / d)).astype(np.float32)

    def pools(self) -> tuple[jax.Array, jax.Array]:
        dt = jnp.bfloat16 if self.dtype != np.float32 else jnp.float32
        return jnp.asarray(self.k, dt), jnp.asarray(self.v, dt)

    def reference(self, r: int) -> np.ndarray:
        """float64: [Hq * D] for row r."""
        t = self.tables[self.seq[r]]
        n = int(self.limit[r]) + 1
        keys = self.k[t].transpose(1, 0, 2, 3).reshape(self.hkv, -1, self.d)[:, :n].astype(np.float64)
        vals = self.v[t].transpose(1, 0, 2, 3).reshape(self.hkv, -1, self.d)[:, :n].astype(np.float64)
        out = []
        for h in range(self.hq):
            g = h // (self.hq // self.hkv)
            logits = keys[g] @ self.q[r, h].astype(np.float64) * MULT
            logits = ATTN_LOGIT_CAP * np.tanh(logits / ATTN_LOGIT_CAP)
            w = np.exp(logits - logits.max())
            out.append((w / w.sum()) @ vals[g])
        return np.concatenate(out)


def _run(c: Case, isa: str, q: np.ndarray | None = None, seq: np.ndarray | None = None,
         limit: np.ndarray | None = None, rows: np.ndarray | None = None, threads: int = 0) -> np.ndarray:
    q = c.q if q is None else q
    seq = c.seq if seq is None else seq
    limit = c.limit if limit is None else limit
    rows = np.ones(len(q), bool) if rows is None else rows
    k, v = c.pools()
    fn = jax.jit(lambda *a: attention.paged_attention(*a, MULT, isa=isa, threads=threads))
    return np.asarray(fn(q, k, v, c.tables, seq, limit, rows))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("shape", [dict(hq=4, hkv=2, d=8, bs=4), dict(hq=6, hkv=2, d=20, bs=4),
                                   dict(hq=16, hkv=8, d=32, bs=16, table=24), dict(hq=6, hkv=1, d=128, bs=16, table=9),
                                   dict(hq=3, hkv=3, d=40, bs=8, table=20)])
def test_each_path_matches_a_float64_reference(isa: str, shape: dict[str, int]) -> None:
    c = Case(1, r=9, **shape)
    c.limit[:3] = [0, c.table * c.bs - 1, c.bs]  # the first key only, every key, a block boundary
    out = _run(c, isa)
    assert out.shape == (9, c.hq * c.d) and out.dtype == np.float32
    for r in range(9):
        np.testing.assert_allclose(out[r], c.reference(r), rtol=2e-5, atol=2e-6, err_msg=f"row {r}")


@pytest.mark.parametrize("isa", ISAS)
def test_logits_far_past_the_cap_match_the_reference(isa: str) -> None:
    c = Case(11, hq=8, hkv=2, d=16, bs=4, table=12, r=8, scale=60.0)
    out = _run(c, isa)
    ref = np.stack([c.reference(r) for r in range(8)])
    first = c.k[c.tables[c.seq, 0]][:, :, 0].repeat(c.hq // c.hkv, axis=1)  # [R, Hq, D]: each head's key 0
    logits = np.einsum("rhd,rhd->rh", c.q.astype(np.float64), first) * MULT
    assert (np.abs(logits) > ATTN_LOGIT_CAP).mean() > 0.3  # many scores are deep in the cap's flat part
    np.testing.assert_allclose(out, ref, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("isa", ISAS)
def test_bfloat16_pools_are_widened_exactly(isa: str) -> None:
    c = Case(2, hq=8, hkv=2, d=24, bs=8, table=10, r=6, dtype=jnp.bfloat16)
    out = _run(c, isa)
    for r in range(6):
        np.testing.assert_allclose(out[r], c.reference(r), rtol=2e-5, atol=2e-6, err_msg=f"row {r}")
    f32 = Case(2, hq=8, hkv=2, d=24, bs=8, table=10, r=6)
    f32.k, f32.v = c.k, c.v  # the same numbers held as float32 give the same bits
    np.testing.assert_array_equal(out, _run(f32, isa))


def test_agrees_with_xlas_per_row_paged_attention() -> None:
    c = Case(3, hq=8, hkv=4, d=16, bs=4, table=8, r=10)
    chunk = 8
    xla = jax.jit(paged_attention_rows, static_argnums=(5, 6))(
        jnp.asarray(c.q[:, None]), jnp.asarray(c.k), jnp.asarray(c.v), jnp.asarray(c.tables[c.seq]),
        jnp.asarray(c.limit[:, None]), MULT, chunk, jnp.ones(10, bool))
    np.testing.assert_allclose(_run(c, ISAS[-1]), np.asarray(xla)[:, 0], rtol=2e-5, atol=2e-6)


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint32)


@pytest.mark.parametrize("isa", ISAS)
def test_a_rows_bits_do_not_depend_on_anything_else_in_the_call(isa: str) -> None:
    c = Case(4, hq=12, hkv=2, d=40, bs=4, s=4, table=40, r=64)
    rng = np.random.default_rng(40)
    c.seq[:48] = 1  # a prompt chunk: 48 rows of one sequence at consecutive positions (several items of it)
    c.limit[:48] = 100 + np.arange(48)
    alone = {r: _run(c, isa, c.q[r:r + 1], c.seq[r:r + 1], c.limit[r:r + 1], threads=1)[0] for r in (0, 17, 47, 50, 63)}
    for size in (2, 7, 64):
        for threads in (1, 2, 0):
            picked = rng.permutation(64)[:size]
            for r in alone:  # the row under test, somewhere in a shuffled call among other rows
                if r not in picked:
                    picked[rng.integers(size)] = r
            mask = rng.random(size) < 0.6
            mask[picked == list(alone)[0]] = True
            out = _run(c, isa, c.q[picked], c.seq[picked], c.limit[picked], mask, threads)
            for i, r in enumerate(picked):
                if r in alone and mask[i]:
                    np.testing.assert_array_equal(_bits(out[i]), _bits(alone[r]), err_msg=f"row {r}, R={size}")


@pytest.mark.parametrize("isa", ISAS)
def test_a_long_prompt_chunk_split_over_items_keeps_every_rows_bits(isa: str) -> None:
    # 48 rows of one sequence past 3,000 keys: their scores would outgrow L2 in one item, so the kernel cuts the
    # chunk into items of fewer rows (each reading the keys again); every row keeps the bits it has alone.
    c = Case(21, hq=2, hkv=1, d=8, bs=16, s=2, table=200, r=50)
    c.seq[:48], c.seq[48:] = 0, 1
    c.limit[:48], c.limit[48:] = 3000 + np.arange(48), [5, 3100]
    out = _run(c, isa)
    for r in (0, 19, 20, 21, 40, 47, 48, 49):
        alone = _run(c, isa, c.q[r:r + 1], c.seq[r:r + 1], c.limit[r:r + 1], threads=1)[0]
        np.testing.assert_array_equal(_bits(out[r]), _bits(alone), err_msg=f"row {r}")
        np.testing.assert_allclose(out[r], c.reference(r), rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("isa", ISAS)
def test_a_rows_bits_do_not_depend_on_the_thread_count(isa: str) -> None:
    # One decode row and a short chunk: the kernel splits the kv heads into more items as threads grow.
    c = Case(12, hq=8, hkv=4, d=32, bs=16, s=2, table=8, r=5)
    c.seq[:] = [0, 1, 1, 1, 1]
    c.limit[:] = [100, 60, 61, 62, 63]
    outs = [_run(c, isa, threads=t) for t in (1, 2, 3, 4, 0)]
    for out in outs[1:]:
        np.testing.assert_array_equal(_bits(out), _bits(outs[0]))


@pytest.mark.parametrize("isa", ISAS)
def test_a_row_never_reads_keys_past_its_limit_even_beside_longer_rows_of_its_sequence(isa: str) -> None:
    c = Case(5, hq=4, hkv=2, d=16, bs=4, s=2, table=20, r=5)
    c.seq[:] = 0
    c.limit[:] = [9, 10, 30, 31, 79]
    alone = [_run(c, isa, c.q[r:r + 1], c.seq[r:r + 1], c.limit[r:r + 1])[0] for r in range(2)]
    for pos in range(11, 80):  # poison every position the first two rows must not see
        block = c.tables[0, pos // c.bs]
        c.k[block, :, pos % c.bs] = np.nan
        c.v[block, :, pos % c.bs] = np.nan
    out = _run(c, isa)
    for r in range(2):
        np.testing.assert_array_equal(_bits(out[r]), _bits(alone[r]))
    assert np.isnan(out[2:]).any(axis=1).all()  # and the longer rows do see the poisoned positions


def test_every_instruction_set_path_gives_the_same_bits() -> None:
    c = Case(6, hq=16, hkv=8, d=36, bs=16, table=12, r=20)
    outs = {isa: _run(c, isa) for isa in ISAS}
    for isa, out in outs.items():
        np.testing.assert_array_equal(_bits(out), _bits(outs["scalar"]), err_msg=isa)


@pytest.mark.parametrize("isa", ISAS)
def test_unmarked_rows_are_zero_and_their_inputs_are_never_read(isa: str) -> None:
    c = Case(7, r=6)
    full = _run(c, isa)
    mask = np.array([True, False, True, False, False, True])
    seq, limit = c.seq.copy(), c.limit.copy()
    seq[~mask], limit[~mask] = 99, -5  # invalid, but not computed
    out = _run(c, isa, seq=seq, limit=limit, rows=mask)
    assert np.all(out[~mask] == 0)
    np.testing.assert_array_equal(out[mask], full[mask])
    assert np.all(_run(c, isa, rows=np.zeros(6, bool)) == 0)


@pytest.mark.parametrize("change, message", [
    (lambda c: c.limit.__setitem__(0, -1), "needs 0 <= limit"),
    (lambda c: c.limit.__setitem__(0, c.table * c.bs), "needs 0 <= limit"),
    (lambda c: c.seq.__setitem__(0, 3), "names sequence 3"),
    (lambda c: c.tables.__setitem__((c.seq[0], 0), c.k.shape[0]), "is not a block of the pool"),
])
def test_invalid_rows_are_refused_with_a_message_naming_them(change, message: str) -> None:  # noqa: ANN001
    c = Case(8, r=3)
    change(c)
    with pytest.raises(Exception, match=message):
        _run(c, ISAS[-1])


def test_shapes_are_checked_before_the_call() -> None:
    c = Case(9, r=3)
    k, v = c.pools()
    with pytest.raises(ValueError, match="multiple of Hkv"):
        attention.paged_attention(c.q[:, :3], k, v, c.tables, c.seq, c.limit, np.ones(3, bool), MULT)
    with pytest.raises(ValueError, match="must both be float32 or both bfloat16"):
        attention.paged_attention(c.q, k, v.astype(jnp.bfloat16), c.tables, c.seq, c.limit, np.ones(3, bool), MULT)
    with pytest.raises(ValueError, match="limit must be"):
        attention.paged_attention(c.q, k, v, c.tables, c.seq, c.limit[:2], np.ones(3, bool), MULT)


def test_under_vmap_each_batch_element_is_its_own_call() -> None:
    c = Case(10, r=4)
    k, v = c.pools()
    qs = np.stack([c.q, c.q[::-1]])
    fn = jax.vmap(lambda q: attention.paged_attention(q, k, v, c.tables, c.seq, c.limit, jnp.ones(4, bool), MULT))
    out = np.asarray(jax.jit(fn)(qs))
    np.testing.assert_array_equal(out[0], _run(c, kernels.default_isa()))
    np.testing.assert_array_equal(out[1], _run(c, kernels.default_isa(), q=c.q[::-1]))


@pytest.mark.parametrize("isa", ISAS)
def test_the_vectorised_exp_is_within_one_ulp_over_the_softmax_range(isa: str) -> None:
    x = np.linspace(-87, 0, 400001).astype(np.float32)
    got = np.asarray(attention.math(x, "exp", isa)).astype(np.float64)
    want = np.exp(x.astype(np.float64))
    assert (np.abs(got - want) / np.spacing(want.astype(np.float32))).max() <= 1.0
    assert np.asarray(attention.math(np.float32(0), "exp", isa)) == 1.0  # the softmax's largest term is exact


@pytest.mark.parametrize("isa", ISAS)
def test_the_vectorised_cap_is_within_four_ulp_and_saturates(isa: str) -> None:
    x = np.concatenate([np.linspace(-300, 300, 400001), np.geomspace(1e-30, 30, 20000),
                        -np.geomspace(1e-30, 30, 20000), [0.0, 1e30, -1e30]]).astype(np.float32)
    got = np.asarray(attention.math(x, "cap", isa)).astype(np.float64)
    want = ATTN_LOGIT_CAP * np.tanh(x.astype(np.float64) / ATTN_LOGIT_CAP)
    assert (np.abs(got - want) / np.spacing(np.abs(want).astype(np.float32))).max() <= 4.0
    assert np.all(np.abs(got) <= 30.0) and got[-3] == 0.0
    np.testing.assert_array_equal(got, -np.asarray(attention.math(-x, "cap", isa)))  # odd, exactly


def test_with_the_kernels_disabled_the_wrapper_says_so_and_names_the_fallback() -> None:
    code = ("from model_service.kernels import attention\n"
            "assert not attention.available()\n"
            "try:\n"
            "    attention.paged_attention(None, None, None, None, None, None, None, 1.0)\n"
            "except RuntimeError as e:\n"
            "    print(e)\n")
    env = {**os.environ, kernels.ISA_ENV: "off"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "not available" in done.stdout and "paged_attention_rows" in done.stdout
