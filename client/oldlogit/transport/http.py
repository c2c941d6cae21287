"""The HTTP transport: one ``httpx.AsyncClient`` per replica, speaking the contract's ``wire``.

In: contract types; out: contract types, or an ``oldlogit.contract.errors`` error rebuilt from the
response (``wire.decode_error``). httpx failures are translated here, at one boundary:
connection failures become ``Unavailable`` (retryable), read/write timeouts
``DeadlineExceeded``, failed TLS handshakes ``TlsError`` (not retried). No retries here.
"""

from __future__ import annotations

import json
import logging
import ssl
from collections.abc import AsyncIterator
from typing import Any, TypeVar
from urllib.parse import quote, urlsplit

import httpx
from pydantic import BaseModel

from oldlogit.contract import wire
from oldlogit.contract.convert import PublishHeader
from oldlogit.contract.errors import DeadlineExceeded, InternalError, OldLogitError, Unavailable
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
from oldlogit.transport.tls import HTTP_OPENER, ClientTls, diagnose, tls_error_from_ssl

__all__ = ["HttpTransport"]

logger = logging.getLogger(__name__)

M = TypeVar("M", bound=BaseModel)

CONNECT_TIMEOUT_S = 10.0

# Connection closed before any answer: over https, possibly a refused client certificate.
_CLOSED = (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)


class HttpTransport:
    """``POST /v1/logprobs`` and friends on one replica (``oldlogit.contract.wire``: the bodies)."""

    def __init__(
        self,
        url: str,
        *,
        token: str | None,
        encoding: str = wire.MSGPACK_TYPE,
        transport: httpx.AsyncBaseTransport | None = None,  # tests inject httpx.MockTransport
        tls: ClientTls | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self._encoding = wire.media_type(encoding)
        headers = {"user-agent": "oldlogit-client"}
        if token:
            headers["authorization"] = f"Bearer {token}"
        parts = urlsplit(self.url)
        self._secure = parts.scheme == "https"
        self._host = str(parts.hostname)
        self._port = parts.port or (443 if self._secure else 80)
        self._tls = tls
        # https:// with the system's CAs, or the client's own CA / certificate.
        verify: ssl.SSLContext | bool = tls.ssl_context() if tls is not None else True
        self._http = httpx.AsyncClient(
            base_url=self.url, headers=headers, timeout=None, transport=transport, verify=verify
        )

    async def _send(
        self,
        method: str,
        path: str,
        timeout_s: float | None,
        **kwargs: Any,
    ) -> httpx.Response:
        connect = CONNECT_TIMEOUT_S if timeout_s is None else min(timeout_s, CONNECT_TIMEOUT_S)
        timeout = httpx.Timeout(timeout_s, connect=connect)
        try:
            resp = await self._http.request(method, path, timeout=timeout, **kwargs)
        except httpx.TransportError as exc:
            # A failed handshake is the same on every replica (they share certificates): a
            # TlsError, which is neither retried nor failed over.
            tls_err = tls_error_from_ssl(exc, self.url)
            if tls_err is None and self._secure and isinstance(exc, _CLOSED):
                # Closed without an answer: a refused client certificate looks like this.
                tls_err = await diagnose(
                    self._host, self._port, self._tls, self.url, alpn="http/1.1", opener=HTTP_OPENER
                )
            if tls_err is not None:
                raise tls_err from exc
            raise self._translate(exc, method, path, timeout_s) from exc
        if resp.status_code >= 400:
            raise wire.decode_error(resp.status_code, resp.content, resp.headers)
        return resp

    def _translate(
        self, exc: httpx.TransportError, method: str, path: str, timeout_s: float | None
    ) -> OldLogitError:
        if isinstance(exc, (httpx.ConnectTimeout, httpx.PoolTimeout)):
            return Unavailable(
                f"cannot connect to {self.url}: {type(exc).__name__}", retry_after_s=0.0
            )
        if isinstance(exc, httpx.TimeoutException):
            return DeadlineExceeded(
                f"{method} {path} on {self.url} took longer than {timeout_s}s",
                parameter="timeout_s",
            )
        # refused, reset, DNS, protocol errors
        return Unavailable(
            f"cannot reach {self.url}: {type(exc).__name__}: {exc}", retry_after_s=0.0
        )

    async def _model(
        self, cls: type[M], method: str, path: str, timeout_s: float | None, **kwargs: Any
    ) -> M:
        return wire.parse_model(cls, await self._json(method, path, timeout_s, **kwargs))

    async def _json(self, method: str, path: str, timeout_s: float | None, **kwargs: Any) -> Any:
        resp = await self._send(method, path, timeout_s, **kwargs)
        try:
            return json.loads(resp.content)
        except ValueError as exc:
            raise InternalError(f"{method} {path}: the body is not JSON", parameter="body") from exc

    async def logprobs(self, req: LogprobsRequest, timeout_s: float | None) -> LogprobsResponse:
        body = wire.encode_request(req, self._encoding)
        resp = await self._send(
            "POST",
            "/v1/logprobs",
            timeout_s,
            content=body,
            headers={"content-type": self._encoding, "accept": self._encoding},
        )
        return wire.decode_response(resp.content, req, resp.headers.get("content-type"))

    async def trace(self, req: TraceRequest, timeout_s: float | None) -> Trace:
        body = req.model_dump(mode="json")
        return await self._model(Trace, "POST", "/v1/trace", timeout_s, json=body)

    async def list_versions(self, timeout_s: float | None) -> tuple[list[VersionInfo], int | None]:
        obj = await self._json("GET", "/v1/versions", timeout_s)
        if not isinstance(obj, dict) or not isinstance(obj.get("versions"), list):
            raise InternalError(
                "GET /v1/versions: expected {versions, watermark}", parameter="versions"
            )
        versions = [wire.parse_model(VersionInfo, v) for v in obj["versions"]]
        watermark = obj.get("watermark")
        return versions, (None if watermark is None else int(watermark))

    async def get_version(self, policy_version: int, timeout_s: float | None) -> VersionInfo:
        return await self._model(VersionInfo, "GET", f"/v1/versions/{policy_version}", timeout_s)

    async def delete_version(self, policy_version: int, timeout_s: float | None) -> None:
        await self._send("DELETE", f"/v1/versions/{policy_version}", timeout_s)

    async def publish(
        self, header: PublishHeader, chunks: AsyncIterator[bytes], timeout_s: float | None
    ) -> PublishResult:
        params: dict[str, Any] = {"delta": str(header.delta).lower()}
        if header.sha256:
            params["sha256"] = header.sha256
        if header.parent is not None:
            params["parent"] = header.parent
        if header.base_version is not None:
            params["base_version"] = header.base_version
        return await self._model(
            PublishResult,
            "PUT",
            f"/v1/versions/{header.policy_version}",
            timeout_s,
            params=params,
            content=chunks,
            # A known length lets the server refuse an oversized upload before reading it.
            headers={
                "content-type": "application/octet-stream",
                "content-length": str(header.total_bytes),
            },
        )

    async def publish_by_path(
        self, header: PublishHeader, path: str, timeout_s: float | None
    ) -> PublishResult:
        body = {
            "policy_version": header.policy_version,
            "path": path,
            "sha256": header.sha256,
            "delta": header.delta,
            "parent": header.parent,
        }
        return await self._model(PublishResult, "POST", "/v1/versions", timeout_s, json=body)

    async def set_watermark(self, policy_version: int, timeout_s: float | None) -> int:
        obj = await self._json(
            "POST", "/v1/watermark", timeout_s, json={"policy_version": policy_version}
        )
        return (
            int(obj["watermark"])
            if isinstance(obj, dict) and "watermark" in obj
            else policy_version
        )

    async def create_lease(
        self, policy_version: int, holder: str, ttl_s: float, timeout_s: float | None
    ) -> LeaseInfo:
        body = {"policy_version": policy_version, "holder": holder, "ttl_s": ttl_s}
        return await self._model(LeaseInfo, "POST", "/v1/leases", timeout_s, json=body)

    async def delete_lease(self, lease_id: str, timeout_s: float | None) -> None:
        await self._send("DELETE", f"/v1/leases/{quote(lease_id, safe='')}", timeout_s)

    async def info(self, timeout_s: float | None) -> Info:
        return await self._model(Info, "GET", "/v1/info", timeout_s)

    async def list_replicas(self, timeout_s: float | None) -> list[dict[str, Any]]:
        body = await self._json("GET", "/v1/replicas", timeout_s)
        return list(body.get("replicas", []))

    async def open_session(self, request: OpenSession, timeout_s: float | None) -> SessionInfo:
        body = request.model_dump(exclude_none=True)
        return await self._model(SessionInfo, "POST", "/v1/sessions", timeout_s, json=body)

    async def upload_part(
        self,
        session_id: str,
        rank: int,
        chunks: AsyncIterator[bytes],
        total_bytes: int,
        timeout_s: float | None,
    ) -> SessionInfo:
        return await self._model(
            SessionInfo,
            "PUT",
            f"/v1/sessions/{quote(session_id, safe='')}/parts/{rank}",
            timeout_s,
            content=chunks,
            headers={
                "content-type": "application/octet-stream",
                "content-length": str(total_bytes),
            },
        )

    async def commit_part(
        self, session_id: str, rank: int, sha256: str, timeout_s: float | None
    ) -> SessionInfo:
        path = f"/v1/sessions/{quote(session_id, safe='')}/parts/{rank}/commit"
        return await self._model(SessionInfo, "POST", path, timeout_s, json={"sha256": sha256})

    async def get_session(self, session_id: str, timeout_s: float | None) -> SessionInfo:
        path = f"/v1/sessions/{quote(session_id, safe='')}"
        return await self._model(SessionInfo, "GET", path, timeout_s)

    async def abort_session(self, session_id: str, timeout_s: float | None) -> SessionInfo:
        path = f"/v1/sessions/{quote(session_id, safe='')}"
        return await self._model(SessionInfo, "DELETE", path, timeout_s)

    async def aclose(self) -> None:
        await self._http.aclose()
