"""Cold versions: keyframes that follow access (service/oldlogit_service/snapshots/rebuild.py): a
keyframe moved down its chain keeps every version's bytes and the disk's, and chains stay whole
through a restart, new publishes and removals; where a keyframe goes; the host buffer pool's
reuse; decoded patches kept within their share of memory (snapshots/tiers.py)."""

from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path

import torch

from oldlogit_service.snapshots import SnapshotStore, buffers, persist
from oldlogit_service.snapshots.rebuild import centroid
from oldlogit_service.snapshots.registry import Registry
from oldlogit_service.snapshots.tiers import MemoryCandidate, memory_victim_parts, patch_share

from .test_store_delta import FRACTIONS, SNAP, assert_all_served, open_store, trace


def ask(s: SnapshotStore, versions: list[int]) -> None:
    """Rebuild each of ``versions`` once (its weights dropped first): the demand a move follows."""
    for v in versions:
        s.evict(v)
        with s.acquire(v):
            pass


def kinds(s: SnapshotStore) -> dict[int, tuple[str, int | None]]:
    return {r.version: (r.kind, r.parent) for r in s.versions()}


def test_a_moved_keyframe_keeps_every_version_bitwise(tmp_path: Path) -> None:
    ws = trace(9, 11, fractions=[*FRACTIONS, 0.05])  # some steps change nothing, some all
    root = tmp_path / "s"
    with open_store(root, keyframe_every=16) as s:
        for v, w in enumerate(ws[:8]):
            s.publish(v, w)
        assert kinds(s)[0] == ("keyframe", None) and kinds(s)[7] == ("patch", 6)
        stored = {r.version: r.stored_nbytes for r in s.versions()}
        assert not s.move_keyframe()  # nothing asked for yet
        ask(s, [6, 7, 7] * 4)  # the newest versions are the ones rebuilt
        assert s.move_keyframe()
        k = kinds(s)
        assert k[7] == ("keyframe", None)
        assert [k[v] for v in range(7)] == [("patch", v + 1) for v in range(7)]
        assert len(s.chain(6)) == 2 and len(s.chain(0)) == 8
        # The same bytes on disk (a reverse patch holds the positions of its child's patch).
        moved = {r.version: r.stored_nbytes for r in s.versions()}
        assert sum(moved.values()) - sum(stored.values()) < 64 * len(stored)
        assert not s.move_keyframe()  # where the demand is: it stays
        s.residency.clear()  # everything read back from the new files
        assert_all_served(s, dict(enumerate(ws[:8])))
        on_disk = {p.name for p in (root / "weights").iterdir()}
        assert on_disk == {s.info(v).file for v in range(8)}  # the old files are gone
        s.publish(8, ws[8])  # a new version: a patch on 7, rebuilt from the moved keyframe
        assert kinds(s)[8] == ("patch", 7)
    with open_store(root, keyframe_every=16) as s2:  # a restart: parents newer than versions
        assert kinds(s2) == {**k, 8: ("patch", 7)}
        assert_all_served(s2, {v: ws[v] for v in reversed(range(9))})
        s2.set_watermark(3)  # 0..2 go (patches on 1..3: nothing depends on them)
        s2.delete(7)  # the moved keyframe: 6 and 8 are rewritten, every other version kept
        live = {v: ws[v] for v in (3, 4, 5, 6, 8)}
        assert set(kinds(s2)) == set(live)
        assert_all_served(s2, live)
        s2.residency.clear()
        assert_all_served(s2, live)


def test_keyframes_move_only_when_it_pays(tmp_path: Path) -> None:
    ws = trace(6, 12, fractions=[0.02])
    with open_store(tmp_path / "s", keyframe_every=16) as s:
        for v, w in enumerate(ws):
            s.publish(v, w)
        ask(s, [0, 1, 2, 3, 4, 5])  # spread evenly: the middle would save too little
        ask(s, [0] * 6)  # most rebuilds at the keyframe itself
        assert s.rebuilder.keyframe_move() is None
    with open_store(tmp_path / "t", keyframe_every=16, keyframes_follow_access=False) as s:
        for v, w in enumerate(ws):
            s.publish(v, w)
        ask(s, [5] * 12)
        s.sweep()
        assert kinds(s)[0] == ("keyframe", None)


def test_centroid() -> None:
    path = {0: None, 1: 0, 2: 1, 3: 2, 4: 3}
    assert centroid(path, {v: 1.0 for v in path}, 0) == 2
    assert centroid(path, {4: 5.0, 0: 4.0}, 0) == 4
    assert centroid(path, {4: 4.0, 0: 4.0}, 0) == 0  # a tie stays
    # A tree: 0 - 1 - 2 - 3, and 1 - 4 - 5 (a branch left by a removal's rebase).
    tree = {0: None, 1: 0, 2: 1, 3: 2, 4: 1, 5: 4}
    assert centroid(tree, {3: 3.0, 5: 3.0}, 0) == 1
    assert centroid(tree, {3: 3.0, 5: 4.0}, 0) == 5


def test_recovery_loses_what_never_reaches_a_keyframe(tmp_path: Path) -> None:
    root = tmp_path / "r"
    (root / persist.WEIGHTS).mkdir(parents=True)
    rec = {"sha256": "0" * 64, "nbytes": 8, "created_at": 0.0, "file_nbytes": 8}
    versions = [
        {**rec, "version": 0, "file": "a", "kind": "patch", "parent": 1},  # parent newer: ok
        {**rec, "version": 1, "file": "b", "kind": "keyframe", "parent": None},
        {**rec, "version": 2, "file": "c", "kind": "patch", "parent": 3},  # 2 <-> 3: a cycle
        {**rec, "version": 3, "file": "d", "kind": "patch", "parent": 2},
        {**rec, "version": 4, "file": "e", "kind": "patch", "parent": 9},  # its parent is gone
    ]
    doc = {"format": 1, "param_specs_sha256": "x", "newest_acknowledged": 4, "versions": versions}
    (root / persist.REGISTRY).write_text(json.dumps(doc))
    for name in "abcde":
        (root / persist.WEIGHTS / name).write_bytes(b"")
    reg = Registry(root, specs_sha256="x", max_versions=10, disk_budget_bytes=1 << 30, clock=float)
    reg.recover(lambda sv: True)
    assert sorted(reg.records()) == [0, 1]
    assert [sv.version for sv in reg.chain(0)] == [0, 1]
    assert all(reg.was_deleted(v) for v in (2, 3, 4))


def test_host_pool_reuses_memory_only_once_nothing_holds_it() -> None:
    pool = buffers.HostPool()
    pool.keep(4096, 1)
    a = pool.take(4096)
    view = a[8:16].view(torch.int16)  # a tensor view outlives the buffer's own tensor
    addr = a.data_ptr()
    del a
    b = pool.take(4096)
    assert b.data_ptr() != addr and pool.reused == 0
    del view  # now nothing holds it: idle, for the next load
    assert pool.idle_bytes == 4096
    c = pool.take(4096)
    assert c.data_ptr() == addr and pool.reused == 1
    del b, c  # one idle buffer kept, the other freed
    assert pool.idle_bytes == 4096
    other = pool.take(100)  # a size no store asked to keep: never pooled
    del other
    assert pool.idle_bytes == 4096
    pool.clear()
    assert pool.idle_bytes == 0


def test_moves_and_rebuilds_race_safely(tmp_path: Path) -> None:
    """A rebuild planned before a move reads the old files, which stay until it is done."""
    ws = trace(6, 13, fractions=[0.02])
    with open_store(tmp_path / "s", keyframe_every=16) as s:
        for v, w in enumerate(ws):
            s.publish(v, w)
        ask(s, [5] * 10)
        with s.rebuilder.reading():  # as a rebuild in flight
            old = {p.name for p in (tmp_path / "s" / "weights").iterdir()}
            assert s.move_keyframe()
            assert old <= {p.name for p in (tmp_path / "s" / "weights").iterdir()}
        assert {p.name for p in (tmp_path / "s" / "weights").iterdir()} == {
            s.info(v).file for v in range(6)
        }
        order = list(range(6))
        random.Random(0).shuffle(order)
        s.residency.clear()
        assert_all_served(s, {v: ws[v] for v in order})


def test_decoded_patches_within_their_share_outlast_weights() -> None:
    """Protected patches go last, after weights queued work wants: a wanted copy dropped costs
    one rebuild, a protected patch dropped costs a file read in every rebuild through it (with
    every resident copy wanted, loads used to push out the whole share, load after load)."""
    hot = MemoryCandidate(1, 100, last_used=9.0, tick=1, rebuild_cost=4.0, uses=30)
    old = MemoryCandidate(2, 100, last_used=1.0, tick=2, rebuild_cost=1.0)
    wanted = MemoryCandidate(3, 100, last_used=0.5, tick=9, rebuild_cost=1.0, wanted=True)
    patches = [
        MemoryCandidate(10 + i, 10, last_used=2.0 + i, tick=3 + i, rebuild_cost=0.5, part="patch")
        for i in range(4)
    ]
    keep = patch_share(patches, budget=100, share=0.25)  # room for two: the most recent ones
    assert keep == {12, 13}
    cands = [wanted, hot, old] + [replace(p, protected=p.version in keep) for p in patches]
    order = [c.version for c in memory_victim_parts(cands, resident=340, incoming=0, budget=0)]
    assert order[:4] == [2, 10, 11, 1]  # unprotected patches and weights by keep_until
    assert order[4:] == [3, 12, 13]  # then what queued work wants, then the protected patches


def test_loads_keep_the_patches_they_read(tmp_path: Path) -> None:
    """A device budget of ~2.7 versions: loads of other versions do not push out the decoded
    patches every rebuild of the chain reads (within the patch share; it leaves room for the
    hottest version and one loading, test_hot_residency.py)."""
    ws = trace(8, 14, fractions=[0.02])
    with open_store(tmp_path / "s", keyframe_every=16, device_budget_bytes=int(2.7 * SNAP)) as s:
        for v, w in enumerate(ws):
            s.publish(v, w)
        for v in [7, 6, 7, 5, 7, 6, 4, 7]:
            with s.acquire(v):
                pass
        reads = s.rebuilder.counters["patch_reads"]
        for v in [7, 6, 5, 7, 4, 6, 7, 5]:
            s.evict(v)
            with s.acquire(v):
                pass
        assert s.rebuilder.counters["patch_reads"] == reads  # every patch still in memory
        assert_all_served(s, {v: ws[v] for v in (4, 5, 6, 7)})


def test_has_room_says_whether_a_load_would_evict(tmp_path: Path) -> None:
    ws = trace(3, 15, fractions=[0.02])
    with open_store(tmp_path / "s", keyframe_every=1, device_budget_bytes=int(2.5 * SNAP)) as s:
        s.publish(0, ws[0])
        with s.acquire(0):
            assert s.has_room()  # one version resident, room for another
        s.publish(1, ws[1])
        with s.acquire(1):
            pass
        assert not s.has_room()  # two resident: a third would evict one
        s.evict(0)
        assert s.has_room()
