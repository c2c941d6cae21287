"""The deployment's one chain of keyframes and patches, as one replica takes part in it.

In: the Redis registry (each version's kind, parent, file and hashes), the shared chain
directory (``<snapshot_dir>/chain``: one link per chain file) and this replica's store. Out: a
publish claimed with its chain file; a version published elsewhere adopted with its chain
(``snapshots/shared.py``: hard links, every step hash-checked); this store's records following
the deployment's; and, by the one replica holding the re-key lease at a time, the rewrites
every replica then follows — retention over the deployment's versions (a removed version's
dependents rebased or re-keyed), keyframes that follow access, deletes, and collecting chain
files no record and no in-flight claim names. Any replica may take the lease; it is void once
its holder's heartbeat is gone, so a killed holder blocks nobody for long.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from oldlogit.contract.errors import ParentMissing, Unavailable, VersionEvicted
from oldlogit_service.cluster.redis_adapters import ParentGone, RedisMembership, RedisRegistry
from oldlogit_service.snapshots import SnapshotStore, crashpoints, persist
from oldlogit_service.snapshots.persist import CorruptSnapshot, StoredVersion
from oldlogit_service.snapshots.shared import (
    ChainMoved,
    SharedChain,
    check_record,
    link_shared,
    shared_files,
)
from oldlogit_service.snapshots.tiers import DiskCandidate, disk_victims

logger = logging.getLogger(__name__)

__all__ = ["CHAIN_DIR", "DeploymentChain"]

CHAIN_DIR = "chain"  # under --snapshot-dir
# The re-key lease's time to live; its holder renews it at every step, and it is void as soon
# as the holder's heartbeat is (a killed replica's: a few seconds).
REKEY_LEASE_S = 30.0
_ADOPT_TRIES = 4
# A replica silent this long (no heartbeat, its directory's lock free, its registry file not
# written) has departed: its store directory goes (``collect``).
DEPARTED_AFTER_S = 600.0
# A temp link older than this in the chain directory is a killed process's leftover.
STALE_TEMP_S = 60.0


class DeploymentChain:
    """Built before the store (whose hooks it gives: ``hooks``), then ``bind``-ed to it."""

    def __init__(
        self,
        registry: RedisRegistry,
        membership: RedisMembership,
        replica_id: str,
        directory: Path,
        *,
        pinned: Callable[[], set[int]],
    ) -> None:
        self.registry = registry
        self.membership = membership
        self.replica_id = replica_id
        self.directory = directory
        self.directory.mkdir(parents=True, exist_ok=True)
        self._pinned = pinned
        self._store: SnapshotStore | None = None
        self.departed_after_s = DEPARTED_AFTER_S
        # Adoption, following and rewriting here, one at a time (re-entrant: a rewrite adopts).
        self.lock = threading.RLock()

    def bind(self, store: SnapshotStore) -> DeploymentChain:
        self._store = store
        return self

    @property
    def store(self) -> SnapshotStore:
        assert self._store is not None, "bind the chain to its store first"
        return self._store

    def hooks(self) -> SharedChain:
        return SharedChain(
            directory=self.directory,
            claim=self.claim,
            fetch=self.fetch,
            pinned_elsewhere=self._pinned,
            quarantined=self.quarantined,
            swap=self.swap,
        )

    # -- records ---------------------------------------------------------------------------
    def records(self) -> dict[int, StoredVersion]:
        """Every version the deployment retains, as chain records (a record written before
        the chain, naming a replica's own file, counts once ``migrate`` has moved it)."""
        out: dict[int, StoredVersion] = {}
        for v, rec in self.registry.all().items():
            try:
                out[v] = _record(v, rec)
            except CorruptSnapshot as exc:
                logger.debug("version %d's record is not a chain record (yet): %s", v, exc)
        return out

    def migrate(self) -> list[int]:
        """Records written before the deployment had one chain (every version whole, its
        ``file`` a path into the publishing replica's store) moved onto the chain: the file
        linked into the chain directory, the record swapped. Call with the lease."""
        moved: list[int] = []
        for v, rec in self.registry.all().items():
            path = Path(str(rec.get("file", "")))
            if not path.is_absolute() or rec.get("kind", "keyframe") != "keyframe":
                continue
            try:
                link_shared(path, self.directory, path.name)
            except FileNotFoundError:
                logger.warning("version %d's file %s is gone: not moved onto the chain", v, path)
                continue
            new = {**rec, "file": path.name, "created_at": rec.get("created_at", time.time())}
            if self.registry.swap(self.replica_id, [], {v: new}, {v: str(path)}) == "ok":
                moved.append(v)
        if moved:
            logger.info("moved versions %s, stored before the chain, onto it", moved)
        return moved

    @staticmethod
    def chain_of(version: int, records: Mapping[int, StoredVersion]) -> list[StoredVersion]:
        """[version, its parent, ..., its keyframe] in ``records``; ``ChainMoved`` if broken."""
        out = [records[version]]
        while out[-1].kind == "patch":
            parent = out[-1].parent
            if parent not in records or len(out) > len(records):
                raise ChainMoved(f"version {out[-1].version}: its parent {parent} is not retained")
            out.append(records[parent])  # type: ignore[index]
        return out

    # -- publish ---------------------------------------------------------------------------
    def claim(self, version: int, sha256: str, path: Path, record: dict[str, Any]) -> bool:
        """Link the durable file into the shared directory (announced first, so no collection
        takes it), then claim the version with its chain record; True if created. On any
        other outcome the shared link goes again and the store rolls its file back."""
        name = path.name
        self.registry.pending(name, self.replica_id)
        created = False
        try:
            link_shared(path, self.directory, name)
            crashpoints.reached("claim", version)
            out = self.registry.register(
                version, {**record, "sha256": sha256, "file": name, "replica": self.replica_id}
            )
            created = out.outcome == "created"
        except ParentGone as exc:
            raise ParentMissing(
                f"policy_version {version} was diffed against version {exc.parent}, which "
                "the deployment removed meanwhile; publish it again",
                parameter="parent",
                details={"parent": exc.parent},
            ) from exc
        finally:
            if not created:
                (self.directory / name).unlink(missing_ok=True)
                with contextlib.suppress(Unavailable):
                    self.registry.not_pending(name)
        return created

    # -- adoption --------------------------------------------------------------------------
    def adopt(self, version: int) -> None:
        """Make a version the deployment retains held here, with its chain. Damaged shared
        files drop their versions from the deployment (``VersionEvicted``)."""
        with self.lock:
            self._adopt(version)

    def _adopt(self, version: int) -> None:
        for attempt in range(_ADOPT_TRIES):
            if self.store.has(version):
                return
            records = self.records()
            if version not in records:
                raise VersionEvicted(
                    f"policy_version {version} was removed from the deployment",
                    parameter="policy_version",
                )
            try:
                self.store.adopt_chain(self.chain_of(version, records))
                return
            except ChainMoved:
                # Another replica rewrote the chain since the records were read.
                time.sleep(0.05 * (attempt + 1))
            except CorruptSnapshot as exc:
                bad = exc.version if exc.version is not None else version
                dropped = self.registry.forget_tree([bad])
                logger.error(
                    "version %d failed its check on adoption (%s); dropped %s", bad, exc, dropped
                )
                raise VersionEvicted(
                    f"policy_version {version} is no longer retained: its chain's file of "
                    f"version {bad} failed verification and was dropped",
                    parameter="policy_version",
                ) from exc
        raise Unavailable(
            f"policy_version {version}'s chain kept changing while it was adopted; retry",
            retry_after_s=1.0,
        )

    def fetch(self, version: int | None) -> None:
        """A publish's parent (None: the deployment's newest), adopted if retained."""
        if version is None:
            version = self.registry.newest()
            if version is None:
                return
        if not self.store.has(version) and self.registry.get(version) is not None:
            self.adopt(version)

    # -- following the deployment ----------------------------------------------------------
    def follow(self) -> tuple[list[int], list[int]]:
        """This store's records to the deployment's (after a removal, re-key or move made on
        another replica): new parents adopted first. Returns (removed, switched)."""
        records = self.records()
        local = self.store.registry.records()
        for v, sv in local.items():
            new = records.get(v)
            if new is None or new.file == sv.file or new.kind != "patch":
                continue
            if new.parent is not None and not self.store.has(new.parent):
                self.adopt(new.parent)
        missing = [v for v in local if v not in records]
        removed = self.registry.gone_among(missing)
        return self.store.follow(records, removed)

    def quarantined(self, versions: tuple[int, ...]) -> None:
        """A file failed verification here: its versions (and the chain's versions above
        them) go from the deployment; every replica reads the same bytes."""
        dropped = self.registry.forget_tree(list(versions))
        if dropped:
            logger.error("dropped versions %s from the deployment (a damaged chain file)", dropped)

    # -- the re-key lease and rewrites -----------------------------------------------------
    def _member_prefix(self) -> str:
        return f"{self.membership.ns}:member:"

    def take_lease(self) -> bool:
        return self.registry.take_rekey_lease(self.replica_id, self._member_prefix(), REKEY_LEASE_S)

    @contextlib.contextmanager
    def lease(self, wait_s: float = 0.0) -> Iterator[bool]:
        """Hold the re-key lease while the block runs (True), or not (False: another live
        replica holds it for all of ``wait_s``)."""
        end = time.monotonic() + wait_s
        got = self.take_lease()
        while not got and time.monotonic() < end:
            time.sleep(0.1)
            got = self.take_lease()
        try:
            yield got
        finally:
            if got:
                with contextlib.suppress(Unavailable):
                    self.registry.drop_rekey_lease(self.replica_id)

    def swap(
        self,
        remove: tuple[int, ...],
        replace: Mapping[int, StoredVersion],
        expect: Mapping[int, StoredVersion],
    ) -> None:
        """The store's rewrite made the deployment's (``SharedChain.swap``)."""
        out = self.registry.swap(
            self.replica_id,
            list(remove),
            {v: {**sv.to_json(), "replica": self.replica_id} for v, sv in replace.items()},
            {v: sv.file for v, sv in expect.items()},
        )
        if out != "ok":
            raise ChainMoved(f"the chain rewrite was not swapped in: {out}")

    def maintain(self) -> None:
        """Under the re-key lease, if free: follow, apply retention to the deployment's
        versions, move a keyframe to where rebuilds are asked for, collect orphan files."""
        with self.lease() as held:
            if not held:
                return
            self.migrate()
            self.follow()
            self.retain()
            if self.store.keyframes_follow_access and self.take_lease():
                try:
                    self.store.move_keyframe()
                except ChainMoved as exc:
                    logger.info("keyframe move not swapped in: %s", exc)
            if self.take_lease():
                self.collect()

    def retain(self) -> list[int]:
        """The disk rules (watermark, ``max_versions``, byte budget) over every version the
        deployment retains, oldest first for the limits; leased (anywhere) and in-use (here)
        versions stay. Call with the lease. Returns the versions removed."""
        records = self.records()
        if not records:
            return []
        wm = self.registry.watermark()
        leased = self._pinned()
        in_use = self.store.residency.in_use()
        reg = self.store.registry
        cands = [
            DiskCandidate(v, sv.disk_nbytes, sv.created_at, v in leased, v in in_use)
            for v, sv in records.items()
        ]
        picked, _ = disk_victims(
            cands, watermark=wm, max_versions=reg.max_versions, budget=reg.disk.budget
        )
        victims = {v for v, _ in picked}
        if not victims:
            return []
        return self.remove(victims, records)

    def remove(self, victims: set[int], records: dict[int, StoredVersion]) -> list[int]:
        """Remove ``victims`` from the deployment: their dependents are adopted here first and
        rewritten here (rebased, or re-keyed), the rewrite swapped in, then this store's."""
        for v, sv in records.items():
            if v not in victims and sv.kind == "patch" and sv.parent in victims:
                self.adopt(v)
        far = sorted(v for v in victims if not self.store.has(v))
        if far:  # nothing retained outside the victims depends on these (their chain is here)
            self.swap(tuple(far), {}, {v: records[v] for v in far})
        held = self.store.remove_versions(victims - set(far))
        gone = sorted([*far, *held])
        logger.info("removed versions %s from the deployment", gone)
        return gone

    def collect(self) -> list[str]:
        """Delete shared chain files that no record names and no live replica's claim
        announced (a publish or rewrite killed half-way). Call with the lease."""
        files = shared_files(self.directory)  # listed before the records are read
        records, pending = self.registry.chain_state()
        live = {m["replica_id"] for m in self.membership.members()}
        keep = {str(rec.get("file", "")) for rec in records.values()}
        for name, owner in pending.items():
            if owner in live:
                keep.add(name)
            else:
                with contextlib.suppress(Unavailable):
                    self.registry.not_pending(name)
        orphans = sorted(n for n in files if n not in keep)
        for name in orphans:
            (self.directory / name).unlink(missing_ok=True)
        # A link's temp name left by a process killed between its two steps (microseconds).
        stale = time.time() - STALE_TEMP_S
        for p in self.directory.glob(f"{persist.TMP_PREFIX}*"):
            with contextlib.suppress(FileNotFoundError):
                if p.lstat().st_ctime < stale:
                    p.unlink()
        if orphans:
            logger.info("collected %d chain file(s) no record needs", len(orphans))
        self._collect_departed(live)
        return orphans

    def _collect_departed(self, live: set[str]) -> None:
        """Remove the store directory of a replica gone for ``departed_after_s`` (no heartbeat,
        its lock free, its registry file untouched that long: a pod replaced under a new id):
        its links would keep bytes of files the chain dropped. Should it come back, it starts
        empty and adopts what it needs again."""
        replicas = self.directory.parent / "replicas"
        cutoff = time.time() - self.departed_after_s
        with contextlib.suppress(FileNotFoundError):
            for d in replicas.iterdir():
                if d.name in live or d.name == self.replica_id or not d.is_dir():
                    continue
                reg = d / persist.REGISTRY
                with contextlib.suppress(FileNotFoundError):
                    if reg.stat().st_mtime > cutoff:
                        continue
                try:
                    lock = persist.lock_root(d)
                except (BlockingIOError, OSError):
                    continue  # a process has it open: not departed
                try:
                    shutil.rmtree(d, ignore_errors=True)
                finally:
                    lock.close()
                logger.info("removed the store directory of departed replica %s", d.name)


def _record(version: int, rec: dict[str, Any]) -> StoredVersion:
    return check_record(
        StoredVersion.from_json(
            {
                **rec,
                "version": version,
                "created_at": rec.get("created_at", 0.0),
                "nbytes": rec.get("nbytes", 0),
            }
        )
    )
