"""Scale-out: N replicas, one Redis, one shared snapshot volume, one service.

In: the local ``SnapshotStore`` and the Redis adapters. Out: a replica that agrees with every
other on versions, watermark, leases and deletions. Each replica keeps its own store directory
under ``<snapshot_dir>/replicas/<replica_id>`` (its own registry file and lock, so the store's
crash-safety holds unchanged); the versions themselves are one chain of keyframes and patches
for the whole deployment (``chain.py``): a version published anywhere is *adopted* lazily with
its chain by hard-linking the shared files (same volume, no copy), every step hash-checked.
The Redis registry is the source of truth: a publish is acknowledged only after its atomic
claim there succeeds.
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
from oldlogit_service.cluster.chain import DeploymentChain
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
from oldlogit_service.snapshots.shared import ChainMoved, SharedChain

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

    Built before the store (which it gives the shared chain's hooks: ``shared``), then
    ``bind``-ed to it. ``chain_dir``: the shared chain directory on the shared volume.
    """

    def __init__(
        self,
        redis_url: str,
        namespace: str,
        replica_id: str,
        *,
        chain_dir: Path,
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
        self._pins: set[int] = set()
        self._pins_at = 0.0
        self.chain = DeploymentChain(
            self.registry, self.membership, replica_id, chain_dir, pinned=self.leased_versions
        )
        self._follow_due = True
        self._listener = EventListener(
            connect(redis_url), self.registry.events_channel, self._on_event, self._catch_up
        )
        self._thread = threading.Thread(
            target=self._beat_loop, name="oldlogit-heartbeat", daemon=True
        )

    def bind(self, store: SnapshotStore) -> ClusterControl:
        self._store = store
        self.chain.bind(store)
        return self

    @property
    def shared(self) -> SharedChain:
        """The store's hooks into the deployment's chain."""
        return self.chain.hooks()

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
        try:
            self.registry.clear_pending(self.replica_id)  # a killed process's claims
        except Unavailable:
            logger.warning("registry unreachable at start: chain files announced stay so")
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

    # -- lazy adoption -------------------------------------------------------------------
    def ensure_local(self, version: int) -> None:
        """Make a version registered anywhere servable here (its chain adopted: hard links,
        every step's sha256 checked)."""
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
        with self.chain.lock:
            if self.store.has(version):
                return
            self.chain.adopt(version)
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
        elif kind in ("deleted", "chain"):
            self.follow()
        elif kind in ("lease", "release"):
            self._pins_at = 0.0  # re-read on the next retention pass

    def _catch_up(self) -> None:
        """On (re)connect: apply what may have been missed (watermark, deletions, rewrites)."""
        try:
            wm = self.registry.watermark()
        except Unavailable:
            return
        if wm is not None:
            self.apply_watermark(wm)
        self.follow()

    def follow(self) -> None:
        """This store's records to the deployment's (removals, re-keyed chains); retried by
        the sweeper when it cannot finish now."""
        try:
            with self.chain.lock:
                self.chain.follow()
            self._follow_due = False
        except Exception as exc:
            self._follow_due = True
            logger.info("following the deployment's chain failed (retried): %s", exc)

    def apply_watermark(self, version: int) -> None:
        """Raise the local store's watermark to ``version`` if it is behind (idempotent; pub/sub
        normally brings it, a reader that saw a newer registry watermark brings it sooner)."""
        try:
            cur = self.store.watermark
            if cur is None or version > cur:
                self.store.set_watermark(version)
        except Exception:
            logger.exception("could not apply watermark %d", version)

    # -- control ------------------------------------------------------------------------
    def prepare(self, versions: set[int], *, tolerant: bool) -> None:
        for v in sorted(versions):
            if self.store.has(v):
                continue  # (below the watermark: the store refuses it, named)
            try:
                self.ensure_local(v)
            except OldLogitError:
                if not tolerant:  # a proxy or fallback may answer for a version gone here
                    raise

    def versions(self) -> tuple[list[VersionInfo], int | None]:
        """Every replica's view: the registry, with this replica's tiers where local."""
        local = self._listed()
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
            local = self._listed()
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

    def _listed(self) -> dict[int, VersionInfo]:
        return {
            r.version: version_info(r)
            for r in self.store.versions()
            if not self.store.retired_here(r.version)
        }

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
        if self._follow_due:
            self.follow()
        try:
            with self.chain.lock:
                self.chain.maintain()
        except (Unavailable, ChainMoved) as exc:
            logger.info("the deployment's chain was not maintained this time: %s", exc)
        except Exception:
            logger.exception("the deployment's retention / re-keying failed; retried")

    def set_watermark(self, version: int) -> int:
        wm = self.registry.raise_watermark(version)
        self.apply_watermark(wm)
        # Retire what it releases now if no other replica is rewriting (else the holder's
        # sweep does); until then every replica refuses those versions (``retired_here``).
        try:
            with self.chain.lock, self.chain.lease(wait_s=2.0) as held:
                if held:
                    self.chain.follow()
                    self.chain.retain()
        except Exception:
            logger.exception("retention after the watermark failed; the sweeper retries")
        return wm

    def delete(self, version: int) -> None:
        live = self.leases.live(version)
        if live:
            raise Conflict(
                f"policy_version {version} is leased by {live[0].holder!r} (and "
                f"{len(live) - 1} more) until its lease ends or is released",
                parameter="policy_version",
            )
        if self.registry.get(version) is None:
            if self.registry.is_gone(version):
                self.follow()
                return
            raise UnknownVersion(
                f"policy_version {version} is not retained", parameter="policy_version"
            )
        with self.chain.lock, self.chain.lease(wait_s=10.0) as held:
            if not held:
                raise Unavailable(
                    "another replica is rewriting the deployment's chain; retry the delete",
                    retry_after_s=1.0,
                )
            self.chain.follow()
            records = self.chain.records()
            if version in records:
                self.chain.remove({version}, records)
