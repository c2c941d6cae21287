"""One version's bytes in CPU memory: allocation, the weight hash of a laid-out buffer, and
reading checked publish sources into one.

In: a byte count, or ``TensorSource``s. Out: a uint8 buffer (page-locked when asked) and its
tensor layout / weight hash; ``TensorSource``, a tensor's bytes streamed on demand. No files,
no locks, nothing of the store above it: ``persist``, ``ingest`` and ``publish`` call these.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from oldlogit.weights import DTYPE_ITEMSIZE, TensorEntry, WeightHasher

__all__ = ["TensorSource", "alloc_buffer", "buffer_from_sources", "hash_buffer"]


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


def alloc_buffer(nbytes: int, *, pin: bool) -> torch.Tensor:
    """A CPU uint8 buffer for a version's bytes. Unpinned ones come from numpy, which asks the
    kernel for huge pages: filling a fresh 40 MB torch.empty buffer page-faults 10k times and
    took 5x the copy itself here (80 ms vs 16 ms)."""
    if pin:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)  # [nbytes]
    return torch.from_numpy(np.empty(nbytes, dtype=np.uint8))  # [nbytes]


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
