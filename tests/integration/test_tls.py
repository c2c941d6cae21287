"""TLS and mutual TLS on both transports, with a private CA made here (tests/tls_certs.py).

Real servers on 127.0.0.1: answers over https:// and grpcs://; an untrusted CA, an expired
certificate, a missing or foreign client certificate and plaintext to a TLS port refused with
named errors, never retried; certificates rotated under load with zero failed requests; and
the finding of the grpc.aio rotation spike, kept as a test.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from oldlogit import Client
from oldlogit.contract import errors
from oldlogit_service.server import ServerThread

from ..tls_certs import CertAuthority, Pair
from .conftest import WRITE_TOKEN, Served, start_served

pytestmark = pytest.mark.integration

TOKENS = [1, 15, 27, 4, 99, 3, 42, 7]


@dataclass
class Pki:
    ca: CertAuthority
    other_ca: CertAuthority  # signs nothing the servers trust or serve
    server: Pair
    client: Pair
    foreign_client: Pair  # signed by other_ca
    expired_server: Pair


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    d = tmp_path_factory.mktemp("pki")
    ca, other = CertAuthority(d, "test CA"), CertAuthority(d, "other CA")
    return Pki(
        ca=ca,
        other_ca=other,
        server=ca.issue("server"),
        client=ca.issue("client", client=True),
        foreign_client=other.issue("foreign-client", client=True),
        expired_server=ca.issue("expired-server", expired=True),
    )


@pytest.fixture(scope="module")
def mtls(tmp_path_factory: pytest.TempPathFactory, model_dir: Path, pki: Pki) -> Iterator[Served]:
    s = start_served(
        tmp_path_factory.mktemp("mtls"),
        model_dir,
        tls_cert_file=pki.server.cert,
        tls_key_file=pki.server.key,
        tls_client_ca_file=pki.ca.pem,
    )
    yield s
    s.server.stop()


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory, model_dir: Path, pki: Pki) -> Iterator[Served]:
    s = start_served(
        tmp_path_factory.mktemp("tls"),
        model_dir,
        tls_cert_file=pki.server.cert,
        tls_key_file=pki.server.key,
    )
    yield s
    s.server.stop()


def _mtls_kwargs(pki: Pki) -> dict[str, Any]:
    return {"ca_file": pki.ca.pem, "cert_file": pki.client.cert, "key_file": pki.client.key}


def test_tls_answers_on_both_transports(tls: Served, pki: Pki, transport: str) -> None:
    url = tls.url(transport)
    assert url.startswith(("https://", "grpcs://"))
    with Client(url, ca_file=pki.ca.pem, token=WRITE_TOKEN) as c:
        r = c.logprobs(TOKENS, policy_version=1, score_from=2)
        assert r.versions == [1] and np.isnan(r.logprobs[:2]).all()
        assert np.isfinite(r.logprobs[2:]).all()
        assert c.set_watermark(0) == 0  # writes with the token


def test_mutual_tls_answers_on_both_transports(mtls: Served, pki: Pki, transport: str) -> None:
    with Client(mtls.url(transport), token=WRITE_TOKEN, **_mtls_kwargs(pki)) as c:
        r = c.logprobs(TOKENS, policy_version=2, score_from=3)
        assert r.versions == [2] and np.isfinite(r.logprobs[3:]).all()
        assert [v.policy_version for v in c.versions()][:4] == [0, 1, 2, 3]


def _refused(url: str, reason: str, parameter: str, **kw: Any) -> errors.TlsError:
    start = time.monotonic()
    with Client(url, timeout_s=30, retries=3, backoff_s=1.0, **kw) as c:
        with pytest.raises(errors.TlsError) as info:
            c.versions()
    err = info.value
    assert (err.reason, err.parameter) == (reason, parameter), err
    assert reason.replace("_", " ") in str(err)
    assert time.monotonic() - start < 1.0 * 0.5 + 5, "a failed handshake is not retried"
    return err


def test_untrusted_server_certificate(tls: Served, pki: Pki, transport: str) -> None:
    _refused(tls.url(transport), "untrusted", "ca_file", ca_file=pki.other_ca.pem)
    _refused(tls.url(transport), "untrusted", "ca_file")  # the system's CAs: not ours either


def test_missing_client_certificate(mtls: Served, pki: Pki, transport: str) -> None:
    err = _refused(
        mtls.url(transport), "client_certificate_required", "cert_file", ca_file=pki.ca.pem
    )
    assert "key_file" in str(err)


def test_client_certificate_from_another_ca(mtls: Served, pki: Pki, transport: str) -> None:
    _refused(
        mtls.url(transport),
        "client_certificate_rejected",
        "cert_file",
        ca_file=pki.ca.pem,
        cert_file=pki.foreign_client.cert,
        key_file=pki.foreign_client.key,
    )


@pytest.fixture(scope="module")
def expired(
    tmp_path_factory: pytest.TempPathFactory, model_dir: Path, pki: Pki
) -> Iterator[Served]:
    s = start_served(
        tmp_path_factory.mktemp("expired"),
        model_dir,
        tls_cert_file=pki.expired_server.cert,
        tls_key_file=pki.expired_server.key,
    )
    yield s
    s.server.stop()


def test_expired_server_certificate(expired: Served, pki: Pki, transport: str) -> None:
    _refused(expired.url(transport), "expired", "url", ca_file=pki.ca.pem)


def test_plaintext_to_a_tls_port_is_refused(tls: Served, pki: Pki, transport: str) -> None:
    plain = tls.url(transport).replace("https://", "http://").replace("grpcs://", "grpc://")
    with Client(plain, timeout_s=10, retries=0) as c:
        with pytest.raises(errors.Unavailable):
            c.versions()
    if transport == "http":  # no answer in clear, not even to the probes
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{plain}/healthz", timeout=10)
    with Client(tls.url(transport), ca_file=pki.ca.pem) as c:
        assert c.versions()  # the server is unharmed


def test_tls_client_to_a_plaintext_port_says_not_tls(
    served: Served, pki: Pki, transport: str
) -> None:
    secure = served.url(transport).replace("http://", "https://").replace("grpc://", "grpcs://")
    _refused(secure, "not_tls", "url", ca_file=pki.ca.pem)


def test_tls_options_need_a_tls_url(pki: Pki) -> None:
    with pytest.raises(errors.InvalidRequest) as info:
        Client("http://127.0.0.1:1", ca_file=pki.ca.pem)
    assert info.value.parameter == "url"
    with pytest.raises(errors.InvalidRequest) as info:
        Client("https://127.0.0.1:1", cert_file=pki.client.cert)
    assert info.value.parameter == "key_file"
    with pytest.raises(errors.InvalidRequest) as info:
        Client("grpcs://127.0.0.1:1", ca_file="/nonexistent/ca.pem")
    assert info.value.parameter == "ca_file"


# ---------------------------------------------------------------------------- rotation


def _install(pair: Pair, cert: Path, key: Path) -> None:
    """Replace the served files one at a time, each atomically (a reload in between sees a
    chain and key that do not match, and must keep the old pair)."""
    for src, dst in ((pair.cert, cert), (pair.key, key)):
        tmp = dst.with_suffix(".tmp")
        tmp.write_bytes(src.read_bytes())
        tmp.replace(dst)


def _served_leaf(url: str, bundle: Path) -> bytes:
    """The DER leaf certificate a new handshake to ``url`` gets."""
    host, port = url.split("://", 1)[1].rsplit(":", 1)
    ctx = ssl.create_default_context(cafile=str(bundle))
    ctx.set_alpn_protocols(["h2" if url.startswith("grpcs") else "http/1.1"])

    with socket.create_connection((host, int(port)), timeout=10) as raw:
        with ctx.wrap_socket(raw, server_hostname=host) as tls_sock:
            der = tls_sock.getpeercert(binary_form=True)
    assert der is not None
    return der


def _der(pair: Pair) -> bytes:
    pem = pair.cert.read_text()
    first = pem[: pem.index("-----END CERTIFICATE-----") + len("-----END CERTIFICATE-----")]
    return ssl.PEM_cert_to_DER_cert(first)


def test_grpc_dynamic_credentials_rotate_new_handshakes_only(tmp_path: Path, pki: Pki) -> None:
    """The spike's finding, kept: grpc.aio's dynamic credentials (``ServerTls.grpc_credentials``)
    ask the fetcher at every new handshake, on gRPC's own threads; after a reload new
    connections get the new pair while a channel opened before keeps working; a pair caught
    half-written is refused by ``reload`` and the old one stays served."""
    import grpc
    import grpc.aio
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_health.v1.health import aio as health_aio

    from oldlogit_service.api.tls import ServerTls

    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    _install(pki.server, cert, key)
    rotated = pki.other_ca.issue("rotated-server")
    tls = ServerTls(cert, key)
    fetch_threads: set[str] = set()
    fetch = tls._fetch

    def spy() -> Any:
        fetch_threads.add(threading.current_thread().name)
        return fetch()

    tls._fetch = spy  # type: ignore[method-assign]

    async def check(port: int, ca: Path, channel: Any = None) -> bool:
        ch = channel or grpc.aio.secure_channel(
            f"127.0.0.1:{port}", grpc.ssl_channel_credentials(ca.read_bytes())
        )
        try:
            await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
            return True
        except grpc.aio.AioRpcError as exc:
            assert exc.code() == grpc.StatusCode.UNAVAILABLE
            return False
        finally:
            if channel is None:
                await ch.close()

    async def main() -> None:
        server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(health_aio.HealthServicer(), server)
        port = server.add_secure_port("127.0.0.1:0", tls.grpc_credentials())
        await server.start()
        try:
            old = grpc.aio.secure_channel(
                f"127.0.0.1:{port}", grpc.ssl_channel_credentials(pki.ca.pem.read_bytes())
            )
            assert await check(port, pki.ca.pem, old)
            assert not await check(port, pki.other_ca.pem)
            # Half-written: the new chain beside the old key. Refused; the old pair stays.
            cert.write_bytes(rotated.cert.read_bytes())
            assert tls.reload() is False
            assert await check(port, pki.ca.pem)
            _install(rotated, cert, key)
            assert tls.reload() is True and tls.reloads == 1
            assert await check(port, pki.other_ca.pem)  # new handshakes: the new pair
            assert not await check(port, pki.ca.pem)
            assert await check(port, pki.ca.pem, old)  # the open channel: its session stays
            await old.close()
        finally:
            await server.stop(None)

    asyncio.run(main())
    assert fetch_threads and threading.current_thread().name not in fetch_threads


def test_rotation_under_load_fails_no_request(tmp_path: Path, model_dir: Path, pki: Pki) -> None:
    """Certificates rotated three times (a new CA, then a new key from the first CA) under
    load over both transports, with long-lived clients and a new connection per request:
    zero failed requests, and new handshakes get the new certificate on both ports."""
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    _install(pki.server, cert, key)
    bundle = tmp_path / "trust.pem"  # what clients trust during a CA rotation: old + new
    bundle.write_bytes(pki.ca.pem.read_bytes() + pki.other_ca.pem.read_bytes())
    client_ca = tmp_path / "client-ca.pem"
    client_ca.write_bytes(pki.ca.pem.read_bytes())
    (tmp_path / "srv").mkdir()
    s = start_served(
        tmp_path / "srv",
        model_dir,
        tls_cert_file=cert,
        tls_key_file=key,
        tls_client_ca_file=client_ca,
        tls_reload_interval_s=0.2,
    )
    server: ServerThread = s.server
    assert server.tls is not None
    mine = {"ca_file": bundle, "cert_file": pki.client.cert, "key_file": pki.client.key}
    urls = [server.http_url, server.grpc_url]
    stop = threading.Event()
    done: list[int] = []
    failures: list[BaseException] = []

    def load(url: str, fresh: bool) -> None:
        n = 0
        client = None if fresh else Client(url, retries=0, timeout_s=60, **mine)
        try:
            while not stop.is_set():
                c = client or Client(url, retries=0, timeout_s=60, **mine)
                try:
                    r = c.logprobs(TOKENS, policy_version=n % 4, score_from=2, use_cache=False)
                    assert r.versions == [n % 4]
                    n += 1
                except BaseException as exc:
                    failures.append(exc)
                finally:
                    if client is None:
                        c.close()
        finally:
            if client is not None:
                client.close()
            done.append(n)

    threads = [
        threading.Thread(target=load, args=(u, fresh), daemon=True)
        for u in urls
        for fresh in (False, True)
    ]
    try:
        for t in threads:
            t.start()
        time.sleep(0.5)
        rotations = [
            pki.other_ca.issue("rot-1"),
            pki.ca.issue("rot-2"),
            pki.other_ca.issue("rot-3"),
        ]
        for i, pair in enumerate(rotations):
            before = server.tls.digest
            _install(pair, cert, key)
            if i == 1:
                assert server.reload_tls()  # what SIGHUP does, without waiting for the poll
            end = time.monotonic() + 20
            while server.tls.digest == before:  # the poll finds the change
                assert time.monotonic() < end, "the TLS files were not reloaded"
                time.sleep(0.05)
            for url in urls:
                assert _served_leaf(url, bundle) == _der(pair), url
            time.sleep(0.5)  # load on the new certificate
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=60)
            assert not t.is_alive(), "a worker thread did not finish in time"
        server.stop()
    assert not failures, failures[:3]
    assert len(done) == 4 and min(done) > 0 and sum(done) > 40, done
