"""What the snapshot store answers with: publish outcomes, version records, statistics.

Plain frozen dataclasses (no torch), so the transports convert them without touching tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["LaggingStats", "PublishOutcome", "StoreStats", "TierStats", "VersionRecord"]


@dataclass(frozen=True)
class PublishOutcome:
    version: int
    sha256: str
    created: bool  # False: an idempotent re-publish of the same weights
    nbytes: int
    kind: str = "keyframe"


@dataclass(frozen=True)
class VersionRecord:
    version: int
    sha256: str
    nbytes: int  # bytes of the full weights in the serving dtype
    tiers: frozenset[str]  # where it is resident now: "device", "host", "disk"
    kind: str  # "keyframe" or "patch" (the changed elements against ``parent``)
    parent: int | None
    leases: int
    created_at: float  # clock seconds of the publish
    last_used: float  # clock seconds of the last acquire (or the publish)
    in_use: int = 0  # requests holding it right now
    stored_nbytes: int = 0  # bytes its file takes on disk (a patch: far less than nbytes)
    file: str = ""  # its file under the snapshot directory's weights/
    patch_cached: bool = False  # its decoded patch is held in memory
    base: int | None = None  # an adapter version's base version (kind "adapter")


@dataclass(frozen=True)
class TierStats:
    """One tier's bytes against its budget."""

    bytes: int
    budget: int
    versions: int  # versions whose weights it holds
    evictions: int
    peak_bytes: int  # the most ever resident + being loaded


@dataclass(frozen=True)
class LaggingStats:
    advances: int = 0  # times the lagging copy moved forward by patches
    patches_applied: int = 0
    reloads: int = 0  # times it was loaded whole (start, a keyframe on the way, a gap)
    passed: int = 0  # acquires of a version it had passed (served by the snapshot path)


@dataclass(frozen=True)
class StoreStats:
    """Live numbers for metrics and the status page (``SnapshotStore.stats``)."""

    tiers: dict[str, TierStats]  # "device", "host", "disk"
    versions: int
    newest: int | None  # newest acknowledged
    watermark: int | None
    leases: int
    tombstones: int
    in_use: int  # versions pinned by running requests
    publishes: int
    snapshot_bytes: int  # one version's weights
    patch_bytes: int  # decoded patches held in memory
    load_seconds: float  # spent building versions in memory
    device_hits: int
    loads_disk: int
    loads_host: int
    load_waits: int  # acquirers that waited on another's load of the same version
    bytes_read: int
    verified_loads: int  # loads whose bytes were hash-checked (first load after a restart)
    rebuilds: int  # versions built from a base plus patches
    patches_applied: int
    lagging: LaggingStats
    # Hot traffic first (snapshots/yielding.py; on a CPU): seconds background work paused for
    # forwards, the turns it took while forwards waited, and the seconds forwards waited.
    background_paused_s: float = 0.0
    background_turns: int = 0
    forward_turn_wait_s: float = 0.0
