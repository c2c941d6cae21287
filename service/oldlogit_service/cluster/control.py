"""The deployment's shared state behind one interface: versions, leases, watermark, visibility.

In: the runtime's control calls (blocking; the runtime runs them in threads). Out: contract
types. ``LocalControl`` is the embedded default (one replica, the local store); the scale-out
implementation (``cluster.ClusterControl``) keeps replicas in step through Redis. The runtime
chooses one at start-up and never branches on which.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Protocol

from oldlogit.contract.errors import InvalidRequest
from oldlogit.contract.types import LeaseInfo, VersionInfo
from oldlogit_service.snapshots import LeaseRecord, SnapshotStore, VersionRecord

if TYPE_CHECKING:
    from oldlogit_service.cluster.redis_adapters import RedisLease

__all__ = ["Control", "LocalControl", "check_ttl", "lease_info", "version_info"]


def version_info(rec: VersionRecord) -> VersionInfo:
    return VersionInfo(
        policy_version=rec.version,
        weight_sha256=rec.sha256,
        nbytes=rec.nbytes,
        tiers=sorted(rec.tiers),
        kind=rec.kind,
        parent=rec.parent,
        leases=rec.leases,
        created_at=rec.created_at,
        adapter_of=rec.base,
    )


def lease_info(rec: LeaseRecord | RedisLease) -> LeaseInfo:
    """A lease record, local or shared (Redis), as the contract type."""
    return LeaseInfo(
        lease_id=rec.lease_id,
        policy_version=rec.version,
        holder=rec.holder,
        ttl_s=rec.ttl_s,
        expires_at=rec.expires_at,
    )


def check_ttl(ttl_s: float) -> float:
    if not (math.isfinite(ttl_s) and 0 < ttl_s <= 7 * 24 * 3600):
        raise InvalidRequest(
            f"ttl_s must be in (0, 604800] seconds, got {ttl_s!r}", parameter="ttl_s"
        )
    return float(ttl_s)


class Control(Protocol):
    """Blocking calls (disk, Redis); errors are of the tree (``UnknownVersion`` …)."""

    def prepare(self, versions: set[int], *, tolerant: bool) -> None:
        """Make these versions servable here if the deployment has them (scale-out: adopt a
        version published on another replica). ``tolerant``: leave a missing one to the
        caller (a proxy or fallback may answer) instead of raising."""
        ...

    def versions(self) -> tuple[list[VersionInfo], int | None]: ...

    def version(self, version: int) -> VersionInfo: ...

    def delete(self, version: int) -> None: ...

    def set_watermark(self, version: int) -> int: ...

    def create_lease(self, version: int, holder: str, ttl_s: float) -> LeaseInfo: ...

    def release_lease(self, lease_id: str) -> None: ...

    def replicas(self) -> list[dict[str, Any]]: ...

    def sweep(self) -> None:
        """Periodic upkeep: lease expiry, retention (reads never do it)."""
        ...

    def start(self, *, http: str, grpc: str, queue_depth: Any) -> None: ...

    def stop(self) -> None: ...


class LocalControl:
    """One replica: the local store is the whole truth."""

    def __init__(self, store: SnapshotStore) -> None:
        self.store = store

    def prepare(self, versions: set[int], *, tolerant: bool) -> None:
        return None  # nothing to adopt: an unknown version is the store's error to raise

    def versions(self) -> tuple[list[VersionInfo], int | None]:
        return [version_info(r) for r in self.store.versions()], self.store.watermark

    def version(self, version: int) -> VersionInfo:
        return version_info(self.store.info(version))

    def delete(self, version: int) -> None:
        self.store.delete(version)

    def set_watermark(self, version: int) -> int:
        self.store.set_watermark(version)
        wm = self.store.watermark
        return int(wm if wm is not None else version)

    def create_lease(self, version: int, holder: str, ttl_s: float) -> LeaseInfo:
        return lease_info(self.store.lease(version, holder, check_ttl(ttl_s)))

    def release_lease(self, lease_id: str) -> None:
        self.store.release(lease_id)

    def replicas(self) -> list[dict[str, Any]]:
        return []

    def sweep(self) -> None:
        self.store.sweep()

    def start(self, *, http: str, grpc: str, queue_depth: Any) -> None:
        return None

    def stop(self) -> None:
        return None
