"""Version-aware dynamic batching: the only part that knows both the store and the engine.

In: work items (one version, one engine job, a future) from the runtime. Out: each future
resolved with the job's logprobs or failed with a mapped error. A batch never mixes versions.
``pick_batch`` (snapshot route) and ``pick_batch_lagging`` (lagging route: version order) are
the pure policies, tested with plain deques; ``Scheduler`` is the one loop that runs one on a
worker thread, so the event loop stays free while a forward runs.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Protocol

import numpy as np
import numpy.typing as npt

from oldlogit.errors import DeadlineExceeded, InternalError, OldLogitError, Overloaded, Unavailable

if TYPE_CHECKING:  # the scheduler drives them; importing them is the runtime's business
    from oldlogit_service.engine import Engine, Job
    from oldlogit_service.snapshots import SnapshotStore

logger = logging.getLogger(__name__)

Result = npt.NDArray[np.float32]


@dataclass
class WorkItem:
    version: int
    job: Job
    future: Future[Result]
    enqueued_at: float  # time.monotonic()
    deadline: float | None = None  # time.monotonic() after which nobody waits for it
    ntokens: int = 0


@dataclass
class BatchPolicy:
    max_batch_tokens: int = 65536  # sum of sequence lengths in one batch (at least one item)
    max_wait_s: float = 0.002  # how long the first item may wait for company
    # Stay on the resident version to save weight switches, unless another version's oldest
    # item has waited this long: bounds starvation.
    max_switch_delay_s: float = 0.05


def pick_batch(
    queues: dict[int, deque[WorkItem]],
    *,
    current: int | None,
    now: float,
    policy: BatchPolicy,
) -> tuple[int, list[WorkItem]] | None:
    """Pop the next batch (one version, FIFO within it) from ``queues``; None if all empty.

    Order: the version the engine used last, while it has work and no other version starves;
    otherwise the version whose oldest item has waited longest.
    """
    live = {v: q for v, q in queues.items() if q}
    if not live:
        return None
    oldest = min(live, key=lambda v: live[v][0].enqueued_at)
    starving = now - live[oldest][0].enqueued_at >= policy.max_switch_delay_s
    if current in live and not (starving and oldest != current):
        version = current
    else:
        version = oldest
    return version, _fill(queues, version, policy)


def pick_batch_lagging(
    queues: dict[int, deque[WorkItem]],
    *,
    current: int | None,
    now: float,
    policy: BatchPolicy,
) -> tuple[int, list[WorkItem]] | None:
    """The lagging route's policy: the smallest queued version first, FIFO within it.

    The lagging model only moves forward, so serving in version order lets it advance one
    patch at a time; a request for a version it has passed is still served first among what is
    queued (by the snapshot path). Same signature as ``pick_batch``; ``current`` and ``now``
    do not matter here.
    """
    del current, now
    live = [v for v, q in queues.items() if q]
    if not live:
        return None
    version = min(live)
    return version, _fill(queues, version, policy)


def _fill(queues: dict[int, deque[WorkItem]], version: int, policy: BatchPolicy) -> list[WorkItem]:
    """Pop one version's items, FIFO, within the token budget (at least one)."""
    q = queues[version]
    batch = [q.popleft()]
    tokens = batch[0].ntokens
    while q and tokens + q[0].ntokens <= policy.max_batch_tokens:
        item = q.popleft()
        tokens += item.ntokens
        batch.append(item)
    if not q:
        del queues[version]
    return batch


class SchedulerObserver(Protocol):
    def on_queue_wait(self, seconds: float) -> None: ...
    def on_batch(self, version: int, items: int, tokens: int, seconds: float) -> None: ...


class _NullObserver:
    def on_queue_wait(self, seconds: float) -> None:
        pass

    def on_batch(self, version: int, items: int, tokens: int, seconds: float) -> None:
        pass


def map_exception(exc: BaseException) -> OldLogitError:
    """The one boundary where foreign exceptions become errors of the tree."""
    if isinstance(exc, OldLogitError):
        return exc
    logger.exception("batch failed", exc_info=exc)
    return InternalError(f"the forward failed: {type(exc).__name__}")


@dataclass
class _State:
    queues: dict[int, deque[WorkItem]] = field(default_factory=dict)
    depth: int = 0
    queued_tokens: int = 0
    running: bool = False  # a batch is being executed
    current: int | None = None


class Scheduler:
    """Queues work per version and runs batches on one worker thread."""

    def __init__(
        self,
        engine: Engine,
        store: SnapshotStore,
        *,
        policy: BatchPolicy,
        max_queue: int,
        observer: SchedulerObserver | None = None,
        clock: Callable[[], float] = time.monotonic,
        strategy: Literal["snapshot", "lagging"] = "snapshot",
    ) -> None:
        """``strategy="lagging"``: batches in version order, weights from the store's lagging
        model (``SnapshotStore.acquire_lagging``)."""
        self._engine = engine
        self._store = store
        self._lagging = strategy == "lagging"
        self._pick = pick_batch_lagging if self._lagging else pick_batch
        self._policy = policy
        self._max_queue = max_queue
        self._observer = observer or _NullObserver()
        self._clock = clock
        self._state = _State()
        self._cond = threading.Condition()
        self._closed = False
        self._avg_batch_s = 0.05  # running estimate, for Retry-After
        self._thread = threading.Thread(target=self._loop, name="oldlogit-scheduler", daemon=True)
        self._thread.start()

    # -- producer side -------------------------------------------------------------------
    def submit(self, version: int, job: Job, *, deadline: float | None = None) -> Future[Result]:
        fut: Future[Result] = Future()
        item = WorkItem(
            version=version,
            job=job,
            future=fut,
            enqueued_at=self._clock(),
            deadline=deadline,
            ntokens=int(job.token_ids.shape[0]),
        )
        with self._cond:
            if self._closed:
                raise Unavailable("the service is shutting down", retry_after_s=1.0)
            if self._state.depth >= self._max_queue:
                raise Overloaded(
                    f"the queue is full ({self._max_queue} jobs); retry later",
                    retry_after_s=self._retry_after(),
                )
            self._state.queues.setdefault(version, deque()).append(item)
            self._state.depth += 1
            self._state.queued_tokens += item.ntokens
            self._cond.notify()
        return fut

    def _retry_after(self) -> float:
        batches = max(1, self._state.queued_tokens // max(1, self._policy.max_batch_tokens))
        return round(min(30.0, max(0.1, batches * self._avg_batch_s)), 3)

    @property
    def depth(self) -> int:
        return self._state.depth

    @property
    def queued_tokens(self) -> int:
        return self._state.queued_tokens

    def drain(self, timeout_s: float) -> bool:
        """Wait until every queued job is done (or ``timeout_s``); True when drained."""
        end = time.monotonic() + timeout_s
        with self._cond:
            while self._state.depth or self._state.running:
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, 0.05))
        return True

    def close(self) -> None:
        with self._cond:
            self._closed = True
            pending = [it for q in self._state.queues.values() for it in q]
            self._state.queues.clear()
            self._state.depth = 0
            self._state.queued_tokens = 0
            self._cond.notify_all()
        for it in pending:
            if not it.future.done():
                it.future.set_exception(Unavailable("the service shut down", retry_after_s=1.0))
        self._thread.join(timeout=10)

    # -- worker side ---------------------------------------------------------------------
    def _take(self) -> tuple[int, list[WorkItem]] | None:
        """Wait for a batch worth running; None when closed."""
        with self._cond:
            while True:
                if self._closed:
                    return None
                st = self._state
                if st.depth == 0:
                    self._cond.wait(0.5)
                    continue
                now = self._clock()
                oldest = min(q[0].enqueued_at for q in st.queues.values() if q)
                waited = now - oldest
                if waited < self._policy.max_wait_s and st.queued_tokens < (
                    self._policy.max_batch_tokens
                ):
                    self._cond.wait(self._policy.max_wait_s - waited)
                    continue
                picked = self._pick(st.queues, current=st.current, now=now, policy=self._policy)
                if picked is None:  # pragma: no cover - depth said otherwise
                    continue
                version, items = picked
                st.depth -= len(items)
                st.queued_tokens -= sum(it.ntokens for it in items)
                st.running = True
                st.current = version
                return version, items

    def _loop(self) -> None:
        while True:
            picked = self._take()
            if picked is None:
                return
            version, items = picked
            try:
                self._run(version, items)
            finally:
                with self._cond:
                    self._state.running = False
                    self._cond.notify_all()

    def _run(self, version: int, items: list[WorkItem]) -> None:
        now = self._clock()
        live: list[WorkItem] = []
        for it in items:
            if not it.future.set_running_or_notify_cancel():
                continue  # the client went away: drop it
            if it.deadline is not None and now > it.deadline:
                it.future.set_exception(
                    DeadlineExceeded("the request's deadline passed while it was queued")
                )
                continue
            self._observer.on_queue_wait(now - it.enqueued_at)
            live.append(it)
        if not live:
            return
        start = time.perf_counter()
        try:
            acquire = self._store.acquire_lagging if self._lagging else self._store.acquire
            with acquire(version) as weights:
                outs = self._engine.run(weights, [it.job for it in live])
        except BaseException as exc:
            err = map_exception(exc)
            for it in live:
                it.future.set_exception(err)
            return
        elapsed = time.perf_counter() - start
        self._avg_batch_s = 0.8 * self._avg_batch_s + 0.2 * elapsed
        for it, out in zip(live, outs, strict=True):
            it.future.set_result(out.numpy())
        self._observer.on_batch(version, len(live), sum(it.ntokens for it in live), elapsed)
