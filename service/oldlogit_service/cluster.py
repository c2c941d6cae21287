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

from oldlogit.errors import Conflict, Unavailable, UnknownVersion, VersionEvicted
from oldlogit_service.config import is_wildcard
from oldlogit_service.redis_adapters import (
    EventListener,
    RedisLeases,
    RedisMembership,
    RedisRegistry,
    check_eviction_policy,
    connect,
)
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


class Cluster:
    """The replica's view of the deployment, kept in step through Redis."""

    def __init__(
        self,
        redis_url: str,
        namespace: str,
        replica_id: str,
        store: SnapshotStore,
        *,
        heartbeat_s: float = 1.0,
    ) -> None:
        self.replica_id = replica_id
        self.store = store
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
        store.commit_hook = self._claim
        store.external_pins = self.leased_versions

    # -- lifecycle -----------------------------------------------------------------------
    def start(self, *, http: str, grpc: str, queue_depth: Callable[[], int]) -> Cluster:
        self._address = {"http": http, "grpc": grpc}
        self._queue_depth = queue_depth
        try:
            check_eviction_policy(self._client, want="noeviction", role="registry")
        except Exception:
            logger.warning("could not check the registry Redis eviction policy")
        self._listener.start()
        self._thread.start()
        return self

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
    def _claim(self, version: int, sha256: str, path: Path, record: dict[str, Any]) -> bool:
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

    # -- operations the runtime routes here ------------------------------------------------
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

    def members(self) -> list[dict[str, Any]]:
        return self.membership.members()
