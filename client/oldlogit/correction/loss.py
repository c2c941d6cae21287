"""The decoupled PPO loss (Hilton et al. 2021): clip on staleness, weight by discrepancy.

In: log ρ_stale [B, T] (gradient through π_θ), advantages ([B, T] or [B]), the keep-mask, and
optionally the detached discrepancy weight w [B, T]. Out: a scalar loss and the PPO statistics
under verl's ``actor/…`` names. The trust region is taken around π_old, the training-side
policy at the sampling version — never around μ, whose numerical noise would eat the clip range.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from oldlogit.contract.errors import InvalidRequest
from oldlogit.correction._common import (
    SAFETY_BOUND,
    as_float,
    as_mask,
    check_positive,
    check_same_shape,
    masked_count,
    masked_mean,
    masked_sum,
)

if TYPE_CHECKING:
    from torch import Tensor

logger = logging.getLogger(__name__)

__all__ = ["Aggregation", "PPOLoss", "decoupled_ppo_loss"]

Aggregation = Literal["token_mean", "seq_mean_token_mean"]


@dataclass(frozen=True)
class PPOLoss:
    loss: Tensor  # [] the scalar to backward
    token_loss: Tensor  # [B, T] per-token loss, 0 outside the mask
    metrics: dict[str, float] = field(default_factory=dict)


def decoupled_ppo_loss(
    stale_log_ratio: Tensor,
    advantages: Any,
    mask: Any = None,
    *,
    behaviour_weight: Tensor | None = None,
    clip_low: float = 0.2,
    clip_high: float | None = None,
    dual_clip: float | None = None,
    aggregation: Aggregation = "token_mean",
) -> PPOLoss:
    """L = −E[ w_t · min(r_t A_t, clip(r_t, 1 − ε_low, 1 + ε_high) A_t) ], r_t = exp(log ρ_stale).

    ``behaviour_weight`` w (the discrepancy term's truncated IS weight) is detached: it changes
    the measure, not the objective; None means w = 1. ``dual_clip`` c (> 1, typically 3) caps
    the loss of a token with A_t < 0 at c·|A_t|. ``aggregation``: ``token_mean`` averages over
    all selected tokens; ``seq_mean_token_mean`` averages each sequence's token mean over the
    non-empty sequences. A batch with no selected token gives a zero loss (still differentiable).

    Metrics: ``actor/pg_loss``, ``actor/pg_clipfrac`` (tokens where the clipped branch is the
    active one), ``actor/pg_clipfrac_lower`` (tokens where the dual clip is active),
    ``actor/ppo_kl`` (mean of −log ρ_stale, the k1 estimate of KL(π_old ‖ π_θ)).
    """
    import torch

    eps_low = check_positive(clip_low, "clip_low")
    eps_high = eps_low if clip_high is None else check_positive(clip_high, "clip_high")
    if dual_clip is not None and not (isinstance(dual_clip, (int, float)) and dual_clip > 1.0):
        raise InvalidRequest(
            f"dual_clip must be a number > 1 (typically 3), got {dual_clip!r}",
            parameter="dual_clip",
        )
    if aggregation not in ("token_mean", "seq_mean_token_mean"):
        raise InvalidRequest(
            f"aggregation must be 'token_mean' or 'seq_mean_token_mean', got {aggregation!r}",
            parameter="aggregation",
        )
    lr = as_float(stale_log_ratio, name="stale_log_ratio")
    m = as_mask(mask, lr.shape, like=lr)
    adv = as_float(advantages, like=lr, name="advantages").detach()
    if adv.dim() == lr.dim() - 1:  # one advantage per sequence
        adv = adv.unsqueeze(-1).expand_as(lr)
    check_same_shape(lr.shape, adv, "advantages")
    zero = torch.zeros((), dtype=lr.dtype, device=lr.device)
    m = m & ~torch.isnan(lr) & torch.isfinite(adv)
    # Sanitise before exp: a masked-out NaN/inf would otherwise poison the backward.
    lr = torch.where(m, lr, zero).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    adv = torch.where(m, adv, zero)
    ratio = torch.exp(lr)  # [B, T]
    pg1 = -adv * ratio
    pg2 = -adv * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    clipped = torch.maximum(pg1, pg2)
    clip_active = pg2 > pg1
    if dual_clip is not None:
        cap = -adv * dual_clip  # = c·|A| where A < 0
        lower_active = (adv < 0) & (clipped > cap)
        per_token = torch.where(adv < 0, torch.minimum(clipped, cap), clipped)
    else:
        lower_active = torch.zeros_like(m)
        per_token = clipped
    if behaviour_weight is not None:
        w = as_float(behaviour_weight, like=lr, name="behaviour_weight").detach()
        check_same_shape(lr.shape, w, "behaviour_weight")
        m = m & torch.isfinite(w)
        per_token = per_token * torch.where(m, w, zero)
    per_token = torch.where(m, per_token, zero)
    if aggregation == "token_mean":
        loss = masked_sum(per_token, m) / masked_count(m).clamp_min(1).to(per_token.dtype)
    else:
        per_seq = masked_mean(per_token, m, dim=-1)  # [B]
        nonempty = masked_count(m, dim=-1) > 0
        loss = masked_mean(per_seq, nonempty)
    with torch.no_grad():
        metrics = {
            "actor/pg_loss": float(loss.detach()),
            "actor/pg_clipfrac": float(masked_mean(clip_active.to(lr.dtype), m)),
            "actor/pg_clipfrac_lower": float(masked_mean(lower_active.to(lr.dtype), m)),
            "actor/ppo_kl": float(masked_mean(-lr.detach(), m)),
        }
    return PPOLoss(loss=loss, token_loss=per_token, metrics=metrics)
