"""A replica lists a reachable address in ``/v1/replicas`` (never its wildcard bind), and a
client's ``discover()`` connects through exactly what was listed."""

from __future__ import annotations

from pathlib import Path

import pytest

from oldlogit import Client

from .conftest import WRITE_TOKEN, start_served

pytestmark = pytest.mark.redis


@pytest.mark.parametrize("transport", ["http", "grpc"])
def test_discover_uses_the_advertised_host(
    tmp_path: Path, model_dir: Path, redis_server: object, transport: str
) -> None:
    # Bound to 127.0.0.1 (test traffic stays on loopback), advertised under another name for
    # the same address, as compose advertises a service name.
    s = start_served(
        tmp_path,
        model_dir,
        redis_url=redis_server.url,  # type: ignore[attr-defined]
        replica_id="r0",
        advertise_host="localhost",
    )
    try:
        http_port = s.server.http_url.rsplit(":", 1)[1]
        grpc_port = s.server.grpc_url.rsplit(":", 1)[1]
        with Client(s.url(transport), token=WRITE_TOKEN) as c:
            (member,) = c.replicas()
            assert member["http"] == f"localhost:{http_port}"
            assert member["grpc"] == f"localhost:{grpc_port}"
            want = f"{transport}://localhost:{http_port if transport == 'http' else grpc_port}"
            assert c.discover() == [want]
            assert c.logprobs([1, 2, 3, 4], policy_version=1).versions == [1]
    finally:
        s.server.stop()
