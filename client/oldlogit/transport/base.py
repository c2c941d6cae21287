"""What the client needs from a transport, and the factory that picks one by URL scheme.

In: a replica URL (``http(s)://host:port[/prefix]``, ``grpc(s)://host:port``); out: an object
with one coroutine per service operation, speaking contract types. Transports translate every
foreign failure into the contract's error tree (connection failures into ``Unavailable``) and
never retry: retries and failover live in ``retry``, driven by ``pool``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol
from urllib.parse import urlsplit

from oldlogit.contract.convert import PublishHeader
from oldlogit.contract.errors import InvalidRequest
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
from oldlogit.transport.tls import ClientTls

__all__ = ["Transport", "open_transport"]

HTTP_SCHEMES = ("http", "https")
GRPC_SCHEMES = ("grpc", "grpcs")
TLS_SCHEMES = ("https", "grpcs")


class Transport(Protocol):
    """One replica, one connection (pool). ``timeout_s`` is the call's deadline (None: none)."""

    url: str

    async def logprobs(self, req: LogprobsRequest, timeout_s: float | None) -> LogprobsResponse: ...

    async def trace(self, req: TraceRequest, timeout_s: float | None) -> Trace: ...

    async def list_versions(
        self, timeout_s: float | None
    ) -> tuple[list[VersionInfo], int | None]: ...

    async def get_version(self, policy_version: int, timeout_s: float | None) -> VersionInfo: ...

    async def delete_version(self, policy_version: int, timeout_s: float | None) -> None: ...

    async def publish(
        self, header: PublishHeader, chunks: AsyncIterator[bytes], timeout_s: float | None
    ) -> PublishResult: ...

    async def publish_by_path(
        self, header: PublishHeader, path: str, timeout_s: float | None
    ) -> PublishResult: ...

    async def set_watermark(self, policy_version: int, timeout_s: float | None) -> int: ...

    async def create_lease(
        self, policy_version: int, holder: str, ttl_s: float, timeout_s: float | None
    ) -> LeaseInfo: ...

    async def delete_lease(self, lease_id: str, timeout_s: float | None) -> None: ...

    async def info(self, timeout_s: float | None) -> Info: ...

    async def list_replicas(self, timeout_s: float | None) -> list[dict[str, Any]]: ...

    # Multi-rank publish sessions (docs/multi-rank-publishing.md).
    async def open_session(self, request: OpenSession, timeout_s: float | None) -> SessionInfo: ...

    async def upload_part(
        self,
        session_id: str,
        rank: int,
        chunks: AsyncIterator[bytes],
        total_bytes: int,
        timeout_s: float | None,
    ) -> SessionInfo: ...

    async def commit_part(
        self, session_id: str, rank: int, sha256: str, timeout_s: float | None
    ) -> SessionInfo: ...

    async def get_session(self, session_id: str, timeout_s: float | None) -> SessionInfo: ...

    async def abort_session(self, session_id: str, timeout_s: float | None) -> SessionInfo: ...

    async def aclose(self) -> None: ...


def check_url(url: str) -> str:
    """The URL's scheme, after checking it names a transport and a host."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in HTTP_SCHEMES + GRPC_SCHEMES or not parts.hostname:
        raise InvalidRequest(
            f"unsupported URL {url!r}: use http://host:port, https://…, grpc://host:port "
            "or grpcs://host:port",
            parameter="url",
        )
    if scheme in GRPC_SCHEMES and parts.path not in ("", "/"):
        raise InvalidRequest(f"a gRPC URL has no path: {url!r}", parameter="url")
    return scheme


def open_transport(
    url: str, *, token: str | None, http_encoding: str, tls: ClientTls | None = None
) -> Transport:
    """A transport for ``url``; the transport modules are imported on first use (gRPC is heavy).
    ``tls`` (a private CA, a client certificate) applies to https:// and grpcs:// URLs."""
    scheme = check_url(url)
    if scheme in GRPC_SCHEMES:
        from oldlogit.transport.grpc import GrpcTransport

        return GrpcTransport(url, token=token, tls=tls)
    from oldlogit.transport.http import HttpTransport

    return HttpTransport(url, token=token, encoding=http_encoding, tls=tls)
