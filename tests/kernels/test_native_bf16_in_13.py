"""A bfloat16 table held in 13 bits a value (packed.pack_bf16_in_13, the kernel's kBf16In13): the packing keeps
every value's bits (checked against a NumPy decoder written from the layout's description, not from the
packer), the embedding lookup reads them back exactly, and every instruction-set path's product gives the bits
of the same table held as bfloat16 (itself held to a float64 reference in test_native_matmul.py), for any rows,
thread count, form, multiplier, and under a mesh whose model axis splits the features."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from model_service import kernels
from model_service.config import MeshConfig
from model_service.model import packed as packing
from model_service.model.packed import PackedWeight, pack_bf16_in_13, pack_table
from model_service.sharding import make_mesh

pytestmark = pytest.mark.skipif(not kernels.available(), reason="native kernels not built")
ISAS = list(kernels.supported_isas()) if kernels.available() else []
EPS32 = 2.0**-24


def _table(rng: np.random.Generator, v: int, d: int, scale: float = 0.02) -> np.ndarray:
    """Random normal values, the first 28 spread over 2^-20 ... 2^6 with both signs: more than 16 distinct high
    bytes, so every dictionary index needs its fifth bit."""
    table = (rng.standard_normal((v, d)) * scale).astype(ml_dtypes.bfloat16)
    spread = np.float32(2.0) ** np.arange(-20, 8, 2).astype(np.float32)
    table.reshape(-1)[:28] = np.concatenate([spread, -spread]).astype(ml_dtypes.bfloat16)
    assert 16 < len(np.unique(table.view(np.uint16) >> 8)) <= 32
    return table


def _decode(packed: np.ndarray, dictionary: np.ndarray, v: int) -> np.ndarray:
    """uint8 [NB, D / 4, 104] -> the table's bits uint16 [V, D], from the layout as matmul.h describes it: per
    group of 4 values of k, value (k = 4 g + t, column c) at position 16 (c // 4) + 2 (c % 4) + t % 2 + 8 (t // 2);
    its low byte at that position, the low 4 bits of its dictionary index in byte 64 + p % 32 (high half for
    p >= 32), the fifth in bit p of bytes 96..103."""
    nb, groups, _ = packed.shape
    out = np.zeros((nb * 16, groups * 4), np.uint16)
    for j in range(nb):
        for g in range(groups):
            b = packed[j, g]
            for t in range(4):
                for c in range(16):
                    p = 16 * (c // 4) + 2 * (c % 4) + t % 2 + 8 * (t // 2)
                    nibble = b[64 + p] & 15 if p < 32 else b[64 + p - 32] >> 4
                    fifth = (b[96 + p // 8] >> (p % 8)) & 1
                    out[16 * j + c, 4 * g + t] = (int(dictionary[nibble | fifth << 4]) << 8) | int(b[p])
    return out[:v]


@pytest.mark.parametrize("v,d", [(70, 48), (16, 8), (33, 36)])
def test_packing_keeps_every_bit(v: int, d: int) -> None:
    table = _table(np.random.default_rng(v), v, d)
    table[0, :4] = np.array([0.0, -0.0, 1e-30, -3e4], ml_dtypes.bfloat16)  # zeros, a tiny value, a large one
    held = pack_bf16_in_13(table)
    assert held is not None
    packed, dictionary = held
    assert packed.shape == (-(-v // 16), d // 4, 104) and packed.dtype == np.uint8 and dictionary.shape == (32,)
    np.testing.assert_array_equal(_decode(packed, dictionary, v), table.view(np.uint16))


def test_more_than_32_high_bytes_keep_the_table_in_bfloat16() -> None:
    rng = np.random.default_rng(5)
    table = _table(rng, 64, 32)
    # 40 distinct high bytes: sign and exponent pairs 2^-40 ... 2^38
    table[1, :] = (np.float32(2.0) ** np.arange(-40, 40, 2)[:32]).astype(ml_dtypes.bfloat16)
    table[2, :8] = (-np.float32(2.0) ** np.arange(0, 16, 2)).astype(ml_dtypes.bfloat16)
    assert len(np.unique(table.view(np.uint16) >> 8)) > 32
    assert pack_bf16_in_13(table) is None
    w = pack_table(table, None)
    assert w.dictionary is None and w.packed.dtype == ml_dtypes.bfloat16 and w.shape == (64, 32)


def test_a_table_in_13_bits_reads_its_rows_back_exactly() -> None:
    rng = np.random.default_rng(1)
    table = _table(rng, 70, 48)
    w = jax.tree.map(jnp.asarray, pack_table(table, None))
    assert w.dictionary is not None and w.packed.dtype == jnp.uint8 and w.shape == (70, 48) and w.table
    ids = jnp.asarray([[0, 15, 16], [69, 3, 3]])
    got = np.asarray(w.rows_of(ids))
    assert got.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(got.view(np.uint16), table[np.asarray(ids)].view(np.uint16))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("v,d", [(300, 40), (70, 600), (129, 8)])
def test_every_path_gives_the_bits_of_the_bfloat16_table(isa: str, v: int, d: int) -> None:
    rng = np.random.default_rng(v + d)
    table = _table(rng, v, d)
    held = jax.tree.map(jnp.asarray, pack_table(table, None))
    half = jax.tree.map(jnp.asarray, pack_table(table, None, in_13_bits=False))
    assert held.dictionary is not None and half.dictionary is None
    x = jnp.asarray(rng.standard_normal((14, d)).astype(np.float32))
    ref = np.asarray(x, np.float64) @ table.astype(np.float64).T
    bound = (d + 1) * EPS32 * (np.abs(np.asarray(x, np.float64)) @ np.abs(table.astype(np.float64).T))
    # AVX-512 tiles of 8 rows: every remainder from 1 to 7, whole tiles, both; then a panel form asked for (the
    # rows form computes it) and one thread
    for m, form, threads in [(m, "rows", 0) for m in (1, 2, 3, 4, 5, 6, 7, 8, 14)] + [(11, "panel", 0), (11, "rows", 1)]:
        got = np.asarray(kernels.matmul(x[:m], held.packed, None, v, isa, threads, form=form,
                                        dictionary=held.dictionary))
        want = np.asarray(kernels.matmul(x[:m], half.packed, None, v, isa, threads, form=form))
        np.testing.assert_array_equal(got, want, err_msg=f"{isa} {m} {form} {threads}")
        assert np.all(np.abs(got - ref[:m]) <= bound[:m])


@pytest.mark.parametrize("isa", ISAS)
def test_rows_not_asked_for_and_the_multiplier(isa: str) -> None:
    rng = np.random.default_rng(8)
    table = _table(rng, 100, 64)
    held = jax.tree.map(jnp.asarray, pack_table(table, None))
    half = jax.tree.map(jnp.asarray, pack_table(table, None, in_13_bits=False))
    x = jnp.asarray(rng.standard_normal((9, 64)).astype(np.float32))
    used = jnp.asarray([True, False, False, True, True, False, True, False, True])
    got = np.asarray(kernels.matmul(x, held.packed, None, 100, isa, rows=used, multiplier=0.3,
                                    dictionary=held.dictionary))
    want = np.asarray(kernels.matmul(x, half.packed, None, 100, isa, rows=used, multiplier=0.3))
    np.testing.assert_array_equal(got, want)
    assert np.all(got[~np.asarray(used)] == 0)
    alone = np.asarray(kernels.matmul(x[3:4], held.packed, None, 100, isa, dictionary=held.dictionary) * np.float32(0.3))
    np.testing.assert_array_equal(got[3:4], alone)  # a row's bits do not depend on the others


def test_a_mesh_splitting_the_features_gives_the_bits_of_the_bfloat16_table() -> None:
    mesh = make_mesh(MeshConfig.parse("1,8"))
    rng = np.random.default_rng(2)
    table = _table(rng, 90, 64)  # 8 features a shard: two groups of 4 each
    x = rng.standard_normal((4, 64)).astype(np.float32)
    out = {}
    for in_13 in (True, False):
        w = pack_table(table, mesh, in_13_bits=in_13)
        assert (w.dictionary is not None) == in_13 and w.shards == 8
        placed = jax.device_put(w, PackedWeight(NamedSharding(mesh, P(None, "model", None)), None, w.n, w.split,
                                                w.shards, w.mesh, True, NamedSharding(mesh, P()) if in_13 else None))
        out[in_13] = np.asarray(jax.jit(lambda a, p: packing.packed_product(a, p))(jnp.asarray(x), placed))
        rows = np.asarray(jax.jit(lambda p: p.rows_of(jnp.asarray([0, 17, 89])))(placed))
        np.testing.assert_array_equal(rows.view(np.uint16), table[[0, 17, 89]].view(np.uint16))
    np.testing.assert_array_equal(out[True], out[False])


def test_a_wrong_weight_or_dictionary_is_refused() -> None:
    with pytest.raises(TypeError, match="uint8"):
        kernels.matmul(jnp.zeros((1, 8)), jnp.zeros((1, 2, 104), jnp.int8), None, 16,
                       dictionary=jnp.zeros((32,), jnp.uint8))
    with pytest.raises(TypeError, match="dictionary of 32"):
        jax.block_until_ready(kernels.matmul(jnp.zeros((1, 8)), jnp.zeros((1, 2, 104), jnp.uint8), None, 16,
                                             dictionary=jnp.zeros((16,), jnp.uint8)))


def test_the_variable_keeps_the_table_in_bfloat16(monkeypatch: pytest.MonkeyPatch) -> None:
    table = _table(np.random.default_rng(6), 40, 16)
    monkeypatch.setenv(kernels.TABLE_BITS_ENV, "16")
    assert pack_table(table, None).dictionary is None
    monkeypatch.setenv(kernels.TABLE_BITS_ENV, "13")
    assert pack_table(table, None).dictionary is not None
    monkeypatch.setenv(kernels.TABLE_BITS_ENV, "12")  # not a choice: warned about, the default
    assert pack_table(table, None).dictionary is not None
