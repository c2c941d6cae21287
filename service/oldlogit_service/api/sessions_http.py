"""HTTP routes of multi-rank publish sessions (README "Publishing from several ranks").

Each route converts and calls the runtime; auth is the app's gate and errors of the tree are
answered by the app's one handler, as for every route. Added to the app by ``create_app``.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from oldlogit.types import MAX_VERSION, SessionInfo
from oldlogit_service.runtime import Runtime

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


def session_routes(rt: Runtime) -> APIRouter:
    """The routes; auth is the app's gate (GET reads, the rest writes), as for every route."""
    router = APIRouter()

    @router.post("/v1/sessions", response_model=SessionInfo, summary="Open a publish session")
    async def open_session(body: OpenSessionBody) -> SessionInfo:
        return await rt.open_session(
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
        return await rt.stage_part(session_id, rank, request.stream())

    @router.post(
        "/v1/sessions/{session_id}/parts/{rank}/commit",
        response_model=SessionInfo,
        summary="Commit a staged part with the rank's hash; the last commit publishes",
    )
    async def commit_part(session_id: str, rank: int, body: CommitBody) -> SessionInfo:
        return await rt.commit_part(session_id, rank, body.sha256)

    @router.get("/v1/sessions/{session_id}", response_model=SessionInfo)
    async def get_session(session_id: str) -> SessionInfo:
        return await rt.get_session(session_id)

    @router.delete("/v1/sessions/{session_id}", response_model=SessionInfo)
    async def abort_session(session_id: str) -> SessionInfo:
        return await rt.abort_session(session_id)

    return router
