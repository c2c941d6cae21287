"""The version every request asks for stays resident beside cold loads in a budget of two
versions: the patch share leaves room for it (snapshots/residency.py, tiers.py's ``hottest``),
so decoded patches of versions asked for once each never push it out (by construction: load
counters of a real store with real files)."""

from __future__ import annotations

import random
from pathlib import Path

from oldlogit_service.snapshots.tiers import MemoryCandidate, hottest

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
