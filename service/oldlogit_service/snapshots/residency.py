"""Memory residency: which versions sit in the device and host tiers, loads and LRU eviction.

In: pinned entries to make resident. Out: their tensors on the serving device, loaded once
however many threads ask, with device bytes never above budget + one snapshot (the one being
loaded). Decoded patches live in the tier that holds CPU copies (device on CPU, host before a
GPU) and compete in the same LRU. Where bytes come from is the subclass's ``_materialize``;
this layer never touches the registry or the disk layout.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from oldlogit.errors import Overloaded
from oldlogit.weights import TensorEntry
from oldlogit_service.snapshots.codec import Patch
from oldlogit_service.snapshots.persist import StoredVersion, tensor_views
from oldlogit_service.snapshots.tiers import (
    DEVICE,
    DISK,
    HOST,
    MemoryCandidate,
    TierAccount,
    memory_victim_parts,
)

logger = logging.getLogger(__name__)

__all__ = ["Residency", "Resident", "VersionEntry"]


@dataclass(eq=False)
class Resident:
    """One copy of a version's weights in one memory tier."""

    buffer: torch.Tensor | None  # [nbytes] uint8 storage the views share (None: per-tensor)
    layout: tuple[TensorEntry, ...]
    tensors: dict[str, torch.Tensor]
    nbytes: int


@dataclass(eq=False)
class VersionEntry:
    """A retained version and its residency. Guarded by the store's lock."""

    stored: StoredVersion
    last_used: float
    tick: int
    verified: bool = False  # bytes checked against the hash since this process wrote/read them
    device: Resident | None = None
    host: Resident | None = None
    pins: int = 0  # requests holding it (including loads in flight)
    retired: bool = False  # deleted from disk; memory copies go when the last pin does
    patch: Patch | None = None  # a patch version's decoded patch, cached (CPU memory)
    patch_used: float = 0.0  # clock seconds of the last rebuild that read ``patch``
    patch_tick: int = 0

    def tiers(self) -> frozenset[str]:
        out = set() if self.retired else {DISK}
        if self.device is not None:
            out.add(DEVICE)
        if self.host is not None:
            out.add(HOST)
        return frozenset(out)


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
        device_tier: TierAccount,
        host_tier: TierAccount,
        host_enabled: bool,
        pin_host: bool,
        clock: Callable[[], float],
        admission_timeout_s: float,
    ) -> None:
        self._device = device
        self._device_tier = device_tier
        self._host_tier = host_tier
        self._host_enabled = host_enabled
        self._pin_host = pin_host
        self._clock = clock
        self._admission_timeout_s = admission_timeout_s
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._load_lock = threading.Lock()  # one load at a time bounds memory to budget + one
        self._entries: dict[int, VersionEntry] = {}
        self._loading: dict[int, _LoadTicket] = {}
        self._ticks = itertools.count()
        self._counters: Counter[str] = Counter()
        self._load_seconds = 0.0

    # -- to be provided by the store --------------------------------------------------------
    def _materialize(self, entry: VersionEntry) -> Resident:
        raise NotImplementedError

    def _evicted_while_loading(self, entry: VersionEntry) -> Exception:
        raise NotImplementedError

    def _rebuild_cost_locked(self, entry: VersionEntry) -> float:
        """Snapshot loads needed to bring its weights back from disk (patches: more)."""
        return 1.0

    def _patch_cost_locked(self, entry: VersionEntry) -> float:
        """Snapshot loads needed to bring its decoded patch back from disk."""
        return 0.0

    @property
    def _cpu_tier(self) -> TierAccount:
        """The tier that holds CPU copies: host in front of a GPU, else device (process
        memory). Decoded patches and rebuild bases live here."""
        return self._host_tier if self._host_enabled else self._device_tier

    @property
    def _direct(self) -> bool:
        """Device copies are the CPU copies themselves (no host tier, no transfer)."""
        return self._device.type == "cpu" and not self._host_enabled

    # -- use --------------------------------------------------------------------------------
    def _touch_locked(self, entry: VersionEntry) -> None:
        entry.last_used = self._clock()
        entry.tick = next(self._ticks)

    def _load_shared(self, entry: VersionEntry) -> Resident:
        """Make a pinned entry device-resident; the first caller loads, the others wait."""
        v = entry.stored.version
        with self._lock:
            if entry.device is not None:
                self._counters["device_hits"] += 1
                return entry.device
            ticket = self._loading.get(v)
            leader = ticket is None
            if ticket is None:
                ticket = self._loading[v] = _LoadTicket()
            if not leader:
                self._counters["load_waits"] += 1
        if not leader:
            return ticket.wait()
        try:
            res = self._load(entry)
        except BaseException as exc:
            with self._lock:
                del self._loading[v]
            ticket.error = exc
            ticket.done.set()
            raise
        with self._lock:
            del self._loading[v]
        ticket.result = res
        ticket.done.set()
        return res

    def _load(self, entry: VersionEntry) -> Resident:
        n = entry.stored.nbytes
        with self._load_lock:
            with self._cond:
                if entry.retired:
                    raise self._evicted_while_loading(entry)
                if entry.device is not None:
                    return entry.device
                self._admit_device_locked(n, entry.stored.version)
            try:
                start = time.perf_counter()
                host = entry.host
                from_disk = host is None
                if host is None:
                    host = self._materialize(entry)
                # With a host tier (a GPU), the device copy is a transfer from the host copy.
                dev = host if self._direct else self._to_device(host)
            except BaseException:
                with self._cond:
                    self._device_tier.reserve(0)
                    self._cond.notify_all()
                raise
            with self._cond:
                self._device_tier.reserve(0)
                self._counters["loads_disk" if from_disk else "loads_host"] += 1
                self._load_seconds += time.perf_counter() - start
                if from_disk:
                    entry.verified = True
                if entry.retired:
                    self._cond.notify_all()
                    raise self._evicted_while_loading(entry)
                entry.device = dev
                self._device_tier.add(dev.nbytes)
                # Keep the host copy just read, unless the budget cannot hold one (then it
                # was only a staging buffer).
                keep_host = self._host_enabled and from_disk and host is not dev
                if keep_host and entry.host is None and self._host_tier.budget >= host.nbytes:
                    entry.host = host
                    self._host_tier.add(host.nbytes)
                    self._evict_host_locked()
                self._evict_device_locked()
                self._cond.notify_all()
                return dev

    def _admit_device_locked(self, nbytes: int, version: int) -> None:
        """Make room for a load: evict unpinned LRU; proceed at once if that brings the tier
        within budget, or when what stays (all in use) is itself within budget — so resident
        bytes stay <= budget + one snapshot. Otherwise wait for releases (bounded)."""
        tier = self._device_tier
        deadline = time.monotonic() + self._admission_timeout_s
        while True:
            self._evict_device_locked(incoming=nbytes)
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

    def _to_device(self, host: Resident) -> Resident:
        if host.buffer is not None:
            buf = host.buffer.to(self._device)  # [nbytes] one transfer for the whole version
            return Resident(buf, host.layout, tensor_views(buf, host.layout), host.nbytes)
        tensors = {k: t.to(self._device) for k, t in host.tensors.items()}
        return Resident(None, host.layout, tensors, host.nbytes)

    def _unpin(self, entry: VersionEntry) -> None:
        with self._cond:
            entry.pins -= 1
            if entry.pins == 0 and entry.retired:
                self._drop_memory_locked(entry)
            self._evict_device_locked()
            self._cond.notify_all()

    # -- eviction ---------------------------------------------------------------------------
    def _candidates_locked(self, tier: TierAccount) -> list[MemoryCandidate]:
        out: list[MemoryCandidate] = []
        patches_here = tier is self._cpu_tier
        for v, e in self._entries.items():
            if tier is self._device_tier and e.device is not None and e.pins == 0:
                cost = 0.0 if e.host is not None else self._rebuild_cost_locked(e)
                out.append(MemoryCandidate(v, e.device.nbytes, e.last_used, e.tick, cost))
            if tier is self._host_tier and e.host is not None:
                cost = self._rebuild_cost_locked(e)
                out.append(MemoryCandidate(v, e.host.nbytes, e.last_used, e.tick, cost))
            if patches_here and e.patch is not None:
                cost = self._patch_cost_locked(e)
                out.append(
                    MemoryCandidate(
                        v, e.patch.nbytes, e.patch_used, e.patch_tick, cost, part="patch"
                    )
                )
        return out

    def _drop_part_locked(self, tier: TierAccount, c: MemoryCandidate) -> None:
        e = self._entries[c.version]
        if c.part == "patch":
            assert e.patch is not None
            tier.remove(e.patch.nbytes, evicted=True, count=False)
            e.patch = None
        elif tier is self._device_tier:
            assert e.device is not None
            tier.remove(e.device.nbytes, evicted=True)
            e.device = None
        else:
            assert e.host is not None
            tier.remove(e.host.nbytes, evicted=True)
            e.host = None
        logger.debug("evicted version %d (%s) from the %s tier", c.version, c.part, tier.name)

    def _evict_locked(self, tier: TierAccount, incoming: int = 0) -> None:
        if tier.resident + incoming <= tier.budget:
            return
        cands = self._candidates_locked(tier)
        for c in memory_victim_parts(
            cands, resident=tier.resident, incoming=incoming, budget=tier.budget
        ):
            self._drop_part_locked(tier, c)

    def _evict_device_locked(self, incoming: int = 0) -> None:
        self._evict_locked(self._device_tier, incoming)

    def _evict_host_locked(self) -> None:
        self._evict_locked(self._host_tier)

    def _offer_locked(
        self, entry: VersionEntry, item: Resident | Patch, *, rebuild_cost: float
    ) -> bool:
        """Keep a CPU copy made anyway (a rebuild base, a decoded patch, published weights)
        if it fits in the CPU tier by evicting only colder copies; never waits, never goes
        over budget (counting a load in flight). False: the caller just drops it."""
        tier = self._cpu_tier
        if entry.retired or entry.stored.version not in self._entries:
            return False
        is_patch = isinstance(item, Patch)
        if entry.patch if is_patch else entry.host if self._host_enabled else entry.device:
            return False  # already held
        n = item.nbytes
        me = MemoryCandidate(entry.stored.version, n, self._clock(), 0, rebuild_cost)
        colder = [c for c in self._candidates_locked(tier) if c.keep_until < me.keep_until]
        room = tier.budget - tier.reserved
        if n > room:
            return False
        victims = memory_victim_parts(colder, resident=tier.resident, incoming=n, budget=room)
        if tier.resident - sum(c.nbytes for c in victims) + n > room:
            return False
        for c in victims:
            self._drop_part_locked(tier, c)
        if isinstance(item, Patch):
            entry.patch = item
            entry.patch_used, entry.patch_tick = self._clock(), next(self._ticks)
            tier.add(n, count=False)
        elif self._host_enabled:
            entry.host = item
            tier.add(n)
        else:
            entry.device = item
            tier.add(n)
        return True

    def _drop_memory_locked(self, entry: VersionEntry) -> None:
        if entry.device is not None:
            self._device_tier.remove(entry.device.nbytes, evicted=False)
            entry.device = None
        if entry.host is not None:
            self._host_tier.remove(entry.host.nbytes, evicted=False)
            entry.host = None
        if entry.patch is not None:
            self._cpu_tier.remove(entry.patch.nbytes, evicted=False, count=False)
            entry.patch = None
