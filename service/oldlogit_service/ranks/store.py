"""The front's store: the registry of record, whose versions land on every rank or none.

In: publishes (through the same calls as a single-device store), deletes, the watermark,
leases, sweeps. Out: a version is verified against its whole-version weight hash, persisted
whole here (the registry, retention, leases and the parent of the next delta, exactly as on one
device), then split and placed on every rank (``Front.place``: each rank stores its part in its
own store, delta-encoded against its own previous parts, and reports the part's hash). It is
visible (``has``, ``versions``, ``info``) only once every rank holds its part. A placement that
fails leaves it invisible and its parts dropped from every rank; publishing it again (the
same weights) places it, and so does the next start. After each change the ranks drop the
parts of versions the registry no longer retains.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from oldlogit.contract.errors import InvalidRequest, UnknownVersion
from oldlogit_service.ranks.front import Front
from oldlogit_service.snapshots import SnapshotStore
from oldlogit_service.snapshots.leases import LeaseRecord
from oldlogit_service.snapshots.records import PublishOutcome, StoreStats, VersionRecord
from oldlogit_service.snapshots.tiers import DISK

logger = logging.getLogger(__name__)

__all__ = ["ADAPTERS_REFUSED", "FrontStore"]

ADAPTERS_REFUSED = (
    "adapter versions are not served under --tensor-parallel above 1 yet: publish them to a "
    "replica started with --tensor-parallel 1 (one device holds the base and its adapters)"
)


class FrontStore(SnapshotStore):
    """A ``SnapshotStore`` of whole versions whose writes also place every rank's part."""

    def __init__(self, root: Path | str, *, front: Front, **kwargs: Any) -> None:
        self._front = front
        self._placed: set[int] = set()
        self._place_lock = threading.RLock()
        super().__init__(root, **kwargs)

    def place_all(self) -> None:
        """At start-up: the versions every rank holds are visible; each retained version a rank
        lacks (a placement cut short, a rank's directory lost) is placed now."""
        with self._place_lock:
            adapters = sorted(
                v for v, sv in self.registry.records().items() if sv.kind == "adapter"
            )
            if adapters:
                raise InvalidRequest(
                    f"the snapshot directory holds adapter versions {adapters[:8]}: "
                    f"{ADAPTERS_REFUSED}; or delete them there first",
                    parameter="tensor_parallel",
                )
            retained = set(self.registry.records())
            self._placed = self._front.versions() & retained
            for version in sorted(retained - self._placed):
                logger.info("placing version %d on every tensor-parallel rank", version)
                self._place(version)
            self._sync()

    # -- placement --------------------------------------------------------------------------
    def _place(self, version: int) -> bool:
        """Place ``version`` on every rank unless it is already; True if placed now."""
        with self._place_lock:
            if version in self._placed:
                return False
            with super().acquire(version) as whole:
                hashes = self._front.place(version, whole)
            self._placed.add(version)
        logger.info(
            "version %d placed on %d ranks (part sha256 %s)",
            version,
            len(hashes),
            ", ".join(h[:12] for h in hashes),
        )
        return True

    def _sync(self) -> None:
        """Every rank keeps the parts of the retained, placed versions only."""
        with self._place_lock:
            self._placed &= set(self.registry.records())
            self._front.retain(set(self._placed))

    def _placed_outcome(self, out: PublishOutcome) -> PublishOutcome:
        placed_now = self._place(out.version)
        self._sync()
        if placed_now and not out.created:  # an earlier attempt stopped before every rank
            return dataclasses.replace(out, created=True)
        return out

    def publish(
        self,
        version: int,
        weights: Mapping[str, torch.Tensor] | Path | str,
        *,
        expected_sha256: str | None = None,
        cast: bool = False,
    ) -> PublishOutcome:
        out = super().publish(version, weights, expected_sha256=expected_sha256, cast=cast)
        return self._placed_outcome(out)

    def publish_file(
        self,
        version: int,
        path: Path | str,
        *,
        expected_sha256: str | None = None,
        move: bool = False,
    ) -> PublishOutcome:
        out = super().publish_file(version, path, expected_sha256=expected_sha256, move=move)
        return self._placed_outcome(out)

    def publish_delta(
        self,
        version: int,
        path: Path | str,
        *,
        parent: int | None = None,
        expected_sha256: str | None = None,
    ) -> PublishOutcome:
        out = super().publish_delta(version, path, parent=parent, expected_sha256=expected_sha256)
        return self._placed_outcome(out)

    def publish_adapter(
        self,
        version: int,
        path: Path | str,
        *,
        base_version: int,
        expected_sha256: str | None = None,
    ) -> PublishOutcome:
        raise InvalidRequest(ADAPTERS_REFUSED, parameter="base_version")

    def adopt(self, version: int, path: Path, expected_sha256: str) -> PublishOutcome:
        raise InvalidRequest(
            "a tensor-parallel replica does not adopt versions from other replicas "
            "(--redis-url with --tensor-parallel above 1 is not served)"
        )

    # -- visibility -------------------------------------------------------------------------
    def _visible(self, version: int) -> None:
        if version not in self._placed and super().has(version):
            raise UnknownVersion(
                f"policy_version {version} is not on every tensor-parallel rank: its publish "
                "did not complete; publish it again",
                parameter="policy_version",
            )

    def _ranked(self, rec: VersionRecord) -> VersionRecord:
        """A record with rank 0's memory tiers (the ranks load and evict alike)."""
        tiers = self._front.store.residency.tiers(rec.version) | {DISK}
        return dataclasses.replace(rec, tiers=tiers)

    def has(self, version: int) -> bool:
        return version in self._placed and super().has(version)

    def versions(self) -> list[VersionRecord]:
        return [self._ranked(r) for r in super().versions() if r.version in self._placed]

    def info(self, version: int) -> VersionRecord:
        self._visible(version)
        return self._ranked(super().info(version))

    def sha256(self, version: int) -> str:
        self._visible(version)
        return super().sha256(version)

    def stats(self) -> StoreStats:
        """The registry's counts with rank 0's memory tiers (each rank holds 1/N of them)."""
        st = super().stats()
        mine = self._front.store.stats().tiers
        return dataclasses.replace(
            st, tiers={**st.tiers, "device": mine["device"], "host": mine["host"]}
        )

    # -- changes that retire versions -------------------------------------------------------
    def delete(self, version: int) -> bool:
        self._visible(version)
        out = super().delete(version)
        self._sync()
        return out

    def set_watermark(self, version: int) -> int:
        out = super().set_watermark(version)
        self._sync()
        return out

    def release(self, lease_id: str) -> LeaseRecord:
        out = super().release(lease_id)
        self._sync()
        return out

    def sweep(self) -> None:
        super().sweep()
        self._front.store.sweep()  # rank 0's keyframe moves (each follower sweeps its own)
        if self._front.health.problem() is None:
            try:
                self._sync()
            except Exception:
                logger.exception("syncing the ranks' versions failed; the next sweep retries")
