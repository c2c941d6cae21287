"""The durable registry: acknowledged versions, ordering, watermark, tombstones, leases, disk.

In: a snapshot directory's registry file. Out: each retained version's record
(``persist.StoredVersion``), the publish order rules, the lease table and which versions the
disk rules retire. Every change writes the registry file first (atomically) and memory after,
so what a crash leaves is what was acknowledged. Knows nothing of memory tiers or tensors.

Locks: ``persist_lock`` (re-entrant) serialises changes, including a caller's "write files, then
the registry" sequence; ``_lock`` guards the in-memory state for short sections only.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

from oldlogit.contract.errors import (
    Conflict,
    InvalidRequest,
    OldLogitError,
    ParentMissing,
    UnknownVersion,
    VersionEvicted,
    VersionNotIncreasing,
    WeightsMismatch,
)
from oldlogit.contract.types import check_version
from oldlogit_service.snapshots import persist
from oldlogit_service.snapshots.leases import LeaseRecord, LeaseTable
from oldlogit_service.snapshots.tiers import DISK, DiskCandidate, TierAccount, disk_victims

logger = logging.getLogger(__name__)

__all__ = ["Registry", "check_version"]


class Registry:
    def __init__(
        self,
        root: Path,
        *,
        specs_sha256: str,
        max_versions: int,
        disk_budget_bytes: int,
        clock: Callable[[], float],
    ) -> None:
        self.root = root
        self._specs_sha = specs_sha256
        self._max_versions = max_versions
        self._clock = clock
        self.persist_lock = threading.RLock()
        self._lock = threading.Lock()
        self._records: dict[int, persist.StoredVersion] = {}
        self._last_used: dict[int, float] = {}
        self._newest: int | None = None
        self._watermark: int | None = None
        self._tombstones = persist.VersionRanges()
        self._leases = LeaseTable(clock)
        self.disk = TierAccount(DISK, int(disk_budget_bytes))
        self.publishes = 0

    # -- recovery ---------------------------------------------------------------------------
    def recover(self, file_ok: Callable[[persist.StoredVersion], bool]) -> None:
        """Load the registry file (or start one); versions whose file is missing or malformed,
        or whose chain lost its parent, are quarantined and tombstoned."""
        doc = persist.read_registry(self.root)
        fresh = doc is None
        if doc is None:
            doc = persist.RegistryDoc(self._specs_sha)
        elif doc.specs_sha256 != self._specs_sha and (doc.versions or doc.newest is not None):
            raise WeightsMismatch(
                f"snapshot_dir {self.root} holds versions of a model with other parameters "
                "(names, dtypes or shapes); point --snapshot-dir at a new directory",
                parameter="snapshot_dir",
            )
        for p in persist.clear_stale(self.root, {sv.file for sv in doc.versions.values()}):
            logger.warning("removed %s: no acknowledged version owns it", p)
        lost: list[int] = []
        # A patch is decided after its parent (older, or newer once a keyframe moved down its
        # chain: rebuild.py); one whose chain never reaches a kept keyframe (a parent lost,
        # missing, or a cycle) is lost too. So is an adapter whose base is lost.
        pending = sorted(doc.versions)
        while pending:
            later: list[int] = []
            for v in pending:
                sv = doc.versions[v]
                needs = sv.parent if sv.kind == "patch" else sv.base
                if sv.kind in ("patch", "adapter") and needs not in self._records:
                    if needs in doc.versions and needs not in lost:
                        later.append(v)  # its parent is not decided yet
                    else:
                        lost.append(v)
                    continue
                if not file_ok(sv):
                    lost.append(v)
                    continue
                self._records[v] = sv
                self._last_used[v] = sv.created_at
                self.disk.add(sv.disk_nbytes)
            if len(later) == len(pending):  # no progress: a cycle of parents
                lost.extend(later)
                later = []
            pending = later
        lost.sort()
        self._newest, self._watermark = doc.newest, doc.watermark
        self._tombstones = doc.tombstones
        self._leases.load(r for r in doc.leases if r.version in self._records)
        self._leases.sweep()
        for v in lost:
            logger.error("version %d: its file (or its chain's) is missing or malformed; gone", v)
            persist.quarantine(self.root, doc.versions[v].file)
            self._tombstones.add(v)
        if fresh or lost or doc.specs_sha256 != self._specs_sha:
            with self._lock:
                persist.write_registry(self.root, self._doc_locked())
        logger.info(
            "snapshot store %s: %d versions retained, newest acknowledged %s, watermark %s",
            self.root,
            len(self._records),
            self._newest,
            self._watermark,
        )

    # -- reads (no side effects) ------------------------------------------------------------
    def get(self, version: int) -> persist.StoredVersion:
        """The record of a retained version; ``UnknownVersion``/``VersionEvicted`` otherwise."""
        with self._lock:
            sv = self._records.get(version)
            if sv is None:
                raise self._missing_locked(version)
            return sv

    def has(self, version: int) -> bool:
        with self._lock:
            return version in self._records

    def records(self) -> dict[int, persist.StoredVersion]:
        """Every retained record, by version (a copy)."""
        with self._lock:
            return dict(self._records)

    def last_used(self, version: int) -> float:
        with self._lock:
            return self._last_used.get(version, 0.0)

    def touch(self, version: int) -> None:
        with self._lock:
            if version in self._records:
                self._last_used[version] = self._clock()

    @property
    def max_versions(self) -> int:
        return self._max_versions

    @property
    def newest(self) -> int | None:
        """The newest version ever acknowledged (it may since have been deleted)."""
        return self._newest

    @property
    def watermark(self) -> int | None:
        return self._watermark

    @property
    def tombstone_count(self) -> int:
        return len(self._tombstones)

    def newest_retained(self) -> int | None:
        with self._lock:
            return max(self._records) if self._records else None

    def retained_range(self) -> tuple[int, int] | None:
        with self._lock:
            return self._range_locked()

    def _range_locked(self) -> tuple[int, int] | None:
        return (min(self._records), max(self._records)) if self._records else None

    def chain(self, version: int) -> list[persist.StoredVersion]:
        """``[version, its parent, ..., its keyframe]``; ``CorruptSnapshot`` if a link is gone."""
        with self._lock:
            out = [self._records[version]] if version in self._records else []
            if not out:
                raise self._missing_locked(version)
            while out[-1].kind == "patch":
                parent = out[-1].parent
                sv = None if parent is None else self._records.get(parent)
                if sv is None or len(out) > len(self._records):
                    v = out[-1].version
                    why = "is gone" if sv is None else "leads round a cycle"
                    raise persist.CorruptSnapshot(f"version {v}: its parent {parent} {why}", v)
                out.append(sv)
            return out

    def descendants(self, versions: set[int]) -> set[int]:
        """Retained versions rebuilt through any of ``versions`` (excluding them), and the
        adapters over any of them."""
        with self._lock:
            out: set[int] = set()
            grew = True
            while grew:  # parents may be newer (a moved keyframe): until nothing joins
                grew = False
                for v, sv in self._records.items():
                    p = sv.parent if sv.base is None else sv.base
                    if v not in out and p is not None and (p in versions or p in out):
                        out.add(v)
                        grew = True
            return out - versions

    def adapters_over(self, base: int) -> list[int]:
        """The retained adapter versions over ``base``, ascending."""
        with self._lock:
            return sorted(v for v, sv in self._records.items() if sv.base == base)

    def _adapter_bases_locked(self) -> set[int]:
        return {sv.base for sv in self._records.values() if sv.base is not None}

    def dependents(self, remove: set[int]) -> list[int]:
        """Retained versions (not in ``remove``) whose parent is in ``remove``, ascending."""
        with self._lock:
            return [
                v
                for v in sorted(self._records)
                if v not in remove and self._records[v].parent in remove
            ]

    def missing_error(self, version: int, why: str | None = None) -> OldLogitError:
        with self._lock:
            return self._missing_locked(version, why)

    def _missing_locked(self, version: int, why: str | None = None) -> OldLogitError:
        if version not in self._tombstones and why is None:
            return UnknownVersion(
                f"policy_version {version} was never published here (newest: {self._newest})",
                parameter="policy_version",
            )
        wm = self._watermark
        if why is None:
            why = (
                f"it is below the watermark {wm}"
                if wm is not None and version < wm
                else "it was deleted by the retention limits or on request"
            )
        rng = self._range_locked()
        where = f"{rng[0]}..{rng[1]}" if rng else "none"
        return VersionEvicted(
            f"policy_version {version} is no longer retained: {why} (retained: {where})",
            parameter="policy_version",
            details={"retained": list(rng) if rng else None},
        )

    def parent_missing(self, version: int, parent: int, why: str) -> ParentMissing:
        rng = self.retained_range()
        return ParentMissing(
            f"the delta for policy_version {version} is against parent {parent}, which {why}; "
            "publish the full weights instead (Client.publish(..., fallback_full=True) does)",
            parameter="parent",
            details={"parent": parent, "retained": list(rng) if rng else None},
        )

    def was_deleted(self, version: int) -> bool:
        with self._lock:
            return version in self._tombstones

    # -- leases -----------------------------------------------------------------------------
    def lease_count(self, version: int) -> int:
        with self._lock:
            return self._leases.count(version)

    def leases(self) -> list[LeaseRecord]:
        with self._lock:
            return self._leases.records()

    def lease_total(self) -> int:
        with self._lock:
            return len(self._leases)

    def lease(self, version: int, holder: str, ttl_s: float) -> LeaseRecord:
        with self.persist_lock:
            with self._lock:
                if version not in self._records:
                    raise self._missing_locked(version)
                rec = self._leases.new(version, holder, ttl_s)
                doc = self._doc_locked(leases=self._leases.records(extra=rec))
            persist.write_registry(self.root, doc)
            with self._lock:
                self._leases.put(rec)
            return rec

    def release(self, lease_id: str) -> LeaseRecord:
        with self.persist_lock:
            with self._lock:
                rec = self._leases.get(lease_id)
                doc = self._doc_locked(leases=self._leases.records(without=lease_id))
            persist.write_registry(self.root, doc)
            with self._lock:
                self._leases.remove(lease_id)
            return rec

    def expire_leases(self) -> list[LeaseRecord]:
        """Drop expired leases (their records carry the expiry, so the file needs no write)."""
        with self._lock:
            expired = self._leases.sweep()
        for r in expired:
            logger.info("lease %s on version %d (%s) expired", r.lease_id, r.version, r.holder)
        return expired

    # -- changes ----------------------------------------------------------------------------
    def precheck(self, version: int, *, adopt: bool = False) -> str | None:
        """The retained version's hash (for the idempotency check), or None if it is new and
        may be published. ``adopt``: another replica's registry already ordered it."""
        with self._lock:
            sv = self._records.get(version)
            if sv is not None:
                return sv.sha256
            if adopt:
                return None
            if version in self._tombstones:
                raise VersionNotIncreasing(
                    f"policy_version {version} was published before and has since been "
                    f"deleted; publish a version above {self._newest}",
                    parameter="policy_version",
                )
            if self._newest is not None and version <= self._newest:
                raise VersionNotIncreasing(
                    f"policy_version {version} is not above the newest acknowledged version "
                    f"{self._newest}",
                    parameter="policy_version",
                )
            if self._watermark is not None and version < self._watermark:
                raise InvalidRequest(
                    f"policy_version {version} is below the watermark {self._watermark}",
                    parameter="policy_version",
                )
            return None

    def commit(self, stored: persist.StoredVersion, *, adopt: bool = False) -> None:
        """Record a durable file: the registry file first, then memory. Call with
        ``persist_lock`` held, after ``precheck`` said the version is new."""
        with self._lock:
            if stored.parent is not None and stored.parent not in self._records:
                raise self._parent_gone(stored)
            if stored.base is not None and stored.base not in self._records:
                raise VersionEvicted(
                    f"base_version {stored.base} of adapter version {stored.version} was "
                    "deleted meanwhile",
                    parameter="base_version",
                )
            doc = self._doc_locked(add=stored)
        persist.write_registry(self.root, doc)
        with self._lock:
            self._records[stored.version] = stored
            self._last_used[stored.version] = stored.created_at
            self._newest = doc.newest
            self.disk.add(stored.disk_nbytes)
            self.publishes += 1

    def commit_adopted(self, chain: Sequence[persist.StoredVersion]) -> list[int]:
        """Record versions adopted from the deployment's chain (parents first) in one durable
        registry write; versions held already are skipped. Call with ``persist_lock`` held.
        Returns the versions recorded."""
        with self._lock:
            held = set(self._records)
            new: list[persist.StoredVersion] = []
            for sv in chain:
                if sv.version in held:
                    continue
                if sv.kind == "patch" and sv.parent not in held:
                    raise self._parent_gone(sv)
                new.append(sv)
                held.add(sv.version)
            if not new:
                return []
            doc = self._doc_locked(replace={sv.version: sv for sv in new})
            top = max(sv.version for sv in new)
            doc.newest = top if doc.newest is None else max(doc.newest, top)
        persist.write_registry(self.root, doc)
        with self._lock:
            for sv in new:
                self._records[sv.version] = sv
                self._last_used[sv.version] = sv.created_at
                self.disk.add(sv.disk_nbytes)
            self._newest = doc.newest
            self.publishes += len(new)
        return [sv.version for sv in new]

    def _parent_gone(self, stored: persist.StoredVersion) -> ParentMissing:
        rng = self._range_locked()
        return ParentMissing(
            f"the delta for policy_version {stored.version} is against parent "
            f"{stored.parent}, which was deleted; publish the full weights instead",
            parameter="parent",
            details={"parent": stored.parent, "retained": list(rng) if rng else None},
        )

    def set_watermark(self, version: int) -> bool:
        """Raise the watermark (monotonic); False when it already was ``version``."""
        with self.persist_lock:
            with self._lock:
                wm = self._watermark
                if wm is not None and version < wm:
                    raise InvalidRequest(
                        f"the watermark is {wm} and only moves up; policy_version {version} "
                        "is below it",
                        parameter="policy_version",
                    )
                if wm == version:
                    return False
                doc = self._doc_locked(watermark=version)
            persist.write_registry(self.root, doc)
            with self._lock:
                self._watermark = version
            return True

    def check_deletable(self, version: int) -> bool:
        """False when already deleted; raises if never published or leased."""
        with self._lock:
            if version in self._tombstones:
                return False
            if version not in self._records:
                raise self._missing_locked(version)
            n = self._leases.count(version)
            if n:
                raise Conflict(
                    f"policy_version {version} is held by {n} lease(s); release them first",
                    parameter="policy_version",
                    details={"leases": n},
                )
            over = sorted(v for v, sv in self._records.items() if sv.base == version)
            if over:
                raise Conflict(
                    f"policy_version {version} is the base of adapter version(s) {over}; "
                    "delete them first",
                    parameter="policy_version",
                    details={"adapters": over},
                )
            return True

    def remove(
        self,
        remove: Iterable[int],
        *,
        replace: Mapping[int, persist.StoredVersion],
        evicted: bool,
    ) -> list[str]:
        """Tombstone ``remove`` and swap in ``replace`` (rewritten dependents) durably. Call with
        ``persist_lock`` held; returns the files no record owns any more (to delete)."""
        gone = tuple(remove)
        with self._lock:
            old = [self._records[v].file for v in (*gone, *replace) if v in self._records]
            doc = self._doc_locked(remove=gone, replace=replace)
        persist.write_registry(self.root, doc)
        with self._lock:
            for v in gone:
                sv = self._records.pop(v)
                self._last_used.pop(v, None)
                self._tombstones.add(v)
                self.disk.remove(sv.disk_nbytes, evicted=evicted)
            for v, sv in replace.items():
                self.disk.remove(self._records[v].disk_nbytes, evicted=False)
                self.disk.add(sv.disk_nbytes)
                self._records[v] = sv
        keep = {sv.file for sv in replace.values()}
        return [f for f in old if f not in keep]

    def retention_victims(
        self, in_use: set[int], pinned_elsewhere: set[int]
    ) -> tuple[list[tuple[int, str]], bool]:
        """What the disk rules retire now (watermark, ``max_versions``, byte budget), and
        whether a running request held a victim back."""
        with self._lock:
            # A base stays while an adapter over it is retained (like a leased version).
            leased = (
                self._leases.leased_versions() | pinned_elsewhere | self._adapter_bases_locked()
            )
            cands = [
                DiskCandidate(
                    v, sv.disk_nbytes, self._last_used.get(v, 0.0), v in leased, v in in_use
                )
                for v, sv in self._records.items()
            ]
        return disk_victims(
            cands,
            watermark=self._watermark,
            max_versions=self._max_versions,
            budget=self.disk.budget,
        )

    def _doc_locked(
        self,
        *,
        add: persist.StoredVersion | None = None,
        remove: tuple[int, ...] = (),
        replace: Mapping[int, persist.StoredVersion] | None = None,
        watermark: int | None = None,
        leases: list[LeaseRecord] | None = None,
    ) -> persist.RegistryDoc:
        versions = {v: sv for v, sv in self._records.items() if v not in remove}
        versions.update(replace or {})
        tombstones = self._tombstones.copy()
        for v in remove:
            tombstones.add(v)
        newest = self._newest
        if add is not None:
            versions[add.version] = add
            newest = add.version if newest is None else max(newest, add.version)
        return persist.RegistryDoc(
            specs_sha256=self._specs_sha,
            newest=newest,
            watermark=self._watermark if watermark is None else watermark,
            versions=versions,
            tombstones=tombstones,
            leases=self._leases.records() if leases is None else leases,
        )
