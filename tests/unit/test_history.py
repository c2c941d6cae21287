"""The status page's history: rates from counter deltas, gaps, resets, the ring bound, the
sampler loop over a real metrics registry, and the charts drawn from it."""

from __future__ import annotations

import asyncio
import math
import re

import pytest

from oldlogit_service.api.status_page import _chart
from oldlogit_service.cache import CacheStats
from oldlogit_service.history import History, Sample, read_registry, sample_forever
from oldlogit_service.metrics import Metrics, ServiceState
from oldlogit_service.snapshots.records import LaggingStats, StoreStats


def values(
    tokens: float = 0,
    wait_sum: float = 0,
    wait_n: float = 0,
    hits: float = 0,
    misses: float = 0,
    depth: float = 0,
) -> dict[str, float]:
    return {
        "oldlogit_tokens_total": tokens,
        "oldlogit_queue_wait_seconds_sum": wait_sum,
        "oldlogit_queue_wait_seconds_count": wait_n,
        "oldlogit_cache_hits_total": hits,
        "oldlogit_cache_misses_total": misses,
        "oldlogit_queue_depth": depth,
    }


def test_rates_come_from_deltas_between_reads() -> None:
    h = History(interval_s=1.0, keep_s=10.0)
    assert h.observe(100.0, values(tokens=1000, wait_sum=5, wait_n=50, hits=10)) is None
    s = h.observe(102.0, values(tokens=1100, wait_sum=5.3, wait_n=53, hits=13, misses=1, depth=4))
    assert s is not None and h.samples() == [s]
    assert s.tokens_per_s == pytest.approx(50.0)
    assert s.queue_wait_ms == pytest.approx(100.0)  # 0.3 s over 3 jobs
    assert s.cache_hit_rate == pytest.approx(0.75)
    assert s.queue_depth == 4
    idle = h.observe(103.0, values(tokens=1100, wait_sum=5.3, wait_n=53, hits=13, misses=1))
    assert idle is not None and idle.tokens_per_s == 0
    assert math.isnan(idle.queue_wait_ms) and math.isnan(idle.cache_hit_rate)  # nothing to average


def test_resets_clock_steps_and_the_ring_bound() -> None:
    h = History(interval_s=1.0, keep_s=3.0)
    h.observe(0.0, values(tokens=500))
    reset = h.observe(1.0, values(tokens=20))  # a new registry: counts start again from zero
    assert reset is not None and reset.tokens_per_s == 20
    assert h.observe(0.5, values(tokens=30)) is None  # the clock went back: a new baseline
    for t in range(1, 10):
        h.observe(float(t), values(tokens=30 + t))
    assert len(h.samples()) == 3 and h.samples()[-1].t == 9.0
    with pytest.raises(ValueError):
        History(interval_s=0)


async def test_sampler_reads_a_real_registry_until_cancelled() -> None:
    m = Metrics()
    store = StoreStats(
        tiers={},
        versions=0,
        newest=None,
        watermark=None,
        leases=0,
        tombstones=0,
        in_use=0,
        publishes=0,
        snapshot_bytes=0,
        patch_bytes=0,
        load_seconds=0.0,
        device_hits=0,
        loads_disk=0,
        loads_host=0,
        load_waits=0,
        bytes_read=0,
        verified_loads=0,
        rebuilds=0,
        patches_applied=0,
        lagging=LaggingStats(),
    )
    state = ServiceState(store, CacheStats(hits=1, misses=3), 2, 0, 0, True, {})
    m.attach_state(lambda: state)
    m.on_batch(items=1, tokens=64, seconds=0.01)
    read = read_registry(m.registry)
    assert read["oldlogit_tokens_total"] == 64 and read["oldlogit_queue_depth"] == 2
    h = History(interval_s=0.02, keep_s=1.0)
    task = asyncio.create_task(sample_forever(h, m.registry))
    await asyncio.sleep(0.15)
    m.on_batch(items=1, tokens=1000, seconds=0.01)
    await asyncio.sleep(0.15)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    samples = h.samples()
    assert len(samples) >= 3 and all(s.queue_depth == 2 for s in samples)
    assert sum(s.tokens_per_s * h.interval_s for s in samples) > 0


def test_chart_breaks_the_line_at_gaps_and_marks_the_newest_point() -> None:
    samples = [
        Sample(
            t=float(t),
            queue_depth=0,
            queue_tokens=0,
            tokens_per_s=v,
            queue_wait_ms=0,
            cache_hit_rate=0,
        )
        for t, v in enumerate([1.0, 2.0, math.nan, 4.0, 8.0])
    ]
    svg = _chart("t", "Throughput", "tokens/s", samples, lambda s: s.tokens_per_s, 4.0, 60.0)
    assert svg.count("<polyline") == 2 and svg.count("<circle") == 1
    assert 'data-samples="4"' in svg and 'data-max="8"' in svg
    assert "<b>8</b>" in svg  # the newest value in the caption
    ys = [float(y) for y in re.findall(r",([\d.]+)", svg.split("<polyline")[2])]
    assert ys[-1] < ys[0]  # a higher value is drawn higher (smaller y)
