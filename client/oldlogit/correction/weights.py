"""Importance weights and rejection masks for one log-ratio term (usually the discrepancy).

In: a log-ratio [B, T] (from ``log_ratios``; clamped again here) and its bool mask. Out:
detached weights [B, T] (0 outside the mask) or bool keep-masks [B, T]. Truncation (TIS) caps a
weight; rejection (MIS) drops tokens or whole sequences; the veto drops a sequence holding any
token whose ratio is below a floor. Sequence-level operations reduce over the last dimension.
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING, Literal

from oldlogit.contract.errors import InvalidRequest
from oldlogit.correction._common import (
    SAFETY_BOUND,
    as_mask,
    check_positive,
    masked_count,
    masked_mean,
    masked_sum,
)

if TYPE_CHECKING:
    from torch import Tensor

logger = logging.getLogger(__name__)

__all__ = [
    "Divergence",
    "ISLevel",
    "RejectionLevel",
    "is_weights",
    "rejection_mask",
    "token_divergence",
    "veto_mask",
]

ISLevel = Literal["token", "sequence", "geometric"]
RejectionLevel = Literal["token", "sequence_sum", "sequence_mean", "sequence_max"]
Divergence = Literal["k1", "k2", "k3"]

_IS_LEVELS = ("token", "sequence", "geometric")
_REJECTION_LEVELS = ("token", "sequence_sum", "sequence_mean", "sequence_max")
_DIVERGENCES = ("k1", "k2", "k3")


def _prepared(log_ratio: Tensor, mask: Tensor | None) -> tuple[Tensor, Tensor]:
    import torch

    lr = log_ratio.detach()
    if not lr.is_floating_point():
        lr = lr.float()
    m = as_mask(mask, lr.shape, like=lr)
    zero = torch.zeros((), dtype=lr.dtype, device=lr.device)
    # NaN is "undefined": never selected (``log_ratio`` already guarantees it, users may not).
    m = m & ~torch.isnan(lr)
    return torch.where(m, lr, zero).clamp(-SAFETY_BOUND, SAFETY_BOUND), m


def is_weights(
    log_ratio: Tensor,
    mask: Tensor | None = None,
    *,
    level: ISLevel = "token",
    threshold: float | None = 2.0,
    batch_normalize: bool = False,
) -> Tensor:
    """Truncated importance weights [B, T], detached, 0 outside the mask.

    - ``token``:     w_t = exp(log ρ_t)
    - ``sequence``:  w = exp(clamp(Σ_t log ρ_t, ±20)), every token of the sequence
    - ``geometric``: w = exp(mean_t log ρ_t), every token of the sequence
    then w ← min(w, threshold) (None: no truncation), then with ``batch_normalize`` w ← w / mean
    (the mean over selected tokens for ``token``, over non-empty sequences otherwise; skipped
    when that mean is 0).
    """
    import torch

    if level not in _IS_LEVELS:
        raise InvalidRequest(f"level must be one of {_IS_LEVELS}, got {level!r}", parameter="level")
    if threshold is not None:
        threshold = check_positive(threshold, "threshold")
    lr, m = _prepared(log_ratio, mask)
    if level == "token":
        w = torch.exp(lr)
    elif level == "sequence":
        seq = masked_sum(lr, m, dim=-1).clamp(-SAFETY_BOUND, SAFETY_BOUND)  # [B]
        w = torch.exp(seq).unsqueeze(-1).expand_as(lr)
    else:
        seq = masked_mean(lr, m, dim=-1)  # [B]; 0 (w = 1) for an empty sequence
        w = torch.exp(seq).unsqueeze(-1).expand_as(lr)
    if threshold is not None:
        w = w.clamp(max=threshold)
    zero = torch.zeros((), dtype=w.dtype, device=w.device)
    w = torch.where(m, w, zero)
    if batch_normalize:
        if level == "token":
            mean = masked_mean(w, m)
        else:
            nonempty = masked_count(m, dim=-1) > 0  # [B]
            per_seq = w.amax(dim=-1) if w.numel() else w.sum(dim=-1)  # [B]: the one value
            mean = masked_mean(per_seq, nonempty)
        w = torch.where(mean > 0, w / mean.clamp_min(torch.finfo(w.dtype).tiny), w)
    return w


def token_divergence(log_ratio: Tensor, divergence: Divergence) -> Tensor:
    """Per-token divergence [B, T] from log ρ: k1 = −log ρ, k2 = ½(log ρ)², k3 = ρ − 1 − log ρ."""
    import torch

    if divergence not in _DIVERGENCES:
        raise InvalidRequest(
            f"divergence must be one of {_DIVERGENCES}, got {divergence!r}",
            parameter="divergence",
        )
    lr = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    if divergence == "k1":
        return -lr
    if divergence == "k2":
        return 0.5 * lr * lr
    return torch.expm1(lr) - lr  # k3 ≥ 0; expm1 keeps it exact near ρ = 1


def rejection_mask(
    log_ratio: Tensor,
    mask: Tensor | None = None,
    *,
    threshold: float,
    level: RejectionLevel = "token",
    divergence: Divergence = "k3",
) -> Tensor:
    """Keep-mask [B, T] bool: the mask minus rejected tokens (``token``) or sequences.

    The statistic is the per-token divergence (see ``token_divergence``) itself (``token``),
    or its sum, mean or max over the sequence's selected tokens. A token/sequence is rejected
    when the statistic exceeds ``threshold``; k1 is signed, so it is compared by its absolute
    value: with ``divergence="k1"`` and ``threshold=log(u)``, ``token`` keeps ρ ∈ [1/u, u] and
    ``sequence_sum`` keeps Π ρ ∈ [1/u, u] (verl's token and sequence modes), ``sequence_mean``
    bounds the geometric mean. An empty sequence is never rejected (it has nothing to drop).
    """
    import torch

    if level not in _REJECTION_LEVELS:
        raise InvalidRequest(
            f"level must be one of {_REJECTION_LEVELS}, got {level!r}", parameter="level"
        )
    threshold = check_positive(threshold, "threshold")
    lr, m = _prepared(log_ratio, mask)
    d = token_divergence(lr, divergence)  # [B, T]
    if divergence == "k1":
        d_stat = d.abs() if level in ("token", "sequence_max") else d
    else:
        d_stat = d
    if level == "token":
        stat = d_stat
    elif level == "sequence_sum":
        stat = masked_sum(d_stat, m, dim=-1).unsqueeze(-1)  # [B, 1]
    elif level == "sequence_mean":
        stat = masked_mean(d_stat, m, dim=-1).unsqueeze(-1)
    else:
        floor = torch.full((), -math.inf, dtype=d.dtype, device=d.device)
        stat = torch.where(m, d_stat, floor).amax(dim=-1, keepdim=True) if d.numel() else d
    if divergence == "k1" and level in ("sequence_sum", "sequence_mean"):
        stat = stat.abs()
    return m & ~(stat > threshold)


def veto_mask(log_ratio: Tensor, mask: Tensor | None = None, *, floor: float = 1e-4) -> Tensor:
    """Keep-mask [B, T] bool: drops every token of a sequence that holds a selected token with
    ρ < ``floor`` ("catastrophic" tokens; ROLL's default floor 1e-4)."""
    floor = check_positive(floor, "floor")
    lr, m = _prepared(log_ratio, mask)
    catastrophic = m & (lr < math.log(floor))  # [B, T]
    return m & ~catastrophic.any(dim=-1, keepdim=True)
