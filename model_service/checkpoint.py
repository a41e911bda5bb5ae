"""Read and write the released Grok-1 checkpoint format safely.

Format: `<dir>/ckpt-0/tensor{i:05d}_000`, one pickle per leaf of TrainingState(params=...) in tree-flatten
order; int8 matrices as `__main__.QuantizedWeight8bit` (int8 `weight` + bfloat16 `scales`), the rest numpy
float32 arrays, written by numpy 1.x (`numpy.core.multiarray._reconstruct`).

Reading uses a restricted unpickler: only array reconstruction, dtypes (rebuilt canonically, so a pickled
bfloat16 dtype can never mutate the process-wide one) and the quantized-weight record are admitted; any other
global is refused before anything runs. Before a file is read, it must be a regular file inside ckpt-0/
(symlinks may not lead out of it; devices and FIFOs are refused without opening them for a blocking read)
and no larger than the tensor the config expects can be; every error names the file. Each tensor goes
straight onto its sharding, and `load_params` reads from disk only the regions of each array that this
process's devices hold (file_arrays.FileArray): with one replica spread over several processes, no process
reads the whole checkpoint.
"""

from __future__ import annotations

import io
import json
import math
import os
import pathlib
import pickle
import stat
import struct
from collections.abc import Callable
from typing import Any

import jax
import ml_dtypes
import numpy as np
from jax.sharding import Mesh, NamedSharding

from model_service.config import ModelConfig
from model_service.file_arrays import FileArray
from model_service.model.params import Params, TensorSpec, pack_for_native, random_leaf, set_leaf, tensor_specs, to_checkpoint, \
    to_internal
from model_service.sharding import fit_spec, path_to_str, spec_for_path

Progress = Callable[[int, int], None]
_BASIC_CODES = {"f2", "f4", "f8", "i1", "i2", "i4", "i8", "u1", "u2", "u4", "u8", "b1"}
# Pickle opcodes, the dtype records and the quantized-weight wrapper around a tensor's raw bytes.
_PICKLE_OVERHEAD = 64 << 10
_MANIFEST_MAX_BYTES = 16 << 20


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
        if not isinstance(self.spec, str) or self.spec not in _BASIC_CODES:
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


class RestrictedUnpickler(pickle.Unpickler):
    """Admits only the globals in _ALLOWED, each mapped to an inert stand-in."""

    def find_class(self, module: str, name: str) -> Any:
        try:
            return _ALLOWED[(module, name)]
        except KeyError:
            raise CheckpointError(f"refused to unpickle global {module}.{name}: checkpoints may only contain "
                                  f"numpy arrays and QuantizedWeight8bit") from None


class _LocatingUnpickler(pickle._Unpickler):  # type: ignore[name-defined]  # noqa: SLF001
    """RestrictedUnpickler's rules, but byte payloads outside pickle frames are located, not read.

    The pure-Python unpickler is used because its opcode table can be extended; a checkpoint file has only a
    few dozen opcodes, so its speed does not matter, and the array bytes themselves are never parsed by it.
    """

    find_class = RestrictedUnpickler.find_class
    dispatch = dict(pickle._Unpickler.dispatch)  # type: ignore[attr-defined]  # noqa: SLF001

    def __init__(self, file: Any, path: str) -> None:
        super().__init__(file)
        self._raw_file = file
        self._path = path
        self._size = os.fstat(file.fileno()).st_size

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
            data = f.read(max_bytes + 1)
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


# ---- writing: emits the same opcodes numpy 1.x produces for arrays, so older readers load it too ----

def _op_global(module: str, name: str) -> bytes:
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def _op_int(v: int) -> bytes:
    return b"J" + struct.pack("<i", v)


def _op_str(s: str) -> bytes:
    raw = s.encode()
    return b"X" + struct.pack("<I", len(raw)) + raw


def _op_bytes(raw: bytes) -> bytes:
    return b"\x8e" + struct.pack("<Q", len(raw)) + raw


def _op_tuple(items: list[bytes]) -> bytes:
    return b"(" + b"".join(items) + b"t"


def _encode_dtype(dt: np.dtype) -> bytes:
    if dt == np.dtype(ml_dtypes.bfloat16):
        spec, state = _op_global("ml_dtypes", "bfloat16"), [_op_int(3), _op_str("<"), b"NNN",
                                                           _op_int(2), _op_int(2), _op_int(80)]
    else:
        code = dt.str[1:]
        if code not in _BASIC_CODES:
            raise CheckpointError(f"cannot write dtype {dt}")
        spec, state = _op_str(code), [_op_int(3), _op_str(dt.str[0]), b"NNN", _op_int(-1), _op_int(-1), _op_int(0)]
    return _op_global("numpy", "dtype") + spec + b"\x89\x88\x87R" + _op_tuple(state) + b"b"


def _encode_array(arr: np.ndarray) -> bytes:
    arr = np.ascontiguousarray(arr)
    head = _op_global("numpy.core.multiarray", "_reconstruct") + _op_global("numpy", "ndarray")
    head += _op_tuple([_op_int(0)]) + b"C\x01b\x87R"
    state = [_op_int(1), _op_tuple([_op_int(d) for d in arr.shape]), _encode_dtype(arr.dtype), b"\x89",
             _op_bytes(arr.tobytes())]
    return head + _op_tuple(state) + b"b"


def encode_tensor(leaf: Any) -> bytes:
    """A numpy array, or (int8 weight, bfloat16 scales), as a protocol-4 pickle in the released layout."""
    if isinstance(leaf, tuple):
        weight, scales = leaf
        body = _op_global("__main__", "QuantizedWeight8bit") + b")\x81}(" + _op_str("weight") + \
            _encode_array(weight) + _op_str("scales") + _encode_array(scales) + b"ub"
    else:
        body = _encode_array(np.asarray(leaf))
    return b"\x80\x04" + body + b"."


def write_checkpoint(out_dir: pathlib.Path | str, cfg: ModelConfig, leaves: Any, progress: Progress | None = None) -> None:
    """Write checkpoint-layout leaves (an iterable in tensor_specs order) plus a manifest.json."""
    ckpt = pathlib.Path(out_dir) / "ckpt-0"
    ckpt.mkdir(parents=True, exist_ok=True)
    specs = tensor_specs(cfg)
    manifest = []
    for i, (spec, leaf) in enumerate(zip(specs, leaves, strict=True)):
        (ckpt / f"tensor{i:05d}_000").write_bytes(encode_tensor(leaf))
        manifest.append({"index": i, "name": spec.ckpt_path, "kind": "QuantizedWeight8bit" if spec.quantized
                         else "ndarray", "shape": list(spec.shape)})
        if progress:
            progress(i + 1, len(specs))
    (pathlib.Path(out_dir) / "manifest.json").write_text(json.dumps({"tensors": manifest}, indent=1))


def save_params(params: Params, cfg: ModelConfig, out_dir: pathlib.Path | str) -> None:
    """Write in-memory params back in the released format."""
    leaves = (to_checkpoint(s, params[s.module][s.name]) for s in tensor_specs(cfg))
    write_checkpoint(out_dir, cfg, leaves)


# ---- loading onto the mesh ----

def _check_layout(ckpt: pathlib.Path, specs: list[TensorSpec]) -> None:
    if not ckpt.is_dir():
        raise CheckpointError(f"no checkpoint directory {ckpt} (expected <dir>/ckpt-0/tensor00000_000 ...)")
    found = sorted(p.name for p in ckpt.glob("tensor*_000"))
    expected = [f"tensor{i:05d}_000" for i in range(len(specs))]
    manifest_path = ckpt.parent / "manifest.json"
    if manifest_path.is_file():
        try:
            manifest = json.loads(read_bounded(manifest_path, _MANIFEST_MAX_BYTES))
            names = [t["name"] for t in manifest.get("tensors", [])]
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"{manifest_path}: not a checkpoint manifest ({type(e).__name__}: {e})") from None
        want = [s.ckpt_path for s in specs]
        if names != want:
            raise CheckpointError(f"checkpoint parameters do not match the model config.\n"
                                  f"Params missing in checkpoint: {sorted(set(want) - set(names))}\n"
                                  f"Params missing in code: {sorted(set(names) - set(want))}")
    if found != expected:
        missing = [f"{n} ({s.ckpt_path})" for n, s in zip(expected, specs) if n not in set(found)]
        extra = sorted(set(found) - set(expected))
        raise CheckpointError(f"checkpoint {ckpt} has {len(found)} tensors, the config expects {len(specs)}.\n"
                              f"Params missing in checkpoint: {missing}\nTensors missing in code: {extra}")


def _check_leaf(spec: TensorSpec, leaf: Any, index: int) -> None:
    if spec.quantized:
        ok = isinstance(leaf, tuple) and leaf[0].shape == spec.shape and leaf[1].shape == spec.scales_shape \
            and leaf[0].dtype == np.int8
        got = f"{leaf[0].shape}/{leaf[1].shape} {leaf[0].dtype}" if isinstance(leaf, tuple) else f"array {leaf.shape}"
        want = f"QuantizedWeight8bit int8 {spec.shape} with scales {spec.scales_shape}"
    else:
        ok = not isinstance(leaf, tuple) and leaf.shape == spec.shape
        got = f"QuantizedWeight8bit {leaf[0].shape}" if isinstance(leaf, tuple) else f"array {leaf.shape}"
        want = f"array {spec.shape}"
    if not ok:
        raise CheckpointError(f"tensor{index:05d}_000 ({spec.ckpt_path}): checkpoint has {got}, the config expects {want}")


def _place(arr: np.ndarray | FileArray, mesh: Mesh, path: str) -> jax.Array:
    sharding = NamedSharding(mesh, fit_spec(spec_for_path(path), arr.shape, mesh))
    source = _read_addressable(arr, sharding) if isinstance(arr, FileArray) else arr
    return jax.make_array_from_callback(arr.shape, sharding, lambda idx: source[idx])


def _read_addressable(arr: FileArray, sharding: NamedSharding) -> Any:
    """Read only what this process's devices hold: in one region when their shards tile a box (a process
    that holds every shard reads the tensor in one go), else shard by shard."""
    shape = arr.shape
    shards = {tuple(s.indices(n)[:2] for s, n in zip(idx, shape))
              for idx in sharding.addressable_devices_indices_map(shape).values()}
    box = tuple((min(s[a][0] for s in shards), max(s[a][1] for s in shards)) for a in range(len(shape)))
    if math.prod(b - a for a, b in box) != sum(math.prod(b - a for a, b in s) for s in shards):
        return _ShardReader(arr)
    return _Region(arr.read(tuple(slice(a, b) for a, b in box)), tuple(a for a, _ in box), shape)


class _Region:
    """A region read from a larger array, answering indices of the whole array."""

    def __init__(self, data: np.ndarray, start: tuple[int, ...], shape: tuple[int, ...]) -> None:
        self.data, self.start, self.shape = data, start, shape

    def __getitem__(self, idx: tuple[slice, ...]) -> np.ndarray:
        bounds = [s.indices(n)[:2] for s, n in zip(idx, self.shape)]
        return self.data[tuple(slice(a - o, b - o) for (a, b), o in zip(bounds, self.start))]


class _ShardReader:
    """Reads each device's shard on request (shards that do not tile a box)."""

    def __init__(self, arr: FileArray) -> None:
        self.arr = arr

    def __getitem__(self, idx: tuple[slice, ...]) -> np.ndarray:
        return self.arr.read(idx)


def place_leaf(spec: TensorSpec, internal: Any, mesh: Mesh) -> Any:
    """Put every array of one parameter (plain, QuantizedWeight or ExpertStack) onto its sharding."""
    base = f"{spec.module}/{spec.name}"

    def put(path: tuple[Any, ...], arr: np.ndarray) -> jax.Array:
        sub = path_to_str(path)
        return _place(arr, mesh, f"{base}/{sub}" if sub else base)

    return jax.tree_util.tree_map_with_path(put, internal)


def _for_products(spec: TensorSpec, internal: Any, mesh: Mesh, pack: bool) -> Any:
    """With native products, a matrix is packed on the host before it reaches the devices (never held twice)."""
    return pack_for_native(spec.module, internal, mesh) if pack else internal


def load_params(ckpt_dir: str, cfg: ModelConfig, mesh: Mesh, dtype: Any, progress: Progress | None = None,
                pack: bool = False) -> Params:
    """Read `<ckpt_dir>/ckpt-0` into sharded device arrays, one tensor at a time (`pack`: the expert matrices
    packed for native products, as GrokModel.pack_params would)."""
    specs = tensor_specs(cfg)
    ckpt = pathlib.Path(ckpt_dir) / "ckpt-0"
    _check_layout(ckpt, specs)
    params: Params = {}
    for i, spec in enumerate(specs):
        leaf = read_tensor(ckpt / f"tensor{i:05d}_000", lazy=True, max_bytes=tensor_max_bytes(spec), root=ckpt)
        _check_leaf(spec, leaf, i)
        set_leaf(params, spec, place_leaf(spec, _for_products(spec, to_internal(spec, leaf, dtype), mesh, pack), mesh))
        if progress:
            progress(i + 1, len(specs))
    return params


def random_leaves(cfg: ModelConfig, seed: int) -> Any:
    """Random checkpoint-layout leaves in file order (numpy PCG64 seeded with `seed`)."""
    rng = np.random.default_rng(seed)
    return (random_leaf(spec, cfg, rng) for spec in tensor_specs(cfg))


def random_params(cfg: ModelConfig, mesh: Mesh, dtype: Any, seed: int, pack: bool = False) -> Params:
    """Random int8-quantized weights, laid out and sharded exactly like a loaded checkpoint."""
    params: Params = {}
    for spec, leaf in zip(tensor_specs(cfg), random_leaves(cfg, seed)):
        set_leaf(params, spec, place_leaf(spec, _for_products(spec, to_internal(spec, leaf, dtype), mesh, pack), mesh))
    return params
