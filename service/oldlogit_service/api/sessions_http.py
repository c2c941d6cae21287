"""HTTP routes of multi-rank publish sessions (README "Publishing from several ranks").

Each route checks auth, converts, calls ``sessions.Sessions`` off the event loop, converts back;
errors of the tree are answered by the app's one handler. Added to the app by ``create_app``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from oldlogit.errors import InvalidRequest, LimitExceeded
from oldlogit.types import MAX_VERSION, SessionInfo
from oldlogit_service.runtime import Runtime
from oldlogit_service.sessions import sessions_of

__all__ = ["session_routes"]


class OpenSessionBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    session_id: str = Field(min_length=8, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    policy_version: int = Field(ge=0, le=MAX_VERSION)
    members: int = Field(ge=1, le=4096)
    delta: bool = False
    parent: int | None = Field(None, ge=0, le=MAX_VERSION)
    sha256: str | None = Field(None, pattern=r"^[0-9a-fA-F]{64}$")
    ttl_s: float | None = Field(None, gt=0, le=86400)


class CommitBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    sha256: str = Field(pattern=r"^[0-9a-fA-F]{64}$")


def session_routes(rt: Runtime, auth: Callable[..., None]) -> APIRouter:
    """The routes, with ``auth(request, write=...)`` the app's own check."""
    router = APIRouter()
    sessions = sessions_of(rt)
    max_upload_bytes = int(rt.settings.max_upload_gib * 1024**3)

    @router.post("/v1/sessions", response_model=SessionInfo, summary="Open a publish session")
    async def open_session(request: Request, body: OpenSessionBody) -> SessionInfo:
        auth(request, write=True)
        return await asyncio.to_thread(
            sessions.open,
            body.session_id,
            body.policy_version,
            body.members,
            delta=body.delta,
            parent=body.parent,
            sha256=body.sha256,
            ttl_s=body.ttl_s,
        )

    @router.put(
        "/v1/sessions/{session_id}/parts/{rank}",
        response_model=SessionInfo,
        summary="Stage one rank's part: the body is a safetensors file, streamed",
        openapi_extra={
            "requestBody": {
                "required": True,
                "content": {
                    "application/octet-stream": {"schema": {"type": "string", "format": "binary"}}
                },
            }
        },
    )
    async def put_part(request: Request, session_id: str, rank: int) -> SessionInfo:
        auth(request, write=True)
        path = await asyncio.to_thread(sessions.part_path, session_id, rank)
        size = 0
        try:
            with open(path, "wb") as f:
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > max_upload_bytes:
                        raise LimitExceeded(
                            f"the part exceeds the limit of {max_upload_bytes} bytes",
                            parameter="body",
                        )
                    f.write(chunk)
            if size == 0:
                raise InvalidRequest("the part is empty: send a safetensors file", parameter="body")
            return await asyncio.to_thread(sessions.stage, session_id, rank, path)
        finally:
            path.unlink(missing_ok=True)

    @router.post(
        "/v1/sessions/{session_id}/parts/{rank}/commit",
        response_model=SessionInfo,
        summary="Commit a staged part with the rank's hash; the last commit publishes",
    )
    async def commit_part(
        request: Request, session_id: str, rank: int, body: CommitBody
    ) -> SessionInfo:
        auth(request, write=True)
        return await asyncio.to_thread(sessions.commit, session_id, rank, body.sha256)

    @router.get("/v1/sessions/{session_id}", response_model=SessionInfo)
    async def get_session(request: Request, session_id: str) -> SessionInfo:
        auth(request, write=False)
        return await asyncio.to_thread(sessions.get, session_id)

    @router.delete("/v1/sessions/{session_id}", response_model=SessionInfo)
    async def abort_session(request: Request, session_id: str) -> SessionInfo:
        auth(request, write=True)
        return await asyncio.to_thread(sessions.abort, session_id)

    return router
