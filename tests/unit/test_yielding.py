"""Background work yields to forwards in bounded turns (snapshots/yielding.py), by construction:
real threads, events for the order of things, never the machine's speed."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from oldlogit_service.snapshots import yielding
from oldlogit_service.snapshots.yielding import Foreground

# Long enough that no turn comes due while a test holds a forward (turns are tested apart).
NEVER = 3600.0


def _wait_for(cond: Callable[[], bool], timeout_s: float = 30.0) -> None:
    end = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.002)


def _background_points(fg: Foreground, n: int, log: list[str], done: threading.Event) -> None:
    with fg.background():
        for i in range(n):
            yielding.point()
            log.append(f"chunk {i}")
    done.set()


def test_a_point_outside_background_work_never_pauses() -> None:
    fg = Foreground(max_yield_s=NEVER)
    with fg.forward():
        out: list[int] = []
        t = threading.Thread(target=lambda: (yielding.point(), out.append(1)))
        t.start()
        t.join(30)
        assert out == [1]  # no background block in that thread: the point did nothing
    assert fg.stats.pauses == 0


def test_background_work_pauses_while_a_forward_runs_and_goes_on_after() -> None:
    fg = Foreground(max_yield_s=NEVER)
    log: list[str] = []
    done = threading.Event()
    release = threading.Event()
    in_forward = threading.Event()

    def forward() -> None:
        with fg.forward():
            in_forward.set()
            release.wait(30)
            log.append("forward ends")

    f = threading.Thread(target=forward)
    f.start()
    in_forward.wait(30)
    b = threading.Thread(target=_background_points, args=(fg, 3, log, done))
    b.start()
    _wait_for(lambda: fg.state()["paused"] == 1)  # stopped at its first point
    assert log == []
    release.set()
    f.join(30)
    assert done.wait(30)
    # Not one chunk ran beside the forward; all of them after it.
    assert log == ["forward ends", "chunk 0", "chunk 1", "chunk 2"]
    assert fg.stats.pauses == 1 and fg.stats.turns == 0


def test_background_work_pauses_for_a_queued_forward_of_a_resident_version() -> None:
    fg = Foreground(max_yield_s=NEVER)
    fg.demand(True)  # the scheduler: a batch of a resident version waits for the compute stage
    log: list[str] = []
    done = threading.Event()
    b = threading.Thread(target=_background_points, args=(fg, 2, log, done))
    b.start()
    _wait_for(lambda: fg.state()["paused"] == 1)
    assert log == []
    fg.demand(False)
    assert done.wait(30)
    assert log == ["chunk 0", "chunk 1"]


def test_a_point_in_the_forwards_own_thread_does_nothing() -> None:
    # The lagging model advances in the compute stage, inside its forward: it must not wait
    # for itself.
    fg = Foreground(max_yield_s=NEVER)
    with fg.forward(), fg.background():
        yielding.point()
        yielding.point()
    assert fg.stats.pauses == 0


def test_a_disabled_foreground_never_pauses() -> None:
    fg = Foreground(enabled=False, max_yield_s=NEVER)
    fg.demand(True)
    with fg.background():
        yielding.point()
    assert fg.stats.pauses == 0


def test_a_starved_background_gets_a_turn_the_next_forward_waits_for() -> None:
    # The background has paused max_yield_s: it is owed a turn. The forward running ends with
    # the next batch queued; that forward waits until the background's turn is over (here: it
    # leaves its block).
    fg = Foreground(max_yield_s=0.01, turn_s=NEVER)
    order: list[str] = []
    release = threading.Event()
    in_forward = threading.Event()
    turn_taken = threading.Event()
    finish = threading.Event()

    def first_forward() -> None:
        with fg.forward():
            in_forward.set()
            release.wait(30)
            order.append("first forward ends")

    def background() -> None:
        with fg.background():
            yielding.point()  # pauses, is owed a turn, takes it once the forward ends
            order.append("background's turn")
            turn_taken.set()
            finish.wait(30)
            yielding.point()  # within its turn: no pause
            order.append("background ends")

    f = threading.Thread(target=first_forward)
    f.start()
    in_forward.wait(30)
    b = threading.Thread(target=background)
    b.start()
    _wait_for(lambda: fg.state()["owed"] == 1)  # owed, waiting for the running forward
    fg.demand(True)  # the next batch is queued
    release.set()
    f.join(30)
    assert turn_taken.wait(30)

    def second_forward() -> None:
        fg.demand(False)  # the compute stage took the batch
        with fg.forward():
            order.append("second forward")

    s = threading.Thread(target=second_forward)
    s.start()
    _wait_for(lambda: fg.state()["forwards_waiting"] == 1)  # held back by the turn
    finish.set()
    b.join(30)
    s.join(30)
    assert order == [
        "first forward ends",
        "background's turn",
        "background ends",
        "second forward",
    ]
    assert fg.stats.turns == 1 and fg.stats.forward_waits == 1


def test_a_forward_waits_for_a_turn_only_a_bounded_time() -> None:
    # A background thread whose turn came but never reaches another point (one long chunk):
    # the forward goes after turn_s (+ max_yield_s), not when the chunk ends.
    fg = Foreground(max_yield_s=0.0, turn_s=0.05)
    took = threading.Event()
    finish = threading.Event()
    fg.demand(True)

    def background() -> None:
        with fg.background():
            yielding.point()  # busy (demand), paused 0 >= max_yield 0: its turn at once
            took.set()
            finish.wait(30)

    b = threading.Thread(target=background)
    b.start()
    assert took.wait(30)
    fg.demand(False)
    ran = threading.Event()

    def forward() -> None:
        with fg.forward():
            ran.set()

    f = threading.Thread(target=forward)
    f.start()
    assert ran.wait(30)  # while the background's chunk still runs
    finish.set()
    b.join(30)
    f.join(30)
    assert fg.stats.forward_waits == 1


def test_a_cold_load_finishes_beside_back_to_back_forwards() -> None:
    # Forwards run back to back without a gap the background could use; it still finishes,
    # in turns (bounded: at least turn_s of its work per max_yield_s and one forward).
    fg = Foreground(max_yield_s=0.005, turn_s=0.002)
    fg.demand(True)  # and a batch always queued: no moment is free
    stop = threading.Event()
    forwards = [0]

    def hot() -> None:
        while not stop.is_set():
            with fg.forward():
                time.sleep(0.002)
                forwards[0] += 1

    h = threading.Thread(target=hot)
    h.start()
    try:
        _wait_for(lambda: forwards[0] > 0)
        log: list[str] = []
        done = threading.Event()
        b = threading.Thread(target=_background_points, args=(fg, 20, log, done))
        b.start()
        assert done.wait(60)
        assert len(log) == 20
        assert fg.stats.turns >= 1 and fg.stats.overdue == 0
    finally:
        stop.set()
        h.join(30)


def test_rejects_bad_settings() -> None:
    with pytest.raises(ValueError):
        Foreground(turn_s=0)
    with pytest.raises(ValueError):
        Foreground(max_yield_s=-1)


def test_a_real_stores_load_and_keyframe_move_yield_and_keep_every_bit(tmp_path: Path) -> None:
    # A real store, real files: a cold version's load (keyframe read, patches decoded and
    # applied, hash checks) pauses while a forward runs, then finishes with the version's own
    # bytes; a keyframe move (re-keying) pauses the same way and keeps every version bitwise.
    from .test_store_delta import assert_all_served, open_store, trace

    ws = trace(6, 3, fractions=[0.02, 0.3])
    with open_store(tmp_path / "s", keyframe_every=16) as s:
        for v, w in enumerate(ws):
            s.publish(v, w)
        fg = s.foreground
        fg.max_yield_s = NEVER  # no turn: everything waits for the forward
        s.residency.clear()
        s.rebuilder._verified.clear()  # the load checks every hash, as after a restart
        release = threading.Event()
        in_forward = threading.Event()

        def forward() -> None:
            with fg.forward():
                in_forward.set()
                release.wait(30)

        f = threading.Thread(target=forward)
        f.start()
        in_forward.wait(30)
        loaded = threading.Event()

        def load() -> None:
            s.hold(5)  # the scheduler's load stage: version 5, a patch chain on version 0
            loaded.set()

        b = threading.Thread(target=load)
        b.start()
        _wait_for(lambda: fg.state()["paused"] == 1)
        assert not loaded.is_set()
        release.set()
        f.join(30)
        assert loaded.wait(30)
        b.join(30)
        s.unhold(5)
        assert s.rebuilder.counters["patches_applied"] == 5
        assert_all_served(s, {5: ws[5]})

        for _ in range(4):  # rebuilds asked for at the newest versions: the keyframe moves
            for v in (4, 5):
                s.evict(v)
                with s.acquire(v):
                    pass
        release.clear()
        in_forward.clear()
        f = threading.Thread(target=forward)
        f.start()
        in_forward.wait(30)
        moved: list[bool] = []
        m = threading.Thread(target=lambda: moved.append(s.move_keyframe()))
        m.start()
        _wait_for(lambda: fg.state()["paused"] == 1)
        assert not moved
        release.set()
        f.join(30)
        m.join(60)
        assert moved == [True]
        assert s.info(0).kind == "patch"
        s.residency.clear()
        assert_all_served(s, dict(enumerate(ws)))
