"""Each error of the tree, reached over both transports: same code, parameter named, no 500."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch

from oldlogit import Client, Sequence
from oldlogit.contract import errors

from .conftest import WRITE_TOKEN, Served, start_served

pytestmark = pytest.mark.integration


def _ids(n: int) -> list[int]:
    return [i % 300 for i in range(n)]


def _shifted(served: Served, v: int) -> dict[str, torch.Tensor]:
    return {k: (t.float() + 0.01).to(t.dtype) for k, t in served.weights[v].items()}


CASES: dict[str, tuple[type[errors.OldLogitError], str | None, Callable[[Client, Served], Any]]] = {
    "token_out_of_vocab": (
        errors.TokenOutOfVocab,
        "sequences[0].token_ids",
        lambda c, s: c.logprobs([1, 2, 10**6], policy_version=0),
    ),
    "sequence_too_long": (
        errors.SequenceTooLong,
        "sequences[0].token_ids",
        lambda c, s: c.logprobs(_ids(600), policy_version=0),
    ),
    "bad_sampling": (
        errors.BadSampling,
        "sampling.temperature",
        lambda c, s: c.logprobs(_ids(5), policy_version=0, temperature=0.0),
    ),
    "bad_top_p": (
        errors.BadSampling,
        "sampling.top_p",
        lambda c, s: c.logprobs(_ids(5), policy_version=0, top_p=1.5),
    ),
    "malformed_versions": (
        errors.MalformedVersions,
        "sequences[0].versions",
        lambda c, s: c.logprobs(_ids(5), versions=[0, 0]),
    ),
    "negative_version": (
        errors.MalformedVersions,
        "sequences[0].versions",
        lambda c, s: c.logprobs(_ids(3), versions=[0, -5, 0]),
    ),
    "unknown_version": (
        errors.UnknownVersion,
        "policy_version",
        lambda c, s: c.logprobs(_ids(5), policy_version=999),
    ),
    "limit_exceeded": (
        errors.LimitExceeded,
        "sequences",
        lambda c, s: c.logprobs_batch([Sequence(token_ids=[1, 2], policy_version=0)] * 129),
    ),
    "weights_mismatch_sha": (
        errors.WeightsMismatch,
        "sha256",
        lambda c, s: c.publish(90, s.weights[3], sha256="0" * 64),
    ),
    "weights_mismatch_shape": (
        errors.WeightsMismatch,
        "weights",
        lambda c, s: c.publish(91, {k: v[:1] for k, v in s.weights[3].items()}),
    ),
    "version_conflict": (
        errors.VersionConflict,
        "policy_version",
        lambda c, s: c.publish(1, _shifted(s, 1)),
    ),
    "version_not_increasing": (
        errors.VersionNotIncreasing,
        "policy_version",
        lambda c, s: c.publish(5, s.weights[3]),
    ),  # 0..3 and 10 exist
    "unknown_lease": (
        errors.UnknownLease,
        "lease_id",
        lambda c, s: c.release_lease("no-such-lease"),
    ),
    "forbidden_path": (
        errors.Forbidden,
        "path",
        lambda c, s: c.publish(92, "/etc/passwd", by_path=True),
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_error_over_transport(served: Served, transport: str, case: str) -> None:
    cls, parameter, call = CASES[case]
    with Client(served.url(transport), token=WRITE_TOKEN, retries=0) as c:
        with pytest.raises(errors.OldLogitError) as info:
            call(c, served)
    err = info.value
    assert type(err) is cls, f"{type(err).__name__}: {err}"
    assert err.code == cls.code
    if parameter is not None:
        assert err.parameter == parameter, err.parameter
        leaf = parameter.split(".")[-1].split("[")[0]
        assert leaf in err.message, err.message


def test_evicted_version_reports_retained_range(served: Served, transport: str) -> None:
    with Client(served.url(transport), token=WRITE_TOKEN, retries=0) as c:
        # The newest ever acknowledged may have been deleted already (by the other transport's
        # run): versions only go up, so ask the store for the newest acknowledged one.
        newest = served.server.runtime.store.newest  # type: ignore[union-attr]
        gone = int(newest) + 1
        c.publish(gone, served.weights[3])
        c.delete_version(gone)
        with pytest.raises(errors.VersionEvicted) as info:
            c.logprobs(_ids(5), policy_version=gone)
    assert info.value.code == "version_evicted"
    assert info.value.parameter == "policy_version"
    assert "retained" in info.value.details


def test_unauthorized_write(served: Served, transport: str) -> None:
    with Client(served.url(transport), token="wrong", retries=0) as c:
        with pytest.raises(errors.Unauthorized) as info:
            c.set_watermark(0)
    assert info.value.parameter == "authorization"


def test_http_framework_errors_use_the_tree(served: Served) -> None:
    base = served.server.http_url
    with httpx.Client(base_url=base) as h:
        r = h.get("/v1/nope")
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
        r = h.post(
            "/v1/logprobs", content=b"{not json", headers={"content-type": "application/json"}
        )
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request"
        r = h.post("/v1/logprobs", json={"sequences": [{"token_ids": "abc", "policy_version": 0}]})
        assert r.status_code == 400
        assert "sequences[0].token_ids" in r.json()["error"]["parameter"]
        r = h.post(
            "/v1/watermark",
            json={"policy_version": "x"},
            headers={"authorization": f"Bearer {WRITE_TOKEN}"},
        )
        assert r.status_code == 400 and r.json()["error"]["parameter"] == "policy_version"
        r = h.post(
            "/v1/leases",
            json={"policy_version": 0, "ttl_s": -1},
            headers={"authorization": f"Bearer {WRITE_TOKEN}"},
        )
        assert r.status_code == 400 and r.json()["error"]["parameter"] == "ttl_s"
        r = h.get("/v1/versions/12345")
        assert r.status_code == 404 and r.json()["error"]["code"] == "unknown_version"
        r = h.put(
            "/v1/versions/77",
            content=b"garbage-not-safetensors",
            headers={"authorization": f"Bearer {WRITE_TOKEN}"},
        )
        assert r.status_code in (400, 422), r.text
        assert r.json()["error"]["code"] in ("invalid_request", "weights_mismatch")


@pytest.fixture(scope="module")
def tiny_queue(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[Served]:
    s = start_served(
        tmp_path_factory.mktemp("tinyq"),
        model_dir,
        max_queue=1,
        max_wait_ms=50.0,
        max_batch_tokens=64,
    )
    yield s
    s.server.stop()


def test_overloaded_with_retry_after(tiny_queue: Served, transport: str) -> None:
    seen: list[BaseException] = []
    ok: list[int] = []

    def one() -> None:
        with Client(tiny_queue.url(transport), retries=0) as c:
            try:
                c.logprobs(_ids(500), policy_version=0, use_cache=False)
                ok.append(1)
            except errors.OldLogitError as exc:
                seen.append(exc)

    threads = [threading.Thread(target=one) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
        assert not t.is_alive(), "a worker thread did not finish in time"
    assert ok, "some requests are served"
    overloaded = [e for e in seen if isinstance(e, errors.Overloaded)]
    assert overloaded, f"expected Overloaded among {seen!r}"
    assert all(type(e) is errors.Overloaded for e in seen), seen
    assert overloaded[0].retry_after_s > 0
    # Retries on Overloaded are the client's default: then every request is eventually served.
    with Client(tiny_queue.url(transport), retries=8) as c:
        r = c.logprobs(_ids(20), policy_version=0)
    assert np.isfinite(r.logprobs[1:]).all()
