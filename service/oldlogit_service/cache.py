"""The in-process result cache: scored logprobs keyed by everything that determines them.

In: a key from ``make_key`` (weight hash, numerics, sampling, tokens, scored positions, a MoE
routing record) and
the float32 array the engine produced. Out: the same array on a later identical request.
Bounded by bytes (LRU); never computes anything and never sees a version number, only the
weight hash, so a cache hit across a weight change is impossible by construction.
"""

from __future__ import annotations

import hashlib
import struct
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

__all__ = ["CacheStats", "ResultCache", "ResultCacheBackend", "make_key"]

_KEY_FORMAT = b"oldlogit.result-cache/1"


def _field(h: hashlib._Hash, tag: bytes, payload: bytes) -> None:
    # Tag + length prefix: no two different field sequences frame to the same bytes.
    h.update(tag)
    h.update(struct.pack("<Q", len(payload)))
    h.update(payload)


def _int_array(a: npt.ArrayLike) -> bytes:
    arr = np.asarray(a)
    if arr.size and arr.dtype.kind not in "iu":
        raise TypeError(f"expected an integer array, got {arr.dtype}")
    return np.ascontiguousarray(arr.reshape(-1), dtype="<i8").tobytes()


def make_key(
    *,
    weight_sha256: str,
    numerics: str,
    sampling: tuple[float, int, float],
    token_ids: npt.ArrayLike,
    positions: npt.ArrayLike,
    routing: npt.ArrayLike | None = None,
) -> bytes:
    """A 32-byte sha256 digest identifying one scoring job.

    ``numerics`` is the deployment's description (e.g. ``"bfloat16/sdpa/head=fp32/
    deterministic"``); ``sampling`` is ``(temperature, top_k, top_p)``, floats compared bit
    for bit. Integer arrays are framed as little-endian int64 whatever their dtype, so equal
    values give equal keys. ``routing``: a MoE routing record on the sequence's positions
    ([n, L, k], −1 rows free; None: free routing, the key of a job without one), framed with
    its shape.
    """
    temperature, top_k, top_p = sampling
    h = hashlib.sha256(_KEY_FORMAT)
    _field(h, b"W", weight_sha256.lower().encode())
    _field(h, b"N", numerics.encode())
    _field(h, b"S", struct.pack("<dqd", float(temperature), int(top_k), float(top_p)))
    _field(h, b"T", _int_array(token_ids))
    _field(h, b"P", _int_array(positions))
    if routing is not None:
        arr = np.asarray(routing)
        _field(h, b"R", _int_array(arr.shape) + _int_array(arr))
    return h.digest()


@dataclass(frozen=True)
class CacheStats:
    hits: int = 0
    misses: int = 0
    errors: int = 0  # lookups or stores that failed (a shared cache that is unreachable)
    bytes: int = 0  # held in this process (0 for a shared cache)
    max_bytes: int = 0
    entries: int = 0
    evictions: int = 0


@runtime_checkable
class ResultCacheBackend(Protocol):
    """What the runtime needs from a result cache (in-process here; Redis implements it too).

    ``blocking``: its calls wait on the network, so the runtime makes them in a thread.
    """

    blocking: bool

    def make_key(
        self,
        *,
        weight_sha256: str,
        numerics: str,
        sampling: tuple[float, int, float],
        token_ids: npt.ArrayLike,
        positions: npt.ArrayLike,
        routing: npt.ArrayLike | None = None,
    ) -> bytes: ...

    def get_many(self, keys: list[bytes]) -> list[npt.NDArray[np.float32] | None]: ...

    def put_many(self, items: list[tuple[bytes, npt.NDArray[np.float32]]]) -> None: ...

    def stats(self) -> CacheStats: ...


class ResultCache:
    """Thread-safe LRU bounded by bytes: each entry costs its array's bytes plus its key's.

    ``max_bytes=0`` disables it (every ``get`` misses, ``put`` stores nothing). Stored arrays
    are private read-only copies, so ``get`` returns them without copying and no caller can
    change what another one reads.
    """

    blocking = False

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError("max_bytes must be >= 0")
        self.max_bytes = int(max_bytes)
        self._lock = threading.Lock()
        self._entries: OrderedDict[bytes, npt.NDArray[np.float32]] = OrderedDict()
        self._bytes = 0
        self._hits = 0
        self._misses = 0
        self._evictions = 0

    @staticmethod
    def make_key(
        *,
        weight_sha256: str,
        numerics: str,
        sampling: tuple[float, int, float],
        token_ids: npt.ArrayLike,
        positions: npt.ArrayLike,
        routing: npt.ArrayLike | None = None,
    ) -> bytes:
        return make_key(
            weight_sha256=weight_sha256,
            numerics=numerics,
            sampling=sampling,
            token_ids=token_ids,
            positions=positions,
            routing=routing,
        )

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    def get(self, key: bytes) -> npt.NDArray[np.float32] | None:
        with self._lock:
            value = self._entries.get(key)
            if value is None:
                self._misses += 1
                return None
            self._entries.move_to_end(key)
            self._hits += 1
            return value

    def put(self, key: bytes, value: npt.NDArray[np.float32]) -> None:
        cost = int(np.asarray(value).nbytes) + len(key)
        if cost > self.max_bytes:  # also the disabled case: nothing fits in 0 bytes
            return
        stored = np.array(value, copy=True)
        stored.setflags(write=False)
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= old.nbytes + len(key)
            self._entries[key] = stored
            self._bytes += cost
            while self._bytes > self.max_bytes:
                k, v = self._entries.popitem(last=False)
                self._bytes -= v.nbytes + len(k)
                self._evictions += 1

    def get_many(self, keys: list[bytes]) -> list[npt.NDArray[np.float32] | None]:
        return [self.get(k) for k in keys]

    def put_many(self, items: list[tuple[bytes, npt.NDArray[np.float32]]]) -> None:
        for k, v in items:
            self.put(k, v)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._bytes = 0

    def stats(self) -> CacheStats:
        with self._lock:
            return CacheStats(
                hits=self._hits,
                misses=self._misses,
                bytes=self._bytes,
                max_bytes=self.max_bytes,
                entries=len(self._entries),
                evictions=self._evictions,
            )

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)
