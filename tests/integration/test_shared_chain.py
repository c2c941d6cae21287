"""One chain for the deployment, in process: three replicas' stores on one shared directory and
a real redis-server (the cluster control of each, as ``server.build_service`` wires it).

Publishes go through each replica in turn as patches; every replica serves every version
bitwise from the one chain (hard links: the volume holds one chain's bytes); a removal re-keys
on one replica and the others follow; a damaged patch is refused, never served; a keyframe
moved by one replica is followed by the others; files a killed claim left are collected.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from oldlogit.contract.errors import ParentMissing, VersionEvicted
from oldlogit_service.cluster.chain import CHAIN_DIR
from oldlogit_service.cluster.replicas import ClusterControl
from oldlogit_service.snapshots import SnapshotStore, persist
from tests.redis_server import RedisServer
from tests.unit.test_store_delta import SNAP, SPECS, open_store, trace

pytestmark = [pytest.mark.integration, pytest.mark.redis]


@dataclass
class Replica:
    control: ClusterControl
    store: SnapshotStore


def volume_bytes(root: Path) -> int:
    """Bytes of the files under ``root``, each inode once (hard links share their bytes)."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for dirpath, _, names in os.walk(root):
        for n in names:
            st = os.lstat(os.path.join(dirpath, n))
            if (st.st_dev, st.st_ino) in seen or not os.path.isfile(os.path.join(dirpath, n)):
                continue
            seen.add((st.st_dev, st.st_ino))
            if n.endswith((".safetensors", ".patch")):
                total += st.st_size
    return total


def start(shared: Path, redis_url: str, rid: str, **kw: Any) -> Replica:
    control = ClusterControl(redis_url, "t", rid, chain_dir=shared / CHAIN_DIR, heartbeat_s=0.2)
    args: dict[str, Any] = {
        "param_specs": SPECS,
        "device": "cpu",
        "device_budget_bytes": 4 * SNAP,
        "host_budget_bytes": 0,
        "disk_budget_bytes": 1000 * SNAP,
        "max_versions": 1000,
        "keyframe_every": 16,
        "keyframe_chain_fraction": 0.5,
        "keyframes_follow_access": False,
        **kw,
    }
    store = SnapshotStore(shared / "replicas" / rid, shared=control.shared, **args)
    control.bind(store)
    control.start(http=f"{rid}:1", grpc=f"{rid}:2", queue_depth=lambda: 0)
    return Replica(control, store)


def stop(r: Replica) -> None:
    r.control.stop()
    r.store.close()


@pytest.fixture
def redis(tmp_path: Path) -> Iterator[RedisServer]:
    srv = RedisServer(tmp_path / "redis", durable=True).start()
    yield srv
    srv.stop()


@pytest.fixture
def three(tmp_path: Path, redis: RedisServer) -> Iterator[list[Replica]]:
    shared = tmp_path / "shared"
    rs = [start(shared, redis.url, f"r{i}") for i in range(3)]
    yield rs
    for r in rs:
        stop(r)


def serve(r: Replica, version: int) -> dict[str, torch.Tensor]:
    r.control.prepare({version}, tolerant=False)
    with r.store.acquire(version) as t:
        return {k: v.clone() for k, v in t.items()}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k].view(torch.uint8), b[k].contiguous().view(torch.uint8)) for k in a
    )


def publish_round_robin(rs: list[Replica], versions: list[dict[str, torch.Tensor]]) -> None:
    for v, w in enumerate(versions):
        out = rs[v % len(rs)].store.publish(v, w)
        assert out.created


def test_one_chain_every_replica_bitwise_volume_holds_one_chain(
    tmp_path: Path, redis: RedisServer, three: list[Replica]
) -> None:
    versions = trace(8, seed=3, fractions=[0.003, 0.02])
    publish_round_robin(three, versions)
    kinds = {v: sv.kind for v, sv in three[0].control.chain.records().items()}
    assert kinds[0] == "keyframe" and list(kinds.values()).count("patch") >= 6, kinds
    for r in three:
        for v, w in enumerate(versions):
            assert same(serve(r, v), w), (r.control.replica_id, v)
    # Every replica holds the whole history; the volume holds the chain once.
    assert all(len(r.store.versions()) == len(versions) for r in three)
    chain_bytes = volume_bytes(tmp_path / "shared" / CHAIN_DIR)
    assert volume_bytes(tmp_path / "shared") == chain_bytes < 2 * SNAP
    # Each replica's records are the deployment's, file for file.
    shared = {v: sv.file for v, sv in three[0].control.chain.records().items()}
    for r in three:
        assert {v: sv.file for v, sv in r.store.registry.records().items()} == shared
    # A replica started later adopts the whole retained history, and adds no bytes.
    late = start(tmp_path / "shared", redis.url, "late")
    try:
        for v, w in enumerate(versions):
            assert same(serve(late, v), w), ("late", v)
    finally:
        stop(late)
    assert volume_bytes(tmp_path / "shared") == chain_bytes


def test_delete_a_keyframe_rekeys_once_and_the_others_follow(
    tmp_path: Path, three: list[Replica]
) -> None:
    versions = trace(6, seed=4, fractions=[0.003, 0.02])
    publish_round_robin(three, versions)
    for r in three:
        serve(r, 5)  # every replica holds the whole chain
    three[1].control.delete(0)  # the keyframe of every other version
    records = three[1].control.chain.records()
    assert 0 not in records and records[1].kind == "keyframe"
    for r in three:
        r.control.follow()
        with pytest.raises(VersionEvicted):
            serve(r, 0)
        for v in range(1, 6):
            assert same(serve(r, v), versions[v]), (r.control.replica_id, v)
        assert {v: sv.file for v, sv in r.store.registry.records().items()} == {
            v: sv.file for v, sv in records.items()
        }
    # The old keyframe's bytes are gone from the volume (no replica links it any more);
    # the chain directory holds exactly what the records name.
    three[0].control.chain.collect()
    names = set(os.listdir(tmp_path / "shared" / CHAIN_DIR))
    assert names == {sv.file for sv in records.values()}
    assert volume_bytes(tmp_path / "shared") == volume_bytes(tmp_path / "shared" / CHAIN_DIR)


def test_watermark_and_max_versions_hold_across_replicas(
    tmp_path: Path, redis: RedisServer
) -> None:
    shared = tmp_path / "shared"
    rs = [start(shared, redis.url, f"r{i}", max_versions=4) for i in range(2)]
    try:
        versions = trace(7, seed=5, fractions=[0.003, 0.02])
        for v, w in enumerate(versions):
            rs[v % 2].store.publish(v, w)
            for r in rs:
                r.control.sweep()
        kept = sorted(rs[0].control.chain.records())
        assert kept == [3, 4, 5, 6], kept
        assert rs[1].control.set_watermark(5) == 5
        for r in rs:
            r.control.follow()
            with pytest.raises(VersionEvicted):
                serve(r, 4)
            for v in (5, 6):
                assert same(serve(r, v), versions[v])
        assert sorted(rs[0].control.chain.records()) == [5, 6]
    finally:
        for r in rs:
            stop(r)


def test_a_damaged_patch_is_refused_on_every_replica_never_served(
    three: list[Replica],
) -> None:
    versions = trace(4, seed=6, fractions=[0.003, 0.02])
    publish_round_robin(three, versions)
    rec = three[0].control.chain.records()[2]
    assert rec.kind == "patch"
    path = three[0].control.chain.directory / rec.file
    raw = bytearray(path.read_bytes())
    raw[-3] ^= 0xFF  # one bit of its data (the same inode every replica links)
    with open(path, "r+b") as f:  # in place: every hard link sees it
        f.write(raw)
    # Replica 1 never held version 3: adoption checks the chain and refuses.
    with pytest.raises(VersionEvicted):
        serve(three[1], 3)
    for r in three:
        r.control.follow()
        with pytest.raises(VersionEvicted):
            serve(r, 2)
        with pytest.raises(VersionEvicted):
            serve(r, 3)
        assert same(serve(r, 1), versions[1])


def test_a_keyframe_moved_by_one_replica_is_followed_by_all(
    tmp_path: Path, redis: RedisServer
) -> None:
    shared = tmp_path / "shared"
    rs = [start(shared, redis.url, f"r{i}", keyframes_follow_access=True) for i in range(2)]
    try:
        versions = trace(6, seed=7, fractions=[0.003, 0.02])
        for v, w in enumerate(versions):
            rs[v % 2].store.publish(v, w)
        for _ in range(12):  # demand on the newest: its rebuilds on replica 0
            serve(rs[0], 5)
            rs[0].store.residency.clear()
        rs[0].control.chain.maintain()
        records = rs[0].control.chain.records()
        assert records[5].kind == "keyframe" and records[0].kind == "patch", records
        rs[1].control.follow()
        for r in rs:
            for v, w in enumerate(versions):
                assert same(serve(r, v), w), (r.control.replica_id, v)
        rs[0].control.chain.collect()
        assert set(os.listdir(shared / CHAIN_DIR)) == {sv.file for sv in records.values()}
    finally:
        for r in rs:
            stop(r)


def test_files_of_a_killed_claim_are_collected_once_its_replica_is_gone(
    tmp_path: Path, redis: RedisServer
) -> None:
    shared = tmp_path / "shared"
    a = start(shared, redis.url, "a")
    try:
        a.store.publish(0, trace(1, seed=8)[0])
        # A claim announced and linked by a replica that then died (no heartbeat).
        orphan = shared / CHAIN_DIR / "v000000000001.deadbeef0000.patch"
        orphan.write_bytes(b"x" * 100)
        a.control.registry.pending(orphan.name, "dead-replica")
        live = shared / CHAIN_DIR / "v000000000002.feedbeef0000.patch"
        live.write_bytes(b"y" * 100)
        a.control.registry.pending(live.name, "a")  # in flight on a live replica: kept
        # A departed replica's directory (a pod replaced under a new id): its links would
        # hold bytes; one whose lock a process holds is not departed, whatever Redis says.
        kf = a.store.registry.get(0).file
        for rid in ("departed", "locked"):
            (shared / "replicas" / rid / "weights").mkdir(parents=True)
            (shared / "replicas" / rid / "registry.json").write_text("{}")
            os.link(shared / CHAIN_DIR / kf, shared / "replicas" / rid / "weights" / kf)
        holder = persist.lock_root(shared / "replicas" / "locked")
        a.control.chain.departed_after_s = 0.0
        try:
            with a.control.chain.lease() as held:
                assert held
                assert a.control.chain.collect() == [orphan.name]
        finally:
            holder.close()
        assert live.exists() and not orphan.exists()
        assert not (shared / "replicas" / "departed").exists()
        assert (shared / "replicas" / "locked" / "weights" / kf).exists()
        assert (shared / "replicas" / "a" / "weights" / kf).exists()
    finally:
        stop(a)


def test_versions_stored_whole_before_the_chain_are_moved_onto_it(
    tmp_path: Path, redis: RedisServer
) -> None:
    """A deployment upgraded in place: records naming a replica's own file (every version
    whole, as before the chain) are moved onto the chain by the lease's holder and served."""
    shared = tmp_path / "shared"
    w = trace(2, seed=9, fractions=[0.02])
    old = open_store(shared / "replicas" / "old", device_budget_bytes=4 * SNAP)
    out = old.publish(0, w[0])
    path = shared / "replicas" / "old" / "weights" / old.registry.get(0).file
    old.close()
    a = start(shared, redis.url, "a")
    b = start(shared, redis.url, "b")
    try:
        legacy = {"sha256": out.sha256, "kind": "keyframe", "parent": None, "nbytes": SNAP}
        a.control.registry.register(0, {**legacy, "file": str(path), "replica": "old"})
        a.control.chain.maintain()
        assert a.control.chain.records()[0].file == path.name
        assert same(serve(b, 0), w[0])
        b.store.publish(1, w[1])  # the chain goes on from it
        assert b.control.chain.records()[1].kind == "patch"
        assert same(serve(a, 1), w[1])
    finally:
        stop(a)
        stop(b)


def test_a_patch_whose_parent_went_before_its_claim_is_stored_whole(tmp_path: Path) -> None:
    """The claim refuses a patch whose parent the deployment removed meanwhile: the publish
    stores the (checked) weights whole instead of failing."""
    refused: list[int] = []

    def claim(version: int, sha: str, path: Path, record: dict[str, Any]) -> bool:
        if record["kind"] == "patch":
            refused.append(version)
            raise ParentMissing(f"parent of {version} gone", parameter="parent")
        return True

    w = trace(2, seed=10, fractions=[0.02])
    with open_store(
        tmp_path / "s", device_budget_bytes=4 * SNAP, keyframe_every=16, claim=claim
    ) as s:
        s.publish(0, w[0])
        out = s.publish(1, w[1])
        assert refused == [1] and out.created and out.kind == "keyframe"
        with s.acquire(1) as t:
            assert same(dict(t), w[1])
        assert len(list((tmp_path / "s" / "weights").iterdir())) == 2  # no patch file left
