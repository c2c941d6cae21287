"""validate.plan_request: every refusal names its parameter; plans split by version."""

from __future__ import annotations

import numpy as np
import pytest

from oldlogit.contract.errors import (
    BadSampling,
    InvalidRequest,
    LimitExceeded,
    MalformedVersions,
    SequenceTooLong,
    TokenOutOfVocab,
)
from oldlogit.contract.types import LogprobsRequest, Sampling, Sequence
from oldlogit_service.validate import Limits, plan_request

LIMITS = Limits(
    vocab_size=100, max_seq_len=16, max_tokens_per_request=40, max_sequences_per_request=3
)


def req(*seqs: Sequence, **kw: object) -> LogprobsRequest:
    return LogprobsRequest(sequences=list(seqs), **kw)  # type: ignore[arg-type]


def test_policy_version_shorthand_plans_one_job() -> None:
    (plan,) = plan_request(
        req(Sequence(token_ids=[1, 2, 3, 4, 5], policy_version=7, score_from=2)), LIMITS
    )
    assert list(plan.jobs) == [7]
    assert plan.jobs[7].tolist() == [2, 3, 4]


def test_score_from_default_scores_all_but_position_zero() -> None:
    (plan,) = plan_request(req(Sequence(token_ids=[1, 2, 3], policy_version=0)), LIMITS)
    assert plan.jobs[0].tolist() == [1, 2]


def test_per_token_versions_split_and_position_zero_never_scored() -> None:
    seq = Sequence(token_ids=[1, 2, 3, 4, 5, 6], versions=[4, -1, 3, 3, 4, -1])
    (plan,) = plan_request(req(seq), LIMITS)
    assert sorted(plan.jobs) == [3, 4]
    assert plan.jobs[3].tolist() == [2, 3]
    assert plan.jobs[4].tolist() == [4]  # position 0 dropped although versions[0] = 4


def test_nothing_scored_is_allowed() -> None:
    (plan,) = plan_request(req(Sequence(token_ids=[5], policy_version=1)), LIMITS)
    assert plan.jobs == {}


@pytest.mark.parametrize(
    ("seq", "err", "param"),
    [
        (Sequence(token_ids=[1, 100], policy_version=0), TokenOutOfVocab, "sequences[0].token_ids"),
        (Sequence(token_ids=[-1, 2], policy_version=0), TokenOutOfVocab, "sequences[0].token_ids"),
        (
            Sequence(token_ids=list(range(17)), policy_version=0),
            SequenceTooLong,
            "sequences[0].token_ids",
        ),
        (Sequence(token_ids=[], policy_version=0), InvalidRequest, "sequences[0].token_ids"),
        (Sequence(token_ids=[1, 2]), MalformedVersions, "sequences[0].policy_version"),
        (
            Sequence(token_ids=[1, 2], policy_version=-2),
            MalformedVersions,
            "sequences[0].policy_version",
        ),
        (
            Sequence(token_ids=[1, 2], policy_version=1, score_from=3),
            MalformedVersions,
            "sequences[0].score_from",
        ),
        (Sequence(token_ids=[1, 2], versions=[1]), MalformedVersions, "sequences[0].versions"),
        (Sequence(token_ids=[1, 2], versions=[1, -2]), MalformedVersions, "sequences[0].versions"),
        (
            Sequence(token_ids=[1, 2], versions=[1, 1], policy_version=1),
            MalformedVersions,
            "sequences[0].versions",
        ),
        (
            Sequence(token_ids=[1, 2], versions=[1, 1], score_from=1),
            MalformedVersions,
            "sequences[0].score_from",
        ),
        (
            Sequence(token_ids=[1, 2], policy_version=0, sampling=Sampling(top_p=0.0)),
            BadSampling,
            "sequences[0].sampling.top_p",
        ),
    ],
)
def test_refusals_name_the_parameter(seq: Sequence, err: type[Exception], param: str) -> None:
    with pytest.raises(err) as info:
        plan_request(req(seq), LIMITS)
    assert getattr(info.value, "parameter", None) == param
    assert param.split(".")[-1].split("[")[0] in str(info.value)


@pytest.mark.parametrize(
    ("sampling", "param"),
    [
        (Sampling(temperature=0.0), "sampling.temperature"),
        (Sampling(temperature=float("inf")), "sampling.temperature"),
        (Sampling(temperature=float("nan")), "sampling.temperature"),
        (Sampling(top_k=-1), "sampling.top_k"),
        (Sampling(top_p=1.5), "sampling.top_p"),
        (Sampling(top_p=float("nan")), "sampling.top_p"),
    ],
)
def test_bad_sampling(sampling: Sampling, param: str) -> None:
    with pytest.raises(BadSampling) as info:
        plan_request(req(Sequence(token_ids=[1, 2], policy_version=0), sampling=sampling), LIMITS)
    assert info.value.parameter == param


def test_limits() -> None:
    s = Sequence(token_ids=[1, 2], policy_version=0)
    with pytest.raises(LimitExceeded) as info:
        plan_request(req(s, s, s, s), LIMITS)
    assert info.value.parameter == "sequences"
    big = Sequence(token_ids=list(range(15)), policy_version=0)
    with pytest.raises(LimitExceeded):
        plan_request(req(big, big, big), LIMITS)
    with pytest.raises(InvalidRequest) as info2:
        plan_request(req(), LIMITS)
    assert info2.value.parameter == "sequences"
    with pytest.raises(InvalidRequest) as info3:
        plan_request(req(s, timeout_s=-1.0), LIMITS)
    assert info3.value.parameter == "timeout_s"


def test_torch_free_arrays_accepted() -> None:
    seq = Sequence(token_ids=np.array([3, 4, 5], dtype=np.int32), policy_version=2)
    (plan,) = plan_request(req(seq), LIMITS)
    assert plan.token_ids.dtype == np.int64
