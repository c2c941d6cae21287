"""The scheduler loop with a recording fake engine and store (pure loop logic, no model)."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from collections.abc import Set as AbstractSet
from contextlib import contextmanager
from typing import Any

import pytest
import torch

from oldlogit.contract.errors import DeadlineExceeded, InternalError, Overloaded, UnknownVersion
from oldlogit_service.model.engine import Job
from oldlogit_service.model.numerics import SamplingParams
from oldlogit_service.scheduler import BatchPolicy, Scheduler, WeightsRef


class FakeStore:
    def __init__(self) -> None:
        self.acquired: list[int] = []
        self.held: list[int] = []
        self.released: list[int] = []
        self.pinned: list[int] = []  # the compute stage's pins outstanding
        self.unpinned: list[int] = []

    def hold(self, version: int, wanted: AbstractSet[int] = frozenset()) -> None:
        if version == 404:
            raise UnknownVersion("no version 404", parameter="policy_version")
        self.held.append(version)

    def unhold(self, version: int) -> None:
        if version in self.pinned:  # the compute stage's own pin
            self.pinned.remove(version)
            self.unpinned.append(version)
        else:
            self.released.append(version)

    def resident(self, version: int) -> bool:
        return version in self.held and self.held.count(version) > self.released.count(version)

    def pin_resident(self, version: int) -> bool:
        if not self.resident(version):
            return False
        self.pinned.append(version)
        return True

    @contextmanager
    def acquire(self, version: int, uses: int = 1) -> Iterator[Mapping[str, Any]]:
        if version == 404:
            raise UnknownVersion("no version 404", parameter="policy_version")
        self.acquired.append(version)
        yield {"version": version}


class FakeEngine:
    def __init__(self, delay_s: float = 0.0, fail: bool = False) -> None:
        self.calls: list[tuple[int, list[int]]] = []
        self.delay_s = delay_s
        self.fail = fail
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()  # a batch reached the engine (and waits at the gate)

    def run(self, weights: Mapping[str, Any], jobs: Sequence[Job]) -> list[torch.Tensor]:
        self.entered.set()
        self.gate.wait(10)
        if self.fail:
            raise RuntimeError("kaboom")
        time.sleep(self.delay_s)
        self.calls.append((weights["version"], [int(j.token_ids[0]) for j in jobs]))
        # The "logprob" of each job is its version and first token, to check routing.
        return [
            torch.full((len(j.positions),), float(weights["version"] * 1000 + int(j.token_ids[0])))
            for j in jobs
        ]

    def trace(self, weights: Mapping[str, Any], job: Job) -> list[str]:
        self.entered.set()
        self.gate.wait(10)
        tag = int(job.token_ids[0])
        if tag == 13:
            raise RuntimeError("an unlucky trace")
        self.calls.append((weights["version"], [-tag]))
        return [f"v{weights['version']}-t{tag}"]


def job(tag: int, n: int = 4) -> Job:
    ids = torch.tensor([tag] + [1] * (n - 1))
    return Job(token_ids=ids, positions=torch.arange(1, n), sampling=SamplingParams())


def make(
    engine: FakeEngine, store: FakeStore | None = None, **kw: Any
) -> tuple[Scheduler, FakeStore]:
    store = store or FakeStore()
    policy = BatchPolicy(
        max_batch_tokens=kw.pop("max_batch_tokens", 64), max_wait_s=kw.pop("max_wait_s", 0.01)
    )
    sched = Scheduler(engine, store, policy=policy, max_queue=kw.pop("max_queue", 100))  # type: ignore[arg-type]
    return sched, store


def test_results_route_back_and_batches_never_mix_versions() -> None:
    engine = FakeEngine()
    sched, _ = make(engine)
    try:
        futs = [
            (v, t, sched.submit(WeightsRef.stored(v), job(t))) for t in range(30) for v in (1, 2, 3)
        ]
        for v, t, f in futs:
            assert f.result(10).tolist() == [float(v * 1000 + t)] * 3
        assert all(tags for _, tags in engine.calls)
        # Each engine call is one version: check via the values each job got (above) and that
        # grouping happened (fewer calls than jobs).
        assert len(engine.calls) < len(futs)
    finally:
        sched.close()


def test_a_lone_request_runs_without_waiting_for_company() -> None:
    """One client asking in turn: each request is alone in the queue after a batch of one, so
    it runs at once instead of waiting the batching window for company."""
    engine = FakeEngine()
    sched, _ = make(engine, max_wait_s=2.0)
    try:
        for tag in range(3):
            start = time.monotonic()
            assert sched.submit(WeightsRef.stored(1), job(tag)).result(10).tolist()[0] == 1000 + tag
            assert time.monotonic() - start < 1.0  # the window is 2 s
        assert [tags for _, tags in engine.calls] == [[0], [1], [2]]
    finally:
        sched.close()


def test_requests_after_a_shared_batch_still_wait_for_company() -> None:
    """Once a batch held several requests, the next lone one waits the window for the others
    (which come back with their answers): here a second request 0.2 s later joins its batch."""
    engine = FakeEngine()
    sched, _ = make(engine, max_wait_s=1.0)
    try:
        engine.gate.clear()
        first = sched.submit(WeightsRef.stored(1), job(0))  # alone: runs at once, held at the gate
        assert engine.entered.wait(10)
        burst = [sched.submit(WeightsRef.stored(1), job(t)) for t in (1, 2, 3)]  # queued meanwhile
        engine.gate.set()
        first.result(10)
        for f in burst:
            f.result(10)
        assert [tags for _, tags in engine.calls] == [[0], [1, 2, 3]]
        start = time.monotonic()
        late = [sched.submit(WeightsRef.stored(1), job(4))]
        time.sleep(0.2)
        late.append(sched.submit(WeightsRef.stored(1), job(5)))
        for f in late:
            f.result(10)
        assert engine.calls[-1][1] == [4, 5]  # one batch: the first waited for company
        assert time.monotonic() - start >= 0.2
    finally:
        sched.close()


def test_cancelled_requests_are_dropped() -> None:
    engine = FakeEngine()
    engine.gate.clear()  # hold the first batch so the rest queue up
    sched, _ = make(engine, max_wait_s=0.0, max_batch_tokens=4)
    try:
        first = sched.submit(WeightsRef.stored(1), job(0))
        assert engine.entered.wait(10)  # taken by the worker, now blocked in the engine
        doomed = [sched.submit(WeightsRef.stored(1), job(t)) for t in range(1, 6)]
        kept = sched.submit(WeightsRef.stored(1), job(9))
        for f in doomed:
            assert f.cancel()
        engine.gate.set()
        assert kept.result(10).tolist()[0] == 1009.0
        first.result(10)
        ran = [t for _, tags in engine.calls for t in tags]
        assert not set(ran) & {1, 2, 3, 4, 5}
    finally:
        sched.close()


def test_expired_deadline_fails_without_running() -> None:
    engine = FakeEngine()
    engine.gate.clear()
    sched, _ = make(engine, max_wait_s=0.0, max_batch_tokens=4)
    try:
        blocker = sched.submit(WeightsRef.stored(1), job(0))
        assert engine.entered.wait(10)
        late = sched.submit(WeightsRef.stored(1), job(5), deadline=time.monotonic() + 0.01)
        time.sleep(0.05)
        engine.gate.set()
        with pytest.raises(DeadlineExceeded):
            late.result(10)
        blocker.result(10)
        assert all(5 not in tags for _, tags in engine.calls)
    finally:
        sched.close()


def test_bounded_queue_answers_overloaded_with_retry_after() -> None:
    engine = FakeEngine()
    engine.gate.clear()
    sched, _ = make(engine, max_queue=3, max_wait_s=0.0, max_batch_tokens=4)
    try:
        sched.submit(WeightsRef.stored(1), job(0))
        assert engine.entered.wait(10)  # taken by the worker, now blocked in the engine
        for t in range(3):
            sched.submit(WeightsRef.stored(1), job(t))
        with pytest.raises(Overloaded) as info:
            sched.submit(WeightsRef.stored(1), job(7))
        assert info.value.retry_after_s > 0
    finally:
        engine.gate.set()
        sched.close()


def test_failed_batch_fails_its_requests_and_the_loop_lives_on() -> None:
    engine = FakeEngine(fail=True)
    sched, _ = make(engine)
    try:
        bad = [sched.submit(WeightsRef.stored(1), job(t)) for t in range(3)]
        for f in bad:
            with pytest.raises(InternalError):
                f.result(10)
        missing = sched.submit(WeightsRef.stored(404), job(1))
        with pytest.raises(UnknownVersion):
            missing.result(10)
        engine.fail = False
        assert sched.submit(WeightsRef.stored(2), job(3)).result(10).tolist()[0] == 2003.0
    finally:
        sched.close()


def test_trace_jobs_ride_the_version_queue_and_fail_alone() -> None:
    engine = FakeEngine()
    sched, store = make(engine)
    try:
        engine.gate.clear()
        blocker = sched.submit(WeightsRef.stored(2), job(0))
        end = time.monotonic() + 10
        while not sched._state.running and time.monotonic() < end:  # the blocker is running:
            time.sleep(0.005)  # what follows queues up and goes as one batch of version 1
        scored = sched.submit(WeightsRef.stored(1), job(5))
        traced = sched.submit_trace(
            WeightsRef.stored(1), Job(torch.tensor([7, 1, 1]), torch.arange(1, 3), trace=True)
        )
        unlucky = sched.submit_trace(
            WeightsRef.stored(1), Job(torch.tensor([13, 1]), torch.arange(1, 2), trace=True)
        )
        engine.gate.set()
        blocker.result(10)
        assert scored.result(10).tolist()[0] == 1005.0  # a neighbour's failure is not its own
        assert traced.result(10) == ["v1-t7"]
        with pytest.raises(InternalError):
            unlucky.result(10)
        assert (1, [5]) in engine.calls and (1, [-7]) in engine.calls
        assert store.acquired.count(1) == 1  # one acquire of the weights for the batch and traces
        with pytest.raises(ValueError, match="submit_trace"):
            sched.submit(
                WeightsRef.stored(1), Job(torch.tensor([1, 2]), torch.arange(1, 2), trace=True)
            )
        with pytest.raises(ValueError, match="trace"):
            sched.submit_trace(WeightsRef.stored(1), job(1))
    finally:
        sched.close()


def test_drain_waits_for_queued_work_and_close_fails_the_rest() -> None:
    engine = FakeEngine(delay_s=0.02)
    sched, _ = make(engine, max_batch_tokens=4)
    futs = [sched.submit(WeightsRef.stored(1), job(t)) for t in range(10)]
    assert sched.drain(10)
    assert all(f.done() and f.exception() is None for f in futs)
    sched.close()
    from oldlogit.contract.errors import Unavailable

    with pytest.raises(Unavailable):
        sched.submit(WeightsRef.stored(1), job(1))


def test_version_switches_are_minimised() -> None:
    engine = FakeEngine()
    engine.gate.clear()
    sched, store = make(engine, max_wait_s=0.0, max_batch_tokens=8)
    try:
        sched.submit(WeightsRef.stored(1), job(0))
        assert engine.entered.wait(10)
        futs = [
            sched.submit(WeightsRef.stored(v), job(t)) for t in range(1, 9) for v in (1, 2)
        ]  # interleaved
        engine.gate.set()
        for f in futs:
            f.result(10)
        acq = store.acquired
        switches = sum(1 for a, b in itertools.pairwise(acq) if a != b)
        assert switches <= 2, store.acquired
    finally:
        sched.close()


class SlowColdStore(FakeStore):
    """Version 9 takes a while to load (a cold version); every other one is resident."""

    def __init__(self) -> None:
        super().__init__()
        self.cold_gate = threading.Event()
        self.loading = threading.Event()  # the load stage is inside version 9's hold

    def resident(self, version: int) -> bool:
        return version != 9 or super().resident(version)

    def hold(self, version: int, wanted: AbstractSet[int] = frozenset()) -> None:
        if version == 9:
            self.loading.set()
            assert self.cold_gate.wait(10)
        super().hold(version, wanted)


def test_a_hot_version_is_served_while_a_cold_one_loads() -> None:
    """The load stage makes the cold version resident; the compute stage keeps serving."""
    engine = FakeEngine()
    store = SlowColdStore()
    sched, _ = make(engine, store, max_wait_s=0.0)
    try:
        cold = sched.submit(WeightsRef.stored(9), job(0))
        assert store.loading.wait(10)  # the loader is now stuck loading 9
        hot = [sched.submit(WeightsRef.stored(1), job(t)) for t in range(1, 6)]
        for t, f in enumerate(hot, start=1):
            assert f.result(5).tolist()[0] == 1000.0 + t
        assert not cold.done()
        assert sched.load_waiting() == 1
        store.cold_gate.set()
        assert cold.result(10).tolist()[0] == 9000.0
        assert 9 in store.held
    finally:
        store.cold_gate.set()
        sched.close()
    assert sorted(store.released) == sorted(store.held)  # every hold let go at the end


class EvictedOnTheWayStore(FakeStore):
    """Version 5 looks resident to the compute stage's choice, but a load evicts it before
    the compute stage can pin it; after that it is resident only once held."""

    def __init__(self) -> None:
        super().__init__()
        self.evicted = False

    def resident(self, version: int) -> bool:
        if version != 5:
            return True  # every other version is resident
        return not self.evicted or super().resident(version)

    def pin_resident(self, version: int) -> bool:
        if version == 5 and not self.evicted:
            self.evicted = True  # a load took it just now
            return False
        if version == 5:
            return super().pin_resident(version)
        self.pinned.append(version)
        return True

    @contextmanager
    def acquire(self, version: int, uses: int = 1) -> Iterator[Mapping[str, Any]]:
        # The store would load inline here: the compute stage must never acquire a version
        # that neither the load stage holds nor it pinned itself.
        assert version in self.pinned or super().resident(version), f"inline load of {version}"
        with super().acquire(version, uses) as w:
            yield w


def test_a_version_evicted_between_choice_and_pin_goes_back_to_the_load_stage() -> None:
    engine = FakeEngine()
    store = EvictedOnTheWayStore()
    sched, _ = make(engine, store, max_wait_s=0.0)
    try:
        futs = [sched.submit(WeightsRef.stored(5), job(t)) for t in range(3)]
        hot = sched.submit(WeightsRef.stored(1), job(9))  # resident, unheld: pinned by compute
        assert [f.result(5).tolist()[0] for f in futs] == [5000.0, 5001.0, 5002.0]
        assert hot.result(5).tolist()[0] == 1009.0
        assert store.evicted and 5 in store.held  # the load stage brought it back
    finally:
        sched.close()
    assert not store.pinned and 1 in store.unpinned  # every pin of the compute stage let go
    assert sorted(store.released) == sorted(store.held)


def test_a_failed_load_fails_that_version_only() -> None:
    engine = FakeEngine()
    sched, _ = make(engine, max_wait_s=0.0)
    try:
        missing = [sched.submit(WeightsRef.stored(404), job(t)) for t in range(3)]
        fine = sched.submit(WeightsRef.stored(2), job(7))
        for f in missing:
            with pytest.raises(UnknownVersion):
                f.result(10)
        assert fine.result(10).tolist()[0] == 2007.0
        assert sched.depth == 0
    finally:
        sched.close()


def test_proxy_weights_run_through_the_same_queue() -> None:
    """An EWMA-style proxy (resident tensors named by their hash) is batched, bounded and
    deadline-checked like a version, with its own resident weights."""
    engine = FakeEngine()
    engine.gate.clear()
    sched, store = make(engine, max_queue=2, max_wait_s=0.0, max_batch_tokens=4)
    proxy = WeightsRef.proxy("ewma-77", {"version": 77})
    try:
        blocker = sched.submit(WeightsRef.stored(1), job(0))
        assert engine.entered.wait(10)
        proxied = sched.submit(proxy, job(3))
        sched.submit(WeightsRef.proxy("ewma-77", {"version": 77}), job(4))
        with pytest.raises(Overloaded):
            sched.submit(proxy, job(5))  # the queue bound holds
        with pytest.raises(ValueError):
            _ = proxy.store_version  # a proxy is never a store version
        engine.gate.set()
        assert proxied.result(10).tolist()[0] == 77003.0  # ran with the proxy's weights
        blocker.result(10)
        assert store.held == [1] and store.acquired == [1]  # the proxy never came from the store
    finally:
        engine.gate.set()
        sched.close()


class RoomyStore(FakeStore):
    """A store whose device budget has room to spare (``has_room``) while ``room`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.room = True

    def has_room(self) -> bool:
        return self.room


def _held_while_one_computes(store: FakeStore, prefetch: int, want: list[int]) -> None:
    """A batch computes on version 1 (held in the engine); versions 2 and 3 wait. The load
    stage ends up holding ``want`` and no more meanwhile; then every request is answered."""
    engine = FakeEngine()
    sched = Scheduler(
        engine,  # type: ignore[arg-type]
        store,  # type: ignore[arg-type]
        policy=BatchPolicy(max_batch_tokens=64, max_wait_s=0.0, max_switch_delay_s=60.0),
        max_queue=100,
        prefetch=prefetch,
    )
    try:
        engine.gate.clear()  # the batch on version 1 stays in the engine
        first = sched.submit(WeightsRef.stored(1), job(0))
        end = time.monotonic() + 5
        while 1 not in store.held and time.monotonic() < end:
            time.sleep(0.005)
        waiting = [sched.submit(WeightsRef.stored(v), job(v)) for v in (2, 3)]
        end = time.monotonic() + 10
        while sorted(store.held) != want and time.monotonic() < end:
            time.sleep(0.005)
        time.sleep(0.2)  # and no more than that meanwhile
        assert sorted(store.held) == want
        engine.gate.set()
        assert first.result(5).tolist()[0] == 1000.0
        assert [f.result(5).tolist()[0] for f in waiting] == [2002.0, 3003.0]
    finally:
        engine.gate.set()
        sched.close()


@pytest.mark.parametrize("room", [True, False])
def test_the_loader_brings_in_waited_for_versions_while_the_budget_has_room(room: bool) -> None:
    """With room in the budget both waiting versions are loaded while another computes (past
    ``prefetch``); without, at most ``prefetch`` versions are held."""
    store = RoomyStore()
    store.room = room
    _held_while_one_computes(store, prefetch=1, want=[1, 2, 3] if room else [1])


class ColdRoomStore(FakeStore):
    """A store that says how many versions fit beside its hot ones (``cold_room``)."""

    def __init__(self, room: tuple[int, frozenset[int]] | None) -> None:
        super().__init__()
        self.room = room

    def cold_room(self) -> tuple[int, frozenset[int]] | None:
        return self.room


@pytest.mark.parametrize(
    ("room", "want"),
    [
        (None, [1, 2, 3]),  # the source cannot say: prefetch alone bounds the load stage
        ((2, frozenset({7})), [1]),  # room for two beside the hot 7: one held + one loading
        ((3, frozenset({7})), [1, 2]),
        ((2, frozenset({1})), [1, 2]),  # 1 is hot itself: it does not take a cold slot
    ],
)
def test_the_loader_holds_no_more_cold_versions_than_fit_beside_the_hot_ones(
    room: tuple[int, frozenset[int]] | None, want: list[int]
) -> None:
    """A batch computes on version 1; versions 2 and 3 wait. The load stage holds at most
    ``prefetch`` (3) versions, and of the versions that are not hot no more than fit beside
    the hot ones with one loading: the others wait rather than push a hot version out."""
    _held_while_one_computes(ColdRoomStore(room), prefetch=3, want=want)
