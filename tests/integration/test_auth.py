"""Auth on both transports: write token, optional read token, loopback-only writes without a
write token, constant-time comparison, tokens never shown."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from oldlogit import Client, errors
from oldlogit_service.config import Settings
from oldlogit_service.runtime import Runtime

from .conftest import WRITE_TOKEN, Served, start_served

pytestmark = pytest.mark.integration

READ_TOKEN = "reader-secret"


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


def test_health_and_metrics_need_no_token(guarded: Served) -> None:
    import httpx

    base = guarded.server.http_url
    assert httpx.get(f"{base}/healthz").status_code == 200
    assert httpx.get(f"{base}/readyz").status_code == 200
    assert httpx.get(f"{base}/metrics").status_code == 200


def test_tokens_are_never_shown(guarded: Served) -> None:
    s = guarded.settings
    assert WRITE_TOKEN not in repr(s) and READ_TOKEN not in repr(s)
    assert WRITE_TOKEN not in str(s.model_dump())


def test_without_write_token_writes_are_loopback_only(tmp_path: Path, model_dir: Path) -> None:
    settings = Settings(model=model_dir, snapshot_dir=tmp_path / "s")
    authorize = Runtime.authorize
    holder = type("H", (), {"settings": settings})()
    authorize(holder, write=True, token=None, peer="127.0.0.1")  # type: ignore[arg-type]
    authorize(holder, write=True, token=None, peer="::1")  # type: ignore[arg-type]
    with pytest.raises(errors.Forbidden) as info:
        authorize(holder, write=True, token=None, peer="10.1.2.3")  # type: ignore[arg-type]
    assert info.value.parameter == "authorization"
    authorize(holder, write=False, token=None, peer="10.1.2.3")  # type: ignore[arg-type]
    # Over the wire from loopback (the test's own address), a write goes through.
    (tmp_path / "x").mkdir()
    s = start_served(tmp_path / "x", model_dir, write_token=None)
    try:
        with Client(s.url("grpc")) as c:
            assert c.set_watermark(0) == 0
    finally:
        s.server.stop()
