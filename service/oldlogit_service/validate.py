"""Validate a logprobs request and plan it into one job per (sequence, version); validate a trace.

In: a ``LogprobsRequest`` (contract type) and the deployment's ``Limits``. Out: a list of
``SequencePlan`` whose ``jobs`` map each distinct version to the positions it scores (and,
for a MoE model, the sequence's routing record checked against the model and placed on its
positions). A ``TraceRequest`` is checked by the same rules (``check_trace``). Every refusal is
an error from ``oldlogit.contract.errors`` naming the offending parameter by its path in the
request (``sequences[3].token_ids``). This stage never touches weights or tensors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from oldlogit.contract.errors import (
    BadSampling,
    InvalidRequest,
    LimitExceeded,
    MalformedVersions,
    SequenceTooLong,
    TokenOutOfVocab,
)
from oldlogit.contract.routing import check_routing, routing_rows
from oldlogit.contract.types import (
    MAX_VERSION,
    NOT_SCORED,
    LogprobsRequest,
    MoeInfo,
    Sampling,
    Sequence,
    TraceRequest,
)


@dataclass(frozen=True)
class Limits:
    vocab_size: int
    max_seq_len: int
    max_tokens_per_request: int
    max_sequences_per_request: int
    moe: MoeInfo | None = None  # the model's MoE routing (None: a dense model)
    replay: bool = True  # the numerics replay and record routing (the invariant profile)


@dataclass
class SequencePlan:
    index: int
    token_ids: npt.NDArray[np.int64]  # [n]
    sampling: Sampling
    # version -> sorted scored positions (each in [1, n)); one whole-sequence forward each.
    jobs: dict[int, npt.NDArray[np.int64]] = field(default_factory=dict)
    # The routing record on the sequence's positions: [n, L, k] int32, −1 rows route freely
    # (always the last); None when no row is recorded (free routing).
    routing: npt.NDArray[np.int32] | None = None


def check_sampling(sampling: Sampling, where: str) -> None:
    """``where``: the path of the settings in the request ("" when they are top-level fields)."""
    prefix = f"{where}." if where else ""
    t = sampling.temperature
    if not (isinstance(t, (int, float)) and math.isfinite(t) and t > 0):
        raise BadSampling(
            f"{prefix}temperature must be a finite number > 0, got {t!r}",
            parameter=f"{prefix}temperature",
        )
    if sampling.top_k < 0:
        raise BadSampling(
            f"{prefix}top_k must be >= 0 (0 disables top-k), got {sampling.top_k}",
            parameter=f"{prefix}top_k",
        )
    p = sampling.top_p
    if not (math.isfinite(p) and 0.0 < p <= 1.0):
        raise BadSampling(
            f"{prefix}top_p must be in (0, 1] (1 disables top-p), got {p!r}",
            parameter=f"{prefix}top_p",
        )


def check_in_vocab(ids: npt.NDArray[np.int64], parameter: str, vocab_size: int) -> None:
    """Every token id in [0, vocab_size), or ``TokenOutOfVocab`` naming the first position."""
    if not ids.size:
        return
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= vocab_size:
        bad_pos = int(np.argmax((ids < 0) | (ids >= vocab_size)))
        raise TokenOutOfVocab(
            f"{parameter}[{bad_pos}] = {int(ids[bad_pos])} is outside the vocabulary "
            f"[0, {vocab_size})",
            parameter=parameter,
        )


def check_trace(req: TraceRequest, limits: Limits, max_tokens: int) -> None:
    """A trace request's fields: a version in [0, 2**63 - 1], 2 to min(``max_tokens``, the
    longest sequence served) tokens in the vocabulary, sampling as for logprobs."""
    if not 0 <= req.policy_version <= MAX_VERSION:
        raise InvalidRequest(
            f"policy_version must be in [0, 2**63 - 1], got {req.policy_version}",
            parameter="policy_version",
        )
    check_sampling(req.sampling(), "")
    n = len(req.token_ids)
    longest = min(max_tokens, limits.max_seq_len)
    if n < 2:
        raise InvalidRequest(
            f"token_ids must hold at least 2 tokens (the first one scored is token 1), got {n}",
            parameter="token_ids",
        )
    if n > longest:
        raise SequenceTooLong(
            f"token_ids has {n} tokens; a trace takes at most {longest} (the trace limit "
            f"{max_tokens} and the longest sequence served, {limits.max_seq_len})",
            parameter="token_ids",
        )
    check_in_vocab(req.token_ids, "token_ids", limits.vocab_size)


def _per_token_versions(seq: Sequence, where: str) -> npt.NDArray[np.int64]:
    n = len(seq.token_ids)
    if seq.versions is not None:
        if seq.policy_version is not None:
            raise MalformedVersions(
                f"{where}: give either policy_version (+ score_from) or versions, not both",
                parameter=f"{where}.versions",
            )
        if seq.score_from is not None:
            raise MalformedVersions(
                f"{where}.score_from goes with policy_version; with per-token versions mark "
                "unscored tokens with -1 instead",
                parameter=f"{where}.score_from",
            )
        if len(seq.versions) != n:
            raise MalformedVersions(
                f"{where}.versions must have one entry per token ({n}), got {len(seq.versions)}",
                parameter=f"{where}.versions",
            )
        if n and int(seq.versions.min()) < NOT_SCORED:
            bad = int(np.argmax(seq.versions < NOT_SCORED))
            raise MalformedVersions(
                f"{where}.versions[{bad}] = {int(seq.versions[bad])}: versions are "
                "non-negative, or -1 for 'not scored'",
                parameter=f"{where}.versions",
            )
        return seq.per_token_versions()
    if seq.policy_version is None:
        raise MalformedVersions(
            f"{where}: give policy_version (+ optional score_from) or per-token versions",
            parameter=f"{where}.policy_version",
        )
    if not 0 <= seq.policy_version <= MAX_VERSION:
        raise MalformedVersions(
            f"{where}.policy_version must be in [0, 2**63 - 1], got {seq.policy_version}",
            parameter=f"{where}.policy_version",
        )
    if seq.score_from is not None and not (0 <= seq.score_from <= n):
        raise MalformedVersions(
            f"{where}.score_from must be in [0, {n}] (the number of tokens), got {seq.score_from}",
            parameter=f"{where}.score_from",
        )
    return seq.per_token_versions()


def _routing_refusal(limits: Limits, parameter: str) -> None:
    """Routing replay and return_routing need a MoE model under the invariant numerics."""
    if limits.moe is None:
        raise InvalidRequest(
            f"{parameter}: this deployment serves a dense model: there is no routing to replay "
            "or return",
            parameter=parameter,
        )
    if not limits.replay:
        raise InvalidRequest(
            f"{parameter}: routing replay and return_routing need the invariant numerics "
            "(--numerics invariant); this deployment runs the plain transformers forward",
            parameter=parameter,
        )


def plan_routing(seq: Sequence, n: int, limits: Limits, where: str) -> npt.NDArray[np.int32] | None:
    """A sequence's routing record checked against the model and placed on its positions
    (``oldlogit.contract.routing``); None when it records no row."""
    record = seq.routed_experts
    if record is None:
        return None
    parameter = f"{where}.routed_experts"
    _routing_refusal(limits, parameter)
    assert limits.moe is not None
    recorded = check_routing(
        record.ids,
        layers=len(limits.moe.layers),
        top_k=limits.moe.top_k,
        num_experts=limits.moe.num_experts,
        parameter=parameter,
        start=record.start,
    )
    rows = routing_rows(record, n, parameter)  # [n, L, k]
    return rows if bool(recorded.any()) and bool((rows[:, 0, 0] >= 0).any()) else None


def plan_request(req: LogprobsRequest, limits: Limits) -> list[SequencePlan]:
    """Check every field and split each sequence into per-version jobs."""
    if req.timeout_s is not None and not (math.isfinite(req.timeout_s) and req.timeout_s > 0):
        raise InvalidRequest(
            f"timeout_s must be a number > 0, got {req.timeout_s!r}", parameter="timeout_s"
        )
    check_sampling(req.sampling, "sampling")
    if req.return_routing:
        _routing_refusal(limits, "return_routing")
    if not req.sequences:
        raise InvalidRequest("sequences must hold at least one sequence", parameter="sequences")
    if len(req.sequences) > limits.max_sequences_per_request:
        raise LimitExceeded(
            f"sequences holds {len(req.sequences)} sequences; the limit per request is "
            f"{limits.max_sequences_per_request}",
            parameter="sequences",
        )
    total = sum(len(s.token_ids) for s in req.sequences)
    if total > limits.max_tokens_per_request:
        raise LimitExceeded(
            f"the request holds {total} tokens; the limit per request is "
            f"{limits.max_tokens_per_request}",
            parameter="sequences",
        )
    plans: list[SequencePlan] = []
    for i, seq in enumerate(req.sequences):
        where = f"sequences[{i}]"
        ids = seq.token_ids
        n = len(ids)
        if n == 0:
            raise InvalidRequest(
                f"{where}.token_ids must hold at least one token", parameter=f"{where}.token_ids"
            )
        if n > limits.max_seq_len:
            raise SequenceTooLong(
                f"{where}.token_ids has {n} tokens; the longest sequence served is "
                f"{limits.max_seq_len}",
                parameter=f"{where}.token_ids",
            )
        check_in_vocab(ids, f"{where}.token_ids", limits.vocab_size)
        sampling = req.sampling
        if seq.sampling is not None:
            check_sampling(seq.sampling, f"{where}.sampling")
            sampling = seq.sampling
        versions = _per_token_versions(seq, where)
        plan = SequencePlan(
            index=i, token_ids=ids, sampling=sampling, routing=plan_routing(seq, n, limits, where)
        )
        scored = np.flatnonzero(versions >= 0)
        if scored.size:
            vs = versions[scored]
            for v in np.unique(vs).tolist():
                plan.jobs[int(v)] = scored[vs == v].astype(np.int64)
        plans.append(plan)
    return plans
