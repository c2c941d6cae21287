"""Trainer-side off-policy correction: the two ratios of π_θ / μ kept apart (docs/correction.md).

In: per-token logprobs — π_θ (the trainer's forward, with grad), π_old (oldlogit's exact
training-side logprobs at each token's sampling version) and μ (the inference engine's) — as
[B, T] tensors or numpy arrays, with a mask. Out: importance weights, rejection masks, the
decoupled PPO loss, per-term diagnostics and health flags. Importing this package does not
import torch; the functions do, when called.
"""

from oldlogit.correction._common import SAFETY_BOUND
from oldlogit.correction.diagnostics import (
    DISCREPANCY_PREFIX,
    LOGPROB_FLOOR,
    STALENESS_PREFIX,
    HealthFlag,
    HealthThresholds,
    health_flags,
    term_metrics,
    two_term_metrics,
)
from oldlogit.correction.loss import Aggregation, PPOLoss, decoupled_ppo_loss
from oldlogit.correction.pipeline import Correction, CorrectionConfig, corrected_ppo_loss
from oldlogit.correction.proximal import approx_loglinear_proximal
from oldlogit.correction.ratios import LogRatios, log_ratio, log_ratios
from oldlogit.correction.weights import (
    Divergence,
    ISLevel,
    RejectionLevel,
    is_weights,
    rejection_mask,
    token_divergence,
    veto_mask,
)

__all__ = [
    "DISCREPANCY_PREFIX",
    "LOGPROB_FLOOR",
    "SAFETY_BOUND",
    "STALENESS_PREFIX",
    "Aggregation",
    "Correction",
    "CorrectionConfig",
    "Divergence",
    "HealthFlag",
    "HealthThresholds",
    "ISLevel",
    "LogRatios",
    "PPOLoss",
    "RejectionLevel",
    "approx_loglinear_proximal",
    "corrected_ppo_loss",
    "decoupled_ppo_loss",
    "health_flags",
    "is_weights",
    "log_ratio",
    "log_ratios",
    "rejection_mask",
    "term_metrics",
    "token_divergence",
    "two_term_metrics",
    "veto_mask",
]
