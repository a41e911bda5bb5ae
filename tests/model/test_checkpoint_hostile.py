"""Hostile checkpoint files (issue 11, fault 7): the loader checks each file's type and size against what
the model config says it must hold before reading it, refuses anything that is not a regular file inside
ckpt-0/, and names the file in every error. Before: /dev/zero was read without bound (4.4 GB, then a
bare MemoryError), a FIFO hung the loader forever, symlinks were followed out of ckpt-0/."""

from __future__ import annotations

import os
import pathlib
import resource
import shutil
import threading

import jax.numpy as jnp
import pytest

from model_service.checkpoint import CheckpointError, load_params, random_leaves, read_tensor, write_checkpoint
from model_service.config import MeshConfig
from model_service.sharding import make_mesh
from tests.model.test_checkpoint import TINY

VICTIM = "tensor00003_000"  # a QuantizedWeight8bit (moe linear_1) of the tiny config


@pytest.fixture
def ckpt(tmp_path: pathlib.Path) -> pathlib.Path:
    write_checkpoint(tmp_path / "model", TINY, random_leaves(TINY, seed=11))
    return tmp_path / "model"


def load(ckpt: pathlib.Path, timeout: float = 60.0) -> BaseException | None:
    """load_params in a thread (a hang must fail the test, not freeze it); the exception it raised."""
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            load_params(str(ckpt), TINY, make_mesh(MeshConfig()), jnp.float32)
            outcome.append(None)
        except BaseException as error:  # noqa: BLE001 - handed to the test
            outcome.append(error)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout)
    assert outcome, f"load_params did not return within {timeout} s"
    return outcome[0]


def rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def test_a_tensor_symlinked_to_dev_zero_is_refused_without_reading_it(ckpt: pathlib.Path) -> None:
    victim = ckpt / "ckpt-0" / VICTIM
    victim.unlink()
    victim.symlink_to("/dev/zero")
    peak = rss_bytes()
    error = load(ckpt)
    assert isinstance(error, CheckpointError), error
    assert VICTIM in str(error) and "/dev/zero" in str(error)
    assert rss_bytes() - peak < 256 << 20


def test_a_fifo_in_place_of_a_tensor_is_refused_instead_of_hanging(ckpt: pathlib.Path) -> None:
    victim = ckpt / "ckpt-0" / VICTIM
    victim.unlink()
    os.mkfifo(victim)
    error = load(ckpt, timeout=30)
    assert isinstance(error, CheckpointError), error
    assert VICTIM in str(error) and "not a regular file" in str(error)


def test_a_symlink_out_of_the_checkpoint_directory_is_refused(ckpt: pathlib.Path, tmp_path: pathlib.Path) -> None:
    victim = ckpt / "ckpt-0" / VICTIM
    outside = tmp_path / "elsewhere" / VICTIM
    outside.parent.mkdir()
    shutil.move(victim, outside)  # a perfectly valid tensor, just not inside ckpt-0/
    victim.symlink_to(outside)
    error = load(ckpt)
    assert isinstance(error, CheckpointError), error
    assert VICTIM in str(error) and "outside" in str(error) and str(outside) in str(error)


def test_a_symlink_inside_the_checkpoint_directory_still_loads(ckpt: pathlib.Path) -> None:
    victim = ckpt / "ckpt-0" / VICTIM
    real = ckpt / "ckpt-0" / "real_copy"
    shutil.move(victim, real)
    victim.symlink_to(real.name)
    assert load(ckpt) is None


def test_a_tensor_file_larger_than_its_tensor_can_be_is_refused_before_reading(ckpt: pathlib.Path) -> None:
    victim = ckpt / "ckpt-0" / VICTIM
    with open(victim, "r+b") as f:
        f.truncate(64 << 30)  # sparse: 64 GiB claimed, nothing on disk
    peak = rss_bytes()
    error = load(ckpt)
    assert isinstance(error, CheckpointError), error
    assert VICTIM in str(error) and "bytes" in str(error)
    assert rss_bytes() - peak < 256 << 20


def test_a_payload_that_does_not_match_its_record_names_the_file(tmp_path: pathlib.Path) -> None:
    write_checkpoint(tmp_path, TINY, random_leaves(TINY, seed=12))
    path = tmp_path / "ckpt-0" / "tensor00000_000"
    raw = bytearray(path.read_bytes())
    # The array record's state is (1, shape, dtype, fortran, payload): bump the shape's first dimension
    # (the 4-byte int after its 'J' opcode) so the payload no longer matches it.
    index = raw.index(b"(J\x01\x00\x00\x00(J") + 8
    raw[index:index + 4] = (int.from_bytes(raw[index:index + 4], "little") + 1).to_bytes(4, "little")
    path.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="tensor00000_000.*does not match shape"):
        read_tensor(path)
