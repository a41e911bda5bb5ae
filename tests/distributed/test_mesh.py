"""The global mesh of a multi-process replica (sharding.multihost_grid), over stand-ins for the devices of
jobs this box cannot run: one TPU slice of several hosts is one mesh along its ICI torus; slices joined
over the data-center network, and CPU processes, are hybrid meshes whose blocks are their granules."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import pytest
from jax.experimental import mesh_utils

from model_service.config import ConfigError, MeshConfig
from model_service.sharding import joined_by, make_mesh, multihost_grid


@dataclass(frozen=True)
class Device:
    """What mesh_utils reads of a device."""

    id: int
    process_index: int
    platform: str = "tpu"
    device_kind: str = "TPU v4"
    coords: tuple[int, int, int] = (0, 0, 0)
    core_on_chip: int = 0
    slice_index: int = 0


def tpu_slice(slice_index: int = 0, first_id: int = 0, first_process: int = 0) -> list[Device]:
    """A 4x4 slice of 16 chips behind 4 hosts, each host a 2x2 corner of the torus, in jax.devices() order
    (process by process)."""
    devices = []
    for host in range(4):
        for k in range(4):
            x, y = 2 * (host % 2) + k % 2, 2 * (host // 2) + k // 2
            devices.append(Device(first_id + len(devices), first_process + host, coords=(x, y, 0),
                                  slice_index=slice_index))
    return devices


def test_one_tpu_slice_over_several_hosts_is_one_mesh_along_its_torus() -> None:
    devices = tpu_slice()
    assert joined_by(devices) == "slice"
    grid = multihost_grid(MeshConfig(4, 4), MeshConfig(4, 1), devices)
    assert grid.tolist() == mesh_utils.create_device_mesh((4, 4), devices).tolist()
    # the model axis follows the torus: each row is a line of neighbouring chips, not one host's 2x2 corner
    for row in grid:
        assert len({d.coords[1] for d in row}) == 1 or len({d.coords[0] for d in row}) == 1
    hybrid = mesh_utils.create_hybrid_device_mesh((1, 4), (4, 1), devices, process_is_granule=True)
    assert grid.tolist() != hybrid.tolist()


def test_slices_over_the_network_are_the_blocks_of_a_hybrid_mesh() -> None:
    devices = tpu_slice(0) + tpu_slice(1, first_id=16, first_process=4)
    assert joined_by(devices) == "slices"
    grid = multihost_grid(MeshConfig(2, 16), MeshConfig(8, 1), devices)  # 8 processes, 2 slices: 2 data blocks
    assert grid.shape == (2, 16)
    assert [{d.slice_index for d in row} for row in grid] == [{0}, {1}]
    assert sorted(d.id for d in grid.flat) == list(range(32))


def test_cpu_processes_each_own_a_block_as_between_hosts_says() -> None:
    devices = [Device(i, i // 4, platform="cpu", device_kind="cpu") for i in range(8)]
    assert joined_by(devices) == "processes"
    by_model = multihost_grid(MeshConfig(2, 4), MeshConfig(1, 2), devices)
    assert [[d.process_index for d in row] for row in by_model] == [[0, 0, 1, 1], [0, 0, 1, 1]]
    by_data = multihost_grid(MeshConfig(1, 8), MeshConfig(1, 2), devices)
    assert [d.process_index for d in by_data[0]] == [0, 0, 0, 0, 1, 1, 1, 1]


def test_a_mesh_that_does_not_span_every_device_of_the_job_is_refused() -> None:
    devices = [Device(i, i // 4, platform="cpu", device_kind="cpu") for i in range(8)]
    with pytest.raises(ConfigError, match="a multi-process mesh spans every device"):
        multihost_grid(MeshConfig(1, 4), MeshConfig(1, 2), devices)


def test_a_single_process_mesh_over_every_device_uses_them_all_in_order() -> None:
    import jax

    mesh = make_mesh(MeshConfig(1, jax.device_count()))
    assert list(mesh.devices.flat) == jax.devices()
    assert np.asarray(mesh.devices).shape == (1, 1, jax.device_count())  # data, expert, model


def test_a_shape_the_torus_does_not_hold_whole_splits_a_torus_axis() -> None:
    """2,8 on a 4x4 slice: no torus axis holds 8 chips, so one is split over both mesh axes."""
    devices = tpu_slice()
    grid = multihost_grid(MeshConfig(2, 8), MeshConfig(4, 1), devices)
    assert grid.tolist() == mesh_utils.create_device_mesh((2, 8), devices, allow_split_physical_axes=True).tolist()
    assert [{d.coords[1] // 2 for d in row} for row in grid] == [{0}, {1}]  # each row: one half of the torus


def test_devices_the_torus_layout_cannot_place_keep_one_block_per_host(caplog: pytest.LogCaptureFixture) -> None:
    holed = [dataclasses.replace(d, coords=(d.coords[0], d.coords[1] + (d.coords[1] >= 2), 0)) for d in tpu_slice()]
    grid = multihost_grid(MeshConfig(4, 4), MeshConfig(4, 1), holed)
    assert [{d.process_index for d in row} for row in grid] == [{0}, {1}, {2}, {3}]
    assert "not laid along the device links" in caplog.text


def test_an_expert_mesh_over_cpu_processes_cuts_each_process_block_into_expert_groups() -> None:
    from model_service.sharding import default_between_hosts

    devices = [Device(i, i // 4, platform="cpu", device_kind="cpu") for i in range(8)]
    mesh = MeshConfig(data=1, expert=4, model=2)
    between = default_between_hosts(mesh, 2)
    grid = multihost_grid(mesh, between, devices).reshape(1, 4, 2)  # as make_multihost_mesh cuts it
    assert [[d.process_index for d in group] for group in grid[0]] == [[0, 0], [0, 0], [1, 1], [1, 1]]
    assert default_between_hosts(MeshConfig(data=1, expert=8, model=1), 2) == MeshConfig(1, 2)
