"""Tier accounting and the eviction policies, as pure functions over plain candidates.

In: per-version residency facts (bytes, last use, rebuild cost, protection). Out: which
versions to drop from a memory tier, or to delete from disk. Nothing here touches tensors,
files or locks, so the policies are tested with plain lists.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

__all__ = [
    "DEVICE",
    "DISK",
    "HOST",
    "DiskCandidate",
    "MemoryCandidate",
    "TierAccount",
    "disk_victims",
    "memory_victims",
]

DEVICE = "device"
HOST = "host"
DISK = "disk"


@dataclass
class TierAccount:
    """Bytes and versions resident in one tier, against its budget."""

    name: str
    budget: int
    resident: int = 0
    versions: int = 0
    evictions: int = 0
    reserved: int = 0  # bytes of a load in flight (counted towards ``peak``)
    peak: int = 0  # the most bytes ever resident + reserved: the budget test reads it

    def add(self, nbytes: int) -> None:
        self.resident += nbytes
        self.versions += 1
        self._observe()

    def remove(self, nbytes: int, *, evicted: bool) -> None:
        self.resident -= nbytes
        self.versions -= 1
        if evicted:
            self.evictions += 1

    def reserve(self, nbytes: int) -> None:
        self.reserved = nbytes
        self._observe()

    def _observe(self) -> None:
        self.peak = max(self.peak, self.resident + self.reserved)

    def as_dict(self) -> dict[str, int]:
        return {
            "bytes": self.resident,
            "budget": self.budget,
            "versions": self.versions,
            "evictions": self.evictions,
            "peak_bytes": self.peak,
        }


@dataclass(frozen=True)
class MemoryCandidate:
    """An unpinned version resident in a memory tier."""

    version: int
    nbytes: int
    last_used: float  # clock seconds
    tick: int  # a strictly increasing use counter: the final tie-break
    rebuild_cost: int  # 0: a copy in a lower memory tier; 1: a disk keyframe (patches: more)


def memory_victims(
    candidates: Iterable[MemoryCandidate], *, resident: int, incoming: int, budget: int
) -> list[int]:
    """Versions to drop, least recently used first, until ``resident + incoming <= budget``.

    On equal last use, the cheapest to bring back goes first (a copy one tier down, then the
    smaller one).
    """
    out: list[int] = []
    order = sorted(candidates, key=lambda c: (c.last_used, c.rebuild_cost, c.nbytes, c.tick))
    for c in order:
        if resident + incoming <= budget:
            break
        out.append(c.version)
        resident -= c.nbytes
    return out


@dataclass(frozen=True)
class DiskCandidate:
    """A version retained on disk."""

    version: int
    nbytes: int
    last_used: float
    leased: bool
    in_use: bool  # pinned by a running request


def disk_victims(
    candidates: Iterable[DiskCandidate],
    *,
    watermark: int | None,
    max_versions: int,
    budget: int,
) -> tuple[list[tuple[int, str]], bool]:
    """Versions to delete from disk with the reason, and whether a running request held one back.

    Below the watermark goes first; then, while ``max_versions`` or the byte budget is
    exceeded, least recently used (older version on ties). Leased and in-use versions stay;
    the newest retained version is never deleted for budget reasons (only the watermark, which
    the trainer sets, can retire it).
    """
    cands = sorted(candidates, key=lambda c: c.version)
    if not cands:
        return [], False
    newest = cands[-1].version
    victims: list[tuple[int, str]] = []
    held_by_use = False
    kept: list[DiskCandidate] = []
    for c in cands:
        if watermark is not None and c.version < watermark:
            if not c.leased and not c.in_use:
                victims.append((c.version, "watermark"))
                continue
            held_by_use |= c.in_use and not c.leased
        kept.append(c)
    count = len(kept)
    total = sum(c.nbytes for c in kept)
    for c in sorted(kept, key=lambda c: (c.last_used, c.version)):
        if count <= max_versions and total <= budget:
            break
        if c.version == newest or c.leased:
            continue
        if c.in_use:
            held_by_use = True
            continue
        victims.append((c.version, "max_versions" if count > max_versions else "disk_budget"))
        count -= 1
        total -= c.nbytes
    return victims, held_by_use
