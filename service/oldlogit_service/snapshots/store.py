"""The snapshot store: every acknowledged policy version's weights, in tiers, within budgets.

In: publishes (state dict or safetensors), acquires, leases, the watermark. Out: a version's
tensors on the serving device, pinned while a request uses them. Thread-safe and
model-agnostic (``param_specs`` is all it knows of the model); no asyncio, HTTP or Redis.
Memory tiers (device, host) evict LRU to their byte budgets; the disk tier is retained by
watermark, ``max_versions`` and byte budget, never deleting a leased version.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping
from types import MappingProxyType
from typing import Any

import torch

from oldlogit.errors import Conflict, InvalidRequest
from oldlogit_service.snapshots import persist
from oldlogit_service.snapshots.core import check_version
from oldlogit_service.snapshots.deltas import Deltas
from oldlogit_service.snapshots.lagging import LaggingModel
from oldlogit_service.snapshots.leases import LeaseRecord
from oldlogit_service.snapshots.records import VersionRecord
from oldlogit_service.snapshots.residency import VersionEntry
from oldlogit_service.snapshots.tiers import DISK

logger = logging.getLogger(__name__)

__all__ = ["SnapshotStore"]

_COUNTERS = (
    "device_hits",
    "loads_disk",
    "loads_host",
    "load_waits",
    "bytes_read",
    "verified_loads",
    "rebuilds",
    "patches_applied",
)


class SnapshotStore(Deltas):
    """Every acknowledged version's weights, served from the fastest tier that holds them.

    ``SnapshotStore(root, *, param_specs, device, device_budget_bytes, host_budget_bytes,
    disk_budget_bytes, max_versions, pin_host=None, clock=time.time, verify_first_load=True,
    admission_timeout_s=60.0)``; the arguments are described on ``StoreCore.__init__``.

    Decisions (DESIGN.md §3):
    - Memory tiers evict LRU among unpinned versions (ties: a copy one tier down first, then
      the smaller). Device bytes stay <= budget + one snapshot: a load that would go further
      (everything resident in use) waits for a release, up to ``admission_timeout_s``, then
      raises ``Overloaded``.
    - Disk: below the watermark first, then LRU while over ``max_versions`` or the byte
      budget; never a leased or in-use version, never the newest for budget reasons. Deleted
      versions are tombstoned (``VersionEvicted`` with the retained range), durably.
    - The watermark only moves up; lowering it is refused (``InvalidRequest``).
    - Leases are persisted with wall-clock expiry, so they survive a restart.
    - Versions are keyframes or patches (``chains``); memory tiers also hold decoded patches
      and rebuild bases, and the LRU credits what a copy would cost to rebuild.
    """

    # -- acquire ----------------------------------------------------------------------------
    @contextlib.contextmanager
    def acquire(self, version: int) -> Iterator[Mapping[str, torch.Tensor]]:
        """Pin ``version`` while the block runs and yield its tensors on the serving device.

        The mapping and tensors must not be modified or kept after the block: once unpinned
        the version may be evicted and its memory reused.
        """
        version = check_version(version)
        self._check_open()
        self._after_op()
        entry, resident = self._pin(version)
        try:
            yield MappingProxyType(resident.tensors)
        finally:
            self._unpin(entry)
            self._after_op()

    _lagging: LaggingModel | None = None

    def acquire_lagging(
        self, version: int
    ) -> contextlib.AbstractContextManager[Mapping[str, torch.Tensor]]:
        """Like ``acquire``, through the lagging model (``--strategy lagging``): one resident
        copy advanced by patches; a version it has passed comes from ``acquire``."""
        with self._lock:
            if self._lagging is None:
                self._lagging = LaggingModel(self)
            lag = self._lagging
        return lag.acquire(version)

    def set_watermark(self, version: int) -> int:
        """The trainer will never ask below ``version``: unleased versions below it are deleted.

        Monotonic: an equal value is a no-op, a lower one is refused (its versions may already
        be gone, so lowering could not bring them back). A watermark above the newest version
        retires every unleased version, and later publishes must be at or above it.
        Returns the watermark.
        """
        version = check_version(version)
        self._check_open()
        with self._persist_lock:
            with self._lock:
                wm = self._watermark
                if wm is not None and version < wm:
                    raise InvalidRequest(
                        f"the watermark is {wm} and only moves up; policy_version {version} "
                        "is below it",
                        parameter="policy_version",
                    )
                if wm == version:
                    return version
                doc = self._doc_locked(watermark=version)
            persist.write_registry(self._root, doc)
            with self._lock:
                self._watermark = version
        logger.info("watermark set to %d", version)
        self._retain()
        return version

    def delete(self, version: int) -> bool:
        """Delete a version (tombstoned: requests get VersionEvicted). Refused while leased;
        requests already holding it finish. Versions rebuilt through it are rewritten first
        (rebased onto its parent, or made keyframes when it is their keyframe). False when
        it was already gone."""
        version = check_version(version)
        self._check_open()
        with self._persist_lock:
            with self._lock:
                self._sweep_locked()
                if version in self._tombstones:
                    return False
                self._live_locked(version)
                n = self._leases.count(version)
                if n:
                    raise Conflict(
                        f"policy_version {version} is held by {n} lease(s); release them first",
                        parameter="policy_version",
                        details={"leases": n},
                    )
            files = self._remove_versions((version,), evicted=False)
            persist.remove_files(self._weights_dir, files)
        logger.info("deleted version %d on request", version)
        return True

    def evict(self, version: int) -> bool:
        """Drop a version's weights from the memory tiers now (its decoded patch and the rest
        stay); the next acquire rebuilds it. For operators and benchmarks; False if it was
        not resident or is in use."""
        version = check_version(version)
        with self._cond:
            e = self._live_locked(version)
            if e.pins or (e.device is None and e.host is None):
                return False
            if e.device is not None:
                self._device_tier.remove(e.device.nbytes, evicted=True)
                e.device = None
            if e.host is not None:
                self._host_tier.remove(e.host.nbytes, evicted=True)
                e.host = None
            self._cond.notify_all()
            return True

    # -- leases -----------------------------------------------------------------------------
    def lease(self, version: int, holder: str, ttl_s: float) -> LeaseRecord:
        """Keep ``version`` on disk until the lease is released or ``ttl_s`` passes."""
        version = check_version(version)
        self._check_open()
        with self._persist_lock:
            with self._lock:
                self._sweep_locked()
                self._live_locked(version)
                rec = self._leases.new(version, holder, ttl_s)
                doc = self._doc_locked(leases=self._leases.records(extra=rec))
            persist.write_registry(self._root, doc)
            with self._lock:
                self._leases.put(rec)
        self._after_op()
        return rec

    def renew(self, lease_id: str, ttl_s: float) -> LeaseRecord:
        """Extend a live lease to ``ttl_s`` from now."""
        self._check_open()
        with self._persist_lock:
            with self._lock:
                self._sweep_locked()
                rec = self._leases.renewed(lease_id, ttl_s)
                doc = self._doc_locked(leases=self._leases.records(extra=rec))
            persist.write_registry(self._root, doc)
            with self._lock:
                self._leases.put(rec)
        self._after_op()
        return rec

    def release(self, lease_id: str) -> LeaseRecord:
        """End a lease; versions it alone kept (below the watermark) are deleted now."""
        self._check_open()
        with self._persist_lock:
            with self._lock:
                self._sweep_locked()
                rec = self._leases.get(lease_id)
                doc = self._doc_locked(leases=self._leases.records(without=lease_id))
            persist.write_registry(self._root, doc)
            with self._lock:
                self._leases.remove(lease_id)
        self._retain()
        return rec

    # -- introspection ----------------------------------------------------------------------
    def _record_locked(self, e: VersionEntry) -> VersionRecord:
        return VersionRecord(
            version=e.stored.version,
            sha256=e.stored.sha256,
            nbytes=e.stored.nbytes,
            tiers=e.tiers(),
            kind=e.stored.kind,
            parent=e.stored.parent,
            stored_nbytes=e.stored.disk_nbytes,
            leases=self._leases.count(e.stored.version),
            created_at=e.stored.created_at,
            last_used=e.last_used,
            in_use=e.pins,
        )

    def versions(self) -> list[VersionRecord]:
        """Every retained version, ascending."""
        self._after_op()
        with self._lock:
            self._sweep_locked()
            return [self._record_locked(self._entries[v]) for v in sorted(self._entries)]

    def info(self, version: int) -> VersionRecord:
        version = check_version(version)
        self._after_op()
        with self._lock:
            self._sweep_locked()
            return self._record_locked(self._live_locked(version))

    def sha256(self, version: int) -> str:
        version = check_version(version)
        self._after_op()
        with self._lock:
            return self._live_locked(version).stored.sha256

    def leases(self) -> list[LeaseRecord]:
        with self._lock:
            self._sweep_locked()
            return self._leases.records()

    @property
    def watermark(self) -> int | None:
        return self._watermark

    @property
    def newest(self) -> int | None:
        """The newest version ever acknowledged (it may since have been deleted)."""
        return self._newest

    @property
    def snapshot_nbytes(self) -> int:
        return self._snapshot_nbytes

    def retained_range(self) -> tuple[int, int] | None:
        with self._lock:
            return self._retained_locked()

    def stats(self) -> dict[str, Any]:
        """Live numbers for metrics: bytes/budget/versions per tier, evictions, loads."""
        with self._lock:
            self._sweep_locked()
            tiers = {
                "device": self._device_tier.as_dict(),
                "host": self._host_tier.as_dict(),
                DISK: self._disk.as_dict(),
            }
            return {
                "tiers": tiers,
                "evictions": {k: t["evictions"] for k, t in tiers.items()},
                "versions": len(self._entries),
                "newest": -1 if self._newest is None else self._newest,
                "watermark": -1 if self._watermark is None else self._watermark,
                "leases": len(self._leases),
                "tombstones": len(self._tombstones),
                "in_use": sum(e.pins for e in self._entries.values()),
                "publishes": self._publishes,
                "snapshot_bytes": self._snapshot_nbytes,
                "load_seconds": self._load_seconds,
                **{k: self._counters.get(k, 0) for k in _COUNTERS},
                "lagging": {} if self._lagging is None else dict(self._lagging.counters),
            }

    # -- lifecycle --------------------------------------------------------------------------
    def close(self) -> None:
        """Drop memory copies and free the directory for another process."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for e in self._entries.values():
                self._drop_memory_locked(e)
            lag, self._lagging = self._lagging, None
        if lag is not None:
            lag.close()
        self._lockfile.close()

    def __enter__(self) -> SnapshotStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
