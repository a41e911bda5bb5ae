"""Packing for the native kernels as the weights load: the slab-by-slab packer gives exactly the layout of a
whole-matrix reference from every kind of source (checkpoint FileArrays K-major or N-major, numpy arrays and
their transposed views, shards, odd sizes), the table keeps the checkpoint's type (bfloat16 for a bfloat16
checkpoint, as the released Grok-1 stores it), random init draws what a written random checkpoint holds."""

from __future__ import annotations

import dataclasses
import pathlib

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from model_service import kernels
from model_service.checkpoint import load_params, place_leaf, random_leaves, random_params, write_checkpoint
from model_service.config import MeshConfig, load_model_config
from model_service.file_arrays import FileArray
from model_service.model import packed as packing
from model_service.model import GrokModel
from model_service.model.layers import ExpertStack, Products, QuantizedWeight
from model_service.model.packed import LANES, PackedWeight, pack_quantized, pack_table
from model_service.model.params import EMBED, random_leaf, tensor_specs, to_internal
from model_service.sharding import make_mesh
from tests.procs import GOLDEN

TINY = dataclasses.replace(
    load_model_config(str(GOLDEN / "config.json")), vocab_size=80,
    model=dataclasses.replace(load_model_config(str(GOLDEN / "config.json")).model, emb_size=32, num_layers=1,
                              num_q_heads=4, num_kv_heads=2, widening_factor=2))


def _reference(w_nk: np.ndarray, shards: int = 1) -> np.ndarray:
    """The packed layout computed in one piece: each shard of N zero-padded to whole 16-column blocks."""
    parts = []
    for part in np.split(np.asarray(w_nk), shards):
        n, k = part.shape
        nb = -(-n // LANES)
        padded = np.zeros((nb * LANES, k), part.dtype)
        padded[:n] = part
        parts.append(padded.reshape(nb, LANES, k).transpose(0, 2, 1))
    return np.concatenate(parts)


def _on_disk(tmp_path: pathlib.Path, arr: np.ndarray) -> FileArray:
    path = tmp_path / "raw"
    path.write_bytes(b"\0" * 7 + np.ascontiguousarray(arr).tobytes())
    return FileArray(str(path), 7, arr.shape, arr.dtype)


@pytest.fixture(params=[64, 1 << 20], ids=["tiny-slabs", "one-slab"])
def slab(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> int:
    monkeypatch.setattr(packing, "SLAB_BYTES", request.param)
    return request.param


@pytest.mark.parametrize("n,k", [(48, 32), (45, 37), (1, 5), (100, 64)])
def test_every_source_packs_to_the_whole_matrix_layout(tmp_path: pathlib.Path, slab: int, n: int, k: int) -> None:
    rng = np.random.default_rng(n * k)
    w_kn = rng.integers(-127, 128, (k, n), dtype=np.int8)
    want = _reference(w_kn.T)
    stored_kn = _on_disk(tmp_path, w_kn)  # the checkpoint's [K, N]: read K-major
    sources = {"file K-major": stored_kn.swapaxes(0, 1), "numpy view": w_kn.T, "numpy": np.ascontiguousarray(w_kn.T)}
    for name, source in sources.items():
        got, _ = packing._pack(source, None, 1, np.int8)
        np.testing.assert_array_equal(got, want, err_msg=name)
    (tmp_path / "n").mkdir()
    stored_nk = _on_disk(tmp_path / "n", np.ascontiguousarray(w_kn.T))  # an [N, K] table: read N-major
    got, _ = packing._pack(stored_nk, None, 1, np.int8)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("shards", [2, 4])
def test_column_shards_are_padded_on_their_own_with_their_scales(tmp_path: pathlib.Path, slab: int,
                                                                 shards: int) -> None:
    rng = np.random.default_rng(shards)
    n, k = 88, 24
    w_kn = rng.integers(-127, 128, (k, n), dtype=np.int8)
    scales = rng.uniform(0.5, 2.0, (1, n)).astype(np.float32)
    got, got_scales = packing._pack(_on_disk(tmp_path, w_kn).swapaxes(0, 1), scales, shards, np.int8)
    np.testing.assert_array_equal(got, _reference(w_kn.T, shards))
    per, nb = n // shards, -(-(n // shards) // LANES)
    for s in range(shards):
        block = got_scales[:, s * nb * LANES:(s + 1) * nb * LANES]
        np.testing.assert_array_equal(block[:, :per], scales[:, s * per:(s + 1) * per])
        assert np.all(block[:, per:] == 0)


def test_a_quantized_weight_packs_the_same_from_the_file_and_from_memory(tmp_path: pathlib.Path, slab: int) -> None:
    rng = np.random.default_rng(9)
    for blocks, (k, n) in ((1, (40, 70)), (8, (64, 30))):
        w_kn = rng.integers(-127, 128, (k, n), dtype=np.int8)
        scales = rng.uniform(0.5, 2.0, (blocks, n)).astype(np.float32)
        stored = _on_disk(tmp_path, w_kn)
        lazy = QuantizedWeight(stored.swapaxes(0, 1) if blocks == 1 else stored, scales)
        eager = QuantizedWeight(w_kn.T.copy() if blocks == 1 else w_kn, scales)
        a, b = pack_quantized(lazy, None), pack_quantized(eager, None)
        np.testing.assert_array_equal(a.packed, b.packed)
        np.testing.assert_array_equal(a.packed_scales, b.packed_scales)
        assert (a.n, a.split) == (b.n, b.split) == (n, "columns" if blocks == 1 else "rows")


def test_the_table_keeps_bfloat16_and_its_rows_and_logits_are_those_of_float32() -> None:
    rng = np.random.default_rng(1)
    table = (rng.standard_normal((70, 48)) * 0.02).astype(ml_dtypes.bfloat16)  # [V, D]
    half, full = pack_table(table, None, in_13_bits=False), pack_table(table.astype(np.float32), None)
    assert half.packed.dtype == ml_dtypes.bfloat16 and full.packed.dtype == np.float32
    assert half.shape == full.shape == (70, 48) and half.table
    ids = jnp.asarray([0, 15, 16, 69])
    half_d, full_d = jax.tree.map(jnp.asarray, half), jax.tree.map(jnp.asarray, full)
    np.testing.assert_array_equal(np.asarray(half_d.rows_of(ids)).astype(np.float32), table[[0, 15, 16, 69]].astype(np.float32))
    if kernels.available():
        x = jnp.asarray(rng.standard_normal((5, 48)).astype(np.float32))
        a = np.asarray(packing.packed_product(x, half_d))
        np.testing.assert_array_equal(a, np.asarray(packing.packed_product(x, full_d)))
        ref = np.asarray(x, np.float64) @ table.astype(np.float64).T
        assert np.allclose(a, ref, rtol=1e-4, atol=1e-5)


def test_random_init_draws_a_bfloat16_table_as_the_released_checkpoint_stores_it() -> None:
    spec = next(s for s in tensor_specs(TINY) if s.module == EMBED)
    table = random_leaf(spec, TINY, np.random.default_rng(0))
    assert table.dtype == ml_dtypes.bfloat16 and table.shape == (80, 32)
    assert 0.001 < float(np.std(table.astype(np.float32))) < 0.004


@pytest.mark.parametrize("pack", [False, True])
def test_random_params_equal_a_loaded_checkpoint_of_the_same_random_leaves(tmp_path: pathlib.Path, pack: bool) -> None:
    if pack and not kernels.available():
        pytest.skip("native kernels not built")
    mesh = make_mesh(MeshConfig())
    write_checkpoint(tmp_path, TINY, random_leaves(TINY, seed=21))
    loaded = load_params(str(tmp_path), TINY, mesh, jnp.float32, pack=pack)
    drawn = random_params(TINY, mesh, jnp.float32, seed=21, pack=pack)
    assert jax.tree.structure(loaded) == jax.tree.structure(drawn)
    for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(drawn)):
        assert a.dtype == b.dtype and a.sharding == b.sharding
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    table = loaded[EMBED]["embeddings"]
    if pack:
        # the bfloat16 table held in 13 bits a value (its random normal values have fewer than 32 high bytes)
        assert isinstance(table, PackedWeight) and table.packed.dtype == jnp.uint8 and table.dictionary is not None
        experts = loaded["transformer/decoder_layer_0/moe/linear"]["w"]
        assert isinstance(experts, ExpertStack) and isinstance(experts.experts[0], PackedWeight)
        # one device: a matrix kind's experts are one stack (2 buffers, not 2 per expert), each expert the
        # matrix packed on its own
        assert experts.stacked and experts.count == TINY.model.num_experts
        (spec, leaf), = [(spec, leaf) for spec, leaf in zip(tensor_specs(TINY), random_leaves(TINY, seed=21))
                         if (spec.module, spec.name) == ("transformer/decoder_layer_0/moe/linear", "w")]
        host = to_internal(spec, leaf, jnp.float32, native=True)
        for e in range(experts.count):
            alone = pack_quantized(host.experts[e], None)
            np.testing.assert_array_equal(np.asarray(experts.expert(e).packed), alone.packed)
            np.testing.assert_array_equal(np.asarray(experts.expert(e).packed_scales), alone.packed_scales)
    else:
        assert table.dtype == jnp.float32  # the compute dtype where XLA's products read the table


def test_a_table_in_13_bits_gives_the_logits_of_the_bfloat16_table() -> None:
    """The whole forward (embedding lookup, layers, unembedding) with the random bfloat16 table held in 13 bits
    gives the bits it gives with the table held as bfloat16, with the features split over 2 devices (one device:
    tests/kernels/test_native_bf16_in_13.py)."""
    if not kernels.available():
        pytest.skip("native kernels not built")
    cfg = dataclasses.replace(TINY, model=dataclasses.replace(TINY.model, emb_size=64))
    mesh = make_mesh(MeshConfig.parse("1,2"))
    model = GrokModel(cfg, mesh, jnp.float32, Products.NATIVE)
    params = random_params(cfg, mesh, jnp.float32, seed=5, pack=True)
    spec, table = next((s, leaf) for s, leaf in zip(tensor_specs(cfg), random_leaves(cfg, seed=5)) if s.module == EMBED)
    spread = np.float32(2.0) ** np.arange(-20, 8, 2).astype(np.float32)  # more than 16 high bytes in all
    table.reshape(-1)[::183][:28] = np.concatenate([spread, -spread]).astype(ml_dtypes.bfloat16)
    held, half = (place_leaf(spec, pack_table(table, mesh, in_13_bits=bits), mesh) for bits in (True, False))
    assert held.dictionary is not None and np.count_nonzero(np.asarray(held.dictionary)) > 16
    assert half.dictionary is None and half.packed.dtype == jnp.bfloat16
    params_half = {**params, EMBED: {**params[EMBED], "embeddings": half}}
    params = {**params, EMBED: {**params[EMBED], "embeddings": held}}
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 7)), jnp.int32)
    forward = jax.jit(model.forward)
    np.testing.assert_array_equal(np.asarray(forward(params, tokens)), np.asarray(forward(params_half, tokens)))
