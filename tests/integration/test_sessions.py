"""Multi-rank publish sessions over both transports, ranks played in one process.

The protocol of docs/multi-rank-publishing.md: a version published from N parts is
visible only once every part is committed, its hash is the whole weights' hash, it serves
bitwise; deltas per rank against the parent; a wrong part hash, two ranks claiming a tensor, a
missing tensor, an abort and a timeout each leave nothing visible and say why.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from oldlogit import Client, Conflict, NotFound, UnknownVersion, WeightsMismatch
from oldlogit.contract.weights import weight_sha256
from oldlogit.publishing.streams import SafetensorsStream, WeightsCopy
from oldlogit_service.model.numerics import SamplingParams
from oldlogit_service.model.reference import reference_logprobs

from .conftest import WRITE_TOKEN, Served, start_served

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def session_served(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[Served]:
    s = start_served(tmp_path_factory.mktemp("sessions"), model_dir)
    yield s
    s.server.stop()


def _sid() -> str:
    return uuid.uuid4().hex


def _split(weights: dict[str, torch.Tensor], n: int) -> list[dict[str, torch.Tensor]]:
    names = sorted(weights)
    return [{k: weights[k] for k in names[r::n]} for r in range(n)]


def _nudge(w: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, t in w.items():
        mask = torch.rand(t.shape, generator=g) < 0.03
        out[k] = torch.where(mask, (t.float() * 1.01 + 1e-3).to(t.dtype), t)
    return out


def _served_bits(s: Served, c: Client, version: int, w: dict[str, torch.Tensor]) -> None:
    ids = list(range(3, 60))
    r = c.logprobs(ids, policy_version=version, use_cache=False)
    ref = reference_logprobs(s.model, w, ids, SamplingParams())
    assert np.array_equal(r.logprobs, ref, equal_nan=True)


@pytest.mark.parametrize(("transport", "first"), [("http", 100), ("grpc", 200)])
def test_parts_publish_one_version_only_when_all_are_committed(
    session_served: Served, transport: str, first: int
) -> None:
    s = session_served
    w = _nudge(s.weights[3], first)
    shares = _split(w, 3)
    with Client(s.url(transport), token=WRITE_TOKEN) as c:
        sid = _sid()
        opened = c.open_session(sid, first, 3)
        again = c.open_session(sid, first, 3)  # idempotent
        assert opened.state == again.state == "open" and again.session_id == sid
        with pytest.raises(Conflict, match="other parameters"):
            c.open_session(sid, first, 2)
        assert s.server.runtime is not None
        registry = s.server.runtime.metrics.registry

        def published() -> float:
            return registry.get_sample_value("oldlogit_publishes_total", {"code": "ok"}) or 0.0

        before = published()
        for rank in (2, 0):
            info, _ = c.publish_part(sid, rank, shares[rank], policy_version=first)
            assert info.state == "open" and rank in info.committed
            with pytest.raises(UnknownVersion):  # nothing visible yet
                c.version(first)
        info, _ = c.publish_part(sid, 1, shares[1], policy_version=first)
        assert info.state == "published" and info.result is not None
        assert info.result.weight_sha256 == weight_sha256(w)  # the whole hash, by the service
        assert c.session(sid, policy_version=first).state == "published"
        assert published() == before + 1  # counted like any publish
        _served_bits(s, c, first, w)

        # A delta session: each rank sends its changes against its own share of the parent.
        w2 = _nudge(w, first + 1)
        shares2 = _split(w2, 3)
        sid2 = _sid()
        c.open_session(sid2, first + 1, 3, delta=True, parent=first)
        layout = c.weight_layout()
        for rank in range(3):  # each rank's copy of its share at the parent
            base = WeightsCopy.read(shares[rank], layout, partial=True).published(first)
            info, _ = c.publish_part(
                sid2, rank, shares2[rank], policy_version=first + 1, parent_copy=base
            )
        assert info.state == "published" and info.result is not None
        assert info.result.weight_sha256 == weight_sha256(w2) and info.result.kind == "patch"
        _served_bits(s, c, first + 1, w2)


def test_bad_parts_fail_or_are_refused_and_nothing_is_visible(session_served: Served) -> None:
    s = session_served
    w = _nudge(s.weights[3], 300)
    shares = _split(w, 2)
    with Client(s.server.grpc_url, token=WRITE_TOKEN) as c:
        layout = c.weight_layout()
        sid = _sid()
        c.open_session(sid, 300, 2)
        # A part committed with another hash is dropped: the rank sends it again.
        stream = SafetensorsStream.from_state_dict(shares[0], layout, partial=True)
        staged = c.upload_part(sid, 0, stream.chunks(), stream.total_bytes, policy_version=300)
        assert staged.parts[0] == stream.sha256() and 0 not in staged.committed
        with pytest.raises(WeightsMismatch, match="send it again"):
            c.commit_part(sid, 0, "0" * 64, policy_version=300)
        c.publish_part(sid, 0, shares[0], policy_version=300)
        # Two ranks claiming one tensor: refused naming it.
        overlap = {**shares[1], **dict(list(shares[0].items())[:1])}
        with pytest.raises(WeightsMismatch, match="sent already") as info:
            c.publish_part(sid, 1, overlap, policy_version=300)
        assert info.value.details["tensor"] in shares[0]
        # A missing tensor: the last commit fails the session, naming it.
        short = dict(list(shares[1].items())[1:])
        failed, _ = c.publish_part(sid, 1, short, policy_version=300)
        assert failed.state == "failed" and next(iter(shares[1])) in failed.error
        with pytest.raises(UnknownVersion):
            c.version(300)
        with pytest.raises(Conflict, match="failed"):
            c.publish_part(sid, 1, shares[1], policy_version=300)
        # Abort: parts dropped, later parts refused; the version stays free.
        sid2 = _sid()
        c.open_session(sid2, 300, 2)
        c.publish_part(sid2, 0, shares[0], policy_version=300)
        assert c.abort_session(sid2, policy_version=300).state == "aborted"
        with pytest.raises(Conflict, match="aborted"):
            c.publish_part(sid2, 1, shares[1], policy_version=300)
        with pytest.raises(NotFound, match="unknown publish session"):
            c.session(_sid(), policy_version=300)
        # A timeout aborts an idle session.
        sid3 = _sid()
        c.open_session(sid3, 300, 2, ttl_s=0.2)
        time.sleep(0.5)
        state = c.session(sid3, policy_version=300)
        assert state.state == "aborted" and "no activity" in state.error
        # And a fresh session publishes the version after all that.
        sid4 = _sid()
        c.open_session(sid4, 300, 2)
        c.publish_part(sid4, 1, shares[1], policy_version=300)
        done, _ = c.publish_part(sid4, 0, shares[0], policy_version=300)
        assert done.state == "published"
        _served_bits(s, c, 300, w)


def test_delta_part_metadata_and_unknown_tensors_are_checked(session_served: Served) -> None:
    s = session_served
    with Client(s.server.http_url, token=WRITE_TOKEN) as c:
        sid = _sid()
        c.open_session(sid, 400, 1)
        with pytest.raises(WeightsMismatch, match="does not have"):
            c.publish_part(sid, 0, {"model.extra": torch.zeros(2)}, policy_version=400)
        delta = _sid()
        c.open_session(delta, 400, 1, delta=True, parent=3)
        plain = SafetensorsStream.from_state_dict(
            dict(list(s.weights[3].items())[:2]), c.weight_layout(), partial=True
        )
        with pytest.raises(Exception, match="format") as info:
            c.upload_part(delta, 0, plain.chunks(), plain.total_bytes, policy_version=400)
        assert getattr(info.value, "parameter", None) == "body"
        assert json.dumps(c.session(delta, policy_version=400).parts) == "{}"
