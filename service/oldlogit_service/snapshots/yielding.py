"""Hot traffic first: background work yields to forwards, in bounded turns.

In: the compute stage's forwards (``Foreground.forward`` around each batch, ``demand`` while
batches of resident versions wait in its queue) and the background work of the store — loads
and rebuilds (keyframe reads, hash checks, patch decoding and scatters), re-keying and the
sweeps' rewrites — run inside ``Foreground.background`` on their own threads. Out: that work
pauses at ``point()`` (called between chunks of a few MiB by the leaves that do it: ``persist``,
``buffers``, ``codec``) while a forward runs or waits, so a forward of a resident version has
the cores to itself instead of sharing them (on a CPU a forward's intra-op threads use every
core, and a load beside it slows it by more than the load's own CPU: its threads wait for one
another, and both stream memory).

Never starved: a background thread pauses at most ``max_yield_s`` (in all, since its last
turn) before it is owed a **turn**: the next forward waits to start until the background has
run ``turn_s`` of its chunks (then it pauses again). So a cold request's load progresses by at
least ``turn_s`` every ``max_yield_s`` plus one forward, however busy the hot version is, and a
forward waits for a turn at most ``turn_s`` + ``max_yield_s`` (it goes once the turn has run
``turn_s``: at the background's next point, or when that time is up). Turns never overlap a
forward. As a safety valve no point pauses longer than ``max_pause_s``. A point in a thread
running a forward (the lagging model advances in the compute stage) and a point outside
``background`` do nothing; a disabled ``Foreground`` (in front of a GPU the forwards do not
run on the host's cores) never pauses anything.

A leaf: imports nothing of the service.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

__all__ = ["MAX_PAUSE_S", "MAX_YIELD_S", "TURN_S", "Foreground", "point"]

# A background thread pauses at most this long in all (since its last turn) before its turn.
MAX_YIELD_S = 0.1
# How long a turn lets the background run while forwards wait.
TURN_S = 0.03
# No point pauses longer than this, whatever runs: a safety valve (the forwards the background
# waits for never wait on it for longer than a turn, so this is not how turns come).
MAX_PAUSE_S = 5.0

_local = threading.local()


def point() -> None:
    """Between two chunks of background work: pause while a forward runs or waits (bounded,
    see the module docstring). A no-op outside ``Foreground.background``."""
    fg: Foreground | None = getattr(_local, "foreground", None)
    if fg is not None:
        fg._point()


@dataclass
class _Thread:
    """A background thread's standing (guarded by the Foreground's lock)."""

    paused: float = 0.0  # seconds paused since its last turn


@dataclass
class YieldStats:
    paused_s: float = 0.0  # background seconds spent paused for forwards
    pauses: int = 0  # points that paused
    turns: int = 0  # turns taken (a forward waited for the background)
    forward_waits: int = 0  # forwards that waited for a turn
    forward_wait_s: float = 0.0
    overdue: int = 0  # pauses cut short by max_pause_s


class Foreground:
    """Forwards first, background work in bounded turns (module docstring)."""

    def __init__(
        self,
        *,
        enabled: bool = True,
        max_yield_s: float = MAX_YIELD_S,
        turn_s: float = TURN_S,
        max_pause_s: float = MAX_PAUSE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_yield_s < 0 or turn_s <= 0 or max_pause_s <= 0:
            raise ValueError("max_yield_s must be >= 0, turn_s and max_pause_s > 0")
        self.enabled = enabled
        self.max_yield_s = max_yield_s
        self.turn_s = turn_s
        self.max_pause_s = max_pause_s
        self._clock = clock
        self._cond = threading.Condition()
        self._running: dict[int, int] = {}  # thread ident -> forwards it runs now
        self._waiting = False  # batches of resident versions queued (the scheduler says)
        self._turn: int | None = None  # the background thread whose turn it is
        self._turn_until = 0.0
        self._owed: set[int] = set()  # background threads whose turn is due
        self._threads: dict[int, _Thread] = {}
        self._paused = 0  # background threads paused at a point now
        self._forwards_waiting = 0  # forwards waiting for a turn to end
        self.stats = YieldStats()

    def counters(self) -> YieldStats:
        """A copy of ``stats`` as of now (they change under the lock)."""
        with self._cond:
            return dataclasses.replace(self.stats)

    def state(self) -> dict[str, int]:
        """Now: forwards running and waiting for a turn, batches queued (0/1), background
        threads paused, owed a turn, in a turn (0/1)."""
        with self._cond:
            return {
                "running": sum(self._running.values()),
                "forwards_waiting": self._forwards_waiting,
                "queued": int(self._waiting),
                "paused": self._paused,
                "owed": len(self._owed),
                "turn": int(self._turn is not None),
            }

    # -- the compute stage ------------------------------------------------------------------
    def demand(self, waiting: bool) -> None:
        """Whether batches of resident versions are queued (the scheduler, as its queue
        changes): background work pauses for them as for a running forward."""
        with self._cond:
            if waiting != self._waiting:
                self._waiting = waiting
                self._cond.notify_all()

    @contextlib.contextmanager
    def forward(self) -> Iterator[None]:
        """Around one forward: waits while a background turn runs or is due (at most
        ``turn_s`` plus ``max_yield_s``), then background work pauses until it ends."""
        me = threading.get_ident()
        with self._cond:
            if self.enabled and self._turn_due_locked():
                start = now = self._clock()
                # Bounded whatever the background does: a turn ends at its next point.
                deadline = now + self.turn_s + self.max_yield_s
                self._forwards_waiting += 1
                while self._turn_due_locked() and now < deadline:
                    until = deadline if self._turn is None else min(deadline, self._turn_until)
                    self._cond.wait(max(0.001, until - now))
                    now = self._clock()
                self._forwards_waiting -= 1
                self.stats.forward_waits += 1
                self.stats.forward_wait_s += now - start
            self._running[me] = self._running.get(me, 0) + 1
        try:
            yield
        finally:
            with self._cond:
                n = self._running[me] - 1
                if n:
                    self._running[me] = n
                else:
                    del self._running[me]
                self._cond.notify_all()

    def _turn_due_locked(self) -> bool:
        return bool(self._owed) or (self._turn is not None and self._clock() < self._turn_until)

    # -- background work --------------------------------------------------------------------
    @contextlib.contextmanager
    def background(self) -> Iterator[None]:
        """The calling thread's work in the block yields to forwards at each ``point()``
        (nested blocks: the outermost one counts)."""
        if getattr(_local, "foreground", None) is not None:
            yield
            return
        me = threading.get_ident()
        _local.foreground = self
        try:
            yield
        finally:
            _local.foreground = None
            with self._cond:
                self._threads.pop(me, None)
                self._owed.discard(me)
                if self._turn == me:
                    self._turn = None
                self._cond.notify_all()

    def _busy_locked(self) -> bool:
        return bool(self._running) or self._waiting or self._forwards_waiting > 0

    def _point(self) -> None:
        if not self.enabled:
            return
        me = threading.get_ident()
        with self._cond:
            if me in self._running:  # a forward's own thread: nothing to yield to
                return
            now = self._clock()
            if self._turn == me:
                if now < self._turn_until:
                    return  # within its turn
                self._turn = None  # the turn is over: the forwards waiting for it go
                self._cond.notify_all()
            if not self._busy_locked():
                return
            th = self._threads.setdefault(me, _Thread())
            start = last = now
            self._paused += 1
            while self._busy_locked():
                th.paused += now - last
                last = now
                if now - start >= self.max_pause_s:
                    self.stats.overdue += 1  # a forward longer than any pause should be
                    self._owed.discard(me)
                    break
                if th.paused < self.max_yield_s:
                    self._cond.wait(self.max_yield_s - th.paused)
                elif self._turn is not None and self._turn != me and now < self._turn_until:
                    # Another thread's turn: it ends at that thread's point, or runs out.
                    self._cond.wait(self._turn_until - now)
                elif not self._running:
                    self._owed.discard(me)
                    self._turn, self._turn_until = me, now + self.turn_s
                    th.paused = 0.0
                    self.stats.turns += 1
                    break
                else:
                    self._owed.add(me)  # the next forward waits for this thread's turn
                    self._cond.wait(self.max_pause_s - (now - start))  # the forward's end
                now = self._clock()
            else:  # the forwards are done: run freely (paused time still counts to a turn)
                th.paused += now - last
                self._owed.discard(me)
            self._paused -= 1
            self.stats.pauses += 1
            self.stats.paused_s += now - start
