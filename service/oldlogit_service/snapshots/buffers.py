"""One version's bytes in CPU memory: allocation, the weight hash of a laid-out buffer, and
reading checked publish sources into one.

In: a byte count, or ``TensorSource``s. Out: a uint8 buffer (page-locked when asked) and its
tensor layout / weight hash; ``TensorSource``, a tensor's bytes streamed on demand. No files,
no locks, nothing of the store above it: ``persist``, ``ingest`` and ``publish`` call these.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from oldlogit.contract.weights import DTYPE_ITEMSIZE, TensorEntry, WeightHasher

__all__ = [
    "BufferPool",
    "TensorSource",
    "alloc_buffer",
    "buffer_from_sources",
    "hash_buffer",
    "recycle_buffer",
]


@dataclass(frozen=True)
class TensorSource:
    """One tensor to write: its declared dtype/shape and a callable streaming its raw bytes."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    chunks: Callable[[], Iterable[bytes | memoryview]]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_ITEMSIZE[self.dtype]


class BufferPool:
    """Reuses freed buffers by size: page-locking memory (``cudaHostAlloc``) costs far more
    than the copy it serves, so the staging buffers of host→device loads are kept for the next
    load. Holds at most ``max_bytes``; thread-safe."""

    def __init__(self, alloc: Callable[[int], torch.Tensor], max_bytes: int) -> None:
        self._alloc = alloc
        self._max_bytes = max_bytes
        self._free: dict[int, list[torch.Tensor]] = {}
        self._held = 0
        self._lock = threading.Lock()
        self.reused = 0

    def take(self, nbytes: int) -> torch.Tensor:
        with self._lock:
            free = self._free.get(nbytes)
            if free:
                self._held -= nbytes
                self.reused += 1
                return free.pop()
        return self._alloc(nbytes)

    def set_limit(self, max_bytes: int) -> None:
        with self._lock:
            self._max_bytes = max(self._max_bytes, int(max_bytes))

    def give(self, buf: torch.Tensor) -> None:
        """Return a buffer no one reads any more (its last user is done with it)."""
        n = int(buf.numel())
        with self._lock:
            if self._held + n <= self._max_bytes:
                self._free.setdefault(n, []).append(buf)
                self._held += n


def _pinned(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)  # [nbytes]


# Page-locked staging buffers in front of a GPU, process-wide like CUDA's caching allocator; the
# residency in front of a GPU sizes it (two snapshots: a load in flight and the next one).
PINNED_POOL = BufferPool(_pinned, max_bytes=0)


def alloc_buffer(nbytes: int, *, pin: bool) -> torch.Tensor:
    """A CPU uint8 buffer for a version's bytes: page-locked ones (in front of a GPU) from the
    pinned pool; unpinned ones from numpy, which asks the kernel for huge pages (filling a fresh
    40 MB torch.empty buffer page-faults 10k times and took 5x the copy itself here: 80 ms vs
    16 ms)."""
    if pin:
        return PINNED_POOL.take(nbytes)  # [nbytes]
    return torch.from_numpy(np.empty(nbytes, dtype=np.uint8))  # [nbytes]


def recycle_buffer(buf: torch.Tensor) -> None:
    """A page-locked staging buffer whose bytes are on the device now: back to the pool."""
    if buf.is_pinned():
        PINNED_POOL.give(buf)


def hash_buffer(data: memoryview | Any, layout: Iterable[TensorEntry]) -> str:
    """The weight hash of tensors laid out in one byte buffer (a memoryview or uint8 array)."""
    view = memoryview(data).cast("B")
    hasher = WeightHasher()
    for e in sorted(layout, key=lambda e: e.name):
        hasher.begin(e.name, e.dtype, e.shape)
        hasher.update(view[e.begin : e.end])
    return hasher.hexdigest()


def buffer_from_sources(
    sources: Mapping[str, TensorSource], *, pin: bool
) -> tuple[torch.Tensor, tuple[TensorEntry, ...], str]:
    """Read checked sources into one CPU uint8 buffer (keyframe layout) and hash them: the
    in-memory twin of ``write_keyframe``, for publishes that diff against a parent."""
    order = sorted(sources.values(), key=lambda s: (-DTYPE_ITEMSIZE[s.dtype], s.name))
    layout: list[TensorEntry] = []
    cursor = 0
    for s in order:
        layout.append(TensorEntry(s.name, s.dtype, s.shape, cursor, cursor + s.nbytes))
        cursor += s.nbytes
    buf = alloc_buffer(cursor, pin=pin)  # [nbytes]
    view = buf.numpy().data.cast("B")
    where = {e.name: e for e in layout}
    hasher = WeightHasher()
    for name in sorted(sources):
        s, e = sources[name], where[name]
        hasher.begin(name, s.dtype, s.shape)
        pos = e.begin
        for chunk in s.chunks():
            hasher.update(chunk)  # checks the byte count before the copy below overruns
            n = memoryview(chunk).nbytes
            view[pos : pos + n] = memoryview(chunk).cast("B")
            pos += n
    return buf, tuple(layout), hasher.hexdigest()
