"""The client side of multi-rank publish sessions (docs/multi-rank-publishing.md).

In: a session's calls as one rank makes them — open, upload a part (bytes streamed from a
blocking iterator, e.g. tensors gathered one at a time), commit it with the rank's own hash,
read the state, abort — and ``publish_part``, which does upload + commit for one rank's share
of a state dict (full, or a delta against the rank's own last share). Out: ``SessionInfo``.
Every call of a session is routed by its ``policy_version``, so all ranks reach the same
replica. The ``Publisher`` owns one ``Sessions``; ``AsyncClient``'s session methods call it.
Keeps no state of its own (a rank's last share is the caller's ``parent_copy``); never imports
torch.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from oldlogit.contract.delta import FORMAT
from oldlogit.contract.errors import InvalidRequest
from oldlogit.contract.layout import WeightLayout
from oldlogit.contract.types import OpenSession, SessionInfo
from oldlogit.publishing.streams import SafetensorsStream, WeightsCopy, aiter_in_thread

if TYPE_CHECKING:
    from oldlogit.transport.base import Transport
    from oldlogit.transport.pool import TransportPool

__all__ = ["Sessions"]


class Sessions:
    """Session calls over the client's pool. ``layout``: the model's weight layout (fetched
    once by the ``Publisher``); ``timeout_s``: the deadline of uploads and commits (the
    client's ``publish_timeout_s``), other calls have the client's."""

    def __init__(
        self,
        pool: TransportPool,
        layout: Callable[[], Awaitable[WeightLayout]],
        *,
        timeout_s: float | None,
    ) -> None:
        self._pool = pool
        self._layout = layout
        self._timeout_s = timeout_s

    async def open(
        self,
        session_id: str,
        policy_version: int,
        members: int,
        *,
        delta: bool,
        parent: int | None,
        sha256: str | None,
        ttl_s: float | None,
    ) -> SessionInfo:
        req = OpenSession(
            session_id=session_id,
            policy_version=policy_version,
            members=members,
            delta=delta,
            parent=parent,
            sha256=sha256,
            ttl_s=ttl_s,
        )
        return await self._pool.call(lambda t, rem: t.open_session(req, rem), key=policy_version)

    async def upload_part(
        self,
        session_id: str,
        rank: int,
        chunks: Iterator[bytes],
        total_bytes: int,
        *,
        policy_version: int,
    ) -> SessionInfo:
        """Not retried: the iterator cannot be replayed."""

        async def op(t: Transport, rem: float | None) -> SessionInfo:
            return await t.upload_part(
                session_id, rank, aiter_in_thread(chunks, None), total_bytes, rem
            )

        return await self._pool.call(op, timeout_s=self._timeout_s, key=policy_version, retry=False)

    async def commit_part(
        self, session_id: str, rank: int, sha256: str, *, policy_version: int
    ) -> SessionInfo:
        return await self._pool.call(
            lambda t, rem: t.commit_part(session_id, rank, sha256, rem),
            timeout_s=self._timeout_s,
            key=policy_version,
        )

    async def get(self, session_id: str, *, policy_version: int) -> SessionInfo:
        return await self._pool.call(
            lambda t, rem: t.get_session(session_id, rem), key=policy_version
        )

    async def abort(self, session_id: str, *, policy_version: int) -> SessionInfo:
        return await self._pool.call(
            lambda t, rem: t.abort_session(session_id, rem), key=policy_version
        )

    async def publish_part(
        self,
        session_id: str,
        rank: int,
        weights: Mapping[str, Any],
        *,
        policy_version: int,
        parent_copy: WeightsCopy | None,
        cast: bool,
    ) -> tuple[SessionInfo, WeightsCopy | None]:
        """Upload + commit one rank's share: full (hashed as streamed), or a delta against
        ``parent_copy`` whose metadata lists the tensors the share owns."""
        layout = await self._layout()
        copy: WeightsCopy | None
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
