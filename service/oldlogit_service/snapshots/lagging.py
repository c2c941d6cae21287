"""The lagging model: one resident copy of the weights, advanced version by version.

In: acquires in (mostly) ascending version order from the scheduler's lagging policy. Out: the
weights of the version asked for: the copy is advanced in place by applying the patches between
its version and the one asked for (a keyframe on the way, or a gap, reloads it); a version it
has already passed is served by the snapshot path, which refuses with ``VersionEvicted`` once
the store no longer retains it. One snapshot of device memory, counted in the device tier.
Talks to the store only through ``ChainSource``.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator, Mapping
from types import MappingProxyType
from typing import Protocol

import torch

from oldlogit.contract.errors import OldLogitError
from oldlogit_service.snapshots import buffers, codec, persist
from oldlogit_service.snapshots.registry import check_version
from oldlogit_service.snapshots.residency import Resident

logger = logging.getLogger(__name__)

__all__ = ["ChainSource", "LaggingModel"]


class ChainSource(Protocol):
    """What the lagging model needs from the store (``SnapshotStore`` implements it)."""

    @property
    def device(self) -> torch.device: ...

    def chain(self, version: int) -> list[persist.StoredVersion]:
        """``[version, its parent, ..., its keyframe]`` (raises for a version not retained)."""
        ...

    def load_patch(self, sv: persist.StoredVersion) -> codec.Patch: ...

    def reading(self) -> contextlib.AbstractContextManager[None]:
        """Held while a chain is read: files its records name are not deleted meanwhile."""
        ...

    def materialize(self, version: int) -> Resident:
        """The version's weights in a fresh CPU buffer."""
        ...

    def to_device(self, res: Resident) -> Resident: ...

    def hold_device(self, nbytes: int, version: int) -> None: ...

    def release_device(self, nbytes: int) -> None: ...

    def is_verified(self, sv: persist.StoredVersion) -> bool: ...

    def mark_verified(self, sv: persist.StoredVersion) -> None: ...

    def acquire(
        self, version: int
    ) -> contextlib.AbstractContextManager[Mapping[str, torch.Tensor]]: ...

    def quarantine(self, version: int, exc: persist.CorruptSnapshot) -> OldLogitError: ...


class LaggingModel:
    """Owned by one store; ``acquire`` is its one entry point."""

    def __init__(self, source: ChainSource) -> None:
        self._src = source
        self._lock = threading.Lock()
        self._res: Resident | None = None  # on the serving device; counted in its tier
        self._version: int | None = None
        self._held = 0  # bytes counted in the device tier
        self.counters = {"advances": 0, "patches_applied": 0, "reloads": 0, "passed": 0}

    @property
    def version(self) -> int | None:
        """The version the resident copy holds now (None before the first acquire)."""
        return self._version

    @contextlib.contextmanager
    def acquire(self, version: int) -> Iterator[Mapping[str, torch.Tensor]]:
        """The weights of ``version`` while the block runs (do not keep or modify them)."""
        version = check_version(version)
        with self._lock:
            passed = self._version is not None and version < self._version
        if passed:
            self.counters["passed"] += 1
            with self._src.acquire(version) as weights:
                yield weights
            return
        with self._lock:
            try:
                self._advance(version)
            except persist.CorruptSnapshot as exc:
                self._drop()
                raise self._src.quarantine(version, exc) from exc
            assert self._res is not None
            yield MappingProxyType(self._res.tensors)

    def _advance(self, target: int) -> None:
        with self._src.reading():
            self._advance_reading(target)

    def _advance_reading(self, target: int) -> None:
        chain = self._src.chain(target)  # [target, parent, ..., keyframe]; missing: raises
        versions = [sv.version for sv in chain]
        at = versions.index(self._version) if self._version in versions else None
        if at == 0:
            return
        if at is not None and self._res is not None:
            patches = [self._src.load_patch(sv) for sv in reversed(chain[:at])]
            if self._res.buffer is not None and self._res.buffer.device.type == "cpu":
                codec.rebuild(self._res.buffer.numpy(), self._res.layout, patches)
            else:
                codec.apply_torch(self._res.tensors, patches)
            self.counters["advances"] += 1
            self.counters["patches_applied"] += len(patches)
        else:
            self._reload(target, chain[0].nbytes)
        if not self._src.is_verified(chain[0]):  # recovered from an earlier process: once
            assert self._res is not None and self._res.buffer is not None
            got = buffers.hash_buffer(self._res.buffer.cpu().numpy(), self._res.layout)
            if got != chain[0].sha256:
                raise persist.CorruptSnapshot(
                    f"version {target} (lagging copy) hashes to {got}, the registry says "
                    f"{chain[0].sha256}",
                    target,
                )
            self._src.mark_verified(chain[0])
        self._version = target

    def _reload(self, version: int, nbytes: int) -> None:
        """Load the version whole (start, a keyframe on the way, a gap)."""
        if not self._held:
            self._src.hold_device(nbytes, version)  # one snapshot of the device tier, for good
            self._held = nbytes
        self._res, self._version = None, None  # free the old copy before the new one is built
        fresh = self._src.materialize(version)
        if self._src.device.type != "cpu":
            fresh = self._src.to_device(fresh)
        self._res = fresh
        self._version = version
        self.counters["reloads"] += 1

    def _drop(self) -> None:
        if self._held:
            self._src.release_device(self._held)
            self._held = 0
        self._res, self._version = None, None

    def close(self) -> None:
        with self._lock:
            self._drop()
