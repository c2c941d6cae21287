"""The last minutes of the live numbers, for the status page's charts.

In: the service's Prometheus registry, read every ``interval_s`` by ``sample_forever`` (so the
charts show exactly what ``/metrics`` exports). Out: ``History.samples()``, a ring buffer of
queue depth, tokens/s, mean queue wait and cache hit rate. Rates are deltas between two reads.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

# Unlabelled samples read from the registry; counters and histogram parts become rates.
_QUEUE_DEPTH = "oldlogit_queue_depth"
_QUEUE_TOKENS = "oldlogit_queue_tokens"
_TOKENS = "oldlogit_tokens_total"
_WAIT_SUM = "oldlogit_queue_wait_seconds_sum"
_WAIT_COUNT = "oldlogit_queue_wait_seconds_count"
_HITS = "oldlogit_cache_hits_total"
_MISSES = "oldlogit_cache_misses_total"
READ = frozenset({_QUEUE_DEPTH, _QUEUE_TOKENS, _TOKENS, _WAIT_SUM, _WAIT_COUNT, _HITS, _MISSES})


@dataclass(frozen=True)
class Sample:
    t: float  # unix seconds at the end of the interval
    queue_depth: float  # jobs waiting at t
    queue_tokens: float  # tokens waiting at t
    tokens_per_s: float  # tokens forwarded per second over the interval
    queue_wait_ms: float  # mean wait of the jobs that left the queue; NaN when none did
    cache_hit_rate: float  # hits / lookups over the interval; NaN when no lookup


def read_registry(registry: Any) -> dict[str, float]:
    """The unlabelled samples named in ``READ``, as ``/metrics`` would render them now."""
    out: dict[str, float] = {}
    for family in registry.collect():
        for s in family.samples:
            if s.name in READ and not s.labels:
                out[s.name] = float(s.value)
    return out


def _ratio(num: float, den: float) -> float:
    return num / den if den > 0 else math.nan


class History:
    """A thread-safe ring buffer of ``Sample``: ``keep_s / interval_s`` of them at most."""

    def __init__(self, interval_s: float = 1.0, keep_s: float = 600.0) -> None:
        if interval_s <= 0 or keep_s < interval_s:
            raise ValueError("need 0 < interval_s <= keep_s")
        self.interval_s = float(interval_s)
        self.keep_s = float(keep_s)
        self._samples: deque[Sample] = deque(maxlen=round(keep_s / interval_s))
        self._last: tuple[float, Mapping[str, float]] | None = None
        self._lock = threading.Lock()

    def observe(self, now: float, values: Mapping[str, float]) -> Sample | None:
        """Add the interval that ends at ``now``; the first read only sets the baseline."""
        with self._lock:
            last, self._last = self._last, (now, dict(values))
            if last is None:
                return None
            t0, prev = last
            dt = now - t0
            if dt <= 0:  # the wall clock stepped back: restart the baseline
                return None

            def delta(name: str) -> float:
                # A counter that went down was reset (a new registry): count from zero.
                d = values.get(name, 0.0) - prev.get(name, 0.0)
                return d if d >= 0 else values.get(name, 0.0)

            hits = delta(_HITS)
            sample = Sample(
                t=now,
                queue_depth=values.get(_QUEUE_DEPTH, 0.0),
                queue_tokens=values.get(_QUEUE_TOKENS, 0.0),
                tokens_per_s=delta(_TOKENS) / dt,
                queue_wait_ms=1000.0 * _ratio(delta(_WAIT_SUM), delta(_WAIT_COUNT)),
                cache_hit_rate=_ratio(hits, hits + delta(_MISSES)),
            )
            self._samples.append(sample)
            return sample

    def samples(self) -> list[Sample]:
        with self._lock:
            return list(self._samples)


async def sample_forever(history: History, registry: Any) -> None:
    """Read the registry every ``history.interval_s`` until cancelled.

    The read runs on a worker thread: collecting takes the store's lock, which a publish may
    hold while it persists, and the event loop must never wait for that.
    """
    while True:
        try:
            values = await asyncio.to_thread(read_registry, registry)
            history.observe(time.time(), values)
        except asyncio.CancelledError:
            raise
        except Exception:  # a failed read leaves a gap in the charts, never a dead sampler
            logger.exception("status history: reading the metrics failed")
        await asyncio.sleep(history.interval_s)
