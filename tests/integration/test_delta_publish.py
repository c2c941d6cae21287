"""Delta publishing over the wire (both transports): only changed elements travel, the service
rebuilds and verifies before the version is visible, ParentMissing and the full fallback."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from oldlogit import Client, InvalidRequest, ParentMissing, UnknownVersion, WeightsMismatch
from oldlogit.publishing.streams import WeightsCopy
from oldlogit_service.model.numerics import SamplingParams
from oldlogit_service.model.reference import reference_logprobs

from .conftest import WRITE_TOKEN, Served, start_served

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def delta_served(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[Served]:
    s = start_served(tmp_path_factory.mktemp("delta"), model_dir, keyframe_every=4)
    yield s
    s.server.stop()


def step(w: dict[str, torch.Tensor], seed: int, frac: float = 0.02) -> dict[str, torch.Tensor]:
    """An optimizer-like step: a few elements move by about one bf16 spacing."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, t in w.items():
        mask = torch.rand(t.shape, generator=g) < frac
        out[k] = torch.where(mask, (t.float() * 1.01 + 1e-3).to(t.dtype), t)
    return out


def check_served(s: Served, c: Client, version: int, w: dict[str, torch.Tensor]) -> None:
    ids = list(range(5, 70))
    r = c.logprobs(ids, policy_version=version, use_cache=False)
    ref = reference_logprobs(s.model, w, ids, SamplingParams())
    assert np.array_equal(r.logprobs, ref, equal_nan=True)


@pytest.mark.parametrize(("transport", "first"), [("http", 100), ("grpc", 200)])
def test_delta_publishes_serve_bitwise(delta_served: Served, transport: str, first: int) -> None:
    s = delta_served
    w = s.weights[3]
    with Client(s.url(transport), token=WRITE_TOKEN) as c:
        published = {}
        for i in range(5):
            w = step(w, first + i)
            res = c.publish(first + i, w, delta=True)
            assert res.created and res.weight_sha256 == WeightsCopy.read(w).sha256
            published[first + i] = w
        infos = {v.policy_version: v for v in c.versions()}
        assert {infos[v].kind for v in published} == {"patch", "keyframe"}
        assert infos[first + 1].kind == "patch" and infos[first + 1].parent == first
        # Only the changed elements travelled: a delta is a few % of the weights.
        last = WeightsCopy.read(w)
        prev = WeightsCopy.read(published[first + 3]).published(first + 3)
        assert last.delta_stream(prev).total_bytes < 0.2 * last.full_stream().total_bytes
        for v, wv in published.items():
            check_served(s, c, v, wv)
        again = c.publish(first + 4, w, delta=True)  # idempotent
        assert not again.created


@pytest.mark.parametrize(("transport", "first"), [("http", 300), ("grpc", 400)])
def test_parent_missing_and_full_fallback(delta_served: Served, transport: str, first: int) -> None:
    s = delta_served
    w = step(s.weights[2], first)
    with Client(s.url(transport), token=WRITE_TOKEN, retries=0) as c:
        c.publish(first, w, delta=True)
        c.delete_version(first)  # the service loses the client's parent
        w2 = step(w, first + 1)
        with pytest.raises(ParentMissing, match="parent") as info:
            c.publish(first + 1, w2, delta=True)
        assert info.value.parameter == "parent" and info.value.code == "parent_missing"
        with pytest.raises(UnknownVersion):
            c.version(first + 1)  # nothing became visible
        res = c.publish(first + 1, w2, delta=True, fallback_full=True)
        assert res.created
        check_served(s, c, first + 1, w2)
        w3 = step(w2, first + 2)  # and deltas continue from there
        assert c.publish(first + 2, w3, delta=True).created
        check_served(s, c, first + 2, w3)


@pytest.mark.parametrize(("transport", "first"), [("http", 500), ("grpc", 600)])
def test_wrong_sha_or_corrupt_delta_is_never_visible(
    delta_served: Served, transport: str, first: int, tmp_path: Path
) -> None:
    s = delta_served
    w = step(s.weights[1], first)
    with Client(s.url(transport), token=WRITE_TOKEN, retries=0) as c:
        c.publish(first, w, delta=True)
        parent = WeightsCopy.read(w).published(first)
        new = WeightsCopy.read(step(w, first + 1))
        stream = new.delta_stream(parent)
        wrong = "0" * 64
        with pytest.raises(WeightsMismatch, match="sha256"):
            c._loop.run(c._aio._upload(first + 1, stream, wrong, False, parent=first))
        # Flip one value bit: the rebuilt weights no longer hash to the claimed sha256.
        raw = bytearray(b"".join(stream.chunks()))
        raw[-1] ^= 0x01
        path = tmp_path / "bad.safetensors"
        path.write_bytes(bytes(raw))
        with pytest.raises(InvalidRequest):  # WeightsMismatch, or malformed positions
            c._loop.run(
                c._aio._upload(first + 1, _FileStream(path), new.sha256, False, parent=first)
            )
        with pytest.raises(UnknownVersion):
            c.version(first + 1)
    incoming = s.settings.snapshot_dir / "incoming"
    assert not any(incoming.glob("*"))


def test_parent_without_delta_is_refused(delta_served: Served) -> None:
    s = delta_served
    r = httpx.put(
        f"{s.server.http_url}/v1/versions/999",
        params={"parent": 3},
        content=b"x" * 16,
        headers={"authorization": f"Bearer {WRITE_TOKEN}"},
    )
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["parameter"] == "parent" and "parent" in err["message"]


class _FileStream:
    """A prepared body, shaped like ``SafetensorsStream`` for ``AsyncClient._upload``."""

    def __init__(self, path: Path) -> None:
        self.data = path.read_bytes()
        self.total_bytes = len(self.data)

    def chunks(self, chunk_bytes: int | None = None) -> Iterator[bytes]:
        yield self.data
