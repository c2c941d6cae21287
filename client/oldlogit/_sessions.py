"""The client side of multi-rank publish sessions (README "Publishing from several ranks").

In: a session's calls as one rank makes them — open, upload a part (bytes streamed from a
blocking iterator, e.g. tensors gathered one at a time), commit it with the rank's own hash,
read the state, abort — and ``publish_part``, which does upload + commit for one rank's share
of a state dict (full, or a delta against the rank's own last share). Out: ``SessionInfo``.
Every call of a session is routed by its ``policy_version``, so all ranks reach the same
replica. A mixin of ``AsyncClient``; torch is never imported here.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, Literal, Protocol

from oldlogit.contract.errors import InvalidRequest
from oldlogit.contract.types import OpenSession, SessionInfo

if TYPE_CHECKING:
    from oldlogit._publish import WeightsCopy
    from oldlogit.contract.layout import WeightLayout
    from oldlogit.transport.base import Transport

__all__ = ["SessionsMixin"]


class _Client(Protocol):
    _publish_timeout_s: float | None

    async def _call(
        self,
        op: Callable[[Transport, float | None], Awaitable[SessionInfo]],
        *,
        timeout_s: float | Literal["client"] | None = "client",
        key: int | None = None,
        retry: bool = True,
    ) -> SessionInfo: ...

    async def weight_layout(self) -> WeightLayout: ...

    async def upload_part(
        self,
        session_id: str,
        rank: int,
        chunks: Iterator[bytes],
        total_bytes: int,
        *,
        policy_version: int,
    ) -> SessionInfo: ...

    async def commit_part(
        self, session_id: str, rank: int, sha256: str, *, policy_version: int
    ) -> SessionInfo: ...


class SessionsMixin:
    """Session calls of ``AsyncClient`` (which provides ``_call`` and ``weight_layout``)."""

    async def open_session(
        self: _Client,
        session_id: str,
        policy_version: int,
        members: int,
        *,
        delta: bool = False,
        parent: int | None = None,
        sha256: str | None = None,
        ttl_s: float | None = None,
    ) -> SessionInfo:
        """Open a publish session (idempotent for the same id and parameters)."""
        req = OpenSession(
            session_id=session_id,
            policy_version=policy_version,
            members=members,
            delta=delta,
            parent=parent,
            sha256=sha256,
            ttl_s=ttl_s,
        )
        info: SessionInfo = await self._call(
            lambda t, rem: t.open_session(req, rem), key=policy_version
        )
        return info

    async def upload_part(
        self: _Client,
        session_id: str,
        rank: int,
        chunks: Iterator[bytes],
        total_bytes: int,
        *,
        policy_version: int,
    ) -> SessionInfo:
        """Stage rank's part, read from ``chunks`` (a blocking iterator, pulled on a worker
        thread) of ``total_bytes`` bytes. Not retried: the iterator cannot be replayed."""
        from oldlogit._publish import aiter_in_thread

        async def op(t: Transport, rem: float | None) -> SessionInfo:
            return await t.upload_part(
                session_id, rank, aiter_in_thread(chunks, None), total_bytes, rem
            )

        info: SessionInfo = await self._call(
            op, timeout_s=self._publish_timeout_s, key=policy_version, retry=False
        )
        return info

    async def commit_part(
        self: _Client, session_id: str, rank: int, sha256: str, *, policy_version: int
    ) -> SessionInfo:
        """Commit rank's staged part with the rank's hash; the last commit publishes."""
        info: SessionInfo = await self._call(
            lambda t, rem: t.commit_part(session_id, rank, sha256, rem),
            timeout_s=self._publish_timeout_s,
            key=policy_version,
        )
        return info

    async def session(self: _Client, session_id: str, *, policy_version: int) -> SessionInfo:
        """A session's state (``published`` carries the version's ``PublishResult``)."""
        info: SessionInfo = await self._call(
            lambda t, rem: t.get_session(session_id, rem), key=policy_version
        )
        return info

    async def abort_session(self: _Client, session_id: str, *, policy_version: int) -> SessionInfo:
        """Abort a session: its parts are dropped, nothing is published."""
        info: SessionInfo = await self._call(
            lambda t, rem: t.abort_session(session_id, rem), key=policy_version
        )
        return info

    async def publish_part(
        self: _Client,
        session_id: str,
        rank: int,
        weights: Mapping[str, Any],
        *,
        policy_version: int,
        parent_copy: WeightsCopy | None = None,
        cast: bool = False,
    ) -> tuple[SessionInfo, WeightsCopy | None]:
        """Upload and commit rank's share of the weights (a ``{name: tensor}``, any names the
        model's layout maps, a subset of the model).

        With ``parent_copy`` (this rank's share as it sent it last, from the previous call) the
        part is a delta against it; the session must be a delta session. Returns the session's
        state and this share's copy for the next delta (None for a full part).
        """
        from oldlogit._publish import SafetensorsStream, WeightsCopy
        from oldlogit.contract.delta import FORMAT

        layout = await self.weight_layout()
        if parent_copy is None:
            stream = SafetensorsStream.from_state_dict(weights, layout, cast=cast, partial=True)
            sha = await asyncio.to_thread(stream.sha256)
            copy = None
        else:
            copy = await asyncio.to_thread(
                WeightsCopy.read, weights, layout, cast=cast, partial=True
            )
            if not copy.matches(parent_copy):
                raise InvalidRequest(
                    "this rank's share holds other tensors than at its last publish: publish "
                    "it full",
                    parameter="parent_copy",
                )
            meta = {"format": FORMAT, "owned": json.dumps(sorted(copy.tensors))}
            stream = await asyncio.to_thread(copy.delta_stream, parent_copy, meta)
            sha = copy.sha256
        await self.upload_part(
            session_id, rank, stream.chunks(), stream.total_bytes, policy_version=policy_version
        )
        info = await self.commit_part(session_id, rank, sha, policy_version=policy_version)
        return info, copy
