"""Prometheus metrics: one registry per runtime (so several servers can live in one process).

Counters and histograms are fed by the transports (requests, latency), the scheduler (queue
wait, batches) and the runtime (cache, publishes); gauges for tiers and the queue are read from
the store and scheduler at scrape time by a collector, so they are never stale.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from oldlogit_service.cache import CacheStats
from oldlogit_service.snapshots.records import StoreStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_TOKEN_BUCKETS = (64, 256, 1024, 4096, 16384, 65536, 262144, 1048576)


@dataclass(frozen=True)
class ServiceState:
    """What metrics and the status page read at scrape time (``Runtime.state``)."""

    store: StoreStats
    cache: CacheStats
    queue_depth: int
    queue_tokens: int
    load_queue: int  # queued versions the load stage has not made resident yet
    ready: bool
    newest_resident: dict[str, int]  # per memory tier, the newest version it holds (-1: none)


class _StateCollector(Collector):
    """Reads live state (tiers, queue, cache, versions) at scrape time."""

    def __init__(self, read: Callable[[], ServiceState]) -> None:
        self._read = read

    def collect(self) -> Iterator[Metric]:
        s = self._read()
        st = s.store
        tier_bytes = GaugeMetricFamily(
            "oldlogit_tier_bytes", "Bytes of weights resident per tier", labels=["tier"]
        )
        tier_budget = GaugeMetricFamily(
            "oldlogit_tier_budget_bytes", "Byte budget per tier", labels=["tier"]
        )
        tier_versions = GaugeMetricFamily(
            "oldlogit_tier_versions", "Versions resident per tier", labels=["tier"]
        )
        evictions = CounterMetricFamily(
            "oldlogit_evictions", "Versions evicted from a tier", labels=["tier"]
        )
        for tier, t in st.tiers.items():
            tier_bytes.add_metric([tier], float(t.bytes))
            tier_budget.add_metric([tier], float(t.budget))
            tier_versions.add_metric([tier], float(t.versions))
            evictions.add_metric([tier], float(t.evictions))
        yield tier_bytes
        yield tier_budget
        yield tier_versions
        yield evictions
        loads = CounterMetricFamily(
            "oldlogit_weight_loads",
            "Versions made device-resident, by where the bytes came from (disk: a keyframe "
            "read or a rebuild from keyframe + patches; host: a host-tier copy)",
            labels=["source"],
        )
        loads.add_metric(["disk"], float(st.loads_disk))
        loads.add_metric(["host"], float(st.loads_host))
        yield loads
        yield CounterMetricFamily(
            "oldlogit_weight_load_seconds",
            "Seconds spent making versions device-resident",
            value=st.load_seconds,
        )
        yield CounterMetricFamily(
            "oldlogit_background_paused_seconds",
            "Seconds background work (loads, rebuilds, re-keying, sweeps) paused for forwards "
            "sharing the CPU cores",
            value=st.background_paused_s,
        )
        yield CounterMetricFamily(
            "oldlogit_background_turns",
            "Turns background work ran while forwards waited (it had paused its maximum)",
            value=st.background_turns,
        )
        yield CounterMetricFamily(
            "oldlogit_forward_turn_wait_seconds",
            "Seconds forwards waited for background turns",
            value=st.forward_turn_wait_s,
        )
        yield CounterMetricFamily(
            "oldlogit_rebuilds", "Versions rebuilt from a base plus patches", value=st.rebuilds
        )
        yield CounterMetricFamily(
            "oldlogit_patches_applied", "Patches applied by rebuilds", value=st.patches_applied
        )
        yield GaugeMetricFamily(
            "oldlogit_versions", "Versions retained (acknowledged, not evicted)", value=st.versions
        )
        yield GaugeMetricFamily(
            "oldlogit_newest_version",
            "Newest published version (-1: none)",
            value=-1 if st.newest is None else st.newest,
        )
        resident = GaugeMetricFamily(
            "oldlogit_newest_resident_version",
            "Newest version resident in a memory tier (-1: none)",
            labels=["tier"],
        )
        for tier, v in s.newest_resident.items():
            resident.add_metric([tier], float(v))
        yield resident
        yield GaugeMetricFamily(
            "oldlogit_watermark",
            "Retention watermark (-1: none)",
            value=-1 if st.watermark is None else st.watermark,
        )
        yield GaugeMetricFamily("oldlogit_leases", "Live leases", value=st.leases)
        yield GaugeMetricFamily(
            "oldlogit_queue_depth", "Jobs waiting in the scheduler", value=s.queue_depth
        )
        yield GaugeMetricFamily(
            "oldlogit_queue_tokens", "Tokens waiting in the scheduler", value=s.queue_tokens
        )
        yield GaugeMetricFamily(
            "oldlogit_load_queue_depth",
            "Queued versions waiting for the load stage to make them resident",
            value=s.load_queue,
        )
        yield CounterMetricFamily("oldlogit_cache_hits", "Result cache hits", value=s.cache.hits)
        yield CounterMetricFamily(
            "oldlogit_cache_misses", "Result cache misses", value=s.cache.misses
        )
        yield GaugeMetricFamily(
            "oldlogit_cache_bytes", "Bytes held by the result cache", value=s.cache.bytes
        )
        yield GaugeMetricFamily(
            "oldlogit_ready", "1 when the service can serve", value=float(s.ready)
        )


class Metrics:
    """The service's metrics; also the scheduler's observer."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "oldlogit_requests",
            "Requests by route, transport and outcome code",
            ["route", "transport", "code"],
            registry=r,
        )
        self.latency = Histogram(
            "oldlogit_request_latency_seconds",
            "Request latency by route and transport",
            ["route", "transport"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_wait = Histogram(
            "oldlogit_queue_wait_seconds",
            "Time a job waited in the scheduler queue",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.batch_tokens = Histogram(
            "oldlogit_batch_tokens",
            "Tokens per executed batch",
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )
        self.batch_seconds = Histogram(
            "oldlogit_batch_seconds",
            "Wall time per executed batch (load + forward)",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.load_seconds = Histogram(
            "oldlogit_load_seconds",
            "Time the load stage took to make a version resident (read, rebuild, copy)",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.tokens = Counter(
            "oldlogit_tokens", "Tokens forwarded (rate() gives tokens/s)", registry=r
        )
        self.scored = Counter(
            "oldlogit_scored_tokens", "Logprobs returned, by source", ["source"], registry=r
        )
        self.publish_seconds = Histogram(
            "oldlogit_publish_seconds",
            "Publish duration (receive, verify, persist)",
            ["outcome"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.publishes = Counter(
            "oldlogit_publishes", "Publishes by outcome code", ["code"], registry=r
        )
        # Export the success series from the start, so dashboards and alerts see zeros.
        self.publish_seconds.labels("ok")
        self.publishes.labels("ok")
        for source in ("forward", "cache"):
            self.scored.labels(source)

    def attach_state(self, read: Callable[[], ServiceState]) -> None:
        self.registry.register(_StateCollector(read))

    # SchedulerObserver
    def on_queue_wait(self, seconds: float) -> None:
        self.queue_wait.observe(seconds)

    def on_load(self, seconds: float, waiting: int) -> None:
        self.load_seconds.observe(seconds)

    def on_batch(self, items: int, tokens: int, seconds: float) -> None:
        self.batch_tokens.observe(tokens)
        self.batch_seconds.observe(seconds)
        self.tokens.inc(tokens)

    def render(self) -> bytes:
        return bytes(generate_latest(self.registry))
