"""Multi-rank publish sessions: N parts staged, checked, committed, then one version.

In: session calls from the intake (``Intake.open_session`` … ``abort_session``, which both
transports call) — open (an ``OpenSession``), a part's bytes staged under the store's staging
directory, a commit carrying the rank's own hash, get, abort. Out: ``SessionInfo`` states, and
a version published through the snapshot store's public API (``publish_file`` on the parts as
shards, or ``publish_delta`` on the merged delta parts) once every part is committed, so
nothing is visible before that and the store verifies, persists and registers it as any other
publish. The protocol is docs/multi-rank-publishing.md. No HTTP, gRPC or asyncio.
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from oldlogit.contract.errors import (
    Conflict,
    InvalidRequest,
    LimitExceeded,
    NotFound,
    OldLogitError,
    WeightsMismatch,
)
from oldlogit.contract.types import OpenSession, PublishResult, SessionInfo
from oldlogit_service.publishing.parts import check_part, merge_delta

logger = logging.getLogger(__name__)

__all__ = ["Sessions"]

DEFAULT_TTL_S = 600.0
MAX_OPEN = 64  # sessions open at once on a replica


@dataclass
class _Part:
    path: Path
    sha256: str  # the service's hash of the part (see ``_part_hash``)
    names: frozenset[str]  # the tensors the rank owns (delta: changed or not)
    committed: bool = False


@dataclass
class _Session:
    session_id: str
    policy_version: int
    members: int
    delta: bool
    parent: int | None
    sha256: str | None
    ttl_s: float
    touched: float
    directory: Path
    parts: dict[int, _Part] = field(default_factory=dict)
    state: str = "open"  # open | published | failed | aborted
    result: PublishResult | None = None
    error: str = ""
    lock: threading.Lock = field(default_factory=threading.Lock)

    def same_request(self, other: _Session) -> bool:
        keys = ("policy_version", "members", "delta", "parent", "sha256")
        return all(getattr(self, k) == getattr(other, k) for k in keys)


class Sessions:
    """The replica's publish sessions over ``store``; see the module docstring.

    ``store`` needs ``staging_dir``, ``publish_file``, ``publish_delta``, ``acquire``,
    ``sha256`` and ``has``; ``specs`` is the model's canonical weight table; ``publish`` runs
    the store call that publishes a finished session and answers its ``PublishResult``.
    """

    def __init__(
        self,
        store: Any,
        specs: Mapping[str, tuple[str, tuple[int, ...]]],
        *,
        publish: Callable[[Callable[[], Any]], PublishResult],
        clock: Callable[[], float] = time.monotonic,
        max_open: int = MAX_OPEN,
    ) -> None:
        self._store = store
        # Runs the store call that publishes a finished session (the runtime's: metrics, the
        # proxy policy's fold), as every other publish.
        self._publish = publish
        self._specs = dict(specs)
        self._clock = clock
        self._max_open = max_open
        self._sessions: dict[str, _Session] = {}
        self._lock = threading.Lock()

    # -- calls ---------------------------------------------------------------------------
    def open(self, request: OpenSession) -> SessionInfo:
        """Open a session, or answer the open one with the same id and parameters.
        ``request`` was validated when it was made (``OpenSession``)."""
        ttl = DEFAULT_TTL_S if request.ttl_s is None else float(request.ttl_s)
        self.sweep()
        session_id = request.session_id
        want = _Session(
            session_id,
            request.policy_version,
            request.members,
            request.delta,
            request.parent,
            request.sha256.lower() if request.sha256 else None,
            ttl,
            self._clock(),
            self._store.staging_dir / f"session-{session_id}",
        )
        with self._lock:
            have = self._sessions.get(session_id)
            if have is not None:
                if not have.same_request(want):
                    raise Conflict(
                        f"session {session_id!r} is open with other parameters",
                        parameter="session_id",
                    )
                return self._info(have)
            if sum(s.state == "open" for s in self._sessions.values()) >= self._max_open:
                raise LimitExceeded(
                    f"{self._max_open} publish sessions are open already", parameter="session_id"
                )
            want.directory.mkdir(parents=True, exist_ok=True)
            self._sessions[session_id] = want
        logger.info(
            "session %s opened: v%d, %d members", session_id, want.policy_version, want.members
        )
        return self._info(want)

    def part_path(self, session_id: str, rank: int) -> Path:
        """A fresh file to stream rank's part into (then ``stage``)."""
        s = self._live(session_id)
        self._check_rank(s, rank)
        s.touched = self._clock()
        return s.directory / f"incoming-{rank}-{uuid.uuid4().hex}.part"

    def stage(self, session_id: str, rank: int, path: Path) -> SessionInfo:
        """Check a streamed part and hash it; it replaces an uncommitted part of the rank."""
        s = self._live(session_id)
        self._check_rank(s, rank)
        try:
            names, sha = check_part(path, self._specs, self._store, s.parent if s.delta else None)
        except OldLogitError:
            path.unlink(missing_ok=True)
            raise
        with s.lock:
            self._check_open(s)
            old = s.parts.get(rank)
            if old is not None and old.committed:
                path.unlink(missing_ok=True)
                if old.sha256 == sha:
                    return self._info(s)
                raise Conflict(
                    f"rank {rank}'s part is committed already, with other weights",
                    parameter="rank",
                )
            final = s.directory / f"part-{rank:05d}.safetensors"
            path.replace(final)
            s.parts[rank] = _Part(final, sha, names)
            s.touched = self._clock()
            return self._info(s)

    def commit(self, session_id: str, rank: int, sha256: str) -> SessionInfo:
        """Commit rank's staged part if ``sha256`` is its hash; the last commit publishes."""
        s = self._live(session_id)
        self._check_rank(s, rank)
        with s.lock:
            self._check_open(s)
            part = s.parts.get(rank)
            if part is None:
                raise NotFound(f"rank {rank} has no staged part", parameter="rank")
            if part.committed:
                if part.sha256 != sha256.lower():
                    raise Conflict(f"rank {rank}'s part is committed already", parameter="rank")
                return self._info(s)
            if part.sha256 != sha256.lower():
                del s.parts[rank]
                part.path.unlink(missing_ok=True)
                raise WeightsMismatch(
                    f"rank {rank}'s part hashes to {part.sha256} here, not {sha256}: send it again",
                    parameter="sha256",
                )
            for other, p in s.parts.items():
                shared = part.names & p.names if p.committed else frozenset()
                if shared:
                    del s.parts[rank]
                    part.path.unlink(missing_ok=True)
                    name = min(shared)
                    raise WeightsMismatch(
                        f"rank {rank}'s part holds {name!r}, which rank {other} sent already",
                        parameter="weights",
                        details={"tensor": name},
                    )
            part.committed = True
            s.touched = self._clock()
            if all(p.committed for p in s.parts.values()) and len(s.parts) == s.members:
                self._finish(s)
            return self._info(s)

    def get(self, session_id: str) -> SessionInfo:
        self.sweep()
        with self._lock:
            s = self._sessions.get(session_id)
        if s is None:
            raise NotFound(f"unknown publish session {session_id!r}", parameter="session_id")
        return self._info(s)

    def abort(self, session_id: str) -> SessionInfo:
        """Drop the session's parts; nothing is published. Idempotent."""
        with self._lock:
            s = self._sessions.get(session_id)
        if s is None:
            raise NotFound(f"unknown publish session {session_id!r}", parameter="session_id")
        with s.lock:
            if s.state == "open":
                self._end(s, "aborted", "aborted by a member")
            return self._info(s)

    # -- internals ----------------------------------------------------------------------
    def _live(self, session_id: str) -> _Session:
        self.sweep()
        with self._lock:
            s = self._sessions.get(session_id)
        if s is None:
            raise NotFound(f"unknown publish session {session_id!r}", parameter="session_id")
        self._check_open(s)
        return s

    @staticmethod
    def _check_open(s: _Session) -> None:
        if s.state != "open":
            why = f": {s.error}" if s.error else ""
            raise Conflict(f"session {s.session_id!r} is {s.state}{why}", parameter="session_id")

    @staticmethod
    def _check_rank(s: _Session, rank: int) -> None:
        if not 0 <= rank < s.members:
            raise InvalidRequest(f"rank must be in [0, {s.members})", parameter="rank")

    def _end(self, s: _Session, state: str, error: str = "") -> None:
        s.state, s.error = state, error
        shutil.rmtree(s.directory, ignore_errors=True)

    def sweep(self) -> None:
        """Abort sessions idle past their TTL; forget ended ones after a while."""
        now = self._clock()
        with self._lock:
            sessions = list(self._sessions.values())
        for s in sessions:
            if not s.lock.acquire(blocking=False):
                continue  # busy (a part being staged, the version being published): alive
            try:
                if s.state == "open" and now - s.touched > s.ttl_s:
                    logger.warning("session %s timed out: aborted", s.session_id)
                    self._end(s, "aborted", f"no activity for {s.ttl_s:g} s")
                    s.touched = now
                elif s.state != "open" and now - s.touched > max(s.ttl_s, 60.0):
                    with self._lock:
                        self._sessions.pop(s.session_id, None)
            finally:
                s.lock.release()

    def _finish(self, s: _Session) -> None:
        """All parts committed: check coverage and publish through the store."""
        owned = frozenset().union(*(p.names for p in s.parts.values()))
        missing = sorted(set(self._specs) - owned)
        try:
            if missing:
                more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
                raise WeightsMismatch(
                    f"no part holds tensor {missing[0]!r}{more}",
                    parameter="weights",
                    details={"tensor": missing[0]},
                )
            if s.delta:
                assert s.parent is not None
                paths = [p.path for p in s.parts.values()]
                merged = merge_delta(paths, s.directory, s.parent, self._store.sha256(s.parent))
                parent = s.parent
                result = self._publish(
                    lambda: self._store.publish_delta(
                        s.policy_version, merged, parent=parent, expected_sha256=s.sha256
                    )
                )
            else:
                result = self._publish(
                    lambda: self._store.publish_file(
                        s.policy_version, s.directory, expected_sha256=s.sha256
                    )
                )
        except OldLogitError as exc:
            logger.warning("session %s failed: %s", s.session_id, exc.message)
            self._end(s, "failed", f"{exc.code}: {exc.message}")
            return
        s.result = result
        self._end(s, "published")
        logger.info("session %s published v%d", s.session_id, s.policy_version)

    def _info(self, s: _Session) -> SessionInfo:
        return SessionInfo(
            session_id=s.session_id,
            policy_version=s.policy_version,
            members=s.members,
            delta=s.delta,
            parent=s.parent,
            state=s.state,
            committed=sorted(r for r, p in s.parts.items() if p.committed),
            parts={r: p.sha256 for r, p in s.parts.items()},
            result=s.result,
            error=s.error,
            expires_in_s=max(0.0, s.ttl_s - (self._clock() - s.touched)),
        )
