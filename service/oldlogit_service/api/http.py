"""HTTP transport (FastAPI): each route converts, calls the runtime or the intake, converts back.

Authorisation runs first, in an ASGI gate that sees only the method, path and headers, so a
request without credentials gets its 401 before any body is read or validated (``access``
says which token a route needs). Errors of the tree are mapped by one handler from their class
attributes (status, code, Retry-After); framework errors (validation, unknown route) become
errors of the tree too, so every non-2xx body is ``{"error": {"code", "message", ...}}``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, Literal

from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from oldlogit.contract import wire
from oldlogit.contract.convert import PublishHeader
from oldlogit.contract.errors import (
    InternalError,
    InvalidRequest,
    LimitExceeded,
    NotFound,
    OldLogitError,
)
from oldlogit.contract.types import (
    MAX_VERSION,
    Info,
    LeaseInfo,
    LogprobsRequest,
    PublishResult,
    Trace,
    TraceRequest,
    VersionInfo,
)
from oldlogit_service import __version__
from oldlogit_service.api.auth import Auth
from oldlogit_service.api.sessions_http import session_routes
from oldlogit_service.api.status_page import render_status_page
from oldlogit_service.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from oldlogit_service.publishing.intake import Intake
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
    """The JSON shape of a publish by path; its fields are checked once, by ``PublishHeader``."""

    model_config = ConfigDict(extra="forbid")
    policy_version: int
    path: str
    sha256: str | None = None
    delta: bool = False
    parent: int | None = None


def error_response(exc: OldLogitError) -> Response:
    """The error body and headers, encoded by the very function the client decodes with."""
    status, body, headers = wire.encode_error(exc)
    return Response(body, status_code=status, headers=headers)


def _loc_to_parameter(loc: tuple[Any, ...]) -> str:
    return wire.parameter_path([p for p in loc if p not in ("body", "query", "path", "header")])


# Who may call what (docs/operations.md, "Security"). Probes are open; everything else reads
# with the read token (when one is set) — the API, /metrics, the status page, /docs and
# /openapi.json — and every method that changes state needs the write token, so a route added
# later is guarded by its method without being listed here.
OPEN_PATHS = frozenset({"/healthz", "/readyz"})
READ_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
READ_POSTS = frozenset({"/v1/logprobs", "/v1/trace"})  # reads with a body


def access(method: str, path: str) -> Literal["open", "read", "write"]:
    if path in OPEN_PATHS:
        return "open"
    if method in READ_METHODS or path in READ_POSTS:
        return "read"
    return "write"


def _bearer(headers: list[tuple[bytes, bytes]]) -> str | None:
    for key, value in headers:
        if key.lower() == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            return token.strip() if scheme.lower() == "bearer" else None
    return None


class AuthGate:
    """Authorise from the request line and headers alone, before routing reads the body."""

    def __init__(self, app: ASGIApp, auth: Auth) -> None:
        self.app = app
        self.auth = auth

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            kind = access(scope["method"], scope["path"])
            if kind != "open":
                client = scope.get("client")
                try:
                    self.auth.check(
                        write=kind == "write",
                        token=_bearer(scope["headers"]),
                        peer=client[0] if client else None,
                    )
                except OldLogitError as exc:
                    await error_response(exc)(scope, receive, send)
                    return
        await self.app(scope, receive, send)


def _add_probes(app: FastAPI, rt: Runtime) -> None:
    @app.get("/healthz", summary="Alive")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz", summary="Can serve: model loaded, not draining")
    async def readyz() -> JSONResponse:
        if rt.ready:
            return JSONResponse({"status": "ready"})
        why = rt.not_ready_reason  # e.g. which tensor-parallel rank is lost
        body = {"status": "not ready", **({"reason": why} if why else {})}
        return JSONResponse(body, status_code=503)


def create_health_app(rt: Runtime) -> FastAPI:
    """The plain-HTTP probe port (``--health-port``): ``/healthz`` and ``/readyz``, nothing else."""
    app = FastAPI(title="oldlogit probes", docs_url=None, redoc_url=None, openapi_url=None)
    _add_probes(app, rt)
    return app


def create_app(rt: Runtime, intake: Intake, auth: Auth) -> FastAPI:
    """The API app: ``rt`` answers logprobs, traces and reads, ``intake`` takes publishes and
    sessions, ``auth`` guards every route but the probes."""
    s = rt.settings
    max_request_bytes = int(s.max_request_mib * 1024 * 1024)
    app = FastAPI(
        title="oldlogit",
        version=__version__,
        description="Exact training-side logprobs of any retained policy version.",
    )

    # Added first, so it runs inside _observe (401s are counted) and before any route.
    app.add_middleware(AuthGate, auth=auth)

    @app.exception_handler(OldLogitError)
    async def _on_error(request: Request, exc: OldLogitError) -> Response:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _on_validation(request: Request, exc: RequestValidationError) -> Response:
        first = exc.errors()[0] if exc.errors() else {}
        param = _loc_to_parameter(tuple(first.get("loc", ())))
        msg = f"{param}: {first.get('msg', 'invalid value')}"
        return error_response(InvalidRequest(msg, parameter=param))

    @app.exception_handler(StarletteHTTPException)
    async def _on_http(request: Request, exc: StarletteHTTPException) -> Response:
        if exc.status_code == 404:
            return error_response(NotFound(f"no route {request.url.path}", parameter="path"))
        err = InvalidRequest(
            f"{request.method} {request.url.path}: {exc.detail}", parameter="method"
        )
        resp = error_response(err)
        resp.status_code = exc.status_code if 400 <= exc.status_code < 500 else 400
        return resp

    @app.exception_handler(Exception)
    async def _on_unexpected(request: Request, exc: Exception) -> Response:
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
        responses={
            200: {"description": "Scored logprobs only, in position order (docs/exactness.md)"}
        },
    )
    async def logprobs(request: Request) -> Response:
        body = await read_body(request, max_request_bytes, "request body")
        req = wire.decode_request(body, request.headers.get("content-type", wire.JSON_TYPE))
        resp = await rt.logprobs(req)
        media = wire.negotiate(request.headers.get("accept"))
        return Response(wire.encode_response(resp, req, media), media_type=media)

    @app.post(
        "/v1/trace",
        response_model=Trace,
        summary="Digests of every stage of one forward of a sequence at a version (where a "
        "trainer's forward and the service's first diverge)",
    )
    async def trace(body: TraceRequest) -> Trace:
        return await rt.trace(body)

    # -- versions ------------------------------------------------------------------------
    @app.get("/v1/versions", summary="Retained versions, their tiers, and the watermark")
    async def list_versions() -> dict[str, Any]:
        versions, watermark = await rt.versions()
        return {"versions": [v.model_dump(mode="json") for v in versions], "watermark": watermark}

    @app.get("/v1/versions/{policy_version}", response_model=VersionInfo)
    async def get_version(policy_version: int) -> VersionInfo:
        return await rt.version(policy_version)

    @app.delete("/v1/versions/{policy_version}")
    async def delete_version(policy_version: int) -> dict[str, int]:
        await rt.delete_version(policy_version)
        return {"deleted": policy_version}

    @app.put(
        "/v1/versions/{policy_version}",
        response_model=PublishResult,
        summary="Publish a version: the body is a safetensors file (delta=true: a delta; "
        "base_version=B: an adapter's LoRA tensors over version B), streamed",
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
        base_version: int | None = None,
    ) -> PublishResult:
        header = PublishHeader(
            policy_version, sha256=sha256, delta=delta, parent=parent, base_version=base_version
        )
        return await intake.publish_stream(header, request.stream())

    @app.post(
        "/v1/versions",
        response_model=PublishResult,
        summary="Publish a version from a path on storage the service can read",
    )
    async def publish_by_path(body: PublishByPathBody) -> PublishResult:
        header = PublishHeader(
            body.policy_version, sha256=body.sha256, delta=body.delta, parent=body.parent
        )
        return await intake.publish_path(header, body.path)

    # -- retention -----------------------------------------------------------------------
    @app.post("/v1/watermark", summary="The trainer will never ask below this version")
    async def set_watermark(body: WatermarkBody) -> dict[str, int]:
        return {"watermark": await rt.set_watermark(body.policy_version)}

    @app.post("/v1/leases", response_model=LeaseInfo, summary="Pin a version for ttl_s seconds")
    async def create_lease(body: LeaseBody) -> LeaseInfo:
        return await rt.create_lease(body.policy_version, body.holder, body.ttl_s)

    @app.delete("/v1/leases/{lease_id}")
    async def delete_lease(lease_id: str) -> dict[str, str]:
        await rt.release_lease(lease_id)
        return {"released": lease_id}

    # -- introspection -------------------------------------------------------------------
    @app.get("/v1/info", response_model=Info)
    async def info() -> Info:
        return await rt.info()

    @app.get("/v1/replicas", summary="Live replicas of the deployment (scale-out discovery)")
    async def replicas() -> dict[str, Any]:
        return {"replicas": await rt.replicas()}

    _add_probes(app, rt)

    @app.get("/metrics", summary="Prometheus metrics")
    async def metrics() -> Response:
        return Response(await rt.metrics_text(), media_type=METRICS_CONTENT_TYPE)

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    async def status_page() -> HTMLResponse:
        return HTMLResponse(await rt.status_page(render_status_page))

    app.include_router(session_routes(intake))  # multi-rank publish sessions
    return app
