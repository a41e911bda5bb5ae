"""Arrays that stay in their checkpoint file until a region of them is asked for.

With one model replica spread over several processes, each process must read only the parts of each
tensor that its own devices hold (the released Grok-1 checkpoint is ~300 GB). The checkpoint reader
(checkpoint.py) locates each array's raw bytes in its pickle without reading them and returns a
`FileArray`; the loader then asks it for exactly the region each addressable device shard covers
(`read`), and only those bytes are read from disk, with one `pread` per contiguous run.

A FileArray also records the cheap layout changes the in-memory format applies (`swapaxes` of the
last two axes, selecting one expert with an integer index, `astype`) as a view, so these never force a
full read.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Any

import numpy as np


class FileArray:
    """A (possibly transposed, indexed, cast) view of a C-order array stored at `offset` in `path`."""

    def __init__(self, path: str, offset: int, stored_shape: Sequence[int], stored_dtype: np.dtype,
                 lead: tuple[int, ...] = (), axes: tuple[int, ...] | None = None, dtype: Any = None) -> None:
        self.path = path
        self.offset = offset
        self.stored_shape = tuple(int(d) for d in stored_shape)
        self.stored_dtype = np.dtype(stored_dtype)
        self.lead = lead  # fixed indices of the first len(lead) stored axes
        rest = len(self.stored_shape) - len(lead)
        self.axes = axes if axes is not None else tuple(range(rest))  # view axis j = remaining stored axis axes[j]
        self.dtype = np.dtype(dtype if dtype is not None else self.stored_dtype.newbyteorder("="))

    @property
    def shape(self) -> tuple[int, ...]:
        rest = self.stored_shape[len(self.lead):]
        return tuple(rest[a] for a in self.axes)

    @property
    def ndim(self) -> int:
        return len(self.axes)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def _view(self, **changes: Any) -> "FileArray":
        fields = dict(lead=self.lead, axes=self.axes, dtype=self.dtype) | changes
        return FileArray(self.path, self.offset, self.stored_shape, self.stored_dtype, **fields)

    def swapaxes(self, a: int, b: int) -> "FileArray":
        axes = list(self.axes)
        axes[a], axes[b] = axes[b], axes[a]
        return self._view(axes=tuple(axes))

    def astype(self, dtype: Any, copy: bool = True) -> "FileArray":
        return self._view(dtype=np.dtype(dtype))

    def __getitem__(self, index: int) -> "FileArray":
        """Select along the first axis (e.g. one expert of a stacked MoE matrix); the rest stays on disk."""
        if not isinstance(index, (int, np.integer)) or self.axes[:1] != (0,):
            raise TypeError("a FileArray is indexed by one integer on an untransposed leading axis; use read()")
        size = self.shape[0]
        if not -size <= index < size:
            raise IndexError(f"index {index} out of range for axis of size {size}")
        axes = tuple(a - 1 for a in self.axes[1:])
        return self._view(lead=(*self.lead, int(index) % size), axes=axes)

    def read(self, index: Sequence[slice] = ()) -> np.ndarray:
        """The region `index` (one slice per view axis; missing ones mean the whole axis) as a new array."""
        view_slices = [s.indices(n) for s, n in zip((*index, *[slice(None)] * self.ndim)[:self.ndim], self.shape)]
        if any(step != 1 for _, _, step in view_slices):
            raise ValueError("FileArray.read supports only contiguous slices")
        rest = [(0, 0)] * self.ndim
        for j, a in enumerate(self.axes):
            rest[a] = view_slices[j][:2]
        bounds = [(i, i + 1) for i in self.lead] + rest
        region = read_region(self.path, self.offset, self.stored_shape, self.stored_dtype, bounds)
        region = region.reshape(region.shape[len(self.lead):]).transpose(self.axes)
        return np.ascontiguousarray(region.astype(self.dtype, copy=False))

    def read_stored(self, bounds: Sequence[tuple[int, int]], into: np.ndarray | None = None) -> np.ndarray:
        """The stored array's region, [start, stop) per stored axis, in its stored layout (shard_reads.py copies
        it into the view's shards, transposing and casting there); read into the bytes of `into` if given."""
        return read_region(self.path, self.offset, self.stored_shape, self.stored_dtype, bounds, into)

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        full = self.read()
        return full if dtype is None else full.astype(dtype)


def read_region(path: str, offset: int, shape: Sequence[int], dtype: np.dtype,
                bounds: Sequence[tuple[int, int]], into: np.ndarray | None = None) -> np.ndarray:
    """Read [start, stop) per axis of the C-order array at `offset`: one pread per contiguous run of bytes (into
    the bytes of `into`, reused memory, when given)."""
    shape = tuple(shape)
    counts = [stop - start for start, stop in bounds]
    if into is None:
        out = np.empty(counts, dtype=dtype)
    else:
        out = into[:math.prod(counts) * dtype.itemsize].view(dtype).reshape(counts)
    if out.size == 0:
        return out.astype(dtype.newbyteorder("="), copy=False)
    # Axes after `split` are read whole, so each run covers them plus a range of axis `split`.
    split = len(shape) - 1
    while split >= 0 and counts[split] == shape[split]:
        split -= 1
    strides = [math.prod(shape[i + 1:]) for i in range(len(shape))]
    if split < 0:
        starts = np.zeros((1,), np.int64)
        run = math.prod(shape)
    else:
        run = counts[split] * strides[split]
        outer = np.indices(counts[:split]).reshape(split, -1) if split else np.zeros((0, 1), np.int64)
        starts = sum(((outer[i] + bounds[i][0]) * strides[i] for i in range(split)), np.zeros(outer.shape[1], np.int64))
        starts = starts + bounds[split][0] * strides[split]
    run_bytes = run * dtype.itemsize
    buffer = memoryview(out.reshape(-1).view(np.uint8))
    fd = os.open(path, os.O_RDONLY)
    try:
        for i, start in enumerate(starts.tolist()):
            _pread_exact(fd, buffer[i * run_bytes:(i + 1) * run_bytes], offset + start * dtype.itemsize, path)
    finally:
        os.close(fd)
    return out.astype(dtype.newbyteorder("="), copy=False)


def _pread_exact(fd: int, buffer: memoryview, offset: int, path: str) -> None:
    done = 0
    while done < len(buffer):
        n = os.preadv(fd, [buffer[done:]], offset + done)
        if n == 0:
            raise EOFError(f"{path}: file ends before byte {offset + len(buffer)} (truncated checkpoint?)")
        done += n
