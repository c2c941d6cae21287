"""One version's bytes in CPU memory: allocation, the weight hash of a laid-out buffer, and
reading checked publish sources into one.

In: a byte count, or ``TensorSource``s. Out: a uint8 buffer (page-locked when asked; otherwise
the memory of a buffer nothing references any more, when one of that size is idle) and its
tensor layout / weight hash; ``TensorSource``, a tensor's bytes streamed on demand. No files,
nothing of the store above it: ``persist``, ``ingest`` and ``publish`` call these.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from oldlogit.contract.weights import DTYPE_ITEMSIZE, TensorEntry, WeightHasher
from oldlogit_service.snapshots import yielding

# Bytes hashed between two of background work's yield points (``yielding.point``): a few ms.
HASH_CHUNK = 4 << 20

__all__ = [
    "HOST_POOL",
    "BufferPool",
    "HostPool",
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


class _Lease:
    """Held by the one array a pooled buffer's tensor is made from: when the last tensor or
    view of that buffer is gone, this goes too and hands the memory back to its pool."""

    __slots__ = ("block", "pool")

    def __init__(self, block: np.ndarray[Any, Any], pool: HostPool) -> None:
        self.block = block
        self.pool = pool

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # interpreter shutdown: nothing to hand back to
            self.pool._returned(self.block)


class _Leased(np.ndarray):  # a view of a pooled block, with its lease
    _lease: _Lease


class HostPool:
    """Unpinned CPU buffers whose memory is reused once nothing references them.

    A fresh buffer costs the kernel's zeroing of every page on first touch: with huge pages,
    filling a fresh 42 MB buffer took 1.7x the copy into a used one here (4.5 vs 2.7 ms), and a
    load fills every byte anyway. A buffer comes back when its last tensor and view are gone
    (a version evicted and no request holding it: ``SnapshotStore.acquire`` says its tensors
    must not be kept after the block), never earlier, so nothing reads memory that is refilled
    under it. Only sizes a store asked for (``keep``: a snapshot's) wait unused, at most that
    many blocks each (outside every tier's count); the others are freed. Thread-safe.
    """

    def __init__(self) -> None:
        self._keep: dict[int, int] = {}  # nbytes -> idle blocks kept at most
        self._idle: dict[int, list[np.ndarray[Any, Any]]] = {}
        # Re-entrant: a buffer may come back (a lease freed) while this thread holds the lock.
        self._lock = threading.RLock()
        self.reused = 0
        self.fresh = 0

    def keep(self, nbytes: int, blocks: int) -> None:
        """Keep up to ``blocks`` idle buffers of ``nbytes`` (stores in one process share the
        pool: the largest count asked for a size wins)."""
        with self._lock:
            self._keep[int(nbytes)] = max(self._keep.get(int(nbytes), 0), int(blocks))

    def take(self, nbytes: int) -> torch.Tensor:
        """A uint8 buffer of ``nbytes`` (old contents: the caller writes every byte it reads)."""
        with self._lock:
            free = self._idle.get(nbytes)
            block = free.pop() if free else None
            if block is not None:
                self.reused += 1
            else:
                self.fresh += 1
        if block is None:
            # numpy asks the kernel for huge pages (a fresh 40 MB torch.empty buffer
            # page-faulted 10k times and took 5x the copy itself here: 80 ms vs 16 ms).
            block = np.empty(nbytes, dtype=np.uint8)
        if nbytes not in self._keep:
            return torch.from_numpy(block)  # [nbytes]: freed when done with, as any array
        view = block.view(_Leased)
        view._lease = _Lease(block, self)
        return torch.from_numpy(view)  # [nbytes]

    @property
    def idle_bytes(self) -> int:
        with self._lock:
            return sum(n * len(blocks) for n, blocks in self._idle.items())

    def clear(self) -> None:
        """Free every idle buffer."""
        with self._lock:
            self._idle.clear()

    def _returned(self, block: np.ndarray[Any, Any]) -> None:
        n = int(block.nbytes)
        with self._lock:
            idle = self._idle.setdefault(n, [])
            if len(idle) < self._keep.get(n, 0):
                idle.append(block)


# The memory of evicted versions, for the next load (``SnapshotStore`` sets its limit).
HOST_POOL = HostPool()


def alloc_buffer(nbytes: int, *, pin: bool) -> torch.Tensor:
    """A CPU uint8 buffer for a version's bytes: page-locked ones (in front of a GPU) from the
    pinned pool; unpinned ones from the host pool (the memory of a buffer no one holds any
    more, else fresh). Its old contents are undefined: callers write every byte of it."""
    if pin:
        return PINNED_POOL.take(nbytes)  # [nbytes]
    return HOST_POOL.take(nbytes)  # [nbytes]


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
        for lo in range(e.begin, e.end, HASH_CHUNK):  # the same bytes in order: the same hash
            yielding.point()
            hasher.update(view[lo : min(e.end, lo + HASH_CHUNK)])
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
