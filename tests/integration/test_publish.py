"""Publishing over the wire: streamed upload on both transports, by path, idempotence."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from oldlogit import Client
from oldlogit_service.model.numerics import SamplingParams
from oldlogit_service.model.reference import reference_logprobs

from .conftest import WRITE_TOKEN, Served, start_served

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def fresh(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[Served]:
    s = start_served(tmp_path_factory.mktemp("publish"), model_dir)
    yield s
    s.server.stop()


def _perturbed(served: Served, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        k: (t.float() + 0.02 * torch.randn(t.shape, generator=g)).to(t.dtype)
        for k, t in served.weights[3].items()
    }


@pytest.mark.parametrize(("transport", "version"), [("http", 20), ("grpc", 21)])
def test_upload_then_serve(fresh: Served, transport: str, version: int) -> None:
    from oldlogit.contract.weights import weight_sha256

    w = _perturbed(fresh, version)
    with Client(fresh.url(transport), token=WRITE_TOKEN) as c:
        res = c.publish(version, w)
        assert res.created is True and res.policy_version == version
        assert res.weight_sha256 == weight_sha256(w)
        again = c.publish(version, w)  # idempotent
        assert again.created is False and again.weight_sha256 == res.weight_sha256
        ids = list(range(3, 80))
        r = c.logprobs(ids, policy_version=version)
    ref = reference_logprobs(fresh.model, w, ids, SamplingParams())
    assert np.array_equal(r.logprobs, ref, equal_nan=True)
    assert r.weight_sha256[version] == res.weight_sha256


@pytest.mark.parametrize(("transport", "version"), [("http", 30), ("grpc", 31)])
def test_publish_by_path_under_root(fresh: Served, transport: str, version: int) -> None:
    w = _perturbed(fresh, version)
    root = fresh.settings.publish_roots[0]
    path = root / f"v{version}.safetensors"
    save_file({k: t.contiguous() for k, t in w.items()}, str(path))
    with Client(fresh.url(transport), token=WRITE_TOKEN) as c:
        res = c.publish(version, str(path), by_path=True)
        assert res.created
        ids = list(range(10, 60))
        r = c.logprobs(ids, policy_version=version)
    ref = reference_logprobs(fresh.model, w, ids, SamplingParams())
    assert np.array_equal(r.logprobs, ref, equal_nan=True)


def test_publish_by_path_refuses_a_nul_byte(fresh: Served) -> None:
    """A NUL byte in the path is refused at the edge, naming the parameter."""
    root = fresh.settings.publish_roots[0]
    r = httpx.post(
        fresh.server.http_url + "/v1/versions",
        json={"policy_version": 40, "path": f"{root}/a\x00b.safetensors"},
        headers={"authorization": f"Bearer {WRITE_TOKEN}"},
    )
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["parameter"] == "path" and "no NUL bytes" in err["message"], err


def test_file_upload_from_disk(fresh: Served, tmp_path: Path) -> None:
    w = _perturbed(fresh, 40)
    path = tmp_path / "w.safetensors"
    save_file({k: t.contiguous() for k, t in w.items()}, str(path))
    with Client(fresh.url("http"), token=WRITE_TOKEN) as c:
        res = c.publish(40, path)
    assert res.created and res.policy_version == 40


def test_failed_publish_leaves_nothing_visible(fresh: Served) -> None:
    w = _perturbed(fresh, 50)
    with Client(fresh.url("grpc"), token=WRITE_TOKEN, retries=0) as c:
        with pytest.raises(Exception):  # noqa: B017 - the type is checked in test_errors
            c.publish(50, w, sha256="f" * 64)
        assert 50 not in [v.policy_version for v in c.versions()]
    incoming = fresh.settings.snapshot_dir / "incoming"
    assert not any(incoming.glob("*")) if incoming.exists() else True


@pytest.mark.parametrize("case", ["unauthorized", "unknown-session"])
def test_an_upload_refused_mid_stream_reports_the_reason_over_grpc(
    fresh: Served, case: str
) -> None:
    """The service refuses an upload while the client is still sending: the client must get
    the reason, not grpcio's "Internal error from Core" from its failed next write."""
    import asyncio

    from oldlogit.contract.convert import PublishHeader
    from oldlogit.contract.errors import NotFound, Unauthorized
    from oldlogit.transport.base import open_transport

    async def chunks() -> AsyncIterator[bytes]:
        for _ in range(8):
            yield b"\0" * (1024 * 1024)

    async def attempt() -> None:
        t = open_transport(
            fresh.url("grpc"),
            token=None if case == "unauthorized" else WRITE_TOKEN,
            http_encoding="msgpack",
        )
        try:
            if case == "unauthorized":
                await t.publish(PublishHeader(policy_version=77, sha256=None), chunks(), 30)
            else:
                await t.upload_part("no-such-session", 0, chunks(), 8 << 20, 30)
        finally:
            await t.aclose()

    expected = Unauthorized if case == "unauthorized" else NotFound
    for _ in range(10):  # the failure was a race: give it many chances
        with pytest.raises(expected):
            asyncio.run(attempt())
