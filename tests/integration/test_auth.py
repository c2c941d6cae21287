"""Auth on both transports: write token, optional read token, loopback-only writes without a
write token (and none with TLS on), constant-time comparison, tokens never shown; a request
without credentials learns nothing but 401, whatever its body, path or route."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from oldlogit import Client
from oldlogit.contract import errors
from oldlogit_service.api.auth import Auth
from oldlogit_service.config import Settings

from .conftest import WRITE_TOKEN, Served, start_served

pytestmark = pytest.mark.integration

READ_TOKEN = "reader-secret"
READ_POSTS = ("/v1/logprobs", "/v1/trace")  # reads with a body


@pytest.fixture(scope="module")
def guarded(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[Served]:
    s = start_served(tmp_path_factory.mktemp("auth"), model_dir, read_token=READ_TOKEN)
    yield s
    s.server.stop()


def test_read_token_required(guarded: Served, transport: str) -> None:
    with Client(guarded.url(transport), retries=0) as c:
        with pytest.raises(errors.Unauthorized) as info:
            c.logprobs([1, 2, 3], policy_version=0)
        assert info.value.parameter == "authorization"
    with Client(guarded.url(transport), token="nope", retries=0) as c:
        with pytest.raises(errors.Unauthorized):
            c.versions()
    with Client(guarded.url(transport), token=READ_TOKEN) as c:
        assert c.logprobs([1, 2, 3], policy_version=0).versions == [0]
        with pytest.raises(errors.Unauthorized):
            c.set_watermark(0)  # a read token does not write
    with Client(guarded.url(transport), token=WRITE_TOKEN) as c:
        assert c.versions()  # the write token reads too


def test_probes_are_open_everything_else_reads_with_the_token(guarded: Served) -> None:
    base = guarded.server.http_url
    assert httpx.get(f"{base}/healthz").status_code == 200
    assert httpx.get(f"{base}/readyz").status_code == 200
    for path in ("/metrics", "/", "/docs", "/openapi.json", "/v1/info", "/no/such/route"):
        r = httpx.get(f"{base}{path}")
        assert r.status_code == 401, path
        assert r.json()["error"]["code"] == "unauthorized", path
        ok = httpx.get(f"{base}{path}", headers={"authorization": f"Bearer {READ_TOKEN}"})
        assert ok.status_code == (404 if path == "/no/such/route" else 200), path


# Each is malformed in its body, path or query: without credentials, the 401 comes first.
MALFORMED = [
    ("POST", "/v1/watermark", b"{not json", "application/json"),
    ("POST", "/v1/watermark", b'{"policy_version": "x", "extra": 1}', "application/json"),
    ("POST", "/v1/leases", b"[]", "application/json"),
    ("POST", "/v1/versions", b'{"path": 7}', "application/json"),
    (
        "PUT",
        "/v1/versions/not-a-number?sha256=zz&delta=maybe",
        b"garbage",
        "application/octet-stream",
    ),
    ("DELETE", "/v1/versions/-1", b"", "application/json"),
    ("DELETE", "/v1/leases/%00", b"", "application/json"),
    ("POST", "/v1/logprobs", b"\x93garbage", "application/msgpack"),
    ("POST", "/v1/trace", b'{"token_ids": "x", "policy_version": -1}', "application/json"),
    ("GET", "/v1/versions/abc", b"", "application/json"),
]


@pytest.mark.parametrize(("method", "path", "body", "ctype"), MALFORMED)
def test_unauthenticated_malformed_requests_get_401_first(
    guarded: Served, method: str, path: str, body: bytes, ctype: str
) -> None:
    r = httpx.request(
        method, f"{guarded.server.http_url}{path}", content=body, headers={"content-type": ctype}
    )
    assert r.status_code == 401, r.text
    assert r.json() == {
        "error": {
            "code": "unauthorized",
            "message": r.json()["error"]["message"],
            "parameter": "authorization",
        }
    }
    assert "policy_version" not in r.text and "body" not in r.text  # no schema leaks
    if method != "GET" and path not in READ_POSTS:  # writes: the read token is not enough
        r = httpx.request(
            method,
            f"{guarded.server.http_url}{path}",
            content=body,
            headers={"content-type": ctype, "authorization": f"Bearer {READ_TOKEN}"},
        )
        assert r.status_code == 401, r.text
    # With the right token the same request reaches validation.
    token = WRITE_TOKEN if method != "GET" and path not in READ_POSTS else READ_TOKEN
    r = httpx.request(
        method,
        f"{guarded.server.http_url}{path}",
        content=body,
        headers={"content-type": ctype, "authorization": f"Bearer {token}"},
    )
    assert r.status_code in (400, 404, 405, 413, 422), r.text


def test_grpc_reflection_needs_the_read_token_health_does_not(guarded: Served) -> None:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    assert guarded.server.bound is not None
    with grpc.insecure_channel(guarded.server.bound.grpc) as ch:
        health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        ask = reflection_pb2.ServerReflectionRequest(list_services="")
        with pytest.raises(grpc.RpcError) as info:
            list(stub.ServerReflectionInfo(iter([ask]), timeout=10))
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        answers = list(
            stub.ServerReflectionInfo(
                iter([ask]), timeout=10, metadata=[("authorization", f"Bearer {READ_TOKEN}")]
            )
        )
        names = {s.name for s in answers[0].list_services_response.service}
        assert "oldlogit.v1.OldLogit" in names


def test_grpc_malformed_message_without_token_is_unauthenticated(guarded: Served) -> None:
    import grpc

    assert guarded.server.bound is not None
    with grpc.insecure_channel(guarded.server.bound.grpc) as ch:
        for method in ("SetWatermark", "Logprobs", "Trace"):
            call = ch.unary_unary(f"/oldlogit.v1.OldLogit/{method}")
            with pytest.raises(grpc.RpcError) as info:
                call(b"\xff\xff\xff garbage", timeout=10)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED, method


def test_tokens_are_never_shown(guarded: Served) -> None:
    s = guarded.settings
    assert WRITE_TOKEN not in repr(s) and READ_TOKEN not in repr(s)
    assert WRITE_TOKEN not in str(s.model_dump())


def test_without_write_token_writes_are_loopback_only(tmp_path: Path, model_dir: Path) -> None:
    settings = Settings(model=model_dir, snapshot_dir=tmp_path / "s")
    authorize = Auth(settings).check
    authorize(write=True, token=None, peer="127.0.0.1")
    authorize(write=True, token=None, peer="::1")
    with pytest.raises(errors.Forbidden) as info:
        authorize(write=True, token=None, peer="10.1.2.3")
    assert info.value.parameter == "authorization"
    authorize(write=False, token=None, peer="10.1.2.3")
    # With TLS on, loopback is no exemption (a TLS proxy beside the server is loopback too).
    tls_settings = settings.model_copy(
        update={"tls_cert_file": tmp_path / "c.pem", "tls_key_file": tmp_path / "k.pem"}
    )
    tls_authorize = Auth(tls_settings).check
    with pytest.raises(errors.Forbidden):
        tls_authorize(write=True, token=None, peer="127.0.0.1")
    tls_authorize(write=False, token=None, peer="127.0.0.1")
    # Over the wire from loopback (the test's own address), a write goes through.
    (tmp_path / "x").mkdir()
    s = start_served(tmp_path / "x", model_dir, write_token=None)
    try:
        with Client(s.url("grpc")) as c:
            assert c.set_watermark(0) == 0
    finally:
        s.server.stop()
