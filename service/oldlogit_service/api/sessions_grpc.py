"""gRPC methods of multi-rank publish sessions (README "Publishing from several ranks").

A mixin of ``OldLogitServicer``: each method converts, calls ``sessions.Sessions`` off the
event loop, converts back; auth, errors and metrics are the service interceptor's, as for every
OldLogit method.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, BinaryIO

from oldlogit import convert
from oldlogit._proto.oldlogit.v1 import oldlogit_pb2 as pb
from oldlogit.errors import InvalidRequest, LimitExceeded
from oldlogit_service.sessions import Sessions, sessions_of

__all__ = ["SESSION_WRITE_METHODS", "SessionsServicerMixin"]

SESSION_WRITE_METHODS = {"OpenSession", "PublishPart", "CommitPart", "AbortSession"}


class SessionsServicerMixin:
    _rt: Any
    _max_upload: int

    @property
    def _sessions(self) -> Sessions:
        return sessions_of(self._rt)

    async def OpenSession(self, request: Any, context: Any) -> Any:
        info = await asyncio.to_thread(
            self._sessions.open,
            request.session_id,
            request.policy_version,
            request.members,
            delta=request.delta,
            parent=request.parent if request.HasField("parent") else None,
            sha256=request.sha256 or None,
            ttl_s=request.ttl_s if request.HasField("ttl_s") else None,
        )
        return convert.to_proto(info)

    async def PublishPart(self, request_iterator: AsyncIterator[Any], context: Any) -> Any:
        header: Any = None
        path: Path | None = None
        f: BinaryIO | None = None
        size = 0
        try:
            async for chunk in request_iterator:
                if chunk.HasField("header"):
                    if header is not None:
                        raise InvalidRequest(
                            "the part stream holds two headers", parameter="header"
                        )
                    header = chunk.header
                    path = await asyncio.to_thread(
                        self._sessions.part_path, header.session_id, header.rank
                    )
                    f = open(path, "wb")  # noqa: SIM115 - closed below
                    continue
                if f is None:
                    raise InvalidRequest(
                        "the first part chunk must carry the header", parameter="header"
                    )
                size += len(chunk.data)
                if size > self._max_upload:
                    raise LimitExceeded(
                        f"the part exceeds the limit of {self._max_upload} bytes", parameter="data"
                    )
                f.write(chunk.data)
            if f is None or path is None:
                raise InvalidRequest("the part stream is empty", parameter="header")
            f.close()
            if size == 0:
                raise InvalidRequest("the part holds no data", parameter="data")
            info = await asyncio.to_thread(
                self._sessions.stage, header.session_id, header.rank, path
            )
            return convert.to_proto(info)
        finally:
            if f is not None:
                f.close()
            if path is not None:
                path.unlink(missing_ok=True)

    async def CommitPart(self, request: Any, context: Any) -> Any:
        info = await asyncio.to_thread(
            self._sessions.commit, request.session_id, request.rank, request.sha256
        )
        return convert.to_proto(info)

    async def GetSession(self, request: Any, context: Any) -> Any:
        return convert.to_proto(await asyncio.to_thread(self._sessions.get, request.session_id))

    async def AbortSession(self, request: Any, context: Any) -> Any:
        info = await asyncio.to_thread(self._sessions.abort, request.session_id)
        return convert.to_proto(info)


_ = pb  # the messages these methods answer: oldlogit_pb2.SessionInfo
