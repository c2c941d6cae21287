"""The public names: ``oldlogit.__all__`` is pinned (a user's import is a promise), and every
public package's ``__all__`` is unique and resolves (its order is ruff's RUF022, in make lint)."""

from __future__ import annotations

import importlib

import pytest

import oldlogit

PUBLIC = [
    "AsyncClient",
    "AsyncLease",
    "BadSampling",
    "Client",
    "Conflict",
    "DeadlineExceeded",
    "Forbidden",
    "Info",
    "InternalError",
    "InvalidRequest",
    "Lease",
    "LeaseInfo",
    "LimitExceeded",
    "LogprobsRequest",
    "LogprobsResponse",
    "MalformedVersions",
    "MoeInfo",
    "NotFound",
    "OldLogitError",
    "OutOfMemory",
    "Overloaded",
    "ParentMissing",
    "PublishResult",
    "RoutedExperts",
    "Sampling",
    "Sequence",
    "SequenceResult",
    "SequenceTooLong",
    "TlsError",
    "TokenOutOfVocab",
    "Trace",
    "TraceRequest",
    "TraceStageInfo",
    "Unauthorized",
    "Unavailable",
    "UnknownLease",
    "UnknownVersion",
    "VersionConflict",
    "VersionEvicted",
    "VersionInfo",
    "VersionNotIncreasing",
    "WeightsMismatch",
    "__version__",
]


def test_oldlogit_all_is_pinned() -> None:
    assert oldlogit.__all__ == PUBLIC


@pytest.mark.parametrize(
    "package", ["oldlogit", "oldlogit.parity", "oldlogit.integrations", "oldlogit.correction"]
)
def test_all_is_unique_and_resolves(package: str) -> None:
    module = importlib.import_module(package)
    names = list(module.__all__)
    assert len(set(names)) == len(names)
    lazy = package in ("oldlogit.integrations",)  # imports trl/verl/torch when a name is used
    for name in names:
        if lazy and name in ("OldLogitGRPOTrainer",):
            continue  # trl: its own test imports it
        assert getattr(module, name) is not None, name
