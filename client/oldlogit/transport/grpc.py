"""The gRPC transport: one ``grpc.aio`` channel per replica, speaking the contract's ``convert``.

In: contract types; out: contract types, or the typed error rebuilt from the status and the
``oldlogit-error-bin`` trailing metadata (``convert.error_from_grpc``), translated here at one
boundary; a failed TLS handshake becomes ``TlsError`` (``tls``), not ``Unavailable``.
Channel options (message sizes, keepalive) are the contract's, shared with the server
(``oldlogit.contract.grpc_options``).
No retries here: gRPC's configurable retries stay off so ``retry`` is the only mechanism.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar
from urllib.parse import urlsplit

import grpc
import grpc.aio

from oldlogit._proto.oldlogit.v1 import oldlogit_pb2 as pb
from oldlogit._proto.oldlogit.v1 import oldlogit_pb2_grpc as pb_grpc
from oldlogit.contract import convert
from oldlogit.contract.convert import PublishHeader
from oldlogit.contract.grpc_options import CHANNEL_OPTIONS
from oldlogit.contract.types import (
    Info,
    LeaseInfo,
    LogprobsRequest,
    LogprobsResponse,
    OpenSession,
    PublishResult,
    SessionInfo,
    Trace,
    TraceRequest,
    VersionInfo,
)
from oldlogit.transport.tls import GRPC_OPENER, ClientTls, diagnose, tls_error_from_grpc

__all__ = ["GrpcTransport"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

PUBLISH_CHUNK_BYTES = 1024 * 1024  # per message: well under any server's receive limit


class GrpcTransport:
    """The ``oldlogit.v1.OldLogit`` service on one replica."""

    def __init__(self, url: str, *, token: str | None, tls: ClientTls | None = None) -> None:
        parts = urlsplit(url)
        self.url = url
        port = parts.port or (443 if parts.scheme == "grpcs" else 50051)
        target = f"{parts.hostname}:{port}"
        self._secure = parts.scheme == "grpcs"
        self._tls = tls
        self._host, self._port = str(parts.hostname), port
        if self._secure:
            # The system's CAs, or the client's own CA / certificate.
            creds = tls.grpc_credentials() if tls is not None else grpc.ssl_channel_credentials()
            self._channel = grpc.aio.secure_channel(target, creds, options=CHANNEL_OPTIONS)
        else:
            self._channel = grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS)
        self._stub = pb_grpc.OldLogitStub(self._channel)
        self._metadata: tuple[tuple[str, str], ...] = (
            (("authorization", f"Bearer {token}"),) if token else ()
        )

    async def _call(
        self, rpc: Callable[..., Awaitable[T]], request: Any, timeout_s: float | None
    ) -> T:
        try:
            return await rpc(request, timeout=timeout_s, metadata=self._metadata)
        except grpc.aio.AioRpcError as exc:
            if self._secure and exc.code() == grpc.StatusCode.UNAVAILABLE:
                tls_err = await self._tls_failure(exc.details())
                if tls_err is not None:
                    raise tls_err from exc
            details = exc.details()
            if exc.code() == grpc.StatusCode.INTERNAL and "execute_batch" in (
                exc.debug_error_string() or ""
            ):
                # grpcio's asyncio client replaces the server's status with this when the
                # service ended an upload it was still sending (grpc/grpc issue 36066); the
                # service reads on for a while first, so only a long refused upload gets here.
                details = (
                    "the service ended the call while the upload was still being sent and "
                    "grpcio lost its reason; publish over HTTP to see it"
                )
            raise convert.error_from_grpc(exc.code(), details, exc.trailing_metadata()) from exc

    async def _tls_failure(self, details: str | None) -> Exception | None:
        """Why a secure channel could not connect, when it is the handshake (not retried)."""
        found = tls_error_from_grpc(details, self.url)
        if found is None and details and "failed to connect" in details:
            # A refused client certificate reads "Socket closed" here: ask Python's ssl.
            found = await diagnose(
                self._host, self._port, self._tls, self.url, alpn="h2", opener=GRPC_OPENER
            )
        return found

    async def logprobs(self, req: LogprobsRequest, timeout_s: float | None) -> LogprobsResponse:
        msg = await self._call(self._stub.Logprobs, convert.request_to_proto(req), timeout_s)
        return convert.response_from_proto(msg, req)

    async def trace(self, req: TraceRequest, timeout_s: float | None) -> Trace:
        msg = await self._call(self._stub.Trace, convert.trace_request_to_proto(req), timeout_s)
        return convert.from_proto(msg, Trace)

    async def list_versions(self, timeout_s: float | None) -> tuple[list[VersionInfo], int | None]:
        msg = await self._call(self._stub.ListVersions, pb.ListVersionsRequest(), timeout_s)
        return convert.versions_from_proto(msg)

    async def get_version(self, policy_version: int, timeout_s: float | None) -> VersionInfo:
        req = pb.GetVersionRequest(policy_version=policy_version)
        return convert.from_proto(
            await self._call(self._stub.GetVersion, req, timeout_s), VersionInfo
        )

    async def delete_version(self, policy_version: int, timeout_s: float | None) -> None:
        req = pb.DeleteVersionRequest(policy_version=policy_version)
        await self._call(self._stub.DeleteVersion, req, timeout_s)

    async def publish(
        self, header: PublishHeader, chunks: AsyncIterator[bytes], timeout_s: float | None
    ) -> PublishResult:
        async def messages() -> AsyncIterator[pb.PublishChunk]:
            yield header.to_proto()
            async for data in chunks:
                # Re-slice so no message exceeds PUBLISH_CHUNK_BYTES whatever the producer yields.
                for start in range(0, len(data), PUBLISH_CHUNK_BYTES):
                    yield pb.PublishChunk(data=data[start : start + PUBLISH_CHUNK_BYTES])

        msg = await self._call(self._stub.Publish, messages(), timeout_s)
        return convert.from_proto(msg, PublishResult)

    async def publish_by_path(
        self, header: PublishHeader, path: str, timeout_s: float | None
    ) -> PublishResult:
        req = pb.PublishByPathRequest(
            policy_version=header.policy_version,
            path=path,
            sha256=header.sha256 or "",
            delta=header.delta,
        )
        if header.parent is not None:
            req.parent = header.parent
        return convert.from_proto(
            await self._call(self._stub.PublishByPath, req, timeout_s), PublishResult
        )

    async def set_watermark(self, policy_version: int, timeout_s: float | None) -> int:
        req = pb.SetWatermarkRequest(policy_version=policy_version)
        msg = await self._call(self._stub.SetWatermark, req, timeout_s)
        return int(msg.watermark)

    async def create_lease(
        self, policy_version: int, holder: str, ttl_s: float, timeout_s: float | None
    ) -> LeaseInfo:
        req = pb.CreateLeaseRequest(policy_version=policy_version, holder=holder, ttl_s=ttl_s)
        return convert.from_proto(
            await self._call(self._stub.CreateLease, req, timeout_s), LeaseInfo
        )

    async def delete_lease(self, lease_id: str, timeout_s: float | None) -> None:
        await self._call(
            self._stub.DeleteLease, pb.DeleteLeaseRequest(lease_id=lease_id), timeout_s
        )

    async def info(self, timeout_s: float | None) -> Info:
        msg = await self._call(self._stub.GetInfo, pb.GetInfoRequest(), timeout_s)
        return convert.from_proto(msg, Info)

    async def list_replicas(self, timeout_s: float | None) -> list[dict[str, Any]]:
        msg = await self._call(self._stub.ListReplicas, pb.ListReplicasRequest(), timeout_s)
        return [
            {
                "replica_id": r.replica_id,
                "http": r.http,
                "grpc": r.grpc,
                "queue_depth": r.queue_depth,
                "resident": list(r.resident),
            }
            for r in msg.replicas
        ]

    async def open_session(self, request: OpenSession, timeout_s: float | None) -> SessionInfo:
        req = pb.OpenSessionRequest(
            session_id=request.session_id,
            policy_version=request.policy_version,
            members=request.members,
            delta=request.delta,
            sha256=request.sha256 or "",
        )
        if request.parent is not None:
            req.parent = request.parent
        if request.ttl_s is not None:
            req.ttl_s = request.ttl_s
        msg = await self._call(self._stub.OpenSession, req, timeout_s)
        return convert.from_proto(msg, SessionInfo)

    async def upload_part(
        self,
        session_id: str,
        rank: int,
        chunks: AsyncIterator[bytes],
        total_bytes: int,
        timeout_s: float | None,
    ) -> SessionInfo:
        async def messages() -> AsyncIterator[pb.PartChunk]:
            yield pb.PartChunk(header=pb.PartHeader(session_id=session_id, rank=rank))
            async for data in chunks:
                for start in range(0, len(data), PUBLISH_CHUNK_BYTES):
                    yield pb.PartChunk(data=data[start : start + PUBLISH_CHUNK_BYTES])

        msg = await self._call(self._stub.PublishPart, messages(), timeout_s)
        return convert.from_proto(msg, SessionInfo)

    async def commit_part(
        self, session_id: str, rank: int, sha256: str, timeout_s: float | None
    ) -> SessionInfo:
        req = pb.CommitPartRequest(session_id=session_id, rank=rank, sha256=sha256)
        return convert.from_proto(
            await self._call(self._stub.CommitPart, req, timeout_s), SessionInfo
        )

    async def get_session(self, session_id: str, timeout_s: float | None) -> SessionInfo:
        req = pb.GetSessionRequest(session_id=session_id)
        return convert.from_proto(
            await self._call(self._stub.GetSession, req, timeout_s), SessionInfo
        )

    async def abort_session(self, session_id: str, timeout_s: float | None) -> SessionInfo:
        req = pb.AbortSessionRequest(session_id=session_id)
        msg = await self._call(self._stub.AbortSession, req, timeout_s)
        return convert.from_proto(msg, SessionInfo)

    async def aclose(self) -> None:
        await self._channel.close()
