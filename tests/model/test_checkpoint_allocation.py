"""A tiny tensor file whose pickle announces a huge record (a FRAME, a BINUNICODE8 string, a BYTEARRAY8)
is refused before anything is allocated for it: sizes are checked against the bytes left in the file
(itself no larger than its tensor can be for the config). The loader used to ask for the announced size
first (4 GiB requested for a 20-byte file; 2^40 ended in a bare MemoryError)."""

from __future__ import annotations

import pathlib
import pickle
import struct
import tracemalloc

import pytest

from model_service.checkpoint import CheckpointError, read_tensor

GIB = 1 << 30


def hostile(tmp_path: pathlib.Path, opcode: bytes, size: int, protocol: int = 4) -> pathlib.Path:
    path = tmp_path / "ckpt-0" / "tensor00000_000"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(bytes([pickle.PROTO[0], protocol]) + opcode + struct.pack("<Q", size) + b"x" * 8 + pickle.STOP)
    return path


@pytest.mark.parametrize(("opcode", "size", "protocol"), [
    (pickle.FRAME, 4 * GIB, 4),
    (pickle.FRAME, 1 << 40, 4),
    (pickle.BINUNICODE8, 4 * GIB, 4),
    (pickle.BYTEARRAY8, 256 << 20, 5),  # bytearray(n) is zero-filled: kept small enough to run before the fix
], ids=["frame 4GiB", "frame 2^40", "binunicode8 4GiB", "bytearray8 256MiB"])
def test_a_huge_record_in_a_tiny_file_is_refused_before_allocating(tmp_path: pathlib.Path, opcode: bytes, size: int,
                                                                   protocol: int) -> None:
    path = hostile(tmp_path, opcode, size, protocol)
    tracemalloc.start()
    try:
        with pytest.raises(CheckpointError) as caught:
            read_tensor(path, lazy=True, max_bytes=1 << 20, root=path.parent)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20, f"{peak} bytes allocated"
    message = str(caught.value)
    assert message.startswith(str(path)) and "past the end of the file" in message, message


def test_the_eager_reader_refuses_them_too(tmp_path: pathlib.Path) -> None:
    path = hostile(tmp_path, pickle.BYTEARRAY8, 256 << 20, 5)
    tracemalloc.start()
    try:
        with pytest.raises(CheckpointError, match="past the end of the file"):
            read_tensor(path, lazy=False, max_bytes=1 << 20, root=path.parent)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20, f"{peak} bytes allocated"
