"""gRPC transport (grpc.aio): each method converts, calls the runtime or the intake, converts back.

One interceptor authorises every call before its handler runs (and before a malformed body is
reported), maps every error of the tree to its status code, with the error payload in the
trailing metadata (``oldlogit-error-bin``) and ``retry-after`` for Overloaded, and records
metrics. Also serves ``grpc.health.v1.Health`` (open, for probes) and server reflection (read
token, like ``/openapi.json``). With TLS on, the port serves ``ServerTls``'s dynamic credentials.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from oldlogit._proto.oldlogit.v1 import oldlogit_pb2 as pb
from oldlogit._proto.oldlogit.v1 import oldlogit_pb2_grpc as pb_grpc
from oldlogit.contract import convert
from oldlogit.contract.errors import (
    InternalError,
    InvalidRequest,
    OldLogitError,
)
from oldlogit.contract.grpc_options import SERVER_OPTIONS
from oldlogit.contract.types import OpenSession
from oldlogit_service.api.auth import Auth
from oldlogit_service.api.tls import ServerTls
from oldlogit_service.metrics import Metrics
from oldlogit_service.publishing.intake import Intake
from oldlogit_service.runtime import Runtime

logger = logging.getLogger(__name__)

SERVICE = "oldlogit.v1.OldLogit"
_REFLECTION_PREFIX = "/grpc.reflection."
_WRITE_METHODS = {
    "DeleteVersion",
    "Publish",
    "PublishByPath",
    "SetWatermark",
    "CreateLease",
    "DeleteLease",
    "OpenSession",
    "PublishPart",
    "CommitPart",
    "AbortSession",
}


def _peer_host(peer: str) -> str:
    # "ipv4:127.0.0.1:5555" / "ipv6:[::1]:5555" / "unix:/path"
    kind, _, rest = peer.partition(":")
    if kind == "ipv4":
        return rest.rsplit(":", 1)[0]
    if kind == "ipv6":
        return rest.rsplit(":", 1)[0].strip("[]").removeprefix("%5B").removesuffix("%5D")
    return peer


def _token(context: grpc.aio.ServicerContext[Any, Any]) -> str | None:
    return _bearer(context.invocation_metadata())


def _bearer(metadata: Any) -> str | None:
    for key, value in metadata or ():
        if key == "authorization":
            scheme, _, tok = str(value).partition(" ")
            return tok.strip() if scheme.lower() == "bearer" else None
    return None


async def _abort(context: grpc.aio.ServicerContext[Any, Any], err: OldLogitError) -> None:
    # Status and trailing metadata from the very functions the client decodes with.
    context.set_trailing_metadata(convert.grpc_trailing_metadata(err))
    await context.abort(convert.grpc_code(err), err.message)


class _Undecodable:
    """Stands in for a message whose bytes did not parse, so the error reaches our mapping
    (grpc would otherwise answer INTERNAL from inside its deserializer)."""

    def __init__(self, exc: Exception) -> None:
        self.exc = exc

    def error(self) -> InvalidRequest:
        return InvalidRequest(
            f"the request body is not a valid protobuf message of this method's type "
            f"({type(self.exc).__name__})",
            parameter="body",
        )


def _lenient(deserialize: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserialize is None:
        return None

    def parse(data: bytes) -> Any:
        try:
            return deserialize(data)
        except Exception as exc:
            return _Undecodable(exc)

    return parse


async def _checked_stream(stream: AsyncIterator[Any]) -> AsyncIterator[Any]:
    async for item in stream:
        if isinstance(item, _Undecodable):
            raise item.error()
        yield item


# An upload refused while the client still sends: read on (up to these bounds) before answering.
_DRAIN_S = 2.0
_DRAIN_MESSAGES = 64  # of at most 1 MiB each from oldlogit's clients


async def _drain(stream: AsyncIterator[Any]) -> None:
    """Read what the client is still sending of a refused upload, within bounds, so its last
    write completes before the status arrives: grpcio's asyncio client otherwise reports
    "INTERNAL: Internal error from Core" for a write that fails because the call has ended,
    in place of the status the server sent (grpc/grpc issue 36066)."""
    try:
        async with asyncio.timeout(_DRAIN_S):
            n = 0
            async for _ in stream:
                n += 1
                if n >= _DRAIN_MESSAGES:
                    return
    except Exception:  # the stream broke or timed out: answer anyway
        return


class _Interceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Auth, error mapping and metrics for every OldLogit method, in one place."""

    def __init__(self, auth: Auth, metrics: Metrics) -> None:
        self._auth = auth
        self._metrics = metrics

    def _wrap(self, method: str, inner: Callable[..., Awaitable[Any]]) -> Callable[..., Any]:
        auth, metrics = self._auth, self._metrics
        write = method in _WRITE_METHODS

        async def behavior(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            start = time.perf_counter()
            code = "OK"
            err: OldLogitError | None = None
            upload = request if hasattr(request, "__aiter__") else None
            try:
                auth.check(write=write, token=_token(context), peer=_peer_host(context.peer()))
                if isinstance(request, _Undecodable):
                    raise request.error()
                if hasattr(request, "__aiter__"):
                    request = _checked_stream(request)
                return await inner(request, context)
            except OldLogitError as exc:
                err = exc
            except Exception as exc:
                if isinstance(exc, grpc.aio.AbortError):
                    raise
                logger.exception("unhandled error in %s", method)
                err = InternalError("internal error; see the server log")
            finally:
                if err is not None:
                    code = err.grpc_status
                metrics.requests.labels(method, "grpc", code).inc()
                metrics.latency.labels(method, "grpc").observe(time.perf_counter() - start)
            if upload is not None:
                await _drain(upload)
            await _abort(context, err)

        return behavior

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        path = details.method or ""
        if handler is not None and path.startswith(_REFLECTION_PREFIX):
            try:
                self._auth.check(write=False, token=_bearer(details.invocation_metadata), peer=None)
            except OldLogitError as exc:
                return _refusal(handler, exc)
            return handler
        if handler is None or not path.startswith(f"/{SERVICE}/"):
            return handler
        method = path.rsplit("/", 1)[-1]
        deserializer = _lenient(handler.request_deserializer)
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                self._wrap(method, handler.unary_unary),
                request_deserializer=deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.stream_unary is not None:
            return grpc.stream_unary_rpc_method_handler(
                self._wrap(method, handler.stream_unary),
                request_deserializer=deserializer,
                response_serializer=handler.response_serializer,
            )
        return handler


def _refusal(handler: grpc.RpcMethodHandler, err: OldLogitError) -> grpc.RpcMethodHandler:
    """A handler of the same shape that only answers ``err`` (reflection is a bidi stream)."""

    async def refuse(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        await _abort(context, err)

    return grpc.stream_stream_rpc_method_handler(
        refuse,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )


async def _split_stream(
    stream: AsyncIterator[Any], what: str = "publish"
) -> tuple[Any, AsyncIterator[bytes]]:
    """The header of an upload stream (Publish, PublishPart: its first message) and its data
    chunks."""
    it = stream.__aiter__()
    try:
        first = await it.__anext__()
    except StopAsyncIteration:
        raise InvalidRequest(f"the {what} stream is empty", parameter="header") from None
    if not first.HasField("header"):
        raise InvalidRequest(f"the first {what} chunk must carry the header", parameter="header")

    async def data() -> AsyncIterator[bytes]:
        async for chunk in it:
            if chunk.HasField("header"):
                raise InvalidRequest(f"the {what} stream holds two headers", parameter="header")
            yield chunk.data

    return first.header, data()


class OldLogitServicer(pb_grpc.OldLogitServicer):
    def __init__(self, rt: Runtime, intake: Intake) -> None:
        self._rt = rt
        self._intake = intake

    async def Logprobs(self, request: Any, context: Any) -> Any:
        req = convert.request_from_proto(request)
        remaining = context.time_remaining()
        if remaining is not None:  # the client's deadline bounds the server's
            cap = max(0.001, float(remaining))
            req.timeout_s = min(req.timeout_s or cap, cap)
        resp = await self._rt.logprobs(req)
        return convert.response_to_proto(resp, req)

    async def Trace(self, request: Any, context: Any) -> Any:
        trace = await self._rt.trace(convert.trace_request_from_proto(request))
        return convert.trace_to_proto(trace)

    async def ListVersions(self, request: Any, context: Any) -> Any:
        versions, watermark = await self._rt.versions()
        return convert.versions_to_proto(versions, watermark)

    async def GetVersion(self, request: Any, context: Any) -> Any:
        return convert.version_info_to_proto(await self._rt.version(request.policy_version))

    async def DeleteVersion(self, request: Any, context: Any) -> Any:
        await self._rt.delete_version(request.policy_version)
        return pb.DeleteVersionResponse(policy_version=request.policy_version)

    async def Publish(self, request_iterator: AsyncIterator[Any], context: Any) -> Any:
        header, data = await _split_stream(request_iterator)
        res = await self._intake.publish_stream(
            convert.PublishHeader.from_fields(header), data, parameter="data"
        )
        return convert.publish_result_to_proto(res)

    async def PublishByPath(self, request: Any, context: Any) -> Any:
        res = await self._intake.publish_path(
            convert.PublishHeader.from_fields(request), request.path
        )
        return convert.publish_result_to_proto(res)

    async def SetWatermark(self, request: Any, context: Any) -> Any:
        wm = await self._rt.set_watermark(request.policy_version)
        return pb.WatermarkResponse(watermark=wm)

    async def CreateLease(self, request: Any, context: Any) -> Any:
        lease = await self._rt.create_lease(request.policy_version, request.holder, request.ttl_s)
        return convert.lease_info_to_proto(lease)

    async def DeleteLease(self, request: Any, context: Any) -> Any:
        await self._rt.release_lease(request.lease_id)
        return pb.DeleteLeaseResponse(lease_id=request.lease_id)

    # multi-rank publish sessions (docs/multi-rank-publishing.md)
    async def OpenSession(self, request: Any, context: Any) -> Any:
        info = await self._intake.open_session(
            OpenSession(
                session_id=request.session_id,
                policy_version=request.policy_version,
                members=request.members,
                delta=request.delta,
                parent=request.parent if request.HasField("parent") else None,
                sha256=request.sha256 or None,
                ttl_s=request.ttl_s if request.HasField("ttl_s") else None,
            )
        )
        return convert.to_proto(info)

    async def PublishPart(self, request_iterator: AsyncIterator[Any], context: Any) -> Any:
        header, data = await _split_stream(request_iterator, "part")
        info = await self._intake.stage_part(header.session_id, header.rank, data, parameter="data")
        return convert.to_proto(info)

    async def CommitPart(self, request: Any, context: Any) -> Any:
        info = await self._intake.commit_part(request.session_id, request.rank, request.sha256)
        return convert.to_proto(info)

    async def GetSession(self, request: Any, context: Any) -> Any:
        return convert.to_proto(await self._intake.get_session(request.session_id))

    async def AbortSession(self, request: Any, context: Any) -> Any:
        return convert.to_proto(await self._intake.abort_session(request.session_id))

    async def GetInfo(self, request: Any, context: Any) -> Any:
        return convert.info_to_proto(await self._rt.info())

    async def ListReplicas(self, request: Any, context: Any) -> Any:
        replicas = await self._rt.replicas()
        return pb.ListReplicasResponse(
            replicas=[
                pb.Replica(
                    replica_id=str(m.get("replica_id", "")),
                    http=str(m.get("http", "")),
                    grpc=str(m.get("grpc", "")),
                    queue_depth=int(m.get("queue_depth", 0)),
                    resident=sorted(int(v) for v in m.get("resident", [])),
                )
                for m in replicas
            ]
        )


class Health:
    """The standard health service; flips to NOT_SERVING when the runtime drains."""

    def __init__(self) -> None:
        self.servicer = health_aio.HealthServicer()

    async def set_serving(self) -> None:
        for name in ("", SERVICE):
            await self.servicer.set(name, health_pb2.HealthCheckResponse.SERVING)

    async def set_not_serving(self) -> None:
        for name in ("", SERVICE):
            await self.servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)


async def start_grpc_server(
    rt: Runtime,
    intake: Intake,
    auth: Auth,
    host: str,
    port: int,
    tls: ServerTls | None = None,
) -> tuple[grpc.aio.Server, int, Health]:
    """Serve ``OldLogit`` (``rt`` and ``intake`` behind ``auth``), health and reflection."""
    max_bytes = int(rt.settings.max_request_mib * 1024 * 1024)
    server = grpc.aio.server(
        interceptors=[_Interceptor(auth, rt.metrics)],
        options=[
            *(o for o in SERVER_OPTIONS if not o[0].startswith("grpc.max_")),
            ("grpc.max_receive_message_length", max_bytes),
            ("grpc.max_send_message_length", max_bytes),
            ("grpc.so_reuseport", 0),
        ],
    )
    pb_grpc.add_OldLogitServicer_to_server(OldLogitServicer(rt, intake), server)
    health = Health()
    health_pb2_grpc.add_HealthServicer_to_server(health.servicer, server)
    reflection.enable_server_reflection(
        (
            pb.DESCRIPTOR.services_by_name["OldLogit"].full_name,
            reflection.SERVICE_NAME,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
        ),
        server,
    )
    target = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    bound = (
        server.add_secure_port(target, tls.grpc_credentials())
        if tls is not None
        else server.add_insecure_port(target)
    )
    if bound == 0:
        raise OSError(f"could not bind gRPC to {target}")
    await server.start()
    await health.set_serving()
    return server, bound, health
