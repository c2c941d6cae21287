"""The one module that reaches Redis: registry, watermark, leases, membership, events, cache.

In: a Redis URL and a deployment namespace. Out: the same operations the embedded defaults
offer, shared by every replica. Redis errors are translated here, at one boundary, into
``Unavailable`` (``raise … from exc``); nothing else in the service imports redis. The registry
Redis must not evict keys (``noeviction``); the result-cache Redis should (``allkeys-lru``).

Keys (``{ns}`` = ``oldlogit:{namespace}``):
    {ns}:versions            hash  version -> JSON record (sha256, kind, parent, file, nbytes,
                                   file_sha256, file_nbytes, created_at, replica): the chain
    {ns}:pending             hash  chain file -> replica: linked on the shared volume, its
                                   record not written yet (a publish's claim, in flight)
    {ns}:rekey               str   the replica holding the re-key lease (PX; void once that
                                   replica's heartbeat is gone)
    {ns}:newest              int   newest version ever acknowledged
    {ns}:watermark           int   retention watermark (only moves up)
    {ns}:gone                set   versions acknowledged once and since deleted (tombstones)
    {ns}:lease:{id}          JSON  one lease; expires by TTL
    {ns}:leases:{version}    set   lease ids of a version (stale ids pruned on read)
    {ns}:member:{replica}    JSON  replica heartbeat (address, resident versions, queue); TTL
    {ns}:events              pub/sub channel of version events
    {ns}:cache:{key hex}     bytes a cached result (second Redis, TTL)
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from oldlogit.contract.errors import (
    Unavailable,
    UnknownLease,
    VersionConflict,
    VersionNotIncreasing,
)
from oldlogit_service.cache import CacheStats, make_key

logger = logging.getLogger(__name__)

_REDIS_ERRORS = (redis.ConnectionError, redis.TimeoutError, redis.exceptions.BusyLoadingError)


@contextmanager
def translated(what: str) -> Iterator[None]:
    """Redis unreachable → ``Unavailable`` naming what could not be done."""
    try:
        yield
    except _REDIS_ERRORS as exc:
        raise Unavailable(
            f"the registry (Redis) is unreachable: cannot {what} right now", retry_after_s=1.0
        ) from exc


def connect(url: str, *, timeout_s: float = 2.0) -> redis.Redis:
    """A pooled client with timeouts and bounded retries with exponential backoff."""
    return redis.Redis.from_url(
        url,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        health_check_interval=15,
        retry=Retry(ExponentialBackoff(cap=0.5, base=0.02), retries=3),
        retry_on_error=[redis.ConnectionError, redis.TimeoutError],
        max_connections=64,
    )


def check_eviction_policy(client: redis.Redis, *, want: str, role: str) -> str | None:
    """The server's maxmemory-policy; logs a warning when it is not ``want``."""
    try:
        policy = str(client.config_get("maxmemory-policy").get("maxmemory-policy", ""))
    except redis.ResponseError:  # CONFIG disabled (managed Redis): cannot check
        return None
    if policy != want:
        logger.warning("the %s Redis has maxmemory-policy=%s; it should be %s", role, policy, want)
    return policy


# Atomic registration: one winner per version, never two different weights under one; a
# patch only while its parent is retained (a removal cannot slip between its diff and this).
_REGISTER = """
local existing = redis.call('HGET', KEYS[1], ARGV[1])
if existing then
  local rec = cjson.decode(existing)
  if rec['sha256'] == ARGV[2] then return {'same', existing} end
  return {'conflict', existing}
end
if redis.call('SISMEMBER', KEYS[3], ARGV[1]) == 1 then return {'gone', ''} end
local newest = redis.call('GET', KEYS[2])
if newest and tonumber(ARGV[1]) <= tonumber(newest) then return {'not_increasing', newest} end
if ARGV[4] ~= '' and redis.call('HEXISTS', KEYS[1], ARGV[4]) == 0 then
  return {'parent_gone', ARGV[4]}
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[3])
redis.call('SET', KEYS[2], ARGV[1])
if ARGV[5] ~= '' then redis.call('HDEL', KEYS[4], ARGV[5]) end
return {'created', ARGV[3]}
"""

# A chain rewrite (re-keyed dependents of removed versions, a keyframe moved) swapped in at
# once, by the re-key lease's holder, only over the records it was computed from, and never
# leaving a retained record whose parent is removed.
_SWAP = """
if redis.call('GET', KEYS[3]) ~= ARGV[1] then return 'lease_lost' end
local req = cjson.decode(ARGV[2])
for v, file in pairs(req['expect']) do
  local raw = redis.call('HGET', KEYS[1], v)
  if not raw or cjson.decode(raw)['file'] ~= file then return 'changed' end
end
local gone = {}
local any = false
for _, v in ipairs(req['remove']) do gone[tostring(v)] = true; any = true end
if any then
  local all = redis.call('HGETALL', KEYS[1])
  for i = 1, #all, 2 do
    if not gone[all[i]] and req['replace'][all[i]] == nil then
      local p = cjson.decode(all[i + 1])['parent']
      if type(p) == 'number' and gone[tostring(p)] then return 'dependent' end
    end
  end
end
for _, v in ipairs(req['remove']) do
  redis.call('HDEL', KEYS[1], tostring(v))
  redis.call('SADD', KEYS[2], tostring(v))
end
for v, raw in pairs(req['replace']) do redis.call('HSET', KEYS[1], v, raw) end
return 'ok'
"""

# Versions whose files are damaged go with every retained version rebuilt through them.
_FORGET_TREE = """
local gone = {}
for _, v in ipairs(ARGV) do gone[v] = true end
local grew = true
while grew do
  grew = false
  local all = redis.call('HGETALL', KEYS[1])
  for i = 1, #all, 2 do
    if not gone[all[i]] then
      local p = cjson.decode(all[i + 1])['parent']
      if type(p) == 'number' and gone[tostring(p)] then gone[all[i]] = true; grew = true end
    end
  end
end
local out = {}
for v, _ in pairs(gone) do
  if redis.call('HDEL', KEYS[1], v) == 1 then table.insert(out, v) end
  redis.call('SADD', KEYS[2], v)
end
return out
"""

# The re-key lease: free, ours already, or its holder's heartbeat gone (it died).
_TAKE_LEASE = """
local cur = redis.call('GET', KEYS[1])
if (not cur) or cur == ARGV[1] or redis.call('EXISTS', ARGV[3] .. cur) == 0 then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 1
end
return 0
"""

_DROP_LEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('DEL', KEYS[1]) end
return 0
"""

_RAISE_WATERMARK = """
local cur = redis.call('GET', KEYS[1])
if (not cur) or tonumber(ARGV[1]) > tonumber(cur) then
  redis.call('SET', KEYS[1], ARGV[1])
  return tonumber(ARGV[1])
end
return tonumber(cur)
"""


def _text(x: Any) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)


class ParentGone(Exception):
    """A patch's claim came after its parent was removed from the deployment."""

    def __init__(self, version: int, parent: int) -> None:
        super().__init__(f"version {version}: its parent {parent} is no longer retained")
        self.version = version
        self.parent = parent


@dataclass(frozen=True)
class Registered:
    outcome: str  # "created" | "same"
    record: dict[str, Any]


class RedisRegistry:
    """The version registry and watermark shared by every replica."""

    def __init__(self, client: redis.Redis, namespace: str) -> None:
        self.r = client
        self.ns = f"oldlogit:{namespace}"
        self._register = client.register_script(_REGISTER)
        self._raise_wm = client.register_script(_RAISE_WATERMARK)
        self._swap = client.register_script(_SWAP)
        self._forget_tree = client.register_script(_FORGET_TREE)
        self._take_lease = client.register_script(_TAKE_LEASE)
        self._drop_lease = client.register_script(_DROP_LEASE)

    @property
    def events_channel(self) -> str:
        return f"{self.ns}:events"

    def register(self, version: int, record: dict[str, Any]) -> Registered:
        """Atomically claim ``version`` for ``record['sha256']`` (idempotent, or a conflict)."""
        parent = record.get("parent") if record.get("kind") == "patch" else None
        with translated(f"register version {version}"):
            out = self._register(
                keys=[
                    f"{self.ns}:versions",
                    f"{self.ns}:newest",
                    f"{self.ns}:gone",
                    f"{self.ns}:pending",
                ],
                args=[
                    version,
                    record["sha256"],
                    json.dumps(record, sort_keys=True),
                    "" if parent is None else str(parent),
                    str(record.get("file", "")),
                ],
            )
        outcome = out[0].decode() if isinstance(out[0], bytes) else str(out[0])
        payload = out[1].decode() if isinstance(out[1], bytes) else str(out[1])
        if outcome == "conflict":
            theirs = json.loads(payload)["sha256"]
            raise VersionConflict(
                f"policy_version {version} is already published with weight sha256 "
                f"{theirs[:16]}…; these weights differ",
                parameter="policy_version",
            )
        if outcome == "not_increasing":
            raise VersionNotIncreasing(
                f"policy_version {version} is not above the newest published version "
                f"{payload}: versions only go up",
                parameter="policy_version",
            )
        if outcome == "parent_gone":
            raise ParentGone(version, int(payload))
        if outcome == "gone":
            raise VersionNotIncreasing(
                f"policy_version {version} was published and deleted before; it cannot be "
                "published again",
                parameter="policy_version",
            )
        if outcome == "created":
            self.r.publish(
                self.events_channel, json.dumps({"event": "published", "version": version})
            )
        return Registered(outcome, json.loads(payload))

    def get(self, version: int) -> dict[str, Any] | None:
        with translated(f"read version {version}"):
            raw = self.r.hget(f"{self.ns}:versions", str(version))
        return None if raw is None else dict(json.loads(raw))

    def all(self) -> dict[int, dict[str, Any]]:
        with translated("list versions"):
            raw = self.r.hgetall(f"{self.ns}:versions")
        return {int(k): json.loads(v) for k, v in raw.items()}

    def newest(self) -> int | None:
        with translated("read the newest version"):
            raw = self.r.get(f"{self.ns}:newest")
        return None if raw is None else int(raw)

    def is_gone(self, version: int) -> bool:
        with translated(f"read version {version}"):
            return bool(self.r.sismember(f"{self.ns}:gone", str(version)))

    def forget(self, version: int) -> None:
        """Mark a version deleted everywhere (a tombstone: it answers VersionEvicted)."""
        with translated(f"delete version {version}"):
            pipe = self.r.pipeline(transaction=True)
            pipe.hdel(f"{self.ns}:versions", str(version))
            pipe.sadd(f"{self.ns}:gone", str(version))
            pipe.publish(self.events_channel, json.dumps({"event": "deleted", "version": version}))
            pipe.execute()

    # -- the shared chain ---------------------------------------------------------------
    def pending(self, name: str, replica_id: str) -> None:
        """A chain file is about to be linked on the shared volume for a claim."""
        with translated("announce a chain file"):
            self.r.hset(f"{self.ns}:pending", name, replica_id)

    def not_pending(self, name: str) -> None:
        with translated("withdraw a chain file"):
            self.r.hdel(f"{self.ns}:pending", name)

    def clear_pending(self, replica_id: str) -> None:
        """Withdraw this replica's announced files (at start: none of its claims is in
        flight, so what a killed process announced is an orphan)."""
        with translated("withdraw chain files"):
            pend = self.r.hgetall(f"{self.ns}:pending")
            mine = [k for k, v in pend.items() if _text(v) == replica_id]
            if mine:
                self.r.hdel(f"{self.ns}:pending", *mine)

    def gone_among(self, versions: list[int]) -> set[int]:
        """Which of ``versions`` are tombstoned (deleted from the deployment)."""
        if not versions:
            return set()
        with translated("read deletions"):
            flags = self.r.smismember(f"{self.ns}:gone", [str(v) for v in versions])
        return {v for v, f in zip(versions, flags, strict=True) if f}

    def chain_state(self) -> tuple[dict[int, dict[str, Any]], dict[str, str]]:
        """The records and the pending chain files, read at one instant."""
        with translated("read the chain"):
            pipe = self.r.pipeline(transaction=True)
            pipe.hgetall(f"{self.ns}:versions")
            pipe.hgetall(f"{self.ns}:pending")
            raw, pend = pipe.execute()
        return (
            {int(k): json.loads(v) for k, v in raw.items()},
            {_text(k): _text(v) for k, v in pend.items()},
        )

    def take_rekey_lease(self, replica_id: str, member_prefix: str, ttl_s: float) -> bool:
        """Take (or renew) the re-key lease; False while another live replica holds it."""
        with translated("take the re-key lease"):
            got = self._take_lease(
                keys=[f"{self.ns}:rekey"],
                args=[replica_id, max(1, int(ttl_s * 1000)), member_prefix],
            )
        return bool(int(got))

    def drop_rekey_lease(self, replica_id: str) -> None:
        with translated("release the re-key lease"):
            self._drop_lease(keys=[f"{self.ns}:rekey"], args=[replica_id])

    def swap(
        self,
        replica_id: str,
        remove: list[int],
        replace: dict[int, dict[str, Any]],
        expect: dict[int, str],
    ) -> str:
        """Swap a chain rewrite in: ``remove`` (tombstoned), ``replace`` (new records), only
        while ``expect`` (version -> file) are the records and this replica holds the re-key
        lease. Returns "ok", "lease_lost", "changed" or "dependent" (a retained record not
        in the rewrite has a removed parent)."""
        req = {
            "remove": remove,
            "replace": {str(v): json.dumps(r, sort_keys=True) for v, r in replace.items()},
            "expect": {str(v): f for v, f in expect.items()},
        }
        with translated("rewrite the chain"):
            out = _text(
                self._swap(
                    keys=[f"{self.ns}:versions", f"{self.ns}:gone", f"{self.ns}:rekey"],
                    args=[replica_id, json.dumps(req)],
                )
            )
            if out == "ok":
                self.r.publish(
                    self.events_channel,
                    json.dumps({"event": "chain", "version": -1, "removed": remove}),
                )
        return out

    def forget_tree(self, versions: list[int]) -> list[int]:
        """Drop versions (damaged files) and every record rebuilt through them; returns
        the versions dropped."""
        with translated("drop damaged versions"):
            out = self._forget_tree(
                keys=[f"{self.ns}:versions", f"{self.ns}:gone"], args=[str(v) for v in versions]
            )
            gone = sorted(int(_text(v)) for v in out)
            if gone:
                self.r.publish(
                    self.events_channel,
                    json.dumps({"event": "chain", "version": -1, "removed": gone}),
                )
        return gone

    def watermark(self) -> int | None:
        with translated("read the watermark"):
            raw = self.r.get(f"{self.ns}:watermark")
        return None if raw is None else int(raw)

    def raise_watermark(self, version: int) -> int:
        """Move the watermark up to ``version`` (never down); returns the watermark."""
        with translated("set the watermark"):
            wm = int(self._raise_wm(keys=[f"{self.ns}:watermark"], args=[version]))
            self.r.publish(self.events_channel, json.dumps({"event": "watermark", "version": wm}))
        return wm


@dataclass(frozen=True)
class RedisLease:
    lease_id: str
    version: int
    holder: str
    ttl_s: float
    expires_at: float


class RedisLeases:
    """Leases as TTL keys: a crashed holder's lease expires on every replica at once."""

    def __init__(
        self, client: redis.Redis, namespace: str, clock: Callable[[], float] = time.time
    ) -> None:
        self.r = client
        self.ns = f"oldlogit:{namespace}"
        self.clock = clock

    def create(self, version: int, holder: str, ttl_s: float) -> RedisLease:
        lease = RedisLease(uuid.uuid4().hex, version, holder, ttl_s, self.clock() + ttl_s)
        with translated("create a lease"):
            pipe = self.r.pipeline(transaction=True)
            pipe.set(
                f"{self.ns}:lease:{lease.lease_id}",
                json.dumps(lease.__dict__),
                px=max(1, int(ttl_s * 1000)),
            )
            pipe.sadd(f"{self.ns}:leases:{version}", lease.lease_id)
            pipe.execute()
        return lease

    def get(self, lease_id: str) -> RedisLease:
        with translated("read a lease"):
            raw = self.r.get(f"{self.ns}:lease:{lease_id}")
        if raw is None:
            raise UnknownLease(f"lease_id {lease_id!r} is unknown or expired", parameter="lease_id")
        return RedisLease(**json.loads(raw))

    def renew(self, lease_id: str, ttl_s: float) -> RedisLease:
        old = self.get(lease_id)
        lease = RedisLease(lease_id, old.version, old.holder, ttl_s, self.clock() + ttl_s)
        with translated("renew a lease"):
            ok = self.r.set(
                f"{self.ns}:lease:{lease_id}",
                json.dumps(lease.__dict__),
                px=max(1, int(ttl_s * 1000)),
                xx=True,
            )
        if not ok:
            raise UnknownLease(f"lease_id {lease_id!r} expired", parameter="lease_id")
        return lease

    def release(self, lease_id: str) -> RedisLease:
        lease = self.get(lease_id)
        with translated("release a lease"):
            pipe = self.r.pipeline(transaction=True)
            pipe.delete(f"{self.ns}:lease:{lease_id}")
            pipe.srem(f"{self.ns}:leases:{lease.version}", lease_id)
            pipe.execute()
        return lease

    def live(self, version: int) -> list[RedisLease]:
        """The unexpired leases of ``version`` (expired ids are pruned as a side effect)."""
        key = f"{self.ns}:leases:{version}"
        with translated("read leases"):
            ids = [i.decode() if isinstance(i, bytes) else str(i) for i in self.r.smembers(key)]
            if not ids:
                return []
            raws = self.r.mget([f"{self.ns}:lease:{i}" for i in ids])
            stale = [i for i, raw in zip(ids, raws, strict=True) if raw is None]
            if stale:
                self.r.srem(key, *stale)
        return [RedisLease(**json.loads(raw)) for raw in raws if raw is not None]


class RedisMembership:
    """Replica heartbeats as TTL keys; a replica that stops beating drops out by itself."""

    def __init__(self, client: redis.Redis, namespace: str, *, ttl_s: float = 5.0) -> None:
        self.r = client
        self.ns = f"oldlogit:{namespace}"
        self.ttl_s = ttl_s

    def beat(self, replica_id: str, info: dict[str, Any]) -> None:
        with translated("send a heartbeat"):
            self.r.set(
                f"{self.ns}:member:{replica_id}",
                json.dumps({**info, "replica_id": replica_id, "at": time.time()}),
                px=int(self.ttl_s * 1000),
            )

    def leave(self, replica_id: str) -> None:
        with translated("leave the membership"):
            self.r.delete(f"{self.ns}:member:{replica_id}")

    def members(self) -> list[dict[str, Any]]:
        with translated("list replicas"):
            keys = list(self.r.scan_iter(match=f"{self.ns}:member:*", count=500))
            raws = self.r.mget(keys) if keys else []
        return sorted(
            (json.loads(r) for r in raws if r is not None), key=lambda m: str(m["replica_id"])
        )


class EventListener:
    """Subscribes to version events on a thread; reconnects with backoff after a gap and then
    calls ``on_gap`` so the replica re-reads the registry (it may have missed events)."""

    def __init__(
        self,
        client: redis.Redis,
        channel: str,
        on_event: Callable[[dict[str, Any]], None],
        on_gap: Callable[[], None],
    ) -> None:
        self._r = client
        self._channel = channel
        self._on_event = on_event
        self._on_gap = on_gap
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="oldlogit-events", daemon=True)
        self.connected = threading.Event()

    def start(self) -> EventListener:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        delay = 0.05
        while not self._stop.is_set():
            pubsub = self._r.pubsub(ignore_subscribe_messages=True)  # type: ignore[no-untyped-call]
            try:
                pubsub.subscribe(self._channel)
                self.connected.set()
                self._on_gap()  # (re)connected: catch up on whatever was missed
                delay = 0.05
                while not self._stop.is_set():
                    msg = pubsub.get_message(timeout=0.5)
                    if msg and msg.get("type") == "message":
                        try:
                            self._on_event(json.loads(msg["data"]))
                        except Exception:
                            logger.exception("bad version event %r", msg.get("data"))
            except _REDIS_ERRORS:
                self.connected.clear()
                logger.warning("lost the event channel; reconnecting in %.2fs", delay)
                self._stop.wait(delay)
                delay = min(2.0, delay * 2)
            finally:
                try:
                    pubsub.close()
                except Exception:
                    pass


class RedisResultCache:
    """The shared result cache (``ResultCacheBackend``) on its own, evicting Redis.

    Keys already include the weight hash, so a republished/changed weight can never hit.
    A Redis outage degrades to misses: the cache is an optimisation, never a dependency.
    """

    blocking = True

    def __init__(self, client: redis.Redis, namespace: str, *, ttl_s: float = 24 * 3600) -> None:
        self.r = client
        self.ns = f"oldlogit:{namespace}:cache"
        self.ttl_ms = int(ttl_s * 1000)
        self._lock = threading.Lock()
        self._hits = self._misses = self._errors = 0

    make_key = staticmethod(make_key)

    def get_many(self, keys: list[bytes]) -> list[npt.NDArray[np.float32] | None]:
        """One round trip (MGET) for a request's keys; an outage is all misses."""
        if not keys:
            return []
        try:
            raws = list(self.r.mget([f"{self.ns}:{k.hex()}" for k in keys]))
        except _REDIS_ERRORS:
            raws = [None] * len(keys)
            with self._lock:
                self._errors += 1
        out: list[npt.NDArray[np.float32] | None] = []
        for raw in raws:
            if raw is None:
                out.append(None)
                continue
            arr = np.frombuffer(raw if isinstance(raw, bytes) else raw.encode("latin-1"), "<f4")
            arr.setflags(write=False)
            out.append(arr)
        with self._lock:
            hits = sum(a is not None for a in out)
            self._hits += hits
            self._misses += len(out) - hits
        return out

    def put_many(self, items: list[tuple[bytes, npt.NDArray[np.float32]]]) -> None:
        if not items:
            return
        try:
            pipe = self.r.pipeline(transaction=False)
            for key, value in items:
                data = np.ascontiguousarray(value, dtype="<f4").tobytes()
                pipe.set(f"{self.ns}:{key.hex()}", data, px=self.ttl_ms)
            pipe.execute()
        except _REDIS_ERRORS:
            with self._lock:
                self._errors += 1

    def stats(self) -> CacheStats:
        with self._lock:
            return CacheStats(hits=self._hits, misses=self._misses, errors=self._errors)
