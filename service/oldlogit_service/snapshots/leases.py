"""Leases: (version, holder, ttl) records that pin a version on disk until they end.

In: lease/renew/release calls and an injectable clock. Out: the live lease records and, from
``sweep``, the ones that expired. Not thread-safe on its own (the store's lock guards it) and
never touches the disk: the store persists the records in its registry.
"""

from __future__ import annotations

import heapq
import math
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any

from oldlogit.contract.errors import InvalidRequest, UnknownLease

__all__ = ["MAX_HOLDER_CHARS", "LeaseRecord", "LeaseTable", "check_ttl"]

MAX_HOLDER_CHARS = 256


@dataclass(frozen=True)
class LeaseRecord:
    lease_id: str
    version: int
    holder: str
    ttl_s: float
    expires_at: float  # clock seconds (unix time with the default clock)

    def to_json(self) -> dict[str, Any]:
        return {
            "lease_id": self.lease_id,
            "version": self.version,
            "holder": self.holder,
            "ttl_s": self.ttl_s,
            "expires_at": self.expires_at,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> LeaseRecord:
        return cls(
            lease_id=str(d["lease_id"]),
            version=int(d["version"]),
            holder=str(d["holder"]),
            ttl_s=float(d["ttl_s"]),
            expires_at=float(d["expires_at"]),
        )


def check_ttl(ttl_s: float) -> float:
    if isinstance(ttl_s, bool) or not isinstance(ttl_s, (int, float)):
        raise InvalidRequest("ttl_s must be a number of seconds", parameter="ttl_s")
    ttl = float(ttl_s)
    if not math.isfinite(ttl) or ttl <= 0:
        raise InvalidRequest(
            f"ttl_s must be a positive number of seconds, got {ttl_s}", parameter="ttl_s"
        )
    return ttl


def _check_holder(holder: str) -> str:
    if not isinstance(holder, str) or len(holder) > MAX_HOLDER_CHARS:
        raise InvalidRequest(
            f"holder must be a string of at most {MAX_HOLDER_CHARS} characters",
            parameter="holder",
        )
    return holder


class LeaseTable:
    """The live leases. ``new``/``renewed`` build records without storing them, so the store
    can persist first and ``put`` after: a lease is never live before it is durable."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._by_id: dict[str, LeaseRecord] = {}
        self._count: dict[int, int] = {}
        # (expires_at, lease_id), possibly stale after renew/release: sweep is O(expired log n)
        # rather than a scan of every lease on every store operation.
        self._expiry: list[tuple[float, str]] = []

    def new(self, version: int, holder: str, ttl_s: float) -> LeaseRecord:
        ttl = check_ttl(ttl_s)
        return LeaseRecord(
            lease_id=uuid.uuid4().hex,
            version=version,
            holder=_check_holder(holder),
            ttl_s=ttl,
            expires_at=self._clock() + ttl,
        )

    def get(self, lease_id: str) -> LeaseRecord:
        rec = self._by_id.get(lease_id) if isinstance(lease_id, str) else None
        if rec is None:
            raise UnknownLease(
                f"lease_id {lease_id!r} names no live lease (never granted, released, or expired)",
                parameter="lease_id",
            )
        return rec

    def renewed(self, lease_id: str, ttl_s: float) -> LeaseRecord:
        ttl = check_ttl(ttl_s)
        return replace(self.get(lease_id), ttl_s=ttl, expires_at=self._clock() + ttl)

    def put(self, rec: LeaseRecord) -> None:
        old = self._by_id.get(rec.lease_id)
        if old is not None:
            self._dec(old.version)
        self._by_id[rec.lease_id] = rec
        self._count[rec.version] = self._count.get(rec.version, 0) + 1
        heapq.heappush(self._expiry, (rec.expires_at, rec.lease_id))

    def remove(self, lease_id: str) -> LeaseRecord:
        rec = self.get(lease_id)
        del self._by_id[lease_id]
        self._dec(rec.version)
        return rec

    def _dec(self, version: int) -> None:
        n = self._count[version] - 1
        if n:
            self._count[version] = n
        else:
            del self._count[version]

    def sweep(self) -> list[LeaseRecord]:
        """Drop and return the leases whose time is up."""
        now = self._clock()
        expired: list[LeaseRecord] = []
        while self._expiry and self._expiry[0][0] <= now:
            at, lease_id = heapq.heappop(self._expiry)
            rec = self._by_id.get(lease_id)
            if rec is not None and rec.expires_at == at:  # else renewed or released since
                expired.append(self.remove(lease_id))
        return expired

    def count(self, version: int) -> int:
        return self._count.get(version, 0)

    def leased_versions(self) -> set[int]:
        return set(self._count)

    def records(
        self, *, without: str | None = None, extra: LeaseRecord | None = None
    ) -> list[LeaseRecord]:
        """The records as they will be persisted (optionally one removed or replaced/added)."""
        out = [
            r
            for lid, r in self._by_id.items()
            if lid != without and (extra is None or lid != extra.lease_id)
        ]
        if extra is not None:
            out.append(extra)
        return sorted(out, key=lambda r: (r.version, r.lease_id))

    def load(self, records: Iterable[LeaseRecord]) -> None:
        for rec in records:
            self.put(rec)

    def __len__(self) -> int:
        return len(self._by_id)
