"""Scale-out: N replicas, one Redis, one shared snapshot volume, one service.

In: the local ``SnapshotStore`` and the Redis adapters. Out: a replica that agrees with every
other on versions, watermark, leases and deletions. Each replica keeps its own store directory
under ``<snapshot_dir>/replicas/<replica_id>`` (its own registry file and lock, so the store's
crash-safety holds unchanged); a version published anywhere is *adopted* lazily by hard-linking
the publisher's file (same volume, no copy) and verifying its sha256. The Redis registry is the
source of truth: a publish is acknowledged only after its atomic claim there succeeds.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from oldlogit.contract.errors import (
    Conflict,
    OldLogitError,
    Unavailable,
    UnknownVersion,
    VersionEvicted,
)
from oldlogit.contract.types import LeaseInfo, VersionInfo
from oldlogit_service.cluster.control import check_ttl, lease_info, version_info
from oldlogit_service.cluster.redis_adapters import (
    EventListener,
    RedisLeases,
    RedisMembership,
    RedisRegistry,
    check_eviction_policy,
    connect,
)
from oldlogit_service.config import is_wildcard
from oldlogit_service.snapshots import SnapshotStore

logger = logging.getLogger(__name__)


def default_replica_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


def advertised_address(bind_host: str, port: int, advertise_host: str | None = None) -> str:
    """``host:port`` other machines reach this replica at, for the membership record.

    ``advertise_host`` if given; else the bind address when it is a specific one; else (bound
    to every interface: 0.0.0.0, ::) this machine's hostname, which compose and a headless
    Service resolve. Never the wildcard itself: a client cannot connect to 0.0.0.0.
    """
    host = advertise_host or (socket.gethostname() if is_wildcard(bind_host) else bind_host)
    host = host.strip("[]")
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class ClusterControl:
    """The replica's view of the deployment, kept in step through Redis (``control.Control``).

    Built before the store (whose publishes it claims: ``claim``; whose retention it pins:
    ``leased_versions``), then ``bind``-ed to it.
    """

    def __init__(
        self,
        redis_url: str,
        namespace: str,
        replica_id: str,
        *,
        heartbeat_s: float = 1.0,
    ) -> None:
        self.replica_id = replica_id
        self._store: SnapshotStore | None = None
        self._client = connect(redis_url)
        self.registry = RedisRegistry(self._client, namespace)
        self.leases = RedisLeases(self._client, namespace)
        self.membership = RedisMembership(self._client, namespace, ttl_s=max(3.0, 3 * heartbeat_s))
        self._heartbeat_s = heartbeat_s
        self._queue_depth: Callable[[], int] = lambda: 0
        self._address: dict[str, str] = {}
        self._stop = threading.Event()
        self._adopt_lock = threading.Lock()
        self._pins: set[int] = set()
        self._pins_at = 0.0
        self._listener = EventListener(
            connect(redis_url), self.registry.events_channel, self._on_event, self._catch_up
        )
        self._thread = threading.Thread(
            target=self._beat_loop, name="oldlogit-heartbeat", daemon=True
        )

    def bind(self, store: SnapshotStore) -> ClusterControl:
        self._store = store
        return self

    @property
    def store(self) -> SnapshotStore:
        assert self._store is not None, "bind the cluster control to its store first"
        return self._store

    # -- lifecycle -----------------------------------------------------------------------
    def start(self, *, http: str, grpc: str, queue_depth: Callable[[], int]) -> None:
        self._address = {"http": http, "grpc": grpc}
        self._queue_depth = queue_depth
        try:
            check_eviction_policy(self._client, want="noeviction", role="registry")
        except Exception:
            logger.warning("could not check the registry Redis eviction policy")
        self._listener.start()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._listener.stop()
        self._thread.join(timeout=5)
        try:
            self.membership.leave(self.replica_id)
        except Unavailable:
            pass

    def _beat_loop(self) -> None:
        while not self._stop.is_set():
            try:
                resident = [r.version for r in self.store.versions() if "device" in r.tiers]
                self.membership.beat(
                    self.replica_id,
                    {**self._address, "queue_depth": self._queue_depth(), "resident": resident},
                )
            except Unavailable:
                logger.debug("heartbeat skipped: registry unreachable")
            except Exception:
                logger.exception("heartbeat failed")
            self._stop.wait(self._heartbeat_s)

    # -- publish: the claim, between "durable here" and "visible anywhere" ------------------
    def claim(self, version: int, sha256: str, path: Path, record: dict[str, Any]) -> bool:
        """Claim ``version`` in the registry; True if created, False if the same weights were
        already there (idempotent). Raises VersionConflict / VersionNotIncreasing /
        Unavailable — then the store rolls the local file back and nothing is acknowledged."""
        out = self.registry.register(
            version, {**record, "sha256": sha256, "file": str(path), "replica": self.replica_id}
        )
        return out.outcome == "created"

    # -- lazy adoption -------------------------------------------------------------------
    def ensure_local(self, version: int) -> None:
        """Make a version registered anywhere servable here (hard link + sha256 check)."""
        if self.store.has(version):
            return
        rec = self.registry.get(version)
        if rec is None:
            gone = self.registry.is_gone(version)
        else:  # below the watermark and not leased: retired everywhere
            wm = self.registry.watermark()
            gone = wm is not None and version < wm and not self.leases.live(version)
        if gone:
            raise VersionEvicted(
                f"policy_version {version} was deleted from the deployment",
                parameter="policy_version",
                details={"retained": self._retained()},
            )
        if rec is None:
            raise UnknownVersion(
                f"policy_version {version} was never published", parameter="policy_version"
            )
        with self._adopt_lock:
            if self.store.has(version):
                return
            self.store.adopt(version, Path(rec["file"]), str(rec["sha256"]))
            logger.info("adopted version %d from %s", version, rec.get("replica"))

    def _retained(self) -> list[int] | None:
        versions = sorted(self.registry.all())
        return [versions[0], versions[-1]] if versions else None

    # -- leases and retention ------------------------------------------------------------
    def leased_versions(self) -> set[int]:
        """Versions leased on any replica (cached for a second; last known if Redis is down,
        so an outage never releases a pin)."""
        now = time.monotonic()
        if now - self._pins_at < 1.0:
            return set(self._pins)
        try:
            pins = {v for v in self.registry.all() if self.leases.live(v)}
        except Unavailable:
            return set(self._pins)
        self._pins, self._pins_at = pins, now
        return set(pins)

    # -- events --------------------------------------------------------------------------
    def _on_event(self, ev: dict[str, Any]) -> None:
        kind, version = ev.get("event"), int(ev.get("version", -1))
        if kind == "watermark":
            self.apply_watermark(version)
        elif kind == "deleted":
            self._apply_delete(version)
        elif kind in ("lease", "release"):
            self._pins_at = 0.0  # re-read on the next retention pass

    def _catch_up(self) -> None:
        """On (re)connect: apply what may have been missed (watermark, deletions)."""
        try:
            wm = self.registry.watermark()
            registered = self.registry.all()
        except Unavailable:
            return
        if wm is not None:
            self.apply_watermark(wm)
        for rec in self.store.versions():
            if rec.version not in registered and self.registry.is_gone(rec.version):
                self._apply_delete(rec.version)

    def apply_watermark(self, version: int) -> None:
        """Raise the local store's watermark to ``version`` if it is behind (idempotent; pub/sub
        normally brings it, a reader that saw a newer registry watermark brings it sooner)."""
        try:
            cur = self.store.watermark
            if cur is None or version > cur:
                self.store.set_watermark(version)
        except Exception:
            logger.exception("could not apply watermark %d", version)

    def _apply_delete(self, version: int) -> None:
        if self.store.has(version):
            try:
                self.store.delete(version)
            except Exception:
                logger.warning("version %d deleted elsewhere stays here for now", version)

    # -- control ------------------------------------------------------------------------
    def prepare(self, versions: set[int], *, tolerant: bool) -> None:
        for v in sorted(versions):
            if self.store.has(v):
                continue
            try:
                self.ensure_local(v)
            except OldLogitError:
                if not tolerant:  # a proxy or fallback may answer for a version gone here
                    raise

    def versions(self) -> tuple[list[VersionInfo], int | None]:
        """Every replica's view: the registry, with this replica's tiers where local."""
        local = {r.version: version_info(r) for r in self.store.versions()}
        try:
            shared = self.registry.all()
            watermark = self.registry.watermark()
        except Unavailable:
            return list(local.values()), self.store.watermark
        local_wm = self.store.watermark
        if watermark is not None and (local_wm is None or local_wm < watermark):
            # raised on another replica and its event not here yet: apply it before answering,
            # so a listing right after set_watermark agrees on every replica
            self.apply_watermark(watermark)
            local = {r.version: version_info(r) for r in self.store.versions()}
        for v, rec in shared.items():
            if watermark is not None and v < watermark:
                continue
            local.setdefault(
                v,
                VersionInfo(
                    policy_version=v,
                    weight_sha256=str(rec["sha256"]),
                    nbytes=int(rec.get("nbytes", 0)),
                    tiers=["shared"],
                    kind=str(rec.get("kind", "keyframe")),
                ),
            )
        return [local[v] for v in sorted(local)], watermark

    def version(self, version: int) -> VersionInfo:
        if not self.store.has(version):
            self.ensure_local(version)
        return version_info(self.store.info(version))

    def create_lease(self, version: int, holder: str, ttl_s: float) -> LeaseInfo:
        """A lease is a TTL key: it pins the version on every replica."""
        ttl = check_ttl(ttl_s)
        if self.registry.get(version) is None:
            self.ensure_local(version)  # raises UnknownVersion / VersionEvicted
        return lease_info(self.leases.create(version, holder, ttl))

    def release_lease(self, lease_id: str) -> None:
        self.leases.release(lease_id)

    def replicas(self) -> list[dict[str, Any]]:
        return self.membership.members()

    def sweep(self) -> None:
        self.store.sweep()

    def set_watermark(self, version: int) -> int:
        wm = self.registry.raise_watermark(version)
        self.apply_watermark(wm)
        return wm

    def delete(self, version: int) -> None:
        live = self.leases.live(version)
        if live:
            raise Conflict(
                f"policy_version {version} is leased by {live[0].holder!r} (and "
                f"{len(live) - 1} more) until its lease ends or is released",
                parameter="policy_version",
            )
        if self.registry.get(version) is None and not self.store.has(version):
            raise UnknownVersion(
                f"policy_version {version} is not retained", parameter="policy_version"
            )
        self.registry.forget(version)
        self._apply_delete(version)
