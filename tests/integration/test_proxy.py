"""The EWMA proxy over both transports: ``proxy="ewma"``, the opt-in fallback for a gone version,
refusals. Answers are never exact and are bitwise the reference forward of the EWMA weights."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from oldlogit import Client, Sequence, SequenceResult
from oldlogit.contract.errors import InvalidRequest, UnknownVersion, VersionEvicted
from oldlogit.contract.weights import weight_sha256
from oldlogit_service.demo.deployment import demo_versions
from oldlogit_service.model.numerics import SamplingParams
from oldlogit_service.model.reference import reference_logprobs

from .conftest import WRITE_TOKEN, Served, start_served

pytestmark = pytest.mark.integration

BETA = 0.6
IDS = [3, 77, 140, 9, 300, 21, 5, 64, 250, 11, 2]
SAMPLING = SamplingParams(temperature=0.9, top_k=0, top_p=0.95)


@dataclass
class ProxyServed:
    served: Served
    ewma_weights: dict[str, torch.Tensor]  # the average in the serving dtype
    sha: str
    reference: np.ndarray  # [len(IDS)], NaN at 0..1


@pytest.fixture(scope="module")
def proxy_served(
    tmp_path_factory: pytest.TempPathFactory, model_dir: Path
) -> Iterator[ProxyServed]:
    s = start_served(tmp_path_factory.mktemp("proxy"), model_dir, ewma_beta=BETA)
    try:
        # start_served published 1..3 and 10 straight into the store; this publish goes
        # through the runtime, which folds every version it has not seen yet, in order.
        w11 = demo_versions(s.weights[10], 2)[1]
        with Client(s.server.http_url, token=WRITE_TOKEN) as c:
            c.publish(11, w11)
            c.delete_version(1)  # gone: only an opted-in request may get an approximation
        s.weights[11] = w11
        rt = s.server.runtime
        assert rt is not None and rt.ewma is not None
        assert (rt.ewma.count, rt.ewma.last_version) == (6, 11)
        order = [s.weights[v] for v in (0, 1, 2, 3, 10, 11)]
        coef = [BETA ** (len(order) - 1 - i) for i in range(len(order))]
        acc = rt.ewma.accumulators()
        for n, t in acc.items():
            want = sum(c * w[n].double() for c, w in zip(coef, order, strict=True)) / sum(coef)
            torch.testing.assert_close(t.double(), want, rtol=1e-6, atol=1e-6)
        ewma_w = {n: t.to(s.model.dtype) for n, t in acc.items()}
        ref = reference_logprobs(s.model, ewma_w, IDS, SAMPLING)
        ref[:2] = np.nan
        yield ProxyServed(s, ewma_w, weight_sha256(ewma_w), ref)
    finally:
        s.server.stop()


def _lp(c: Client, version: int, **kw: Any) -> SequenceResult:
    return c.logprobs(
        IDS,
        policy_version=version,
        score_from=2,
        temperature=SAMPLING.temperature,
        top_p=SAMPLING.top_p,
        **kw,
    )


def test_proxy_answers_inexact_and_bitwise(proxy_served: ProxyServed, transport: str) -> None:
    p = proxy_served
    with Client(p.served.url(transport)) as c:
        for v in (0, 3, 11):
            r = _lp(c, v, proxy="ewma", use_cache=False)
            assert r.exact is False
            assert r.versions == [v]
            assert r.weight_sha256 == {v: p.sha}
            np.testing.assert_array_equal(r.logprobs, p.reference)
        with pytest.raises(UnknownVersion) as ei:
            _lp(c, 12, proxy="ewma")
        assert ei.value.parameter == "policy_version"


def test_gone_version_needs_opt_in(proxy_served: ProxyServed, transport: str) -> None:
    p = proxy_served
    with Client(p.served.url(transport)) as c:
        with pytest.raises(VersionEvicted):
            _lp(c, 1)
        r = _lp(c, 1, allow_inexact=True)
        assert r.exact is False and r.weight_sha256 == {1: p.sha}
        np.testing.assert_array_equal(r.logprobs, p.reference)
        # Per-token versions mixing a gone and a retained version, next to an exact sequence.
        mixed = Sequence(token_ids=IDS, versions=[-1, -1, 1, 1, 1, 3, 3, 3, 11, 11, 11])
        plain = Sequence(token_ids=IDS, policy_version=3, score_from=2)
        got = c.logprobs_batch(
            [mixed, plain],
            temperature=SAMPLING.temperature,
            top_p=SAMPLING.top_p,
            allow_inexact=True,
        )
        assert got[0].exact is False and got[0].weight_sha256[1] == p.sha
        assert got[0].weight_sha256[3] == got[1].weight_sha256[3] != p.sha
        np.testing.assert_array_equal(got[0].logprobs[2:5], p.reference[2:5])
        np.testing.assert_array_equal(got[0].logprobs[5:8], got[1].logprobs[5:8])
        assert got[1].exact is True


def test_proxy_refused_when_disabled(served: Served, transport: str) -> None:
    with Client(served.url(transport)) as c:
        with pytest.raises(InvalidRequest) as ei:
            _lp(c, 0, proxy="ewma")
        assert ei.value.parameter == "proxy" and "proxy" in ei.value.message
