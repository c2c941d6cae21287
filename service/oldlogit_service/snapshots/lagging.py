"""The lagging model: one resident copy of the weights, advanced version by version.

In: acquires in (mostly) ascending version order from the scheduler's lagging policy. Out: the
weights of the version asked for: the copy is advanced in place by applying the patches between
its version and the one asked for (a keyframe on the way, or a gap, reloads it); a version it
has already passed is served by the snapshot path (``SnapshotStore.acquire``), which refuses
with ``VersionEvicted`` once the store no longer retains it. One snapshot of device memory.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator, Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import torch

from oldlogit_service.snapshots import buffers, codec, persist
from oldlogit_service.snapshots.core import check_version
from oldlogit_service.snapshots.residency import Resident

if TYPE_CHECKING:
    from oldlogit_service.snapshots.store import SnapshotStore

logger = logging.getLogger(__name__)

__all__ = ["LaggingModel"]


class LaggingModel:
    """Owned by one ``SnapshotStore``; ``acquire`` is its one entry point."""

    def __init__(self, store: SnapshotStore) -> None:
        self._store = store
        self._lock = threading.Lock()
        self._res: Resident | None = None  # on the serving device; counted in its tier
        self._version: int | None = None
        self._held = False  # its bytes are counted in the device tier
        self.counters = {"advances": 0, "patches_applied": 0, "reloads": 0, "passed": 0}

    @property
    def version(self) -> int | None:
        """The version the resident copy holds now (None before the first acquire)."""
        return self._version

    @contextlib.contextmanager
    def acquire(self, version: int) -> Iterator[Mapping[str, torch.Tensor]]:
        """The weights of ``version`` while the block runs (do not keep or modify them)."""
        version = check_version(version)
        st = self._store
        st._check_open()
        with self._lock:
            passed = self._version is not None and version < self._version
        if passed:
            self.counters["passed"] += 1
            with st.acquire(version) as weights:
                yield weights
            return
        with self._lock:
            try:
                self._advance(version)
            except persist.CorruptSnapshot as exc:
                self._drop()
                raise st._corrupt(version, exc) from exc
            assert self._res is not None
            yield MappingProxyType(self._res.tensors)

    def _advance(self, target: int) -> None:
        st = self._store
        with st._lock:
            st._sweep_locked()
            entry = st._live_locked(target)  # UnknownVersion / VersionEvicted
            chain = st._chain_locked(entry)  # [target, parent, ..., keyframe]
        versions = [e.stored.version for e in chain]
        at = versions.index(self._version) if self._version in versions else None
        if at == 0:
            return
        if at is not None and self._res is not None:
            steps = [(e, e.stored) for e in reversed(chain[:at])]
            patches = [st._load_patch(e, sv) for e, sv in steps]
            if self._res.buffer is not None and self._res.buffer.device.type == "cpu":
                codec.rebuild(self._res.buffer.numpy(), self._res.layout, patches)
            else:
                codec.apply_torch(self._res.tensors, patches)
            self.counters["advances"] += 1
            self.counters["patches_applied"] += len(patches)
        else:
            self._reload(entry)
        if not entry.verified:  # recovered from an earlier process: check once
            assert self._res is not None and self._res.buffer is not None
            got = buffers.hash_buffer(self._res.buffer.cpu().numpy(), self._res.layout)
            if got != entry.stored.sha256:
                raise persist.CorruptSnapshot(
                    f"version {target} (lagging copy) hashes to {got}, the registry says "
                    f"{entry.stored.sha256}",
                    target,
                )
            with st._lock:
                entry.verified = True
        self._version = target

    def _reload(self, entry: Any) -> None:
        """Load the version whole (start, a keyframe on the way, a gap)."""
        st = self._store
        n = entry.stored.nbytes
        if not self._held:
            with st._cond:  # the copy is one snapshot of the device tier, for good
                st._admit_device_locked(n, entry.stored.version)
                st._device_tier.reserve(0)
                st._device_tier.add(n, count=False)
                self._held = True
        self._res, self._version = None, None  # free the old copy before the new one is built
        fresh = st._materialize(entry)
        if st._device.type != "cpu":
            fresh = st._to_device(fresh)
        self._res = fresh
        self._version = entry.stored.version
        self.counters["reloads"] += 1

    def _drop(self) -> None:
        st = self._store
        if self._held:
            with st._cond:
                st._device_tier.remove(st.snapshot_nbytes, evicted=False, count=False)
                st._cond.notify_all()
            self._held = False
        self._res, self._version = None, None

    def close(self) -> None:
        with self._lock:
            self._drop()
