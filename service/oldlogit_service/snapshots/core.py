"""The snapshot store's shared core: state, recovery, the registry, disk retention.

In: the constructor's arguments and an existing (or empty) snapshot directory. Out: the
in-memory state every other part of the store reads, kept equal to the durable registry
(change the registry first, then memory). No request handling here: ``publishing`` adds
versions, ``store`` serves them and exposes the public API.
"""

from __future__ import annotations

import logging
import numbers
import re
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from oldlogit.errors import (
    Conflict,
    InvalidRequest,
    OldLogitError,
    Unavailable,
    UnknownVersion,
    VersionEvicted,
    WeightsMismatch,
)
from oldlogit.types import MAX_VERSION
from oldlogit.weights import read_safetensors_header
from oldlogit_service.snapshots import ingest, persist
from oldlogit_service.snapshots.leases import LeaseRecord, LeaseTable
from oldlogit_service.snapshots.residency import Residency, VersionEntry
from oldlogit_service.snapshots.tiers import DISK, DiskCandidate, TierAccount, disk_victims

logger = logging.getLogger(__name__)

__all__ = ["StoreCore", "check_sha", "check_version"]

_SHA_RE = re.compile(r"^[0-9a-f]{64}$")


def check_version(version: object, parameter: str = "policy_version") -> int:
    if (
        isinstance(version, bool)
        or not isinstance(version, numbers.Integral)
        or not 0 <= int(version) <= MAX_VERSION
    ):
        raise InvalidRequest(
            f"{parameter} must be an integer in [0, 2**63 - 1], got {version!r}",
            parameter=parameter,
        )
    return int(version)


def check_sha(sha: str | None) -> str | None:
    if sha is None:
        return None
    if not isinstance(sha, str) or not _SHA_RE.match(sha.lower()):
        raise InvalidRequest("sha256 must be 64 hex digits", parameter="sha256")
    return sha.lower()


class StoreCore(Residency):
    """State shared by the store's parts; see ``SnapshotStore`` for the public API.

    Lock order: ``_persist_lock`` (registry writes) → ``_load_lock`` (one load at a time) →
    ``_lock`` (in-memory state, short sections only). Disk reads and hashing hold none of the
    state lock, so resident versions keep being served while another one loads.
    """

    def __init__(
        self,
        root: Path | str,
        *,
        param_specs: Mapping[str, tuple[str, tuple[int, ...]]],
        device: torch.device | str,
        device_budget_bytes: int,
        host_budget_bytes: int,
        disk_budget_bytes: int,
        max_versions: int,
        pin_host: bool | None = None,
        clock: Callable[[], float] = time.time,
        verify_first_load: bool = True,
        admission_timeout_s: float = 60.0,
        keyframe_every: int = 1,
        keyframe_chain_fraction: float = 1.0,
    ) -> None:
        """``verify_first_load``: a version recovered from an earlier process has its weight
        hash recomputed on its first load (hashing runs on the buffer just read, costing about
        one more pass over memory per version per process; disk rot or tampering then fails
        loudly instead of answering with the wrong weights). Versions published by this
        process were hashed when written and are not re-checked.

        Keyframe policy (``chains``): a new version is stored as a patch against its parent
        unless that would make its chain ``keyframe_every`` versions long (1: every version is
        a keyframe, no patches) or its chain's patches larger than ``keyframe_chain_fraction``
        of one keyframe; both bound what a rebuild reads and applies."""
        if max_versions < 1:
            raise ValueError("max_versions must be >= 1")
        if keyframe_every < 1 or not keyframe_chain_fraction > 0:
            raise ValueError("keyframe_every must be >= 1 and keyframe_chain_fraction > 0")
        dev = torch.device(device)
        specs = ingest.normalize_specs(param_specs)
        use_host = dev.type == "cuda"
        super().__init__(
            device=dev,
            device_tier=TierAccount("device", int(device_budget_bytes)),
            # The host tier only makes sense in front of a GPU; on CPU the device tier is
            # process memory already.
            host_tier=TierAccount("host", int(host_budget_bytes) if use_host else 0),
            host_enabled=use_host,
            pin_host=bool(use_host if pin_host is None else pin_host and use_host),
            clock=clock,
            admission_timeout_s=admission_timeout_s,
        )
        self._root = Path(root)
        self._weights_dir = self._root / persist.WEIGHTS
        self._specs = specs
        self._specs_sha = ingest.specs_sha256(specs)
        self._snapshot_nbytes = ingest.specs_nbytes(specs)
        self._max_versions = int(max_versions)
        self._verify_first_load = verify_first_load
        self._keyframe_every = int(keyframe_every)
        self._keyframe_chain_fraction = float(keyframe_chain_fraction)
        self._disk = TierAccount(DISK, int(disk_budget_bytes))
        self._persist_lock = threading.RLock()  # a rewrite may find a corrupt file: _lose
        self._leases = LeaseTable(clock)
        self._tombstones = persist.VersionRanges()
        # Scale-out seams (cluster.py): a claim in the shared registry that must succeed
        # before a publish becomes visible, and versions leased on other replicas.
        self.commit_hook: Callable[[int, str, Path, dict[str, Any]], bool] | None = None
        self.external_pins: Callable[[], set[int]] | None = None
        self._newest: int | None = None
        self._watermark: int | None = None
        self._retention_due = False
        self._closed = False
        self._publishes = 0
        self._root.mkdir(parents=True, exist_ok=True)
        self._weights_dir.mkdir(exist_ok=True)
        try:
            self._lockfile = persist.lock_root(self._root)
        except BlockingIOError as exc:
            raise Conflict(str(exc), parameter="snapshot_dir") from exc
        try:
            self._recover()
        except BaseException:
            self._lockfile.close()
            raise
        if self._device_tier.budget < self._snapshot_nbytes:
            logger.warning(
                "device budget %d B is below one version (%d B): every request reloads",
                self._device_tier.budget,
                self._snapshot_nbytes,
            )

    # -- recovery ---------------------------------------------------------------------------
    def _recover(self) -> None:
        doc = persist.read_registry(self._root)
        fresh = doc is None
        if doc is None:
            doc = persist.RegistryDoc(self._specs_sha)
        elif doc.specs_sha256 != self._specs_sha and (doc.versions or doc.newest is not None):
            raise WeightsMismatch(
                f"snapshot_dir {self._root} holds versions of a model with other parameters "
                "(names, dtypes or shapes); point --snapshot-dir at a new directory",
                parameter="snapshot_dir",
            )
        for p in persist.clear_stale(self._root, {sv.file for sv in doc.versions.values()}):
            logger.warning("removed %s: no acknowledged version owns it", p)
        lost: list[int] = []
        for v in sorted(doc.versions):  # a patch's parent is older: it is decided first
            sv = doc.versions[v]
            orphan = sv.kind == "patch" and sv.parent not in self._entries
            if orphan or not self._file_ok(sv):
                lost.append(sv.version)
                continue
            e = VersionEntry(
                sv, sv.created_at, next(self._ticks), verified=not self._verify_first_load
            )
            self._entries[sv.version] = e
            self._disk.add(sv.disk_nbytes)
        self._newest = doc.newest
        self._watermark = doc.watermark
        self._tombstones = doc.tombstones
        self._leases.load(r for r in doc.leases if r.version in self._entries)
        self._leases.sweep()
        for v in lost:
            logger.error(
                "version %d: its file (or its chain's) is missing or malformed; it is gone", v
            )
            persist.quarantine(self._root, doc.versions[v].file)
            self._tombstones.add(v)
        if fresh or lost or doc.specs_sha256 != self._specs_sha:
            with self._lock:
                persist.write_registry(self._root, self._doc_locked())
        logger.info(
            "snapshot store %s: %d versions retained, newest acknowledged %s, watermark %s",
            self._root,
            len(self._entries),
            self._newest,
            self._watermark,
        )
        self._retain()

    def _file_ok(self, sv: persist.StoredVersion) -> bool:
        """The file's table matches the model (a patch's bytes are checked when read)."""
        try:
            header = read_safetensors_header(self._weights_dir / sv.file)
        except OldLogitError:
            return False
        if sv.kind == "patch":
            return header.file_size == sv.file_nbytes and sv.parent is not None
        found = {n: (e.dtype, e.shape) for n, e in header.tensors.items()}
        return found == self._specs and header.nbytes == sv.nbytes

    # -- registry helpers (call with _lock held) --------------------------------------------
    def _doc_locked(
        self,
        *,
        add: persist.StoredVersion | None = None,
        remove: tuple[int, ...] = (),
        replace: Mapping[int, persist.StoredVersion] | None = None,
        watermark: int | None = None,
        leases: list[LeaseRecord] | None = None,
    ) -> persist.RegistryDoc:
        versions = {v: e.stored for v, e in self._entries.items() if v not in remove}
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

    def _sweep_locked(self) -> None:
        expired = self._leases.sweep()
        for r in expired:
            logger.info("lease %s on version %d (%s) expired", r.lease_id, r.version, r.holder)
        if expired:
            self._retention_due = True

    def _check_open(self) -> None:
        if self._closed:
            raise Unavailable("the snapshot store is closed")

    def _retained_locked(self) -> tuple[int, int] | None:
        return (min(self._entries), max(self._entries)) if self._entries else None

    def _missing_error(self, version: int, why: str | None = None) -> OldLogitError:
        rng = self._retained_locked()
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
        where = f"{rng[0]}..{rng[1]}" if rng else "none"
        return VersionEvicted(
            f"policy_version {version} is no longer retained: {why} (retained: {where})",
            parameter="policy_version",
            details={"retained": list(rng) if rng else None},
        )

    def _live_locked(self, version: int) -> VersionEntry:
        e = self._entries.get(version)
        if e is None:
            raise self._missing_error(version)
        return e

    def _after_op(self) -> None:
        """Expire leases and, if that (or a released pin) freed a version for deletion, apply
        the retention rules now: expiry is lazy, checked on every operation."""
        if self._closed:
            return
        with self._lock:
            self._sweep_locked()
            due = self._retention_due
        if due:
            self._retain()

    def _retire_locked(self, version: int, *, evicted: bool = True) -> None:
        e = self._entries.pop(version)
        self._tombstones.add(version)
        self._disk.remove(e.stored.disk_nbytes, evicted=evicted)
        e.retired = True
        if e.pins == 0:
            self._drop_memory_locked(e)

    def _descendants_locked(self, versions: set[int]) -> set[int]:
        """Retained versions rebuilt through any of ``versions`` (excluding them)."""
        out: set[int] = set()
        for v in sorted(self._entries):  # parents are older: one pass sees them first
            p = self._entries[v].stored.parent
            if p is not None and (p in versions or p in out):
                out.add(v)
        return out - versions

    # -- removal (chains stay whole) --------------------------------------------------------
    def _rewrites_for_removal(
        self, remove: set[int]
    ) -> dict[int, persist.StoredVersion]:  # pragma: no cover - the chains layer provides it
        """New records (and files, written durably) for retained versions whose chain runs
        through a removed one. Called with ``_persist_lock`` held."""
        raise NotImplementedError

    def _remove_versions(self, remove: tuple[int, ...], *, evicted: bool) -> list[str]:
        """Delete versions durably (tombstoned), rewriting the versions that depend on them
        first, so no retained chain loses its keyframe. Needs ``_persist_lock``; returns the
        files to remove after the caller logs."""
        rewrites = self._rewrites_for_removal(set(remove))
        with self._lock:
            old = [self._entries[v].stored.file for v in (*remove, *rewrites)]
            doc = self._doc_locked(remove=remove, replace=rewrites)
        try:
            persist.write_registry(self._root, doc)
        except BaseException:
            persist.remove_files(self._weights_dir, [sv.file for sv in rewrites.values()])
            raise
        with self._lock:
            for v in remove:
                self._retire_locked(v, evicted=evicted)
            for v, sv in rewrites.items():
                e = self._entries[v]
                self._disk.remove(e.stored.disk_nbytes, evicted=False)
                self._disk.add(sv.disk_nbytes)
                if e.patch is not None:  # it was against the old parent
                    self._cpu_tier.remove(e.patch.nbytes, evicted=False, count=False)
                    e.patch = None
                e.stored = sv
        return old

    # -- retention --------------------------------------------------------------------------
    def _retain(self) -> None:
        """Apply the disk retention rules after an operation that already succeeded: a failure
        here (a full or read-only disk) is logged and retried later, never reported as the
        failure of that operation (a publish that is durable must not look failed)."""
        try:
            self._enforce_retention()
        except Exception:
            logger.exception("disk retention failed; it is retried on the next operation")
            with self._lock:
                self._retention_due = True

    def _enforce_retention(self) -> None:
        with self._persist_lock:
            with self._lock:
                self._sweep_locked()
                self._retention_due = False
            # A removal can rewrite a dependent version as a keyframe (more bytes), so the
            # rules are applied again until they pick nothing; each round removes a version.
            for _ in range(len(self._entries) + 1):
                # Asked outside the lock: the answer may come from Redis.
                pinned_elsewhere = self.external_pins() if self.external_pins else set()
                with self._lock:
                    leased = self._leases.leased_versions() | pinned_elsewhere
                    cands = [
                        DiskCandidate(v, e.stored.disk_nbytes, e.last_used, v in leased, e.pins > 0)
                        for v, e in self._entries.items()
                    ]
                    victims, held = disk_victims(
                        cands,
                        watermark=self._watermark,
                        max_versions=self._max_versions,
                        budget=self._disk.budget,
                    )
                    self._retention_due = held  # retry when the request holding it lets go
                if not victims:
                    return
                files = self._remove_versions(tuple(v for v, _ in victims), evicted=True)
                persist.remove_files(self._weights_dir, files)
                for v, why in victims:
                    logger.info("deleted version %d from disk (%s)", v, why)
