"""Budgets under load, in the manner of Redis' maxmemory tests: many random operations from
several threads, with the bounds checked after every one of them."""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from oldlogit.contract.errors import VersionEvicted
from oldlogit_service.snapshots import SnapshotStore, ingest
from oldlogit_service.snapshots.tiers import (
    DiskCandidate,
    MemoryCandidate,
    disk_victims,
    memory_victim_parts,
)

SPECS: dict[str, tuple[str, tuple[int, ...]]] = {
    "a": ("BF16", (32, 16)),
    "b": ("F32", (16, 16)),
    "step": ("I64", ()),
}
SNAP = ingest.specs_nbytes(SPECS)


def make_sd(v: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(v)
    return {
        "a": torch.randn(32, 16, generator=g).bfloat16(),
        "b": torch.randn(16, 16, generator=g),
        "step": torch.tensor(v, dtype=torch.int64),
    }


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0
        self._lock = threading.Lock()

    def __call__(self) -> float:
        with self._lock:
            return self.t

    def advance(self, dt: float) -> None:
        with self._lock:
            self.t += dt


def open_store(root: Path, **kw: Any) -> SnapshotStore:
    args: dict[str, Any] = {
        "param_specs": SPECS,
        "device": "cpu",
        "device_budget_bytes": 3 * SNAP,
        "host_budget_bytes": 0,
        "disk_budget_bytes": 1000 * SNAP,
        "max_versions": 1000,
    }
    args.update(kw)
    return SnapshotStore(root, **args)


def test_device_budget_under_concurrent_random_acquires(tmp_path: Path) -> None:
    budget = 3 * SNAP
    n_versions = 6  # twice the budget's worth
    refs = {v: make_sd(v) for v in range(n_versions)}
    with open_store(tmp_path / "s", device_budget_bytes=budget) as s:
        for v in range(n_versions):
            s.publish(v, refs[v])
        failures: list[str] = []

        def check(where: str) -> None:
            dev = s.stats().tiers["device"]
            if dev.bytes > budget + SNAP:
                failures.append(f"{where}: {dev['bytes']} resident bytes")

        def worker(seed: int) -> None:
            rng = random.Random(seed)
            try:
                for _ in range(60):
                    v = rng.randrange(n_versions)
                    with s.acquire(v) as w:
                        if int(w["step"]) != v or not torch.equal(w["b"], refs[v]["b"]):
                            failures.append(f"wrong weights for version {v}")
                        check("inside")
                        time.sleep(rng.random() * 0.002)
                    check("after")
            except BaseException as exc:
                failures.append(repr(exc))

        # Five workers can pin more than the budget holds: the fifth waits for a release.
        threads = [threading.Thread(target=worker, args=(i,)) for i in range(5)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not failures, failures[:5]
        st = s.stats()
        dev = st.tiers["device"]
        assert dev.peak_bytes <= budget + SNAP  # never over, even between observations
        assert dev.bytes <= budget  # eviction caught up once everything was released
        assert dev.evictions > 0 and st.loads_disk > n_versions
        assert st.in_use == 0


def test_disk_retention_random_operations(tmp_path: Path) -> None:
    clock = FakeClock()
    max_versions = 4
    rng = random.Random(7)
    with open_store(tmp_path / "s", clock=clock, max_versions=max_versions) as s:
        published: list[int] = []
        leases: dict[str, tuple[int, float]] = {}  # lease_id -> (version, expires_at)
        watermark = 0
        for step in range(300):
            retained = [r.version for r in s.versions()]
            op = rng.random()
            if op < 0.3 or not published:
                v = (published[-1] + 1) if published else 0
                v = max(v, watermark)
                s.publish(v, make_sd(v))
                published.append(v)
            elif op < 0.5 and retained:
                v = rng.choice(retained)
                ttl = rng.uniform(1, 20)
                rec = s.lease(v, f"worker-{step}", ttl)
                leases[rec.lease_id] = (v, rec.expires_at)
            elif op < 0.6 and leases:
                lid = rng.choice(sorted(leases))
                v, exp = leases.pop(lid)
                if exp > clock():
                    s.release(lid)
            elif op < 0.75:
                clock.advance(rng.uniform(0, 5))
            elif op < 0.85:
                watermark = rng.randint(watermark, published[-1])
                s.set_watermark(watermark)
            elif retained:
                v = rng.choice(retained)
                with s.acquire(v) as w:
                    assert int(w["step"]) == v

            s.sweep()  # the service's periodic sweeper: lease expiry and retention
            now = clock()
            live = {lid: lv for lid, lv in leases.items() if lv[1] > now}
            leased = {v for v, _ in live.values()}
            retained_now = {r.version for r in s.versions()}
            assert {r.lease_id for r in s.leases()} == set(live), step
            assert leased <= retained_now, (step, leased, retained_now)  # never lost a lease
            for v in retained_now:
                assert v >= watermark or v in leased, (step, v)
            assert len(retained_now) <= max(max_versions, len(leased) + 1), step
            if published[-1] >= watermark:
                assert published[-1] in retained_now  # never the newest (above the mark)
            for v in set(published) - retained_now:
                with pytest.raises(VersionEvicted):
                    s.info(v)
            assert s.stats().tiers["disk"].versions == len(retained_now)


def test_disk_lru_and_budget(tmp_path: Path) -> None:
    clock = FakeClock()
    with open_store(tmp_path / "a", clock=clock, max_versions=3) as s:
        for v in range(3):
            clock.advance(1)
            s.publish(v, make_sd(v))
        clock.advance(1)
        with s.acquire(0):
            pass  # 0 becomes the most recently used
        clock.advance(1)
        s.publish(3, make_sd(3))
        assert [r.version for r in s.versions()] == [0, 2, 3]  # 1 was least recently used
        s.lease(2, "w", 100)
        clock.advance(1)
        s.publish(4, make_sd(4))
        # 2 is leased; of the others 0 (used before 3 was published) is least recent.
        assert [r.version for r in s.versions()] == [2, 3, 4]
    with open_store(tmp_path / "b", disk_budget_bytes=int(2.5 * SNAP)) as s:
        for v in range(5):
            s.publish(v, make_sd(v))
        assert [r.version for r in s.versions()] == [3, 4]
        assert s.stats().tiers["disk"].bytes <= 2.5 * SNAP
    with open_store(tmp_path / "c", disk_budget_bytes=SNAP // 2) as s:
        for v in range(3):
            s.publish(v, make_sd(v))
        assert [r.version for r in s.versions()] == [2]  # over budget, but never the newest


def test_policies_pure() -> None:
    cands = [
        MemoryCandidate(1, 10, last_used=5.0, tick=1, rebuild_cost=1),
        MemoryCandidate(2, 10, last_used=5.0, tick=2, rebuild_cost=0),  # a host copy: cheaper
        MemoryCandidate(3, 10, last_used=1.0, tick=3, rebuild_cost=1),
    ]

    def victims(**kw: int) -> list[int]:
        return [c.version for c in memory_victim_parts(cands, **kw)]

    assert victims(resident=30, incoming=10, budget=30) == [3]
    assert victims(resident=30, incoming=10, budget=15) == [3, 2, 1]
    assert victims(resident=30, incoming=0, budget=30) == []
    disk = [
        DiskCandidate(1, 10, 9.0, leased=False, in_use=False),
        DiskCandidate(2, 10, 1.0, leased=True, in_use=False),
        DiskCandidate(3, 10, 2.0, leased=False, in_use=True),
        DiskCandidate(4, 10, 3.0, leased=False, in_use=False),
        DiskCandidate(5, 10, 0.0, leased=False, in_use=False),
    ]
    victims, held = disk_victims(disk, watermark=2, max_versions=2, budget=1000)
    assert victims == [(1, "watermark"), (4, "max_versions")]
    assert held  # 3 would have gone, but a request holds it
    victims, held = disk_victims(disk, watermark=None, max_versions=10, budget=25)
    assert victims == [(4, "disk_budget"), (1, "disk_budget")] and held


def test_a_stream_of_once_used_versions_does_not_push_out_the_one_in_constant_use(
    tmp_path: Path,
) -> None:
    # Rollout workers score the newest version all the time while a second client asks for old
    # versions in turn, each once. Plain LRU would evict the hot version whenever two old ones
    # come back to back; its re-use since loading keeps it resident, and it still ages out
    # once nobody uses it.
    clock = FakeClock()
    with open_store(tmp_path, clock=clock, device_budget_bytes=2 * SNAP) as s:
        for v in range(6):
            s.publish(v, make_sd(v))
        hot = 5
        for _ in range(15):
            clock.advance(0.01)
            with s.acquire(hot):
                pass
        for cold in [0, 1, 2, 3, 4, 0, 1, 2]:
            clock.advance(0.05)
            with s.acquire(cold):
                pass
            assert s.resident(hot), cold
            assert s.resident(cold)
        # Nobody asks for the hot version any more: four half-lives on, its recent uses are
        # below tiers.HOT_MIN_USES and it goes like any other copy.
        clock.advance(20.0)
        for cold in (3, 4):
            with s.acquire(cold):
                pass
        assert not s.resident(hot)
    cands = [
        MemoryCandidate(1, 10, last_used=5.0, tick=1, rebuild_cost=1, uses=20),
        MemoryCandidate(2, 10, last_used=5.2, tick=2, rebuild_cost=1),
    ]
    assert [c.version for c in memory_victim_parts(cands, resident=20, incoming=10, budget=20)] == [
        2
    ]


def test_a_load_makes_room_from_versions_no_queued_work_needs(tmp_path: Path) -> None:
    # The scheduler's load stage says which versions its queue needs: a load evicts the others
    # first, even more recently used ones, so no version is dropped just before its requests.
    clock = FakeClock()
    with open_store(tmp_path, clock=clock, device_budget_bytes=2 * SNAP) as s:
        for v in range(4):
            s.publish(v, make_sd(v))
        for v in (0, 1):
            clock.advance(1)
            with s.acquire(v):
                pass
        clock.advance(1)
        s.hold(2, wanted={0, 2})  # 0 is the least recent, but queued work needs it
        try:
            assert s.resident(0) and s.resident(2) and not s.resident(1)
        finally:
            s.unhold(2)
        clock.advance(1)
        s.hold(3)  # nothing said wanted: plain recency (0, the least recent, goes)
        s.unhold(3)
        assert not s.resident(0) and s.resident(3)


def test_a_load_for_an_old_version_keeps_the_hot_versions_over_wanted_ones(tmp_path: Path) -> None:
    # An RL trainer's clients ask mostly for the newest two versions; with many of them, those
    # two often have nothing queued at the moment a load for an old version makes room, while
    # another old version's requests wait. Dropping a hot version would stall every client that
    # asks for it next; the old one's few requests wait for one load (tiers.hot_versions).
    clock = FakeClock()
    with open_store(tmp_path, clock=clock, device_budget_bytes=3 * SNAP) as s:
        for v in range(5):
            s.publish(v, make_sd(v))
        for _ in range(6):
            for v in (4, 3):
                clock.advance(0.01)
                with s.acquire(v):
                    pass
        clock.advance(0.01)
        with s.acquire(1):  # an old version, asked for once
            pass
        assert all(s.resident(v) for v in (1, 3, 4))
        assert s.cold_room() == (1, frozenset({3, 4}))  # one version fits beside the hot two
        clock.advance(0.01)
        s.hold(2, wanted={1, 2})  # 1 has queued work; the hot 3 and 4 have none right now
        try:
            assert s.resident(2) and s.resident(3) and s.resident(4) and not s.resident(1)
        finally:
            s.unhold(2)


def test_pin_resident_pins_only_a_device_copy_there_now_and_loads_nothing(tmp_path: Path) -> None:
    # The compute stage takes an unheld resident version this way: once pinned, no load can
    # evict it before its batch; a version not resident is left to the load stage.
    clock = FakeClock()
    with open_store(tmp_path, clock=clock, device_budget_bytes=SNAP) as s:
        for v in range(3):
            s.publish(v, make_sd(v))
        with s.acquire(0):
            pass
        loads = s.stats().loads_disk
        assert not s.pin_resident(1)  # not resident: nothing pinned, nothing loaded
        assert s.stats().loads_disk == loads and not s.resident(1)
        assert s.pin_resident(0)
        try:
            clock.advance(1)
            s.hold(1)  # the budget holds one: the pinned 0 stays, 1 comes in over the budget
            assert s.resident(0) and s.resident(1)
            s.unhold(1)
        finally:
            s.unhold(0)
        clock.advance(1)
        with s.acquire(2):  # unpinned now: the LRU may take it
            pass
        assert not s.resident(0)
        assert s.residency.pins(0) == 0 and s.residency.pins(1) == 0


def test_a_hot_version_cheap_to_rebuild_stays_before_a_rarely_used_long_chain() -> None:
    # The credit is use × rebuild cost: a keyframe-backed version every request needs is worth
    # more than a version rebuilt through a long chain that one request in thirty asks for.
    hot = MemoryCandidate(1, 10, last_used=5.0, tick=1, rebuild_cost=1, uses=30)
    chain = MemoryCandidate(2, 10, last_used=5.2, tick=2, rebuild_cost=8, uses=1)
    victims = memory_victim_parts([hot, chain], resident=20, incoming=10, budget=20)
    assert [c.version for c in victims] == [2]
    # Uses decay: the same version unused for a minute is worth its recency alone.
    from oldlogit_service.snapshots.tiers import decayed_uses

    assert decayed_uses(30, 60.0) < 0.01
    assert decayed_uses(30, 0.0) == 30
