"""Reading a checkpoint array (file_arrays.FileArray) straight into this process's device shards.

checkpoint.py hands each on-disk array here with its sharding. The region of the file this process's devices
hold (the box their shards tile) is read in large contiguous reads: whole experts of a stacked MoE matrix, or
blocks of whole rows when one expert is larger than a read (`READ_BYTES`). Each read is copied into the host
buffers of the device shards it covers, and a shard goes to its devices as soon as it is complete. Beside what
the devices keep, the host holds one read buffer (reused for the tensor's reads) and the shards still being
filled: never a copy of the whole tensor, or of the process's region, that is then sliced. With the model axis splitting an expert's columns among this
process's devices, a read covers whole rows and each device's columns are copied out of it; only a process that
holds a column slice of rows that other processes hold too (more processes than expert groups, or `--mesh 1,8`
over several processes) reads one run per row.

On the CPU platform a complete shard's host buffer becomes its device buffer (64-byte aligned, device_put aliases
it; the CPU devices holding replicas of a shard share it), so a CPU process's peak memory is what it keeps plus
one read.
"""

from __future__ import annotations

import itertools
import math
import mmap
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from model_service.file_arrays import FileArray

READ_BYTES = 256 << 20  # one Grok-1 expert matrix (6,144 x 32,768 int8, 192 MiB) is one read
_MAPPED = 1 << 20  # buffers from this size on are mappings of their own (aligned_empty)
_FLAGS = mmap.MAP_PRIVATE | getattr(mmap, "MAP_POPULATE", 0)  # private anonymous memory, faulted in at once
Box = tuple[tuple[int, int], ...]  # [start, stop) per axis


def aligned_empty(shape: tuple[int, ...], dtype: Any, align: int = 64) -> np.ndarray:
    """An uninitialised host array whose data starts on an `align`-byte boundary (what JAX's CPU client needs to
    use host memory as a device buffer without copying it).

    A large one is an anonymous mapping of its own, its pages faulted in by the one call that maps it, not a numpy
    allocation: numpy asks the kernel for transparent huge pages for its large arrays, and where the kernel
    compacts memory to find them (THP defrag "madvise", its default) filling the weights spent more time in the
    kernel than the copy took. Grok-1's widths, 1 layer, 6.5 GB on a 2-core VM: 13-19 s of system time with
    numpy's arrays, 8 s with 4 KiB pages faulted one by one (the old loader's XLA buffers), 4 s mapped populated.
    The service backs the weights with huge pages once it has compiled (host_memory.huge_pages)."""
    size = math.prod(shape) * np.dtype(dtype).itemsize
    if size >= _MAPPED:
        return np.frombuffer(mmap.mmap(-1, size, flags=_FLAGS), np.uint8).view(dtype).reshape(shape)  # page-aligned
    raw = np.empty(size + align, np.uint8)
    offset = -raw.ctypes.data % align
    return raw[offset:offset + size].view(dtype).reshape(shape)


@dataclass(eq=False)  # compared by identity: its buffer is an array
class Shard:
    """One distinct shard of the array (view coordinates), the devices holding it and its host buffer."""

    box: Box
    devices: list[Any]
    dtype: np.dtype
    buffer: np.ndarray | None = None
    missing: int = 0  # elements not yet copied in
    placed: tuple[Any, ...] = ()  # its single-device arrays, once complete

    def start(self) -> None:
        self.buffer = aligned_empty(tuple(b - a for a, b in self.box), self.dtype)
        self.missing = self.buffer.size


def place_file_array(arr: FileArray, sharding: jax.sharding.Sharding, read_bytes: int | None = None) -> jax.Array:
    """`arr` on `sharding`, read from its file as this module's docstring says (reads of at most `read_bytes`,
    default READ_BYTES)."""
    index_map = sharding.addressable_devices_indices_map(arr.shape)
    shards = shards_of(arr.shape, index_map, arr.dtype)
    for shard in read_shards(arr, shards, read_bytes or READ_BYTES):
        shard.placed = tuple(jax.device_put(shard.buffer, d, may_alias=True) for d in shard.devices)
        shard.buffer = None  # the devices hold it now (on CPU this memory itself, shared by a shard's replicas)
    by_device = {d: a for s in shards for d, a in zip(s.devices, s.placed)}
    return jax.make_array_from_single_device_arrays(arr.shape, sharding, [by_device[d] for d in index_map])


def shards_of(shape: tuple[int, ...], index_map: dict[Any, tuple[slice, ...]], dtype: Any) -> list[Shard]:
    """The distinct shards of `index_map` (device -> index), in its order, each with every device holding it."""
    shards: dict[Box, Shard] = {}
    for device, index in index_map.items():
        box = tuple(s.indices(n)[:2] for s, n in zip(index, shape))
        shards.setdefault(box, Shard(box, [], np.dtype(dtype))).devices.append(device)
    return list(shards.values())


def read_shards(arr: FileArray, shards: Sequence[Shard], read_bytes: int) -> Iterator[Shard]:
    """Fill each shard's buffer from the file, yielding each as soon as it is complete. The shards are read as
    one region when they tile a box (the usual case), else one by one."""
    box = _union(s.box for s in shards)
    regions = [(box, list(shards))]
    if math.prod(b - a for a, b in box) != sum(math.prod(b - a for a, b in s.box) for s in shards):
        regions = [(s.box, [s]) for s in shards]  # each read only for its own shard
    itemsize = arr.stored_dtype.itemsize
    scratch: np.ndarray | None = None  # one buffer for every read, so that its pages are faulted in once
    for region, pending in regions:
        for chunk in chunks(_stored_box(arr, region), itemsize, read_bytes):
            size = math.prod(b - a for a, b in chunk) * itemsize
            if scratch is None or scratch.size < size:
                scratch = aligned_empty((max(size, min(read_bytes, math.prod(b - a for a, b in region) * itemsize)),),
                                        np.uint8)
            data = arr.read_stored(chunk, into=scratch)
            view_chunk = _view_box(arr, chunk)
            for shard in pending:
                overlap = _intersect(shard.box, view_chunk)
                if overlap is None:
                    continue
                if shard.buffer is None:
                    shard.start()
                _copy(arr, data, chunk, shard, overlap)
            done = [s for s in pending if s.buffer is not None and s.missing == 0]
            pending = [s for s in pending if s not in done]
            yield from done
            del data  # before the next read is allocated


def chunks(box: Box, itemsize: int, read_bytes: int) -> Iterator[Box]:
    """`box` (stored coordinates) cut into reads of at most `read_bytes`, along the outermost axis whose inner
    part fits: a box of whole experts is read an expert (or several) at a time, a larger expert in blocks of
    whole rows (a row larger than a read in pieces)."""
    extents = [b - a for a, b in box]
    limit = max(1, read_bytes // itemsize)
    axis = 0
    while axis < len(box) - 1 and math.prod(extents[axis + 1:]) > limit:
        axis += 1
    step = max(1, limit // max(1, math.prod(extents[axis + 1:])))
    start, stop = box[axis] if box else (0, 0)
    for outer in itertools.product(*(range(a, b) for a, b in box[:axis])):
        for first in range(start, stop, step):
            yield (*((i, i + 1) for i in outer), (first, min(first + step, stop)), *box[axis + 1:])
    if not box:
        yield ()


def _union(boxes: Iterator[Box]) -> Box:
    boxes = list(boxes)
    return tuple((min(b[a][0] for b in boxes), max(b[a][1] for b in boxes)) for a in range(len(boxes[0])))


def _intersect(a: Box, b: Box) -> Box | None:
    box = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b))
    return None if any(lo >= hi for lo, hi in box) else box


def _stored_box(arr: FileArray, view: Box) -> Box:
    """A view box in the stored array's coordinates (the view's fixed leading indices as length-1 ranges)."""
    rest: list[tuple[int, int]] = [(0, 0)] * arr.ndim
    for j, a in enumerate(arr.axes):
        rest[a] = view[j]
    return (*((i, i + 1) for i in arr.lead), *rest)


def _view_box(arr: FileArray, stored: Box) -> Box:
    rest = stored[len(arr.lead):]
    return tuple(rest[a] for a in arr.axes)


def _copy(arr: FileArray, data: np.ndarray, chunk: Box, shard: Shard, overlap: Box) -> None:
    """Copy `overlap` (view coordinates) from `data` (the stored region `chunk`) into the shard's buffer: the
    view's transpose and cast happen in this one copy."""
    stored = _stored_box(arr, overlap)
    part = data[tuple(slice(a - c, b - c) for (a, b), (c, _) in zip(stored, chunk))]
    part = part.reshape(part.shape[len(arr.lead):]).transpose(arr.axes)
    target = tuple(slice(a - s, b - s) for (a, b), (s, _) in zip(overlap, shard.box))
    shard.buffer[target] = part
    shard.missing -= part.size
