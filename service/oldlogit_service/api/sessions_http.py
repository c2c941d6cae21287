"""HTTP routes of multi-rank publish sessions (docs/multi-rank-publishing.md).

Each route converts and calls the intake (``publishing.intake.Intake``); auth is the app's gate
and errors of the tree are answered by the app's one handler, as for every route. Added to the
app by ``create_app``.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from oldlogit.contract.types import OpenSession, SessionInfo
from oldlogit_service.publishing.intake import Intake

__all__ = ["session_routes"]


class CommitBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    sha256: str = Field(pattern=r"^[0-9a-fA-F]{64}$")


def session_routes(intake: Intake) -> APIRouter:
    """The routes; auth is the app's gate (GET reads, the rest writes), as for every route."""
    router = APIRouter()

    @router.post("/v1/sessions", response_model=SessionInfo, summary="Open a publish session")
    async def open_session(body: OpenSession) -> SessionInfo:
        return await intake.open_session(body)

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
        return await intake.stage_part(session_id, rank, request.stream())

    @router.post(
        "/v1/sessions/{session_id}/parts/{rank}/commit",
        response_model=SessionInfo,
        summary="Commit a staged part with the rank's hash; the last commit publishes",
    )
    async def commit_part(session_id: str, rank: int, body: CommitBody) -> SessionInfo:
        return await intake.commit_part(session_id, rank, body.sha256)

    @router.get("/v1/sessions/{session_id}", response_model=SessionInfo)
    async def get_session(session_id: str) -> SessionInfo:
        return await intake.get_session(session_id)

    @router.delete("/v1/sessions/{session_id}", response_model=SessionInfo)
    async def abort_session(session_id: str) -> SessionInfo:
        return await intake.abort_session(session_id)

    return router
