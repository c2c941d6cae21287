"""Hot traffic first, in the scheduler: the load stage's load pauses between chunks while a
forward of a resident version runs or waits, and a cold request still completes (by
construction: events and recorded order, a real ``Foreground``; never the machine's speed)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from typing import Any

import torch

from oldlogit_service.model.engine import Job
from oldlogit_service.scheduler import WeightsRef
from oldlogit_service.snapshots import yielding
from oldlogit_service.snapshots.yielding import Foreground
from tests.unit.test_scheduler_loop import FakeEngine, FakeStore, job, make

COLD = 9  # not resident until the load stage has held it; every other version is


def _wait_for(cond: Callable[[], bool], timeout_s: float = 30.0) -> None:
    end = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.002)


class ChunkedLoadStore(FakeStore):
    """A store whose cold version loads in ``chunks`` chunks of background work, as the real
    store's loads do (``Residency`` runs them in ``foreground.background()``)."""

    def __init__(self, foreground: Foreground, chunks: int, log: list[str]) -> None:
        super().__init__()
        self.foreground = foreground
        self.chunks = chunks
        self.log = log

    def resident(self, version: int) -> bool:
        return version != COLD or super().resident(version)

    def hold(self, version: int, wanted: AbstractSet[int] = frozenset()) -> None:
        if version == COLD:
            with self.foreground.background():
                for i in range(self.chunks):
                    yielding.point()
                    self.log.append(f"load chunk {i}")
        super().hold(version, wanted)


class LoggingEngine(FakeEngine):
    """Records each forward's start and end in the shared log; hot forwards wait at
    ``gate`` (cleared by a test to hold one running)."""

    def __init__(self, log: list[str]) -> None:
        super().__init__()
        self.log = log

    def run(self, weights: Mapping[str, Any], jobs: Sequence[Job]) -> list[torch.Tensor]:
        v = weights["version"]
        self.log.append(f"forward {v} starts")
        try:
            return super().run(weights, jobs)
        finally:
            self.log.append(f"forward {v} ends")


def test_a_load_pauses_while_a_resident_versions_forward_runs() -> None:
    log: list[str] = []
    fg = Foreground(max_yield_s=3600.0)  # no turn comes due: the load waits for the forward
    engine = LoggingEngine(log)
    store = ChunkedLoadStore(fg, chunks=4, log=log)
    sched, _ = make(engine, store, max_wait_s=0.0)
    try:
        engine.gate.clear()  # the hot forward will run until the test lets it end
        hot = sched.submit(WeightsRef.stored(1), job(1))
        assert engine.entered.wait(10)
        cold = sched.submit(WeightsRef.stored(COLD), job(2))
        _wait_for(lambda: fg.state()["paused"] == 1)  # the load stopped at its first chunk
        assert not any(e.startswith("load chunk") for e in log)
        engine.gate.set()
        assert hot.result(10).tolist()[0] == 1001.0
        assert cold.result(10).tolist()[0] == 9002.0
    finally:
        engine.gate.set()
        sched.close()
    # Every chunk of the load ran after the hot forward, none beside it.
    assert log.index("forward 1 ends") < log.index("load chunk 0")
    assert log[-2:] == [f"forward {COLD} starts", f"forward {COLD} ends"]
    assert fg.stats.pauses >= 1 and fg.stats.turns == 0


def test_a_load_pauses_for_a_queued_batch_of_a_resident_version() -> None:
    # A batch of a resident version waiting in the queue (the compute stage busy elsewhere or
    # about to take it) holds the load back as a running one does: the scheduler says so.
    log: list[str] = []
    fg = Foreground(max_yield_s=3600.0)
    engine = LoggingEngine(log)
    store = ChunkedLoadStore(fg, chunks=2, log=log)
    sched, _ = make(engine, store, max_wait_s=0.0)
    try:
        engine.gate.clear()
        first = sched.submit(WeightsRef.stored(1), job(1))
        assert engine.entered.wait(10)
        queued = sched.submit(WeightsRef.stored(2), job(2))  # resident, waits for the engine
        _wait_for(lambda: fg.state()["queued"] == 1)
        cold = sched.submit(WeightsRef.stored(COLD), job(3))
        _wait_for(lambda: fg.state()["paused"] == 1)
        engine.gate.set()
        for f in (first, queued, cold):
            f.result(10)
    finally:
        engine.gate.set()
        sched.close()
    # The queued batch ran before any chunk of the load.
    assert log.index("forward 2 ends") < log.index("load chunk 0")
    assert fg.state()["queued"] == 0  # nothing left: background work runs freely again


def test_a_cold_request_completes_beside_back_to_back_hot_requests() -> None:
    # The hot version always has a batch queued or running: the load progresses in turns and
    # the cold request completes while the hot traffic goes on.
    log: list[str] = []
    fg = Foreground(max_yield_s=0.005, turn_s=0.002)
    engine = LoggingEngine(log)
    store = ChunkedLoadStore(fg, chunks=10, log=log)
    sched, _ = make(engine, store, max_wait_s=0.0)
    stop = threading.Event()
    hot_done = [0]

    def hot_client(tag: int) -> None:
        while not stop.is_set():
            sched.submit(WeightsRef.stored(1), job(tag)).result(30)
            hot_done[0] += 1

    clients = [threading.Thread(target=hot_client, args=(t,)) for t in (1, 2)]
    for c in clients:
        c.start()
    try:
        _wait_for(lambda: hot_done[0] > 2)
        cold = sched.submit(WeightsRef.stored(COLD), job(5))
        assert cold.result(60).tolist()[0] == 9005.0
        assert sum(e.startswith("load chunk") for e in log) == 10
        assert fg.stats.overdue == 0
    finally:
        stop.set()
        for c in clients:
            c.join(30)
        sched.close()
