"""The version every request asks for stays resident beside cold loads in a budget of two
versions: the patch share leaves room for it (snapshots/residency.py, tiers.py's ``hottest``),
so decoded patches of versions asked for once each never push it out (by construction: load
counters of a real store with real files)."""

from __future__ import annotations

import random
from pathlib import Path

from oldlogit_service.snapshots.tiers import (
    MemoryCandidate,
    hot_versions,
    hottest,
    memory_victim_parts,
)

from .test_store_delta import SNAP, assert_all_served, open_store, trace


def test_the_hot_version_is_not_reloaded_beside_cold_loads(tmp_path: Path) -> None:
    ws = trace(8, 5, fractions=[0.02, 0.05])
    with open_store(tmp_path / "s", keyframe_every=16, device_budget_bytes=2 * SNAP) as s:
        for v, w in enumerate(ws):
            s.publish(v, w)
        hot = 7  # a patch chain of 7 on version 0
        s.residency.clear()
        for _ in range(4):
            with s.acquire(hot):
                pass
        rng = random.Random(0)
        last = None
        for _ in range(12):  # every cold request another old version: each one a load
            v = rng.choice([x for x in range(hot) if x != last])
            last = v
            before = s.residency.counters["loads_disk"]
            with s.acquire(v):
                pass
            assert s.residency.counters["loads_disk"] == before + 1  # the cold one, only
            with s.acquire(hot):  # the hot one: still resident
                pass
            assert s.residency.counters["loads_disk"] == before + 1
            assert hot in s.residency.resident_versions()
        assert s.residency.device_tier.peak <= 3 * SNAP  # budget + the one loading
        assert_all_served(s, {hot: ws[hot], 3: ws[3]})


def test_hottest_picks_the_most_used_weights_from_a_threshold() -> None:
    def c(v: int, uses: float, part: str = "weights") -> MemoryCandidate:
        return MemoryCandidate(v, 10, 0.0, v, 1.0, part=part, uses=uses)

    assert hottest([c(1, 1.5), c(2, 0.5)]) is None  # nobody asked twice lately
    assert hottest([c(1, 3.0), c(2, 5.0), c(3, 9.0, part="patch")]) == 2


def test_hot_versions_carry_a_share_of_the_recent_uses() -> None:
    def c(v: int, uses: float, part: str = "weights") -> MemoryCandidate:
        return MemoryCandidate(v, 10, 0.0, v, 1.0, part=part, uses=uses)

    # An RL mix: most uses at the newest two, a few spread over older versions.
    mix = [c(15, 55.0), c(14, 30.0), c(13, 4.0), c(12, 3.0), c(11, 3.0), c(3, 1.0)]
    assert hot_versions(mix) == {15, 14}
    assert hot_versions([c(1, 1.0), c(2, 1.5)]) == set()  # nobody asked twice lately
    assert hot_versions([c(1, 1.0), c(2, 90.0, part="patch")]) == set()  # weights only
    assert hot_versions([c(v, 10.0) for v in range(4)]) == {0, 1, 2, 3}  # an even spread


def test_victims_go_unwanted_then_wanted_then_hot_then_protected_patches() -> None:
    cands = [
        MemoryCandidate(1, 10, last_used=9.0, tick=1, rebuild_cost=1, hot=True),
        MemoryCandidate(2, 10, last_used=1.0, tick=2, rebuild_cost=1, wanted=True),
        MemoryCandidate(3, 10, last_used=5.0, tick=3, rebuild_cost=1),
        MemoryCandidate(4, 1, last_used=0.0, tick=4, rebuild_cost=1, part="patch", protected=True),
    ]
    order = memory_victim_parts(cands, resident=31, incoming=10, budget=11)
    assert [(c.version, c.part) for c in order] == [(3, "weights"), (2, "weights"), (1, "weights")]
    everything = memory_victim_parts(cands, resident=31, incoming=10, budget=0)
    assert [c.version for c in everything] == [3, 2, 1, 4]
