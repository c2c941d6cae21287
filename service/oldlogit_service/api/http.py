"""HTTP transport (FastAPI): each route converts, calls ``Runtime``, converts back.

Errors of the tree are mapped by one handler from their class attributes (status, code,
Retry-After); framework errors (validation, unknown route) become errors of the tree too, so
every non-2xx body is ``{"error": {"code", "message", "parameter"?, "details"?}}``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from oldlogit import wire
from oldlogit.errors import (
    InternalError,
    InvalidRequest,
    LimitExceeded,
    NotFound,
    OldLogitError,
    Overloaded,
)
from oldlogit.types import MAX_VERSION, Info, LeaseInfo, LogprobsRequest, PublishResult, VersionInfo
from oldlogit_service import __version__
from oldlogit_service.api.sessions_http import session_routes
from oldlogit_service.api.status_page import render_status_page
from oldlogit_service.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from oldlogit_service.runtime import Runtime

logger = logging.getLogger(__name__)


class WatermarkBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    policy_version: int = Field(ge=0, le=MAX_VERSION)


class LeaseBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    policy_version: int = Field(ge=0, le=MAX_VERSION)
    holder: str = Field("", max_length=256)
    ttl_s: float = 300.0


class PublishByPathBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    policy_version: int = Field(ge=0, le=MAX_VERSION)
    path: str
    sha256: str | None = None
    delta: bool = False
    parent: int | None = Field(None, ge=0, le=MAX_VERSION)


def error_response(exc: OldLogitError) -> JSONResponse:
    headers = {}
    if isinstance(exc, Overloaded):
        headers["Retry-After"] = str(max(1, round(exc.retry_after_s)))
    return JSONResponse({"error": exc.to_payload()}, status_code=exc.http_status, headers=headers)


def _loc_to_parameter(loc: tuple[Any, ...]) -> str:
    parts = [p for p in loc if p not in ("body", "query", "path", "header")]
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or "body"


def _bearer(request: Request) -> str | None:
    auth = request.headers.get("authorization")
    if not auth:
        return None
    scheme, _, token = auth.partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None


def _negotiate(accept: str | None) -> str:
    if accept and wire.MSGPACK_TYPE in accept:
        return wire.MSGPACK_TYPE
    return wire.JSON_TYPE


def create_app(rt: Runtime) -> FastAPI:
    s = rt.settings
    max_request_bytes = int(s.max_request_mib * 1024 * 1024)
    max_upload_bytes = int(s.max_upload_gib * 1024**3)
    app = FastAPI(
        title="oldlogit",
        version=__version__,
        description="Exact training-side logprobs of any retained policy version.",
    )

    def auth(request: Request, *, write: bool) -> None:
        peer = request.client.host if request.client else None
        rt.authorize(write=write, token=_bearer(request), peer=peer)

    @app.exception_handler(OldLogitError)
    async def _on_error(request: Request, exc: OldLogitError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _on_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        param = _loc_to_parameter(tuple(first.get("loc", ())))
        msg = f"{param}: {first.get('msg', 'invalid value')}"
        return error_response(InvalidRequest(msg, parameter=param))

    @app.exception_handler(StarletteHTTPException)
    async def _on_http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            return error_response(NotFound(f"no route {request.url.path}", parameter="path"))
        err = InvalidRequest(
            f"{request.method} {request.url.path}: {exc.detail}", parameter="method"
        )
        resp = error_response(err)
        resp.status_code = exc.status_code if 400 <= exc.status_code < 500 else 400
        return resp

    @app.exception_handler(Exception)
    async def _on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s", request.url.path, exc_info=exc)
        return error_response(InternalError("internal error; see the server log"))

    @app.middleware("http")
    async def _observe(
        request: Request, call_next: Callable[[Request], Awaitable[Response]]
    ) -> Response:
        start = time.perf_counter()
        response = await call_next(request)
        route = request.scope.get("route")
        path = getattr(route, "path", "unmatched")
        rt.metrics.latency.labels(path, "http").observe(time.perf_counter() - start)
        rt.metrics.requests.labels(path, "http", str(response.status_code)).inc()
        return response

    async def read_body(request: Request, limit: int, what: str) -> bytes:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise LimitExceeded(
                f"the {what} is {declared} bytes; the limit is {limit}", parameter="body"
            )
        chunks: list[bytes] = []
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise LimitExceeded(
                    f"the {what} exceeds the limit of {limit} bytes", parameter="body"
                )
            chunks.append(chunk)
        return b"".join(chunks)

    # -- logprobs ------------------------------------------------------------------------
    @app.post(
        "/v1/logprobs",
        summary="Training-side logprobs of tokens under retained policy versions",
        openapi_extra={
            "requestBody": {
                "required": True,
                "content": {
                    wire.JSON_TYPE: {"schema": LogprobsRequest.model_json_schema()},
                    wire.MSGPACK_TYPE: {"schema": {"type": "string", "format": "binary"}},
                },
            }
        },
        responses={200: {"description": "Scored logprobs only, in position order; see README"}},
    )
    async def logprobs(request: Request) -> Response:
        auth(request, write=False)
        body = await read_body(request, max_request_bytes, "request body")
        req = wire.decode_request(body, request.headers.get("content-type", wire.JSON_TYPE))
        resp = await rt.logprobs(req)
        media = _negotiate(request.headers.get("accept"))
        return Response(wire.encode_response(resp, req, media), media_type=media)

    # -- versions ------------------------------------------------------------------------
    @app.get("/v1/versions", summary="Retained versions, their tiers, and the watermark")
    async def list_versions(request: Request) -> dict[str, Any]:
        auth(request, write=False)
        versions, watermark = await asyncio.to_thread(rt.versions)
        return {"versions": [v.model_dump(mode="json") for v in versions], "watermark": watermark}

    @app.get("/v1/versions/{policy_version}", response_model=VersionInfo)
    async def get_version(request: Request, policy_version: int) -> VersionInfo:
        auth(request, write=False)
        return await asyncio.to_thread(rt.version, policy_version)

    @app.delete("/v1/versions/{policy_version}")
    async def delete_version(request: Request, policy_version: int) -> dict[str, int]:
        auth(request, write=True)
        await rt.delete_version(policy_version)
        return {"deleted": policy_version}

    @app.put(
        "/v1/versions/{policy_version}",
        response_model=PublishResult,
        summary="Publish a version: the body is a safetensors file (delta=true: a delta), streamed",
        openapi_extra={
            "requestBody": {
                "required": True,
                "content": {
                    "application/octet-stream": {"schema": {"type": "string", "format": "binary"}}
                },
            }
        },
    )
    async def publish(
        request: Request,
        policy_version: int,
        sha256: str | None = None,
        delta: bool = False,
        parent: int | None = None,
    ) -> PublishResult:
        auth(request, write=True)
        if parent is not None and not delta:
            raise InvalidRequest("parent applies to delta uploads only", parameter="parent")
        incoming = rt.store.staging_dir  # same filesystem as the snapshots: a rename, no copy
        incoming.mkdir(parents=True, exist_ok=True)
        tmp = incoming / f"upload-{policy_version}-{uuid.uuid4().hex}.safetensors.part"
        size = 0
        try:
            with open(tmp, "wb") as f:
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > max_upload_bytes:
                        raise LimitExceeded(
                            f"the upload exceeds the limit of {max_upload_bytes} bytes",
                            parameter="body",
                        )
                    f.write(chunk)
            if size == 0:
                raise InvalidRequest(
                    "the request body is empty: send a safetensors file", parameter="body"
                )
            if delta:  # the changed elements only, against parent (see README: delta format)
                return await rt.publish_delta_file(
                    policy_version, tmp, sha256=sha256, parent=parent
                )
            return await rt.publish_file(policy_version, tmp, sha256=sha256, move=True)
        finally:
            if tmp.exists():
                os.unlink(tmp)

    @app.post(
        "/v1/versions",
        response_model=PublishResult,
        summary="Publish a version from a path on storage the service can read",
    )
    async def publish_by_path(request: Request, body: PublishByPathBody) -> PublishResult:
        auth(request, write=True)
        return await rt.publish_path(
            body.policy_version,
            body.path,
            sha256=body.sha256,
            delta=body.delta,
            parent=body.parent,
        )

    # -- retention -----------------------------------------------------------------------
    @app.post("/v1/watermark", summary="The trainer will never ask below this version")
    async def set_watermark(request: Request, body: WatermarkBody) -> dict[str, int]:
        auth(request, write=True)
        return {"watermark": await rt.set_watermark(body.policy_version)}

    @app.post("/v1/leases", response_model=LeaseInfo, summary="Pin a version for ttl_s seconds")
    async def create_lease(request: Request, body: LeaseBody) -> LeaseInfo:
        auth(request, write=True)
        return await asyncio.to_thread(
            rt.create_lease, body.policy_version, body.holder, body.ttl_s
        )

    @app.delete("/v1/leases/{lease_id}")
    async def delete_lease(request: Request, lease_id: str) -> dict[str, str]:
        auth(request, write=True)
        await asyncio.to_thread(rt.release_lease, lease_id)
        return {"released": lease_id}

    # -- introspection -------------------------------------------------------------------
    @app.get("/v1/info", response_model=Info)
    async def info(request: Request) -> Info:
        auth(request, write=False)
        return rt.info()

    @app.get("/v1/replicas", summary="Live replicas of the deployment (scale-out discovery)")
    async def replicas(request: Request) -> dict[str, Any]:
        auth(request, write=False)
        return {"replicas": await asyncio.to_thread(rt.replicas)}

    @app.get("/healthz", summary="Alive")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz", summary="Can serve: model loaded, not draining")
    async def readyz() -> JSONResponse:
        if rt.ready:
            return JSONResponse({"status": "ready"})
        return JSONResponse({"status": "not ready"}, status_code=503)

    @app.get("/metrics", summary="Prometheus metrics")
    async def metrics() -> Response:
        return Response(rt.metrics.render(), media_type=METRICS_CONTENT_TYPE)

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    async def status_page() -> HTMLResponse:
        return HTMLResponse(await asyncio.to_thread(render_status_page, rt))

    app.include_router(session_routes(rt, auth))  # multi-rank publish sessions
    return app
