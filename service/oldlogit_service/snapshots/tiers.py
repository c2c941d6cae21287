"""Tier accounting and the eviction policies, as pure functions over plain candidates.

In: per-version residency facts (bytes, last use, rebuild cost, protection). Out: which
versions (or decoded patches) to drop from a memory tier, or to delete from disk. Nothing here
touches tensors, files or locks, so the policies are tested with plain lists.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

__all__ = [
    "DEVICE",
    "DISK",
    "HOST",
    "HOT_SHARE",
    "PATCH_SHARE",
    "REBUILD_WEIGHT_S",
    "DiskCandidate",
    "MemoryCandidate",
    "TierAccount",
    "decayed_uses",
    "disk_victims",
    "hot_versions",
    "hottest",
    "memory_victim_parts",
    "patch_share",
    "reuse_factor",
]

DEVICE = "device"
HOST = "host"
DISK = "disk"

# Seconds of recency one unit of rebuild cost is worth (1.0 = one full snapshot load): a version
# rebuilt from a keyframe plus patches costing 3 loads is kept as if used 0.3 s more recently
# than a keyframe copy. Small next to how long versions stay hot in RL, large next to the gaps
# between requests, so among recently used copies the expensive ones stay.
REBUILD_WEIGHT_S = 0.1


# Half-life of a copy's use count: uses this long ago count half. The count is a recency-weighted
# frequency kept across evictions, so a version every request needs is known as such when it
# is loaded again.
USE_HALF_LIFE_S = 5.0


def decayed_uses(uses: float, seconds_since: float) -> float:
    """A use count ``seconds_since`` its last update, halved every ``USE_HALF_LIFE_S``."""
    return float(uses * 2.0 ** (-max(0.0, seconds_since) / USE_HALF_LIFE_S))


def reuse_factor(uses: float) -> float:
    """How much a copy's rebuild credit grows with its use: 1 for a copy nobody uses, + 1 per
    recent use (``decayed_uses``). The credit is the expected cost of evicting it — how often it
    is used × what bringing it back costs — so a hot version that is cheap to rebuild is not
    dropped for a rarely used one with a long chain, a stream of versions each used once cannot
    push out the version every request uses, and a copy nobody uses any more ages out within a
    few half-lives."""
    return 1.0 + uses


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

    def add(self, nbytes: int, *, count: bool = True) -> None:
        """``count=False``: bytes that are not a version's weights (a decoded patch)."""
        self.resident += nbytes
        self.versions += count
        self._observe()

    def remove(self, nbytes: int, *, evicted: bool, count: bool = True) -> None:
        self.resident -= nbytes
        self.versions -= count
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
    """An unpinned copy in a memory tier: a version's weights, or its decoded patch."""

    version: int
    nbytes: int
    last_used: float  # clock seconds
    tick: int  # a strictly increasing use counter: the final tie-break
    # In snapshot loads: 0 a copy in a lower memory tier, 1 a disk keyframe, more for a
    # version rebuilt through a chain of patches, a fraction for a decoded patch.
    rebuild_cost: float
    part: str = "weights"  # or "patch"
    uses: float = 0.0  # recent uses, decayed to now (``decayed_uses``, ``reuse_factor``)
    wanted: bool = False  # queued work needs it: dropped only after every copy nothing needs
    # It carries a large share of recent requests (``hot_versions``): dropped after wanted ones.
    hot: bool = False
    # A decoded patch within the tier's patch share (``patch_share``): dropped only after every
    # weights copy, wanted ones included.
    protected: bool = False

    @property
    def keep_until(self) -> float:
        """The eviction key: last use, credited for what bringing it back would cost, the more
        the more it has been re-used."""
        return self.last_used + REBUILD_WEIGHT_S * self.rebuild_cost * reuse_factor(self.uses)


def memory_victim_parts(
    candidates: Iterable[MemoryCandidate], *, resident: int, incoming: int, budget: int
) -> list[MemoryCandidate]:
    """What to drop, lowest ``keep_until`` first, until ``resident + incoming <= budget``.

    Copies that queued work wants go late (dropping one means loading it again before its
    requests run), hot ones later still (``hot_versions``: with many clients, the version a
    third of the requests ask for often has none queued at the moment a load for an old
    version makes room, and dropping it stalls every client that asks for it next, while a
    wanted copy's few queued requests wait for one load), and protected patches last: a
    wanted copy dropped costs one rebuild, a protected patch dropped costs a file read (hash,
    decode) in every rebuild through it, and with every resident copy wanted, as under a
    queue over more versions than the budget holds, loads would otherwise push the whole
    patch share out load after load. On equal keys, the cheapest to bring back goes first (a
    copy one tier down, then the smaller one).
    """
    out: list[MemoryCandidate] = []
    order = sorted(
        candidates,
        key=lambda c: (
            c.protected,
            c.hot,
            c.wanted,
            c.keep_until,
            c.rebuild_cost,
            c.nbytes,
            c.tick,
        ),
    )
    for c in order:
        if resident + incoming <= budget:
            break
        out.append(c)
        resident -= c.nbytes
    return out


# The share of a memory tier's budget kept for decoded patches: within it, the patches most
# worth keeping are dropped only after every weights copy (``memory_victim_parts``). A decoded patch
# is a few percent of a snapshot and every rebuild through it needs it (reading it back: file,
# hash, decode, 1-2 snapshot loads' worth), while the LRU credits weights by their requests:
# without a share, loads of hot versions pushed out the patches every load then read again.
PATCH_SHARE = 0.25


# Recent uses (``decayed_uses``) from which the most used weights copy is the tier's hottest.
HOT_MIN_USES = 2.0


def hottest(candidates: Iterable[MemoryCandidate], min_uses: float = HOT_MIN_USES) -> int | None:
    """The version whose weights copy recent requests used most (at least ``min_uses``), if
    any. The patch share leaves room for it and one version loading: in a budget of a few
    versions, protected patches of versions asked for once each pushed the version every
    request asks for out, and it was loaded again."""
    best: MemoryCandidate | None = None
    for c in candidates:
        if c.part == "weights" and c.uses >= min_uses and (best is None or c.uses > best.uses):
            best = c
    return None if best is None else best.version


# A weights copy with at least this share of the recent uses of every weights copy in its tier
# is hot (``hot_versions``). An RL trainer's requests are mostly at the newest one or two
# versions, each well above it; a spread of older versions asked for now and then each falls
# below it.
HOT_SHARE = 0.1


def hot_versions(
    candidates: Iterable[MemoryCandidate],
    share: float = HOT_SHARE,
    min_uses: float = HOT_MIN_USES,
) -> set[int]:
    """The versions whose weights copies carry at least ``share`` of the recent uses of all
    the weights copies given (and ``min_uses``): evicted only after the copies nothing queued
    needs (``memory_victim_parts``)."""
    weights = [c for c in candidates if c.part == "weights"]
    total = sum(c.uses for c in weights)
    return {c.version for c in weights if c.uses >= min_uses and c.uses >= share * total}


def patch_share(
    patches: Iterable[MemoryCandidate], budget: int, share: float = PATCH_SHARE
) -> set[int]:
    """The versions whose decoded patches are protected: the ones most worth keeping
    (``keep_until``, latest first) while they fit in ``share`` of ``budget``."""
    out: set[int] = set()
    room = share * budget
    for c in sorted(patches, key=lambda c: (-c.keep_until, c.nbytes, -c.tick)):
        if c.nbytes > room:
            break
        room -= c.nbytes
        out.add(c.version)
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
