"""Checkpoint arrays stay on disk until a region is read, and reading a region reads only its bytes.

"Bytes read" is the kernel's count of what this process passed through read()/pread() (/proc/self/io
rchar), so the tests see what actually left the file, not what the code meant to read.
"""

from __future__ import annotations

import pathlib

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from model_service.checkpoint import CheckpointError, encode_tensor, load_params, read_tensor
from model_service.config import MeshConfig
from model_service.file_arrays import FileArray
from model_service.model.params import tensor_specs
from model_service.sharding import make_mesh
from tests.model.test_checkpoint import TINY


def bytes_read() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


def write(tmp_path: pathlib.Path, leaf: object, name: str = "t") -> pathlib.Path:
    path = tmp_path / name
    path.write_bytes(encode_tensor(leaf))
    return path


@pytest.mark.parametrize("index", [(slice(0, 64), slice(0, 256)), (slice(16, 32), slice(None)),
                                   (slice(None), slice(128, 192)), (slice(5, 6), slice(7, 9))])
def test_region_of_a_stored_array_equals_the_numpy_slice(tmp_path: pathlib.Path, index: tuple[slice, ...]) -> None:
    arr = np.random.default_rng(0).integers(-127, 128, (64, 256), dtype=np.int8)
    lazy = read_tensor(write(tmp_path, arr), lazy=True)
    assert isinstance(lazy, FileArray) and lazy.shape == arr.shape and lazy.dtype == np.int8
    np.testing.assert_array_equal(lazy.read(index), arr[index])


def test_views_transpose_select_and_cast_without_reading(tmp_path: pathlib.Path) -> None:
    weight = np.random.default_rng(1).integers(-127, 128, (3, 16, 24), dtype=np.int8)
    scales = np.random.default_rng(2).random((3, 1, 24)).astype(ml_dtypes.bfloat16)
    path = write(tmp_path, (weight, scales))
    before = bytes_read()
    lazy_w, lazy_s = read_tensor(path, lazy=True)
    view = lazy_w.swapaxes(-1, -2)[2]  # expert 2, [N, K] as the in-memory layout stores it
    cast = lazy_s[1].astype(np.float32)
    assert bytes_read() - before < 1024  # only the pickle's opcodes so far
    assert view.shape == (24, 16) and cast.shape == (1, 24) and cast.dtype == np.float32
    np.testing.assert_array_equal(view.read((slice(8, 16), slice(None))), weight[2].T[8:16])
    np.testing.assert_array_equal(np.asarray(cast), scales[1].astype(np.float32))


def test_reading_one_shard_reads_only_that_shard_from_disk(tmp_path: pathlib.Path) -> None:
    arr = np.random.default_rng(3).standard_normal((512, 1024)).astype(np.float32)  # 2 MiB
    path = write(tmp_path, arr)
    before = bytes_read()
    lazy = read_tensor(path, lazy=True)
    shard = lazy.read((slice(None), slice(256, 384)))  # an eighth of the columns, as a model-axis shard
    read = bytes_read() - before
    np.testing.assert_array_equal(shard, arr[:, 256:384])
    assert shard.nbytes <= read < shard.nbytes + 4096, (read, shard.nbytes, arr.nbytes)


def test_lazy_load_equals_eager_placement(tmp_path: pathlib.Path) -> None:
    mesh = make_mesh(MeshConfig(2, 4))
    eager = load_params_eagerly(tmp_path, mesh)
    lazy = load_params(str(tmp_path), TINY, mesh, jnp.float32)
    for a, b in zip(jax.tree.leaves(eager), jax.tree.leaves(lazy), strict=True):
        assert a.sharding == b.sharding
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def load_params_eagerly(tmp_path: pathlib.Path, mesh: jax.sharding.Mesh) -> object:
    """Write TINY's random params, then place fully read numpy leaves (the loader before lazy reads)."""
    from model_service.checkpoint import place_leaf, random_leaves, write_checkpoint
    from model_service.model.params import set_leaf, to_internal

    write_checkpoint(tmp_path, TINY, random_leaves(TINY, seed=5))
    params: dict = {}
    for i, spec in enumerate(tensor_specs(TINY)):
        leaf = read_tensor(tmp_path / "ckpt-0" / f"tensor{i:05d}_000")
        set_leaf(params, spec, place_leaf(spec, to_internal(spec, leaf, jnp.float32), mesh))
    return params


def test_truncated_payload_is_refused_before_reading(tmp_path: pathlib.Path) -> None:
    path = write(tmp_path, np.zeros((256, 256), np.float32))
    path.write_bytes(path.read_bytes()[:-1000])
    with pytest.raises(CheckpointError, match="past the end of the file"):
        read_tensor(path, lazy=True)


def test_lazy_reading_still_refuses_foreign_globals(tmp_path: pathlib.Path) -> None:
    evil = tmp_path / "evil"
    evil.write_bytes(b"\x80\x04cos\nsystem\n\x8c\x04echo\x85R.")
    with pytest.raises(CheckpointError, match="refused to unpickle global os.system"):
        read_tensor(evil, lazy=True)


def test_a_process_holding_every_shard_reads_each_array_in_one_go(monkeypatch: pytest.MonkeyPatch) -> None:
    """Eight device shards of one array are one read, not eight strided ones (Grok-1 on one 8-GPU host)."""
    from model_service import file_arrays
    from model_service.config import load_model_config
    from tests.procs import GOLDEN

    preads = []
    real = file_arrays.os.preadv
    monkeypatch.setattr(file_arrays.os, "preadv", lambda *a: preads.append(a[2]) or real(*a))
    params = load_params(str(GOLDEN / "checkpoint"), load_model_config(str(GOLDEN / "config.json")),
                         make_mesh(MeshConfig(1, 8)), jnp.float32)
    # At most one read per parameter array (small ones sit inside pickle frames and come with the opcodes).
    assert 0 < len(preads) <= len(jax.tree.leaves(params))
