"""The two log-ratios of π_θ / μ (discrepancy, staleness), per token, with their mask.

In: per-token logprobs [B, T] — π_θ (the trainer's forward, with grad), π_old (oldlogit's
training-side logprobs at each token's sampling version) and μ (the inference engine's) — and a
mask of the tokens to train on. Out: ``LogRatios``: log ρ_disc = log π_old − log μ (detached)
and log ρ_stale = log π_θ − log π_old (gradient through π_θ only), both clamped to ±20.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from oldlogit.correction._common import (
    SAFETY_BOUND,
    as_float,
    as_mask,
    check_same_shape,
)

if TYPE_CHECKING:
    from torch import Tensor

logger = logging.getLogger(__name__)

__all__ = ["LogRatios", "log_ratio", "log_ratios"]


@dataclass(frozen=True)
class LogRatios:
    """Both terms, kept apart; ``disc + stale`` is log π_θ − log μ where nothing was clamped."""

    disc: Tensor  # [B, T] log π_old − log μ: train–inference discrepancy, detached
    stale: Tensor  # [B, T] log π_θ − log π_old: policy staleness, grad through π_θ
    mask: Tensor  # [B, T] bool: the given mask minus tokens whose ratio is undefined
    undefined: Tensor  # [] int64: tokens of the given mask dropped because a ratio was NaN

    @property
    def total(self) -> Tensor:
        """[B, T] log π_θ − log μ, the ratio a pipeline without oldlogit clips on."""
        return self.disc + self.stale


def log_ratio(numerator: Any, denominator: Any, mask: Any = None) -> tuple[Tensor, Tensor]:
    """``(clamp(num − den, ±20), mask)``, 0 where not selected: ([...], [...] bool).

    Extremes are kept as clamped values: π_num = 0 with μ > 0 (a token the training side rules
    out) gives −20, which the veto sees. An undefined ratio (NaN: not scored, or −inf − −inf,
    a token impossible on both sides) is dropped from the returned mask. ``mask`` None selects
    every defined entry — handy for the client's arrays, NaN where not scored.
    """
    import torch

    like = numerator if isinstance(numerator, torch.Tensor) else None
    num = as_float(numerator, like=like, name="numerator")
    den = as_float(denominator, like=num, name="denominator")
    check_same_shape(num.shape, den, "denominator")
    given = as_mask(mask, num.shape, like=num)
    raw = num - den.to(num.dtype)
    defined = ~torch.isnan(raw)
    keep = given & defined
    # Select before clamping, so no NaN/inf reaches the backward of anything downstream.
    safe = torch.where(keep, raw, torch.zeros((), dtype=raw.dtype, device=raw.device))
    return safe.clamp(-SAFETY_BOUND, SAFETY_BOUND), keep


def log_ratios(current: Any, old: Any, behaviour: Any, mask: Any = None) -> LogRatios:
    """Split log π_θ − log μ into the discrepancy and the staleness term.

    ``current`` is the trainer's logprobs (a tensor; gradient flows through it); ``old`` and
    ``behaviour`` may be tensors or numpy arrays (detached either way). All share one shape,
    typically [B, T]; ``mask`` selects the tokens to train on (None: every defined token).
    """
    import torch

    cur = as_float(current, name="current")
    old_t = as_float(old, like=cur, name="old").detach()
    beh = as_float(behaviour, like=cur, name="behaviour").detach()
    check_same_shape(cur.shape, old_t, "old")
    check_same_shape(cur.shape, beh, "behaviour")
    given = as_mask(mask, cur.shape, like=cur)
    disc, keep_d = log_ratio(old_t, beh, given)
    stale, keep_s = log_ratio(cur, old_t, given)
    keep = keep_d & keep_s
    zero = torch.zeros((), dtype=disc.dtype, device=disc.device)
    undefined = (given & ~keep).sum()
    return LogRatios(
        disc=torch.where(keep, disc, zero),
        stale=torch.where(keep, stale, zero.to(stale.dtype)),
        mask=keep,
        undefined=undefined,
    )
