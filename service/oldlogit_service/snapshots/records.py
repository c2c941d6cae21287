"""What the snapshot store answers with: publish outcomes and version records.

Plain frozen dataclasses (no torch), so the transports convert them without touching tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PublishOutcome", "VersionRecord"]


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
