"""A process reads its own region of an MoE matrix in large reads straight into its device shards
(model_service/shard_reads.py): one read per expert, or per block of whole rows, never the whole tensor, and no
host copy of the region beside the shards; what it places equals the reference loader's arrays on every mesh.

A process of a group is simulated by its share of the mesh's devices: the processes split the data axis when they
divide it, else the expert-major (expert, model) devices in order (sharding.default_between_hosts and
multihost_grid), so with experts split, process p holds the expert groups after those of processes 0..p-1.
"""

from __future__ import annotations

import math
import pathlib

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding

from model_service import file_arrays, shard_reads
from model_service.checkpoint import encode_tensor, load_params, place_leaf, random_leaves, read_tensor, write_checkpoint
from model_service.config import MeshConfig, load_model_config
from model_service.model.params import TensorSpec, set_leaf, tensor_specs, to_internal
from model_service.sharding import EXPERT_SPECS, default_between_hosts, fit_spec, make_mesh
from tests.procs import GOLDEN

CFG = load_model_config(str(GOLDEN / "config.json"))  # 8 experts of [128, 688], 2 layers
MOE = {name: next(s for s in tensor_specs(CFG) if s.module.endswith(f"decoder_layer_0/moe/{name}"))
       for name in ("linear", "linear_1")}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    out = tmp_path_factory.mktemp("random_golden")
    write_checkpoint(out, CFG, random_leaves(CFG, seed=3))
    return out


@pytest.fixture
def preads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The size of every read of array bytes from a checkpoint file (file_arrays reads them with preadv)."""
    sizes: list[int] = []
    real = file_arrays.os.preadv
    monkeypatch.setattr(file_arrays.os, "preadv", lambda fd, buffers, offset: sizes.append(len(buffers[0])) or
                        real(fd, buffers, offset))
    return sizes


def lazy_weight(checkpoint: pathlib.Path, spec: TensorSpec) -> file_arrays.FileArray:
    index = tensor_specs(CFG).index(spec)
    return read_tensor(checkpoint / "ckpt-0" / f"tensor{index:05d}_000", lazy=True)[0]


def process_devices(mesh: jax.sharding.Mesh, mesh_cfg: MeshConfig, processes: int, p: int) -> set[jax.Device]:
    between = default_between_hosts(mesh_cfg, processes)
    grid = mesh.devices.reshape(mesh_cfg.data, mesh_cfg.expert * mesh_cfg.model)
    rows, cols = grid.shape[0] // between.data, grid.shape[1] // between.model
    i, j = divmod(p, between.model)
    return set(grid[i * rows:(i + 1) * rows, j * cols:(j + 1) * cols].flat)


def read_as_process(arr: file_arrays.FileArray, sharding: NamedSharding, devices: set[jax.Device],
                    read_bytes: int) -> list[shard_reads.Shard]:
    index_map = {d: i for d, i in sharding.devices_indices_map(arr.shape).items() if d in devices}
    shards = shard_reads.shards_of(arr.shape, index_map, arr.dtype)
    done = list(shard_reads.read_shards(arr, shards, read_bytes))
    assert len(done) == len(shards)
    return shards


@pytest.mark.parametrize("mesh_text, processes", [("1,2,4", 2), ("1,4,2", 2), ("1,8,1", 4), ("1,4,2", 1),
                                                  ("2,4,1", 2)])
@pytest.mark.parametrize("name", ["linear", "linear_1"])
def test_each_process_reads_its_own_experts_one_read_per_expert(checkpoint, preads, mesh_text, processes, name):
    mesh_cfg = MeshConfig.parse(mesh_text)
    mesh, spec = make_mesh(mesh_cfg), MOE[name]
    arr = lazy_weight(checkpoint, spec)
    reference = np.asarray(read_tensor(checkpoint / "ckpt-0" / pathlib.Path(arr.path).name)[0])
    sharding = NamedSharding(mesh, fit_spec(EXPERT_SPECS[(name, "weight")], arr.shape, mesh))
    expert_bytes = math.prod(arr.shape[1:])
    for p in range(processes):
        preads.clear()
        shards = read_as_process(arr, sharding, process_devices(mesh, mesh_cfg, processes, p), expert_bytes)
        held = {e for s in shards for e in range(*s.box[0])}
        assert len(preads) == len(held) and set(preads) == {expert_bytes}, (p, preads)
        for shard in shards:
            np.testing.assert_array_equal(shard.buffer, reference[tuple(slice(a, b) for a, b in shard.box)])


@pytest.mark.parametrize("name", ["linear", "linear_1"])
def test_an_expert_larger_than_a_read_is_read_in_blocks_of_whole_rows(checkpoint, preads, name):
    mesh_cfg = MeshConfig(1, model=4, expert=2)
    mesh, spec = make_mesh(mesh_cfg), MOE[name]
    arr = lazy_weight(checkpoint, spec)
    rows, row_bytes = arr.shape[1:]
    per_read = 32  # rows
    sharding = NamedSharding(mesh, fit_spec(EXPERT_SPECS[(name, "weight")], arr.shape, mesh))
    read_as_process(arr, sharding, process_devices(mesh, mesh_cfg, 2, 0), per_read * row_bytes)
    assert len(preads) == 4 * math.ceil(rows / per_read)  # the process's 4 experts
    assert all(size % row_bytes == 0 and size <= per_read * row_bytes for size in preads)
    assert sum(preads) == 4 * rows * row_bytes


@pytest.mark.parametrize("mesh_text", ["1,8", "1,4,2", "1,8,1", "2,4,1"])
@pytest.mark.parametrize("read_bytes", [None, 4096])
def test_loaded_arrays_equal_the_reference_loaders(checkpoint, monkeypatch, mesh_text, read_bytes):
    """Every parameter, as load_params places it (stacked experts on an expert mesh, one matrix per expert, some
    transposed, on 1,8), equals the reference loader's: every file read whole, then each shard sliced from it."""
    if read_bytes:  # a read smaller than one expert: blocks of rows, shards filled across several reads
        monkeypatch.setattr(shard_reads, "READ_BYTES", read_bytes)
    mesh_cfg = MeshConfig.parse(mesh_text)
    mesh, stacked = make_mesh(mesh_cfg), mesh_cfg.expert > 1
    loaded = load_params(str(checkpoint), CFG, mesh, jnp.float32, stacked=stacked)
    reference: dict = {}
    for i, spec in enumerate(tensor_specs(CFG)):
        leaf = read_tensor(checkpoint / "ckpt-0" / f"tensor{i:05d}_000")
        set_leaf(reference, spec, place_leaf(spec, to_internal(spec, leaf, jnp.float32, stacked=stacked), mesh))
    pairs = zip(jax.tree.leaves_with_path(reference), jax.tree.leaves_with_path(loaded), strict=True)
    for (path, want), (_, got) in pairs:
        assert got.sharding == want.sharding and got.dtype == want.dtype, path
        for a, b in zip(want.addressable_shards, got.addressable_shards, strict=True):
            assert a.device == b.device and a.index == b.index, path
            np.testing.assert_array_equal(np.asarray(a.data), np.asarray(b.data), err_msg=str(path))


def test_loading_reads_each_expert_in_one_read_not_row_by_row(checkpoint, preads, monkeypatch):
    """A whole checkpoint on an expert mesh: the reads number O(experts x layers) (one per expert of each MoE
    matrix, one per other array at most), whatever the rows."""
    monkeypatch.setattr(shard_reads, "READ_BYTES", 128 * 688)  # one expert matrix a read
    params = load_params(str(checkpoint), CFG, make_mesh(MeshConfig(1, model=4, expert=2)), jnp.float32, stacked=True)
    moe_matrices = 3 * CFG.model.num_layers
    assert len(preads) <= moe_matrices * CFG.model.num_experts + len(jax.tree.leaves(params))
    assert max(preads) == 128 * 688


def _rss(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(f"{field}:"))


def test_peak_host_memory_while_loading_stays_near_what_the_devices_keep(tmp_path, monkeypatch):
    """A 64 MiB MoE matrix onto 8 expert groups: the process's peak RSS over its baseline is at most 1.25x the
    bytes its devices keep (a host copy of the tensor beside the shards would make it 2x)."""
    monkeypatch.setattr(shard_reads, "READ_BYTES", 4 << 20)
    spec = TensorSpec("language_model/transformer/decoder_layer_0/moe/linear", "w", (8, 1024, 8192), 1)
    rng = np.random.default_rng(0)
    path = tmp_path / "tensor"
    path.write_bytes(_encoded(rng.integers(-127, 128, spec.shape, dtype=np.int8), spec))
    mesh = make_mesh(MeshConfig(1, model=1, expert=8))
    leaf = read_tensor(path, lazy=True)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak (VmHWM) starts again from the current RSS
    base = _rss("VmRSS")
    placed = place_leaf(spec, to_internal(spec, leaf, jnp.float32, stacked=True), mesh)
    jax.block_until_ready(placed)
    kept = sum(s.data.nbytes for a in jax.tree.leaves(placed) for s in a.addressable_shards)
    assert kept >= 64 << 20
    assert _rss("VmHWM") - base <= 1.25 * kept, (_rss("VmHWM") - base, kept)


def _encoded(weight: np.ndarray, spec: TensorSpec) -> bytes:
    return encode_tensor((weight, np.ones(spec.scales_shape, ml_dtypes.bfloat16)))


@pytest.mark.parametrize("shape", [(3, 5), (4, 1 << 20)])  # below and above the size mapped on its own
def test_a_shard_buffer_becomes_the_cpu_devices_memory_without_a_copy(shape):
    buffer = shard_reads.aligned_empty(shape, np.int8)
    buffer[:] = 3
    placed = jax.device_put(buffer, jax.devices()[0], may_alias=True)
    assert buffer.ctypes.data % 64 == 0 and placed.unsafe_buffer_pointer() == buffer.ctypes.data
    np.testing.assert_array_equal(np.asarray(placed), buffer)
