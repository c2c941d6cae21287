"""One call from the three logprobs to a corrected loss: ratios → weights/masks → loss → metrics.

In: π_θ (with grad), π_old, μ ([B, T]), advantages and the response mask, plus a
``CorrectionConfig``. Out: ``Correction`` with the loss to backward, the weight and keep-mask
used, both terms' diagnostics, the PPO statistics and the health flags. Each step is also a
public function of its own (``log_ratios``, ``is_weights``, ``rejection_mask``, …).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from oldlogit.correction._common import masked_count, masked_mean
from oldlogit.correction.diagnostics import (
    DISCREPANCY_PREFIX,
    STALENESS_PREFIX,
    HealthFlag,
    HealthThresholds,
    health_flags,
    term_metrics,
)
from oldlogit.correction.loss import Aggregation, decoupled_ppo_loss
from oldlogit.correction.ratios import LogRatios, log_ratios
from oldlogit.correction.weights import (
    Divergence,
    ISLevel,
    RejectionLevel,
    is_weights,
    rejection_mask,
    veto_mask,
)

if TYPE_CHECKING:
    from torch import Tensor

logger = logging.getLogger(__name__)

__all__ = ["Correction", "CorrectionConfig", "corrected_ppo_loss"]


@dataclass(frozen=True)
class CorrectionConfig:
    """What to do with each term. Defaults: token-level TIS at 2.0, ROLL's veto floor, ε = 0.2."""

    is_level: ISLevel | None = "token"  # None: no discrepancy weight (w = 1)
    is_threshold: float | None = 2.0  # truncation; None: untruncated
    is_batch_normalize: bool = False
    rejection_level: RejectionLevel | None = None  # None: no rejection
    rejection_divergence: Divergence = "k3"
    rejection_threshold: float = 0.1
    veto_floor: float | None = 1e-4  # None: no veto
    clip_low: float = 0.2
    clip_high: float | None = None  # None: = clip_low
    dual_clip: float | None = None
    aggregation: Aggregation = "token_mean"
    metrics_threshold: float = 2.0  # thr of the diagnostics (ESS clamp, fraction_high/low)
    health: HealthThresholds = field(default_factory=HealthThresholds)


@dataclass(frozen=True)
class Correction:
    loss: Tensor  # [] to backward
    weight: Tensor  # [B, T] the detached discrepancy weight used (1 where not weighted)
    mask: Tensor  # [B, T] bool: tokens that entered the loss
    ratios: LogRatios
    metrics: dict[str, float]
    flags: list[HealthFlag]


def corrected_ppo_loss(
    current: Any,
    old: Any,
    behaviour: Any,
    advantages: Any,
    mask: Any = None,
    config: CorrectionConfig = CorrectionConfig(),
) -> Correction:
    """The decoupled PPO loss with the discrepancy corrected by weight/rejection/veto.

    ``old`` should be oldlogit's exact training-side logprobs at each token's sampling version;
    passing μ or a recomputation at the current weights works too, and the health flags then
    say which term collapsed to 1.
    """
    import torch

    c = config
    lr = log_ratios(current, old, behaviour, mask)
    keep = lr.mask
    fractions: dict[str, float] = {}
    if c.rejection_level is not None:
        kept = rejection_mask(
            lr.disc,
            lr.mask,
            threshold=c.rejection_threshold,
            level=c.rejection_level,
            divergence=c.rejection_divergence,
        )
        dropped = lr.mask & ~kept
        fractions["rollout_rs_masked_fraction"] = float(masked_mean(dropped.double(), lr.mask))
        fractions["rollout_rs_seq_masked_fraction"] = _seq_fraction(dropped, lr.mask)
        keep = keep & kept
    if c.veto_floor is not None:
        kept = veto_mask(lr.disc, lr.mask, floor=c.veto_floor)
        catastrophic = lr.mask & (lr.disc < math.log(c.veto_floor))
        fractions["rollout_is_veto_fraction"] = _seq_fraction(lr.mask & ~kept, lr.mask)
        fractions["rollout_is_catastrophic_token_fraction"] = float(
            masked_mean(catastrophic.double(), lr.mask)
        )
        keep = keep & kept
    if c.is_level is not None:
        weight = is_weights(
            lr.disc,
            keep,
            level=c.is_level,
            threshold=c.is_threshold,
            batch_normalize=c.is_batch_normalize,
        )
    else:
        weight = keep.to(lr.disc.dtype)
    ppo = decoupled_ppo_loss(
        lr.stale,
        advantages,
        keep,
        behaviour_weight=weight,
        clip_low=c.clip_low,
        clip_high=c.clip_high,
        dual_clip=c.dual_clip,
        aggregation=c.aggregation,
    )
    # Diagnostics see every defined token (before rejection): they describe the data.
    metrics = term_metrics(
        old, behaviour, lr.mask, prefix=DISCREPANCY_PREFIX, threshold=c.metrics_threshold
    )
    metrics.update(
        term_metrics(current, old, lr.mask, prefix=STALENESS_PREFIX, threshold=c.metrics_threshold)
    )
    metrics.update({DISCREPANCY_PREFIX + k: v for k, v in fractions.items()})
    metrics[DISCREPANCY_PREFIX + "undefined_token_count"] = float(lr.undefined)
    w_sel = masked_mean(weight.double(), keep) if int(masked_count(keep)) else torch.ones(())
    metrics[DISCREPANCY_PREFIX + "weight_mean_after_truncation"] = float(w_sel)
    metrics.update(ppo.metrics)
    flags = health_flags(metrics, thresholds=c.health)
    return Correction(ppo.loss, weight, keep, lr, metrics, flags)


def _seq_fraction(dropped: Tensor, mask: Tensor) -> float:
    """Fraction of non-empty sequences with at least one dropped token."""
    import torch

    if dropped.dim() == 0:
        return float(dropped)
    nonempty = masked_count(mask, dim=-1) > 0
    hit = dropped.any(dim=-1)
    n = int(nonempty.sum())
    return float((hit & nonempty).sum()) / n if n else float(torch.zeros(()))
