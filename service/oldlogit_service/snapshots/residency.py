"""Memory residency: which versions sit in the device and host tiers; loads and LRU eviction.

In: pins of versions the registry retains, and a ``materialize(version)`` that builds a
version's weights (or an adapter version's LoRA tensors: entries like any other) in a CPU
buffer. Out: the version's tensors on the serving device, loaded once however many threads
ask, with device bytes never above budget + one snapshot (the one being loaded). Decoded
patches and rebuild bases live in the tier that holds CPU copies (device on CPU, host in front
of a GPU) and compete in the same LRU, credited with what they would cost to rebuild. A load
runs as background work of ``foreground`` (``yielding.py``): on a CPU it pauses between chunks
while a forward runs or waits, in bounded turns. Never touches the registry, the disk layout or
a patch's contents.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Any

import torch

from oldlogit.contract.errors import Overloaded
from oldlogit.contract.weights import TensorEntry
from oldlogit_service.snapshots import buffers
from oldlogit_service.snapshots.codec import Patch
from oldlogit_service.snapshots.persist import tensor_views
from oldlogit_service.snapshots.tiers import (
    DEVICE,
    HOST,
    PATCH_SHARE,
    MemoryCandidate,
    TierAccount,
    decayed_uses,
    hot_versions,
    hottest,
    memory_victim_parts,
    patch_share,
)
from oldlogit_service.snapshots.yielding import Foreground

logger = logging.getLogger(__name__)

__all__ = ["Residency", "Resident"]


def _empty_device_cache() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@dataclass(eq=False)
class Resident:
    """One copy of a version's weights in one memory tier."""

    buffer: torch.Tensor | None  # [nbytes] uint8 storage the views share (None: per-tensor)
    layout: tuple[TensorEntry, ...]
    tensors: dict[str, torch.Tensor]
    nbytes: int


@dataclass(eq=False)
class _Memory:
    """A version's copies in memory. Guarded by the residency lock."""

    last_used: float
    tick: int
    device: Resident | None = None
    host: Resident | None = None
    patch: Patch | None = None  # decoded patch against its parent (CPU memory)
    patch_key: str = ""  # the patch file's hash: a rewritten record never reads a stale patch
    patch_used: float = 0.0
    patch_tick: int = 0
    patch_uses: float = 0.0  # rebuilds that applied it, decayed; kept across evictions, as
    patch_uses_at: float = 0.0  # ``uses``: a patch every rebuild of a hot chain needs stays
    pins: int = 0  # requests holding it (including loads in flight)
    uses: float = 0.0  # requests that used it, decayed (``tiers.decayed_uses``); kept across
    uses_at: float = 0.0  # evictions, so a hot version is known as hot when it comes back
    retired: bool = False  # deleted: copies go when the last pin does


@dataclass(eq=False)
class _LoadTicket:
    """One load in flight; concurrent acquirers of the same cold version wait on it."""

    done: threading.Event = field(default_factory=threading.Event)
    result: Resident | None = None
    error: BaseException | None = None

    def wait(self) -> Resident:
        self.done.wait()
        if self.error is not None:
            raise self.error
        assert self.result is not None
        return self.result


class Residency:
    def __init__(
        self,
        *,
        device: torch.device,
        device_budget_bytes: int,
        host_budget_bytes: int,
        pin_host: bool,
        clock: Callable[[], float],
        admission_timeout_s: float,
        materialize: Callable[[int], Resident],
        rebuild_cost: Callable[[int], float],
        patch_cost: Callable[[int], float],
        gone: Callable[[int], Exception],
    ) -> None:
        """``rebuild_cost``/``patch_cost``: snapshot loads needed to bring a version's weights
        or its decoded patch back; ``gone``: the error for a version retired while loading."""
        self.device = device
        # The host tier only makes sense in front of a GPU; on CPU the device tier is process
        # memory already.
        self.host_enabled = device.type == "cuda"
        self.pin_host = pin_host and self.host_enabled
        self.device_tier = TierAccount(DEVICE, int(device_budget_bytes))
        self.host_tier = TierAccount(HOST, int(host_budget_bytes) if self.host_enabled else 0)
        self._clock = clock
        self._admission_timeout_s = admission_timeout_s
        self._materialize = materialize
        self._rebuild_cost = rebuild_cost
        self._patch_cost = patch_cost
        self._gone = gone
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._load_lock = threading.Lock()  # one load at a time bounds memory to budget + one
        self._mem: dict[int, _Memory] = {}
        self._loading: dict[int, _LoadTicket] = {}
        # Versions queued work needs next (the scheduler's load stage says so with each load):
        # evicted only after every copy nothing waits for.
        self._wanted: frozenset[int] = frozenset()
        self._ticks = itertools.count()
        self.counters: Counter[str] = Counter()
        self.load_seconds = 0.0
        # In front of a GPU: host→device copies run on a side stream, so the compute stream
        # keeps running forwards while a version is copied in.
        self._copy_stream: Any = None
        # Forwards first: loads (and the store's other background work) yield to them where
        # they share the cores — on a CPU; a GPU's forwards leave the host's cores free.
        self.foreground = Foreground(enabled=device.type == "cpu")
        if device.type == "cuda":
            self._copy_stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]

    @property
    def cpu_tier(self) -> TierAccount:
        """The tier that holds CPU copies: host in front of a GPU, else device."""
        return self.host_tier if self.host_enabled else self.device_tier

    @property
    def direct(self) -> bool:
        """Device copies are the CPU copies themselves (no host tier, no transfer)."""
        return self.device.type == "cpu" and not self.host_enabled

    def _entry_locked(self, version: int) -> _Memory:
        m = self._mem.get(version)
        if m is None:
            m = self._mem[version] = _Memory(self._clock(), next(self._ticks))
        return m

    # -- pins and loads ---------------------------------------------------------------------
    def pin(
        self,
        version: int,
        nbytes: int,
        wanted: AbstractSet[int] | None = None,
        *,
        uses: int = 1,
    ) -> Resident:
        """Pin ``version`` (``nbytes`` of weights) and return its device copy, loading it if
        needed (the first caller loads, concurrent ones wait). ``wanted``: the versions queued
        work needs, kept over the others if room must be made (None: as last said). ``uses``:
        how many requests use it (counted for eviction; 0 for a load ahead of the requests).
        ``unpin`` when done; on error it is unpinned already."""
        with self._lock:
            if wanted is not None:
                self._wanted = frozenset(wanted)
            m = self._entry_locked(version)
            if m.retired:
                raise self._gone(version)
            m.pins += 1
            now = self._clock()
            m.last_used, m.tick = now, next(self._ticks)
            if uses:
                m.uses = decayed_uses(m.uses, now - m.uses_at) + uses
                m.uses_at = now
            if m.device is not None:
                self.counters["device_hits"] += 1
                return m.device
        try:
            return self._load_shared(version, m, nbytes)
        except BaseException:
            self.unpin(version)
            raise

    def pin_resident(self, version: int) -> bool:
        """Pin ``version`` only if its device copy is there now, loading nothing; True when
        pinned (``unpin`` it after use). The scheduler's compute stage takes an unheld resident
        version this way, so no load can evict it between the choice and the forward."""
        with self._lock:
            m = self._mem.get(version)
            if m is None or m.retired or m.device is None:
                return False
            m.pins += 1
            return True

    def unpin(self, version: int) -> None:
        with self._cond:
            m = self._mem.get(version)
            if m is not None:
                m.pins -= 1
                if m.pins == 0 and m.retired:
                    self._drop_locked(version)
            self._evict_locked(self.device_tier)
            self._cond.notify_all()

    def _load_shared(self, version: int, m: _Memory, nbytes: int) -> Resident:
        with self._lock:
            if m.device is not None:
                self.counters["device_hits"] += 1
                return m.device
            ticket = self._loading.get(version)
            leader = ticket is None
            if ticket is None:
                ticket = self._loading[version] = _LoadTicket()
            else:
                self.counters["load_waits"] += 1
        if not leader:
            return ticket.wait()
        try:
            res = self._load(version, m, nbytes)
        except BaseException as exc:
            with self._lock:
                del self._loading[version]
            ticket.error = exc
            ticket.done.set()
            raise
        with self._lock:
            del self._loading[version]
        ticket.result = res
        ticket.done.set()
        return res

    def _load(self, version: int, m: _Memory, nbytes: int) -> Resident:
        with self._load_lock:
            with self._cond:
                if m.retired:
                    raise self._gone(version)
                if m.device is not None:
                    return m.device
                self._admit_device_locked(nbytes, version)
                host = m.host
            try:
                start = time.perf_counter()
                from_disk = host is None
                if host is None:
                    with self.foreground.background():
                        host = self._materialize(version)
                # With a host tier (a GPU), the device copy is a transfer from the host copy.
                dev = host if self.direct else self._to_device_or_evict(host, version)
            except BaseException:
                with self._cond:
                    self.device_tier.reserve(0)
                    self._cond.notify_all()
                raise
            with self._cond:
                self.device_tier.reserve(0)
                self.counters["loads_disk" if from_disk else "loads_host"] += 1
                self.load_seconds += time.perf_counter() - start
                logger.debug(
                    "loaded version %d from %s in %.1f ms",
                    version,
                    "disk" if from_disk else "host",
                    1000 * (time.perf_counter() - start),
                )
                if m.retired:
                    self._cond.notify_all()
                    raise self._gone(version)
                m.device = dev
                self.device_tier.add(dev.nbytes)
                # Keep the host copy just built, unless the budget cannot hold one (then it
                # was only a staging buffer).
                keep_host = self.host_enabled and from_disk and host is not dev
                if keep_host and m.host is None and self.host_tier.budget >= host.nbytes:
                    m.host = host
                    self.host_tier.add(host.nbytes)
                    self._evict_locked(self.host_tier)
                elif keep_host and host.buffer is not None:
                    buffers.recycle_buffer(host.buffer)  # a staging buffer: the next load's
                self._evict_locked(self.device_tier)
                self._cond.notify_all()
                return dev

    def _admit_device_locked(self, nbytes: int, version: int) -> None:
        """Make room for a load: evict unpinned LRU; proceed at once if that brings the tier
        within budget, or when what stays (all in use) is itself within budget — so resident
        bytes stay <= budget + one snapshot. Otherwise wait for releases (bounded)."""
        tier = self.device_tier
        deadline = time.monotonic() + self._admission_timeout_s
        while True:
            self._evict_locked(tier, incoming=nbytes)
            if tier.resident + nbytes <= tier.budget or tier.resident <= tier.budget:
                break
            left = deadline - time.monotonic()
            if left <= 0:
                raise Overloaded(
                    f"cannot load policy_version {version} now: the device budget "
                    f"({tier.budget} bytes) is held by versions in use; retry shortly",
                    parameter="policy_version",
                    retry_after_s=1.0,
                )
            self._cond.wait(left)
        tier.reserve(nbytes)

    def to_device(self, host: Resident) -> Resident:
        """A device copy of a CPU copy: one transfer for the whole version; in front of a GPU on
        the side stream, waited for here (the caller is the load stage, not the compute)."""
        with contextlib.ExitStack() as stack:
            if self._copy_stream is not None:
                stack.enter_context(torch.cuda.stream(self._copy_stream))
            if host.buffer is not None:
                buf = host.buffer.to(self.device, non_blocking=True)  # [nbytes]
                out = Resident(buf, host.layout, tensor_views(buf, host.layout), host.nbytes)
            else:
                tensors = {k: t.to(self.device, non_blocking=True) for k, t in host.tensors.items()}
                out = Resident(None, host.layout, tensors, host.nbytes)
        if self._copy_stream is not None:
            self._copy_stream.synchronize()
        return out

    def _to_device_or_evict(self, host: Resident, version: int) -> Resident:
        """``to_device``; when the device is out of memory (activations grew, another process),
        evict every unpinned device copy and try once more, else ``Overloaded``."""
        try:
            return self.to_device(host)
        except torch.OutOfMemoryError:
            with self._cond:
                dropped = self._evict_all_unpinned_locked()
            _empty_device_cache()
            logger.warning("device out of memory loading version %d: evicted %d", version, dropped)
        try:
            return self.to_device(host)
        except torch.OutOfMemoryError as exc:
            _empty_device_cache()
            raise Overloaded(
                f"the device has no memory left for policy_version {version} now (everything "
                "resident is in use); retry shortly or lower --device-budget-gib",
                parameter="policy_version",
                retry_after_s=1.0,
            ) from exc

    def _evict_all_unpinned_locked(self) -> int:
        victims = [c for c in self._candidates_locked(self.device_tier) if c.part != "patch"]
        for c in victims:
            self._drop_part_locked(self.device_tier, c)
        return len(victims)

    # -- a resident copy held outside the LRU (the lagging model) ---------------------------
    def hold_device(self, nbytes: int, version: int) -> None:
        """Count ``nbytes`` in the device tier for good (making room first)."""
        with self._cond:
            self._admit_device_locked(nbytes, version)
            self.device_tier.reserve(0)
            self.device_tier.add(nbytes, count=False)

    def release_device(self, nbytes: int) -> None:
        with self._cond:
            self.device_tier.remove(nbytes, evicted=False, count=False)
            self._cond.notify_all()

    # -- CPU copies, decoded patches --------------------------------------------------------
    def cpu_copy(self, version: int) -> Resident | None:
        """A version's weights in a CPU buffer, if memory holds one (a rebuild base)."""
        with self._lock:
            m = self._mem.get(version)
            if m is None:
                return None
            res = m.host if self.host_enabled else m.device if self.direct else None
            return res if res is not None and res.buffer is not None else None

    def cached_patch(self, version: int, key: str) -> Patch | None:
        """The decoded patch of ``version`` if memory holds the one with file hash ``key``."""
        with self._lock:
            m = self._mem.get(version)
            if m is None or m.patch is None or m.patch_key != key:
                return None
            self._use_patch_locked(m)
            return m.patch

    def _use_patch_locked(self, m: _Memory) -> None:
        now = self._clock()
        m.patch_used, m.patch_tick = now, next(self._ticks)
        m.patch_uses = decayed_uses(m.patch_uses, now - m.patch_uses_at) + 1
        m.patch_uses_at = now

    def forget_patch(self, version: int) -> None:
        """Drop a cached patch that no longer applies (its version was rebased)."""
        with self._lock:
            m = self._mem.get(version)
            if m is not None and m.patch is not None:
                self.cpu_tier.remove(m.patch.nbytes, evicted=False, count=False)
                m.patch = None

    def offer(self, version: int, item: Resident | Patch, patch_key: str = "") -> bool:
        """Keep a CPU copy made anyway (a rebuild base, a decoded patch with its file hash
        ``patch_key``, published weights) if it fits in the CPU tier by evicting only colder
        copies; never waits, never goes over budget (counting a load in flight). False: the
        caller just drops it."""
        is_patch = isinstance(item, Patch)
        cost = self._patch_cost(version) if is_patch else self._rebuild_cost(version)
        with self._lock:
            m = self._entry_locked(version)
            if m.retired:
                return False
            held = m.patch if is_patch else m.host if self.host_enabled else m.device
            if held is not None:
                return False
            tier = self.cpu_tier
            n = item.nbytes
            now = self._clock()
            if is_patch:  # this use, and the ones before it was evicted
                uses = decayed_uses(m.patch_uses, now - m.patch_uses_at) + 1
            else:
                uses = decayed_uses(m.uses, now - m.uses_at)
            me = MemoryCandidate(
                version, n, now, 0, cost, part="patch" if is_patch else "weights", uses=uses
            )
            cands = self._candidates_locked(tier)
            mine = is_patch and version in patch_share(
                [*(c for c in cands if c.part == "patch"), me],
                tier.budget,
                self._share_locked(tier),
            )
            if mine:  # within the patch share: weights make room (as in eviction's order)
                colder = [c for c in cands if not c.protected or c.keep_until < me.keep_until]
            else:
                colder = [c for c in cands if c.keep_until < me.keep_until and not c.protected]
            room = tier.budget - tier.reserved
            if n > room:
                return False
            victims = memory_victim_parts(colder, resident=tier.resident, incoming=n, budget=room)
            if tier.resident - sum(c.nbytes for c in victims) + n > room:
                return False
            for c in victims:
                self._drop_part_locked(tier, c)
            if isinstance(item, Patch):
                m.patch, m.patch_key = item, patch_key
                self._use_patch_locked(m)
                tier.add(n, count=False)
            elif self.host_enabled:
                m.host = item
                tier.add(n)
            else:
                m.device = item
                tier.add(n)
            return True

    # -- retirement, eviction ---------------------------------------------------------------
    def retire(self, version: int) -> None:
        """A deleted version: its copies go now, or when the last request holding it ends; a
        load in flight is discarded."""
        with self._cond:
            m = self._mem.get(version)
            if m is None:
                return
            m.retired = True
            if m.pins == 0:
                self._drop_locked(version)
            self._cond.notify_all()

    def evict(self, version: int) -> bool:
        """Drop a version's weights from the memory tiers now (its decoded patch stays);
        False if none was resident or it is in use."""
        with self._cond:
            m = self._mem.get(version)
            if m is None or m.pins or (m.device is None and m.host is None):
                return False
            if m.device is not None:
                self.device_tier.remove(m.device.nbytes, evicted=True)
                m.device = None
            if m.host is not None:
                self.host_tier.remove(m.host.nbytes, evicted=True)
                m.host = None
            self._cond.notify_all()
            return True

    def _candidates_locked(self, tier: TierAccount) -> list[MemoryCandidate]:
        out: list[MemoryCandidate] = []
        now = self._clock()
        patches_here = tier is self.cpu_tier
        hot = hot_versions(self._uses_locked(now)) if tier is self.device_tier else set()
        for v, m in self._mem.items():
            if tier is self.device_tier and m.device is not None and m.pins == 0:
                cost = 0.0 if m.host is not None else self._rebuild_cost(v)
                out.append(
                    MemoryCandidate(
                        v,
                        m.device.nbytes,
                        m.last_used,
                        m.tick,
                        cost,
                        uses=decayed_uses(m.uses, now - m.uses_at),
                        wanted=v in self._wanted,
                        hot=v in hot,
                    )
                )
            if tier is self.host_tier and m.host is not None:
                out.append(
                    MemoryCandidate(v, m.host.nbytes, m.last_used, m.tick, self._rebuild_cost(v))
                )
            if patches_here and m.patch is not None:
                out.append(
                    MemoryCandidate(
                        v,
                        m.patch.nbytes,
                        m.patch_used,
                        m.patch_tick,
                        self._patch_cost(v),
                        part="patch",
                        uses=decayed_uses(m.patch_uses, now - m.patch_uses_at),
                    )
                )
        if patches_here:
            keep = patch_share(
                (c for c in out if c.part == "patch"), tier.budget, self._share_locked(tier)
            )
            out = [
                dataclasses.replace(c, protected=True)
                if c.part == "patch" and c.version in keep
                else c
                for c in out
            ]
        return out

    def _uses_locked(self, now: float) -> list[MemoryCandidate]:
        """Every version's recent uses (resident or not: a use count outlives its copy), with
        the bytes of its device copy (0: none): what ``hottest`` and ``hot_versions`` read."""
        return [
            MemoryCandidate(
                v,
                0 if m.device is None else m.device.nbytes,
                0.0,
                0,
                0.0,
                uses=decayed_uses(m.uses, now - m.uses_at),
            )
            for v, m in self._mem.items()
        ]

    def _hot_locked(self) -> tuple[int | None, int]:
        """The hottest device copy (``tiers.hottest``, pinned or not) and its bytes."""
        cands = [c for c in self._uses_locked(self._clock()) if c.nbytes]
        hot = hottest(cands)
        return hot, next((c.nbytes for c in cands if c.version == hot), 0)

    def _share_locked(self, tier: TierAccount) -> float:
        """The patch share of ``tier``: ``tiers.PATCH_SHARE``, less where the budget would not
        hold the hottest version, one more loading and the share (a budget of a few versions):
        the patches of versions asked for once each must not push out the one asked for most."""
        hot, nbytes = self._hot_locked() if tier is self.device_tier else (None, 0)
        if hot is None or tier.budget <= 0:
            return PATCH_SHARE
        return max(0.0, min(PATCH_SHARE, (tier.budget - 2 * nbytes) / tier.budget))

    def _drop_part_locked(self, tier: TierAccount, c: MemoryCandidate) -> None:
        m = self._mem[c.version]
        if c.part == "patch":
            assert m.patch is not None
            tier.remove(m.patch.nbytes, evicted=True, count=False)
            m.patch = None
        elif tier is self.device_tier:
            assert m.device is not None
            tier.remove(m.device.nbytes, evicted=True)
            m.device = None
        else:
            assert m.host is not None
            tier.remove(m.host.nbytes, evicted=True)
            m.host = None
        logger.debug(
            "evicted version %d (%s) from the %s tier (kept until %+.2f s, %.1f uses, cost %.2f)",
            c.version,
            c.part,
            tier.name,
            c.keep_until - self._clock(),
            c.uses,
            c.rebuild_cost,
        )

    def _evict_locked(self, tier: TierAccount, incoming: int = 0) -> None:
        if tier.resident + incoming <= tier.budget:
            return
        cands = self._candidates_locked(tier)
        for c in memory_victim_parts(
            cands, resident=tier.resident, incoming=incoming, budget=tier.budget
        ):
            self._drop_part_locked(tier, c)

    def _drop_locked(self, version: int) -> None:
        m = self._mem.pop(version, None)
        if m is None:
            return
        if m.device is not None:
            self.device_tier.remove(m.device.nbytes, evicted=False)
        if m.host is not None:
            self.host_tier.remove(m.host.nbytes, evicted=False)
        if m.patch is not None:
            self.cpu_tier.remove(m.patch.nbytes, evicted=False, count=False)

    # -- introspection ----------------------------------------------------------------------
    def tiers(self, version: int) -> frozenset[str]:
        with self._lock:
            m = self._mem.get(version)
            if m is None:
                return frozenset()
            return frozenset(t for t, r in ((DEVICE, m.device), (HOST, m.host)) if r is not None)

    def cold_room(self, nbytes: int) -> tuple[int, frozenset[int]]:
        """(How many copies of ``nbytes`` the device budget holds beside the hot versions'
        device copies and the decoded patches in it, the hot versions: ``tiers.hot_versions``
        over every version's recent uses). Decoded patches count where they live in the device
        tier (on a CPU; in front of a GPU they are in the host tier)."""
        with self._lock:
            uses = self._uses_locked(self._clock())
            hot = hot_versions(uses)
            taken = sum(c.nbytes for c in uses if c.version in hot)  # their device copies
            if self.cpu_tier is self.device_tier:
                taken += sum(m.patch.nbytes for m in self._mem.values() if m.patch is not None)
            free = self.device_tier.budget - taken
            return (max(0, free // nbytes) if nbytes > 0 else 0), frozenset(hot)

    def has_room(self, nbytes: int) -> bool:
        """The device tier holds ``nbytes`` more (and a load in flight) within its budget."""
        with self._lock:
            t = self.device_tier
            return t.resident + t.reserved + nbytes <= t.budget

    def pins(self, version: int) -> int:
        with self._lock:
            m = self._mem.get(version)
            return 0 if m is None else m.pins

    def in_use(self) -> set[int]:
        with self._lock:
            return {v for v, m in self._mem.items() if m.pins > 0}

    def has_patch(self, version: int) -> bool:
        with self._lock:
            m = self._mem.get(version)
            return m is not None and m.patch is not None

    def patch_bytes(self) -> int:
        with self._lock:
            return sum(m.patch.nbytes for m in self._mem.values() if m.patch is not None)

    def resident_versions(self) -> list[int]:
        """Versions with a device copy now, ascending."""
        with self._lock:
            return sorted(v for v, m in self._mem.items() if m.device is not None)

    def clear(self) -> None:
        """Drop every memory copy not in use, decoded patches too (benchmarks: a cold store)."""
        with self._cond:
            for v in [v for v, m in self._mem.items() if m.pins == 0]:
                self._drop_locked(v)
            self._cond.notify_all()

    def close(self) -> None:
        with self._lock:
            for v in list(self._mem):
                self._drop_locked(v)
