"""The Redis adapters against a real redis-server: registry, leases, membership, events, cache."""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest

from oldlogit.contract import errors
from oldlogit_service.cluster.redis_adapters import (
    EventListener,
    ParentGone,
    RedisLeases,
    RedisMembership,
    RedisRegistry,
    RedisResultCache,
    check_eviction_policy,
    connect,
)

pytestmark = [pytest.mark.integration, pytest.mark.redis]


def rec(sha: str) -> dict[str, Any]:
    return {"sha256": sha, "kind": "keyframe", "parent": None, "nbytes": 10}


def test_registry_one_winner_idempotence_and_order(redis_server: Any) -> None:
    reg = RedisRegistry(connect(redis_server.url), "t")
    assert reg.register(1, rec("a")).outcome == "created"
    assert reg.register(1, rec("a")).outcome == "same"
    with pytest.raises(errors.VersionConflict) as info:
        reg.register(1, rec("b"))
    assert info.value.parameter == "policy_version"
    assert reg.register(3, rec("c")).outcome == "created"
    with pytest.raises(errors.VersionNotIncreasing):
        reg.register(2, rec("d"))
    assert reg.newest() == 3
    reg.forget(3)
    assert reg.get(3) is None and reg.is_gone(3)
    with pytest.raises(errors.VersionNotIncreasing):
        reg.register(3, rec("c"))  # a deleted version never comes back
    assert reg.raise_watermark(2) == 2
    assert reg.raise_watermark(1) == 2  # only moves up
    assert reg.watermark() == 2


def test_chain_claims_swaps_and_the_rekey_lease(redis_server: Any) -> None:
    """A patch is claimed only while its parent is retained; a chain rewrite is swapped in
    only by the lease's holder, over the records it was computed from, and never leaves a
    retained record without its parent; the lease is free once its holder's heartbeat is."""
    client = connect(redis_server.url)
    reg = RedisRegistry(client, "chain")
    members = RedisMembership(client, "chain", ttl_s=0.5)
    prefix = "oldlogit:chain:member:"

    def patch(sha: str, parent: int, file: str) -> dict[str, Any]:
        return {"sha256": sha, "kind": "patch", "parent": parent, "nbytes": 10, "file": file}

    assert reg.register(1, {**rec("a"), "file": "k1"}).outcome == "created"
    reg.pending("p2", "r0")
    assert reg.register(2, patch("b", 1, "p2")).outcome == "created"
    assert reg.chain_state()[1] == {}  # the claim withdrew its announcement
    assert reg.register(3, patch("c", 2, "p3")).outcome == "created"
    members.beat("r0", {})
    assert reg.take_rekey_lease("r0", prefix, 30)
    assert not reg.take_rekey_lease("r1", prefix, 30)  # held by a live replica
    # Removing 2 without rewriting 3 would break 3's chain: refused.
    assert reg.swap("r0", [2], {}, {2: "p2"}) == "dependent"
    assert reg.swap("r0", [2], {3: patch("c", 1, "p3b")}, {2: "p2", 3: "p2"}) == "changed"
    assert reg.swap("r1", [2], {3: patch("c", 1, "p3b")}, {2: "p2", 3: "p3"}) == "lease_lost"
    assert reg.swap("r0", [2], {3: patch("c", 1, "p3b")}, {2: "p2", 3: "p3"}) == "ok"
    assert reg.get(2) is None and reg.is_gone(2) and reg.get(3)["file"] == "p3b"
    with pytest.raises(ParentGone):
        reg.register(4, patch("d", 2, "p4"))  # its parent was removed meanwhile
    # Damaged: 1 goes with everything rebuilt through it.
    assert reg.forget_tree([1]) == [1, 3]
    assert reg.all() == {}
    members.leave("r0")  # its heartbeat gone: the lease is void
    assert reg.take_rekey_lease("r1", prefix, 30)


def test_concurrent_publishers_of_one_version_never_disagree(redis_server: Any) -> None:
    regs = [RedisRegistry(connect(redis_server.url), "race") for _ in range(8)]
    outcomes: list[str] = []

    def claim(i: int) -> None:
        try:
            outcomes.append(regs[i].register(5, rec(f"sha{i % 2}")).outcome)
        except errors.VersionConflict:
            outcomes.append("conflict")

    ts = [threading.Thread(target=claim, args=(i,)) for i in range(8)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert outcomes.count("created") == 1
    winner = regs[0].get(5)
    assert winner is not None
    # Every loser either saw its own identical weights (same) or a conflict.
    assert outcomes.count("same") + outcomes.count("conflict") == 7


def test_leases_expire_by_ttl(redis_server: Any) -> None:
    leases = RedisLeases(connect(redis_server.url), "t")
    a = leases.create(4, "worker-a", ttl_s=0.3)
    b = leases.create(4, "worker-b", ttl_s=30)
    assert {x.lease_id for x in leases.live(4)} == {a.lease_id, b.lease_id}
    time.sleep(0.5)
    assert [x.lease_id for x in leases.live(4)] == [b.lease_id]
    with pytest.raises(errors.UnknownLease):
        leases.renew(a.lease_id, 10)
    leases.renew(b.lease_id, 0.2)
    time.sleep(0.4)
    assert leases.live(4) == []
    with pytest.raises(errors.UnknownLease) as info:
        leases.release("nope")
    assert info.value.parameter == "lease_id"


def test_membership_heartbeats_drop_out(redis_server: Any) -> None:
    m = RedisMembership(connect(redis_server.url), "t", ttl_s=1.0)
    m.beat("r1", {"grpc": "127.0.0.1:1"})
    m.beat("r2", {"grpc": "127.0.0.1:2"})
    first = time.monotonic()
    assert [x["replica_id"] for x in m.members()] == ["r1", "r2"]
    time.sleep(0.5)
    m.beat("r2", {"grpc": "127.0.0.1:2"})
    # r1's heartbeat lapses about 0.5 s before r2's second one: r1 drops out, r2 stays.
    while "r1" in [x["replica_id"] for x in m.members()] and time.monotonic() < first + 10:
        time.sleep(0.02)
    assert [x["replica_id"] for x in m.members()] == ["r2"]


def test_events_and_reconnect_after_a_gap(redis_server: Any) -> None:
    client = connect(redis_server.url)
    reg = RedisRegistry(client, "ev")
    seen: list[dict[str, Any]] = []
    gaps: list[float] = []
    listener = EventListener(
        connect(redis_server.url), reg.events_channel, seen.append, lambda: gaps.append(time.time())
    ).start()
    try:
        assert listener.connected.wait(5)
        reg.register(1, rec("a"))
        end = time.time() + 5
        while not seen and time.time() < end:
            time.sleep(0.02)
        assert seen and seen[0]["event"] == "published" and seen[0]["version"] == 1
        redis_server.stop()
        with pytest.raises(errors.Unavailable):
            reg.register(2, rec("b"))
        redis_server.start()
        end = time.time() + 10
        while len(gaps) < 2 and time.time() < end:
            time.sleep(0.05)
        assert len(gaps) >= 2  # re-subscribed and asked to catch up
    finally:
        listener.stop()


def test_result_cache_and_outage_degrades_to_misses(tmp_path: Any) -> None:
    from tests.redis_server import RedisServer

    srv = RedisServer(tmp_path / "c", policy="allkeys-lru", maxmemory="16mb").start()
    try:
        client = connect(srv.url, timeout_s=0.3)
        assert check_eviction_policy(client, want="allkeys-lru", role="cache") == "allkeys-lru"
        cache = RedisResultCache(client, "t")
        v = np.array([-1.5, -np.inf, 0.25], dtype=np.float32)
        assert cache.get_many([b"k1"])[0] is None
        cache.put_many([(b"k1", v)])
        got = cache.get_many([b"k1"])[0]
        assert got is not None and np.array_equal(got, v)
        srv.stop()
        assert cache.get_many([b"k1"])[0] is None  # not an error: a miss
        assert cache.stats().errors >= 1
    finally:
        srv.stop()


def test_noeviction_check_warns(redis_server: Any, caplog: pytest.LogCaptureFixture) -> None:
    client = connect(redis_server.url)
    assert check_eviction_policy(client, want="noeviction", role="registry") == "noeviction"
    with caplog.at_level("WARNING"):
        check_eviction_policy(client, want="allkeys-lru", role="cache")
    assert "maxmemory-policy=noeviction" in caplog.text
