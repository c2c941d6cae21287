"""Version-aware batching in two stages: loads and forwards never wait on each other.

In: work items (a weights reference, one engine job, a future) from the runtime. Out: each future
resolved with the job's logprobs — or, for a trace job, the stages of its forward
(``Engine.trace``, run beside the batch under the same weights) — or failed with a mapped error.
A batch never mixes versions.
The **load stage** (a thread) looks ahead over the queue and makes the versions the next
batches need device-resident, holding each until its queued work is done (``prefetch``
versions ahead, and more while the device budget has room for one without evicting anything:
it never idles while a queued version could come in for free); the **compute stage** (another
thread) runs batches only of versions already held, so a hot version keeps being served while a
cold one loads. Hot traffic first: where the store has a ``foreground``
(``snapshots/yielding.py``), each batch runs inside its ``forward()`` and the scheduler tells it
whenever batches of resident versions are queued (``demand``), so the store's background work —
the load stage's loads, rebuilds, re-keying, sweeps — pauses between chunks for them, in turns
bounded so a cold version still loads. ``pick_batch`` / ``pick_batch_lagging`` / ``pick_load``
are the pure policies, tested with plain deques. A job names its weights by ``WeightsRef``: a
store version (the load stage makes it resident), or a proxy policy's resident tensors (the
EWMA average) named by their weight hash.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from collections.abc import Set as AbstractSet
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Generic, Literal, NamedTuple, Protocol, TypeVar

import numpy as np
import numpy.typing as npt
import torch

from oldlogit.contract.errors import (
    DeadlineExceeded,
    InternalError,
    OldLogitError,
    Overloaded,
    Unavailable,
)

if TYPE_CHECKING:  # the scheduler drives them; importing them is the runtime's business
    from typing_extensions import TypeIs

    from oldlogit.parity.trace import TraceStage
    from oldlogit_service.model.engine import Job, Scored
    from oldlogit_service.snapshots.yielding import Foreground

logger = logging.getLogger(__name__)


class Routed(NamedTuple):
    """A scoring job's logprobs and the MoE routing its forward used (``Job.record_routing``:
    [T − 1, L, k] int32)."""

    logprobs: npt.NDArray[np.float32]
    routing: npt.NDArray[np.int32]


Result = npt.NDArray[np.float32] | Routed  # a scoring job's logprobs (and routing, if asked)
Stages = list["TraceStage"]  # a trace job's stages, in forward order
R = TypeVar("R")
T = TypeVar("T")
K = TypeVar("K")  # a queue's key: ``WeightsRef`` in the scheduler, anything hashable in tests


@dataclass(frozen=True)
class WeightsRef:
    """The weights a job runs under, by reference; the scheduler's queues are keyed by it.

    A store version (``stored``): the load stage makes it device-resident before its batches
    run. A proxy (``proxy``): tensors resident already (the EWMA average), named by their
    weight hash, so two requests under the same average share a queue and a batch, and a new
    average is a new queue. Equality and hashing ignore the tensors themselves.
    """

    version: int | None  # the store version; None for a proxy
    sha256: str = ""  # a proxy's weight hash (a stored version is named by its number)
    tensors: Mapping[str, torch.Tensor] | None = field(
        default=None, compare=False, hash=False, repr=False
    )

    @classmethod
    def stored(cls, version: int) -> WeightsRef:
        return cls(int(version))

    @classmethod
    def proxy(cls, sha256: str, tensors: Mapping[str, torch.Tensor]) -> WeightsRef:
        return cls(None, sha256, tensors)

    @property
    def loads(self) -> bool:
        """Whether the load stage brings it in (a store version) or it is resident (a proxy)."""
        return self.tensors is None

    @property
    def store_version(self) -> int:
        if self.version is None:
            raise ValueError(f"{self!r} is not a store version")
        return self.version


class Forward(Protocol):
    """What the compute stage runs batches on: ``model.engine.Engine``, or one spread over
    tensor-parallel ranks (``ranks.front.ShardedEngine``)."""

    def run(self, weights: Mapping[str, torch.Tensor], jobs: list[Job]) -> list[torch.Tensor]: ...

    def score(self, weights: Mapping[str, torch.Tensor], jobs: list[Job]) -> list[Scored]: ...

    def trace(self, weights: Mapping[str, torch.Tensor], job: Job) -> list[TraceStage]: ...


class WeightsSource(Protocol):
    """What the scheduler needs from the snapshot store (``SnapshotStore`` implements it)."""

    def hold(self, version: int, wanted: AbstractSet[int] = frozenset()) -> None:
        """Make ``version`` device-resident and keep it so until ``unhold`` (may load). If
        room must be made, versions in ``wanted`` (queued work needs them) go last."""
        ...

    def unhold(self, version: int) -> None: ...

    def resident(self, version: int) -> bool:
        """Device-resident right now (an acquire would not load)."""
        ...

    def pin_resident(self, version: int) -> bool:
        """Pin ``version`` if it is device-resident now, loading nothing (True: pinned until
        ``unhold``). The compute stage takes a resident version it does not hold this way."""
        ...

    def has_room(self) -> bool:
        """A load now would evict nothing (the device budget has a version's room free)."""
        ...

    def cold_room(self) -> tuple[int, frozenset[int]] | None:
        """(How many versions' weights the device budget holds beside the hot versions' copies,
        the hot versions): what the load stage may hold at once without pushing out a
        version most requests ask for. None: the source cannot say (no bound)."""
        ...

    def acquire(
        self, version: int, uses: int = 1
    ) -> contextlib.AbstractContextManager[Mapping[str, torch.Tensor]]:
        """Pin ``version`` for one batch serving ``uses`` requests (they count for eviction)."""
        ...

    def acquire_lagging(
        self, version: int
    ) -> contextlib.AbstractContextManager[Mapping[str, torch.Tensor]]: ...


@dataclass
class WorkItem(Generic[R]):
    weights: WeightsRef
    job: Job
    future: Future[R]  # Result for a scoring job, Stages for a trace job (``job.trace``)
    enqueued_at: float  # time.monotonic()
    deadline: float | None = None  # time.monotonic() after which nobody waits for it
    ntokens: int = 0


Item = WorkItem[Result] | WorkItem[Stages]


def _is_trace(item: Item) -> TypeIs[WorkItem[Stages]]:
    return item.job.trace


def _attempt(fn: Callable[[], T]) -> T | OldLogitError:
    """``fn()``, or the error it failed with: one job's failure is not its neighbours'."""
    try:
        return fn()
    except Exception as exc:
        return map_exception(exc)


@dataclass
class BatchPolicy:
    max_batch_tokens: int = 65536  # sum of sequence lengths in one batch (at least one item)
    # How long the first item may wait for company — where there is a sign of any: more than
    # one item queued, or the previous batch held more than one. A lone request after a lone
    # batch (one client asking in turn, light load) runs at once: nothing shows more will come.
    max_wait_s: float = 0.002
    # Stay on the resident version to save weight switches, unless another version's oldest
    # item has waited this long: bounds starvation.
    max_switch_delay_s: float = 0.05


def pick_batch(
    queues: dict[K, deque[Item]],
    *,
    current: K | None,
    now: float,
    policy: BatchPolicy,
    ready: AbstractSet[K] | None = None,
) -> tuple[K, list[Item]] | None:
    """Pop the next batch (one version, FIFO within it) from ``queues``; None if none runs.

    Only versions in ``ready`` (None: all) are considered. Order: the version the engine used
    last, while it has work and no other version starves; otherwise the version whose oldest
    item has waited longest.
    """
    live = {v: q for v, q in queues.items() if q and (ready is None or v in ready)}
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
    queues: dict[WeightsRef, deque[Item]],
    *,
    current: WeightsRef | None,
    now: float,
    policy: BatchPolicy,
    ready: AbstractSet[WeightsRef] | None = None,
) -> tuple[WeightsRef, list[Item]] | None:
    """The lagging route's policy: the smallest queued version first, FIFO within it.

    The lagging model only moves forward, so serving in version order lets it advance one
    patch at a time; a request for a version it has passed is still served first among what is
    queued (by the snapshot path). Proxy work (resident, outside the version order) runs
    first. Same signature as ``pick_batch``; ``current``, ``now`` and ``ready`` do not matter
    here (the lagging model loads in order, in the compute stage).
    """
    del current, now, ready
    live = [w for w, q in queues.items() if q]
    if not live:
        return None
    proxies = [w for w in live if not w.loads]
    weights = proxies[0] if proxies else min(live, key=lambda w: w.store_version)
    return weights, _fill(queues, weights, policy)


def pick_load(
    queues: dict[K, deque[Item]],
    *,
    held: AbstractSet[K],
    running: object,  # the key a batch runs under now, or None
    now: float,
    policy: BatchPolicy,
    limit: int,
    resident: AbstractSet[K] = frozenset(),
    served: AbstractSet[K] | None = None,
) -> tuple[K | None, K | None]:
    """What the load stage does next: (version to make resident, held version to let go).

    The queued version whose oldest item has waited longest and is neither held nor resident
    already is loaded while fewer than ``limit`` are held; at the limit, only once that item
    has waited ``max_switch_delay_s``, and then a held version other than the running one
    (the one with the youngest work) is let go for it: no version starves behind two hot
    ones. With ``served`` (the held versions a batch has run on since they were loaded), only
    those are let go: a version loaded for queued work is not dropped before that work runs
    (under a saturated queue every item has waited long enough, and loads would replace each
    other unused). ``queues`` holds only work whose weights must be loaded (the scheduler
    leaves resident proxies out).
    """
    waiting = [v for v, q in queues.items() if q and v not in held and v not in resident]
    if not waiting:
        return None, None
    nxt = min(waiting, key=lambda v: queues[v][0].enqueued_at)
    if len(held) < limit:
        return nxt, None
    if now - queues[nxt][0].enqueued_at < policy.max_switch_delay_s:
        return None, None
    others = [v for v in held if v != running and (served is None or v in served)]
    if not others:
        return None, None
    victim = max(others, key=lambda v: queues[v][0].enqueued_at if queues.get(v) else float("inf"))
    return nxt, victim


def _fill(queues: dict[K, deque[Item]], version: K, policy: BatchPolicy) -> list[Item]:
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
    def on_batch(self, items: int, tokens: int, seconds: float) -> None: ...
    def on_load(self, seconds: float, waiting: int) -> None: ...


class _NullObserver:
    def on_queue_wait(self, seconds: float) -> None:
        pass

    def on_batch(self, items: int, tokens: int, seconds: float) -> None:
        pass

    def on_load(self, seconds: float, waiting: int) -> None:
        pass


def _score(engine: Forward, weights: Mapping[str, torch.Tensor], jobs: list[Job]) -> list[Result]:
    """One batch's answers: logprobs, with the routing for the jobs that record it."""
    if not any(job.record_routing for job in jobs):
        return [out.numpy() for out in engine.run(weights, jobs)]
    return [
        Routed(s.logprobs.numpy(), s.routing.numpy())
        if job.record_routing and s.routing is not None
        else s.logprobs.numpy()
        for job, s in zip(jobs, engine.score(weights, jobs), strict=True)
    ]


def map_exception(exc: BaseException) -> OldLogitError:
    """The one boundary where foreign exceptions become errors of the tree."""
    if isinstance(exc, OldLogitError):
        return exc
    logger.exception("batch failed", exc_info=exc)
    return InternalError(f"the forward failed: {type(exc).__name__}")


@dataclass
class _State:
    queues: dict[WeightsRef, deque[Item]] = field(default_factory=dict)
    depth: int = 0
    queued_tokens: int = 0
    running: bool = False  # a batch is being executed
    current: WeightsRef | None = None
    last_batch: int = 0  # items in the batch taken last (0: none yet)
    held: set[WeightsRef] = field(default_factory=set)  # versions the load stage holds resident
    served: set[WeightsRef] = field(default_factory=set)  # held ones a batch has run on since

    def loadable(self) -> dict[WeightsRef, deque[Item]]:
        """The queues whose weights the load stage brings in (store versions with work)."""
        return {w: q for w, q in self.queues.items() if q and w.loads}


class Scheduler:
    """Queues work per weights source; a load stage and a compute stage on two threads."""

    def __init__(
        self,
        engine: Forward,
        store: WeightsSource,
        *,
        policy: BatchPolicy,
        max_queue: int,
        observer: SchedulerObserver | None = None,
        clock: Callable[[], float] = time.monotonic,
        strategy: Literal["snapshot", "lagging"] = "snapshot",
        prefetch: int = 2,
    ) -> None:
        """``prefetch``: versions the load stage may hold for queued work at once (the batch
        running and the next ones) when loading another would evict something; while the
        store ``has_room`` it holds one more (bounded by the device budget itself). Versions
        that are not hot (the store's ``cold_room``) it holds no more of than fit beside the
        hot ones with the one loading: a queue over old versions waits its turn rather than
        pushing out the versions most requests ask for.
        ``strategy="lagging"``: batches in version order, weights from the store's lagging
        model, loaded by the compute stage itself (it advances in place)."""
        self._engine = engine
        self._store = store
        self._lagging = strategy == "lagging"
        self._pick = pick_batch_lagging if self._lagging else pick_batch
        self._policy = policy
        self._max_queue = max_queue
        self._prefetch = max(1, prefetch)
        self._observer = observer or _NullObserver()
        self._clock = clock
        self._state = _State()
        self._cond = threading.Condition()
        self._closed = False
        self._avg_batch_s = 0.05  # running estimate, for Retry-After
        # Forwards first (snapshots/yielding.py): sources without one (a test's fake store, the
        # tensor-parallel front) have no background work to pause.
        self._foreground: Foreground | None = getattr(store, "foreground", None)
        self._compute = threading.Thread(
            target=self._compute_loop, name="oldlogit-compute", daemon=True
        )
        self._loader = threading.Thread(target=self._load_loop, name="oldlogit-loader", daemon=True)
        self._compute.start()
        if not self._lagging:
            self._loader.start()

    # -- producer side -------------------------------------------------------------------
    def submit(
        self, weights: WeightsRef, job: Job, *, deadline: float | None = None
    ) -> Future[Result]:
        """Queue a scoring job to run under ``weights``."""
        if job.trace:
            raise ValueError("a trace job goes through submit_trace")
        fut: Future[Result] = Future()
        item = WorkItem(
            weights=weights,
            job=job,
            future=fut,
            enqueued_at=self._clock(),
            deadline=deadline,
            ntokens=int(job.token_ids.shape[0]),
        )
        self._enqueue(item)
        return fut

    def submit_trace(
        self, weights: WeightsRef, job: Job, *, deadline: float | None = None
    ) -> Future[Stages]:
        """Queue a trace job (``job.trace``) under ``weights``: it waits in their queue like
        any job and its future takes the stages of its forward (``Engine.trace``)."""
        if not job.trace:
            raise ValueError("submit_trace takes trace jobs (Job.trace=True)")
        fut: Future[Stages] = Future()
        item = WorkItem(
            weights=weights,
            job=job,
            future=fut,
            enqueued_at=self._clock(),
            deadline=deadline,
            ntokens=int(job.token_ids.shape[0]),
        )
        self._enqueue(item)
        return fut

    def _enqueue(self, item: Item) -> None:
        with self._cond:
            if self._closed:
                raise Unavailable("the service is shutting down", retry_after_s=1.0)
            if self._state.depth >= self._max_queue:
                raise Overloaded(
                    f"the queue is full ({self._max_queue} jobs); retry later",
                    retry_after_s=self._retry_after(),
                )
            self._state.queues.setdefault(item.weights, deque()).append(item)
            self._state.depth += 1
            self._state.queued_tokens += item.ntokens
            self._demand_locked()
            self._cond.notify_all()

    def _retry_after(self) -> float:
        batches = max(1, self._state.queued_tokens // max(1, self._policy.max_batch_tokens))
        return round(min(30.0, max(0.1, batches * self._avg_batch_s)), 3)

    @property
    def depth(self) -> int:
        return self._state.depth

    @property
    def queued_tokens(self) -> int:
        return self._state.queued_tokens

    def load_waiting(self) -> int:
        """Queued versions not resident yet (the load stage's backlog)."""
        with self._cond:
            st = self._state
            return len(st.loadable()) - len(self._resident_locked())

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
            self._demand_locked()
            self._cond.notify_all()
        for it in pending:
            if not it.future.done():
                it.future.set_exception(Unavailable("the service shut down", retry_after_s=1.0))
        self._compute.join(timeout=10)
        if self._loader.is_alive():
            self._loader.join(timeout=10)
        with self._cond:
            held, self._state.held = self._state.held, set()
        for w in held:
            self._store.unhold(w.store_version)

    # -- load stage ----------------------------------------------------------------------
    def _load_loop(self) -> None:
        # Loads (file reads, patch scatters, hashing) yield the CPU to the forwards at their
        # points (snapshots/yielding.py) and run at the compute stage's priority: in a turn the
        # forwards wait for the load, and a lower priority (nice 10 before) only let other
        # threads stretch the turn (3.6 % less throughput under the RL peer mix,
        # docs/performance.md).
        while True:
            with self._cond:
                while True:
                    if self._closed:
                        return
                    st = self._state
                    self._release_idle_locked()
                    # Free room in the budget: bring the next waited-for version in now.
                    limit = max(self._prefetch, len(st.held) + 1 if self._has_room() else 0)
                    limit = self._cold_limit(limit)
                    weights, victim = pick_load(
                        st.loadable(),  # type: ignore[arg-type]  # mypy widens K by the return's None
                        held=st.held,
                        running=st.current if st.running else None,
                        now=self._clock(),
                        policy=self._policy,
                        limit=limit,
                        resident=self._resident_locked(),
                        served=st.served,
                    )
                    if weights is not None:
                        break
                    self._cond.wait(0.5 if st.depth == 0 else self._policy.max_switch_delay_s)
                if victim is not None:
                    st.held.discard(victim)
                    st.served.discard(victim)
                wanted = {w.store_version for w in st.loadable()}
                waiting = len(wanted) - len(self._resident_locked())
            if victim is not None:
                self._store.unhold(victim.store_version)
            start = self._clock()
            try:
                self._store.hold(weights.store_version, wanted)
            except BaseException as exc:
                self._fail(weights, map_exception(exc))
                continue
            self._observer.on_load(self._clock() - start, waiting)
            with self._cond:
                if self._closed:
                    self._store.unhold(weights.store_version)
                    return
                self._state.held.add(weights)
                self._state.served.discard(weights)
                self._demand_locked()
                self._cond.notify_all()

    def _cold_limit(self, limit: int) -> int:
        """``limit`` on held versions, less where holding that many versions that are not hot
        would leave no room for the hot ones beside the version loading (``cold_room``)."""
        room = getattr(self._store, "cold_room", None)
        said: tuple[int, frozenset[int]] | None = room() if room is not None else None
        if said is None:
            return limit
        slots, hot = said
        held_hot = sum(1 for w in self._state.held if w.store_version in hot)
        return min(limit, held_hot + max(1, slots - 1))

    def _has_room(self) -> bool:
        # Sources that cannot say (a test's fake store) never have room.
        room = getattr(self._store, "has_room", None)
        return bool(room()) if room is not None else False

    def _demand_locked(self) -> None:
        """Tell the foreground whether a batch is taken or can run now (queued with resident
        weights): background work pauses for it as for a running forward."""
        if self._foreground is None:
            return
        st = self._state
        ready = st.running or any(
            q and (not w.loads or w in st.held or self._store.resident(w.store_version))
            for w, q in st.queues.items()
        )
        self._foreground.demand(ready)

    def _resident_locked(self) -> set[WeightsRef]:
        """Queued store versions whose weights are on the device already (held or not)."""
        st = self._state
        return {w for w in st.loadable() if w in st.held or self._store.resident(w.store_version)}

    def _release_idle_locked(self) -> None:
        """Let go of held versions with no queued work once the compute stage is not on them
        (they stay resident until the LRU needs the room)."""
        st = self._state
        busy = st.current if st.running else None
        for w in [w for w in st.held if not st.queues.get(w) and w != busy]:
            st.held.discard(w)
            st.served.discard(w)
            self._store.unhold(w.store_version)

    def _fail(self, weights: WeightsRef, err: OldLogitError) -> None:
        with self._cond:
            items = list(self._state.queues.pop(weights, ()))
            self._state.depth -= len(items)
            self._state.queued_tokens -= sum(it.ntokens for it in items)
            self._demand_locked()
            self._cond.notify_all()
        for it in items:
            if it.future.set_running_or_notify_cancel():
                it.future.set_exception(err)

    # -- compute stage -------------------------------------------------------------------
    def _take(self) -> tuple[WeightsRef, list[Item], bool] | None:
        """Wait for a batch worth running whose weights are resident; None when closed. The
        third field: the compute stage pinned the weights itself (``unhold`` after the batch).

        A store version runs only while pinned: held by the load stage, or resident and pinned
        here, atomically with the choice. Otherwise a load could evict it between the choice
        and the forward, and the compute stage would load it inline — waiting in admission
        while the load stage, waiting in its own, holds the versions that would make room."""
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
                lone = st.depth == 1 and st.last_batch <= 1  # no sign of company (BatchPolicy)
                if (
                    not lone
                    and waited < self._policy.max_wait_s
                    and st.queued_tokens < self._policy.max_batch_tokens
                ):
                    self._cond.wait(self._policy.max_wait_s - waited)
                    continue
                ready = None
                if not self._lagging:  # resident versions run; the others wait for the load stage
                    ready = self._resident_locked() | {w for w in st.queues if not w.loads}
                picked = self._pick(
                    st.queues, current=st.current, now=now, policy=self._policy, ready=ready
                )
                if picked is None:  # everything queued is still loading
                    self._cond.wait(0.05)
                    continue
                weights, items = picked
                pinned = False
                if weights.loads and not self._lagging and weights not in st.held:
                    pinned = self._store.pin_resident(weights.store_version)
                    if not pinned:  # evicted since it was judged ready: back to the load stage
                        st.queues.setdefault(weights, deque()).extendleft(reversed(items))
                        self._cond.notify_all()
                        self._cond.wait(0.01)
                        continue
                st.depth -= len(items)
                st.queued_tokens -= sum(it.ntokens for it in items)
                st.last_batch = len(items)
                st.running = True
                st.current = weights
                if weights in st.held:
                    st.served.add(weights)
                self._demand_locked()
                return weights, items, pinned

    def _compute_loop(self) -> None:
        while True:
            picked = self._take()
            if picked is None:
                return
            weights, items, pinned = picked
            try:
                self._run(weights, items)
            finally:
                if pinned:
                    self._store.unhold(weights.store_version)
                with self._cond:
                    self._state.running = False
                    self._demand_locked()
                    self._cond.notify_all()

    @contextlib.contextmanager
    def _tensors(self, weights: WeightsRef, requests: int) -> Iterator[Mapping[str, torch.Tensor]]:
        if weights.tensors is not None:  # a proxy's, resident
            yield weights.tensors
        elif self._lagging:
            with self._store.acquire_lagging(weights.store_version) as w:
                yield w
        else:
            # Held resident by the load stage; each request counts as a use for eviction.
            with self._store.acquire(weights.store_version, uses=requests) as w:
                yield w

    def _run(self, ref: WeightsRef, items: list[Item]) -> None:
        now = self._clock()
        live: list[Item] = []
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
        scoring = [it for it in live if not _is_trace(it)]
        traces = [it for it in live if _is_trace(it)]
        start = time.perf_counter()
        outs: list[Result] | OldLogitError = []
        stages: list[Stages | OldLogitError] = []
        forward = self._foreground.forward() if self._foreground else contextlib.nullcontext()
        try:
            # The forward() inside the pin: the store's pin takes locks background work may
            # hold while it pauses for forwards.
            with self._tensors(ref, len(live)) as weights, forward:
                if scoring:
                    jobs = [it.job for it in scoring]
                    outs = _attempt(lambda: _score(self._engine, weights, jobs))
                # Each trace alone, beside the batch: its stages are of the sequence's own forward.
                stages = [
                    _attempt(functools.partial(self._engine.trace, weights, it.job))
                    for it in traces
                ]
        except BaseException as exc:  # the weights could not be had (or the thread is stopping)
            err = map_exception(exc)
            for it in live:
                it.future.set_exception(err)
            return
        elapsed = time.perf_counter() - start
        self._avg_batch_s = 0.8 * self._avg_batch_s + 0.2 * elapsed
        if isinstance(outs, OldLogitError):
            for it in scoring:
                it.future.set_exception(outs)
        else:
            for it, out in zip(scoring, outs, strict=True):
                it.future.set_result(out)
        for trace_item, got in zip(traces, stages, strict=True):
            if isinstance(got, OldLogitError):
                trace_item.future.set_exception(got)
            else:
                trace_item.future.set_result(got)
        self._observer.on_batch(len(live), sum(it.ntokens for it in live), elapsed)
