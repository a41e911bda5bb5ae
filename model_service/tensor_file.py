"""Reading one tensor file of the released checkpoint format safely: the restricted unpickler.

Only array reconstruction, dtypes (rebuilt canonically, so a pickled bfloat16 dtype can never mutate the
process-wide one) and the quantized-weight record are admitted; any other global is refused before
anything runs. Every size a pickle announces is checked against the bytes left in the file before
anything is allocated for it. Before a file is read, it must be a regular file inside ckpt-0/ (symlinks
may not lead out of it; devices and FIFOs are refused without opening them for a blocking read) and no
larger than the tensor the config expects can be; every error names the file. checkpoint.py builds the
model's parameters from these tensors.
"""

from __future__ import annotations

import io
import math
import os
import pathlib
import pickle
import stat
import struct
from typing import Any

import ml_dtypes
import numpy as np

from model_service.file_arrays import FileArray
from model_service.model.params import TensorSpec

BASIC_DTYPE_CODES = {"f2", "f4", "f8", "i1", "i2", "i4", "i8", "u1", "u2", "u4", "u8", "b1"}
# Pickle opcodes, the dtype records and the quantized-weight wrapper around a tensor's raw bytes.
_PICKLE_OVERHEAD = 64 << 10


class CheckpointError(ValueError):
    """A checkpoint that cannot be read into this model; the message says what differs."""


class _NDArrayMarker:
    """Stands in for numpy.ndarray inside a pickle."""


class _BFloat16Marker:
    """Stands in for ml_dtypes.bfloat16 inside a pickle."""


class _DTypeStub:
    """Records a pickled dtype; its state is kept but never applied to a real dtype object."""

    def __init__(self, spec: Any, align: bool = False, copy: bool = False) -> None:
        self.spec, self.state = spec, None

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def resolve(self) -> np.dtype:
        if self.spec is _BFloat16Marker:
            return np.dtype(ml_dtypes.bfloat16)
        if not isinstance(self.spec, str) or self.spec not in BASIC_DTYPE_CODES:
            raise CheckpointError(f"refused array dtype {self.spec!r}: only numeric dtypes are allowed")
        order = self.state[1] if isinstance(self.state, tuple) and len(self.state) > 1 else "<"
        return np.dtype(self.spec).newbyteorder(">" if order == ">" else "<")


class _ArrayStub:
    """Records a pickled ndarray's (shape, dtype, order, raw bytes); materialised with canonical dtypes."""

    def __init__(self) -> None:
        self.state: Any = None

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def materialize(self) -> np.ndarray:
        if not isinstance(self.state, tuple) or len(self.state) != 5:
            raise CheckpointError("malformed array record in checkpoint")
        _, shape, dtype, fortran, raw = self.state
        if not isinstance(dtype, _DTypeStub) or not isinstance(raw, (bytes, bytearray, _Payload)):
            raise CheckpointError("refused array: object arrays and non-byte payloads are not allowed")
        dt = dtype.resolve()
        if len(raw) != math.prod(shape) * dt.itemsize:
            raise CheckpointError(f"array payload of {len(raw)} bytes does not match shape {shape} {dt}")
        if isinstance(raw, _Payload):
            if not fortran:  # stays on disk; regions are read on demand
                return FileArray(raw.path, raw.offset, shape, dt)
            raw = raw.read()
        arr = np.frombuffer(raw, dtype=dt).reshape(shape, order="F" if fortran else "C")
        return arr.astype(dt.newbyteorder("="), copy=False)


class _QuantizedStub:
    """Receives the fields of a pickled `__main__.QuantizedWeight8bit`."""

    def __setstate__(self, state: Any) -> None:
        if not isinstance(state, dict) or set(state) != {"weight", "scales"}:
            raise CheckpointError("malformed QuantizedWeight8bit record in checkpoint")
        self.weight, self.scales = state["weight"], state["scales"]


def _reconstruct(cls: Any, shape: Any, typecode: Any) -> _ArrayStub:
    if cls is not _NDArrayMarker:
        raise CheckpointError("refused array reconstruction of a non-ndarray type")
    return _ArrayStub()


def _frombuffer(buf: Any, dtype: Any, shape: Any, order: str) -> _ArrayStub:
    stub = _ArrayStub()
    stub.state = (1, tuple(shape), dtype, order == "F", buf if isinstance(buf, _Payload) else bytes(buf))
    return stub


class _Payload:
    """Where a pickled bytes object sits in its file (read lazily by `_LocatingUnpickler`)."""

    def __init__(self, path: str, offset: int, length: int) -> None:
        self.path, self.offset, self.length = path, offset, length

    def __len__(self) -> int:
        return self.length

    def read(self) -> bytes:
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            return f.read(self.length)


_ALLOWED: dict[tuple[str, str], Any] = {
    ("numpy.core.multiarray", "_reconstruct"): _reconstruct,
    ("numpy._core.multiarray", "_reconstruct"): _reconstruct,
    ("numpy._core.numeric", "_frombuffer"): _frombuffer,
    ("numpy.core.numeric", "_frombuffer"): _frombuffer,
    ("numpy", "ndarray"): _NDArrayMarker,
    ("numpy", "dtype"): _DTypeStub,
    ("ml_dtypes", "bfloat16"): _BFloat16Marker,
    ("__main__", "QuantizedWeight8bit"): _QuantizedStub,
}


def _refuse_global(module: str, name: str) -> Any:
    try:
        return _ALLOWED[(module, name)]
    except KeyError:
        raise CheckpointError(f"refused to unpickle global {module}.{name}: checkpoints may only contain "
                              f"numpy arrays and QuantizedWeight8bit") from None


def _past_the_end(n: int, left: int) -> CheckpointError:
    return CheckpointError(f"a pickle record of {n} bytes runs past the end of the file ({left} bytes are left): "
                           "truncated or corrupt")


class _SizedFile:
    """The file as an unpickler reads it: a read asking for more than is left of the file is refused before
    anything is allocated for it (FileIO.read(n) allocates n bytes first, whatever the file holds)."""

    def __init__(self, file: Any, size: int) -> None:
        self.file, self.size = file, size

    def left(self) -> int:
        return self.size - self.file.tell()

    def read(self, n: int = -1) -> bytes:
        left = self.left()
        if n > left:
            raise _past_the_end(n, left)
        return self.file.read(left if n < 0 else n)

    def readinto(self, buffer: Any) -> int:
        if len(buffer) > self.left():
            raise _past_the_end(len(buffer), self.left())
        return self.file.readinto(buffer)

    def readline(self) -> bytes:
        return self.file.readline()


class RestrictedUnpickler(pickle._Unpickler):  # type: ignore[name-defined]  # noqa: SLF001
    """Admits only the globals in _ALLOWED, each mapped to an inert stand-in, and checks every announced size
    against the bytes left before allocating for it.

    The pure-Python unpickler, because its opcode table can be extended (C's allocates a BYTEARRAY8's size
    before reading it); a checkpoint file has only a few dozen opcodes, so its speed does not matter, and the
    array bytes themselves are never parsed by it.
    """

    find_class = staticmethod(_refuse_global)  # type: ignore[assignment]
    dispatch = dict(pickle._Unpickler.dispatch)  # type: ignore[attr-defined]  # noqa: SLF001

    def __init__(self, file: Any, size: int | None = None) -> None:
        self._sized = _SizedFile(file, len(file.getbuffer()) if size is None else size)
        super().__init__(self._sized)

    def _left(self) -> int:
        """Bytes still unread: the rest of the current frame, then the rest of the file."""
        frame = self._unframer.current_frame
        in_frame = len(frame.getbuffer()) - frame.tell() if frame is not None else 0
        return in_frame + self._sized.left()

    def _load_bytearray8(self) -> None:
        (n,) = struct.unpack("<Q", self.read(8))
        if n > self._left():
            raise _past_the_end(n, self._left())
        buffer = bytearray(n)
        self.readinto(buffer)
        self.append(buffer)

    dispatch[pickle.BYTEARRAY8[0]] = _load_bytearray8


class _LocatingUnpickler(RestrictedUnpickler):
    """RestrictedUnpickler's rules, but byte payloads outside pickle frames are located, not read."""

    dispatch = dict(RestrictedUnpickler.dispatch)

    def __init__(self, file: Any, path: str) -> None:
        self._raw_file = file
        self._path = path
        self._size = os.fstat(file.fileno()).st_size
        super().__init__(file, self._size)

    def _payload(self, n: int) -> bytes | _Payload:
        frame = self._unframer.current_frame
        if frame is not None and frame.tell() < len(frame.getbuffer()):
            return self.read(n)  # inside an in-memory frame: small, already read
        self._unframer.current_frame = None
        offset = self._raw_file.tell()
        if offset + n > self._size:
            raise CheckpointError(f"array payload of {n} bytes runs past the end of the file (truncated?)")
        self._raw_file.seek(n, io.SEEK_CUR)
        return _Payload(self._path, offset, n)

    def _load_binbytes(self) -> None:
        (n,) = struct.unpack("<I", self.read(4))
        self.append(self._payload(n))

    def _load_binbytes8(self) -> None:
        (n,) = struct.unpack("<Q", self.read(8))
        self.append(self._payload(n))

    dispatch[pickle.BINBYTES[0]] = _load_binbytes
    dispatch[pickle.BINBYTES8[0]] = _load_binbytes8


def _materialize(obj: Any) -> Any:
    if isinstance(obj, _ArrayStub):
        return obj.materialize()
    if isinstance(obj, _QuantizedStub):
        return (_materialize(obj.weight), _materialize(obj.scales))
    raise CheckpointError(f"unexpected object of type {type(obj).__name__} in checkpoint")


def open_checked(path: pathlib.Path | str, max_bytes: int, root: pathlib.Path | None = None) -> tuple[Any, str]:
    """An unbuffered binary file object for `path` and its real path, after checking, before reading anything,
    that it is a regular file of at most `max_bytes` (inside `root` if given).

    A symlink to /dev/zero or a huge file would otherwise be read without bound, and a FIFO would block the
    open forever (it is opened non-blocking and checked first).
    """
    path = pathlib.Path(path)
    real = path.resolve()
    if root is not None and not real.is_relative_to(root.resolve()):
        raise CheckpointError(f"{path}: is a symlink to {real}, outside {root}; copy the file into the "
                              "checkpoint directory instead of linking to it")
    try:
        fd = os.open(real, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot open ({e.strerror})") from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise CheckpointError(f"{path}: not a regular file ({_kind(info.st_mode)}"
                              f"{f' {real}' if real != path.absolute() else ''}); a checkpoint tensor must be a "
                              "plain file")
    if info.st_size > max_bytes:
        os.close(fd)
        raise CheckpointError(f"{path}: is {info.st_size} bytes, more than the {max_bytes} bytes its tensor can "
                              "take: the wrong file, or a checkpoint of a different model config")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb", buffering=0), str(real)


def read_bounded(path: pathlib.Path | str, max_bytes: int, root: pathlib.Path | None = None) -> bytes:
    """The bytes of `path`, checked as `open_checked` does."""
    f, _ = open_checked(path, max_bytes, root)
    with f:
        try:
            data = f.read(min(os.fstat(f.fileno()).st_size, max_bytes) + 1)  # never more than the file holds
        except (OSError, MemoryError) as e:
            raise CheckpointError(f"{path}: could not be read ({type(e).__name__}: {e})") from None
    if len(data) > max_bytes:  # grew while being read
        raise CheckpointError(f"{path}: is more than the {max_bytes} bytes its tensor can take")
    return data


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISDIR, "a directory"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a file"


def tensor_max_bytes(spec: TensorSpec) -> int:
    """The largest file a tensor of `spec` can be: its values at the widest dtype the reader admits."""
    widest = 8  # float64/int64
    if spec.quantized:
        return math.prod(spec.shape) + math.prod(spec.scales_shape) * widest + _PICKLE_OVERHEAD
    return math.prod(spec.shape) * widest + _PICKLE_OVERHEAD


def read_tensor(path: pathlib.Path | str, lazy: bool = False, max_bytes: int | None = None,
                root: pathlib.Path | None = None) -> Any:
    """One checkpoint file -> numpy array, or (int8 weight, bfloat16 scales) for a QuantizedWeight8bit.

    lazy: arrays stay on disk as FileArray (same shape and dtype) until regions of them are read.
    max_bytes (and root): the file is checked first (see `open_checked`). Every error names the file.
    """
    try:
        if lazy:
            if max_bytes is not None:
                f, real = open_checked(path, max_bytes, root)
            else:
                f, real = open(path, "rb", buffering=0), str(path)
            with f:  # unbuffered: read nothing beyond the pickle's opcodes
                obj = _LocatingUnpickler(f, real).load()
        else:
            if max_bytes is not None:
                data = read_bounded(path, max_bytes, root)
            else:
                with open(path, "rb") as f:
                    data = f.read()
            obj = RestrictedUnpickler(io.BytesIO(data)).load()
        return _materialize(obj)
    except CheckpointError as e:
        message = str(e)
        raise CheckpointError(message if message.startswith(f"{path}:") else f"{path}: {message}") from None
    except Exception as e:  # truncated or corrupt pickles raise many types
        raise CheckpointError(f"{path}: not a readable checkpoint tensor ({type(e).__name__}: {e})") from None
