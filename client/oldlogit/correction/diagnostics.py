"""Diagnostics for each term separately, under verl's ``rollout_corr/…`` names, and health flags.

In: two logprob arrays (numerator, denominator) and a mask per term. Out: ``{name: float}``.
The discrepancy term (π_old vs μ) is exactly what verl reports as ``rollout_corr/…`` (its
"training" vs "rollout" logprobs), so it keeps those names and dashboards carry over; the
staleness term (π_θ vs π_old) gets the same names under ``staleness_corr/``. Everything is
computed in float64 on detached values, log ratios clamped to ±20 and logprobs floored at −100,
so no NaN or inf reaches a metric; a term with no selected token reports neutral values.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

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

__all__ = [
    "DISCREPANCY_PREFIX",
    "LOGPROB_FLOOR",
    "STALENESS_PREFIX",
    "HealthFlag",
    "HealthThresholds",
    "health_flags",
    "term_metrics",
    "two_term_metrics",
]

DISCREPANCY_PREFIX = "rollout_corr/"  # π_old vs μ: verl's own meaning of these names
STALENESS_PREFIX = "staleness_corr/"  # π_θ vs π_old
LOGPROB_FLOOR = -100.0  # a −inf logprob counts as −100 in the perplexities (finite in float64)


def term_metrics(
    numerator: Any,
    denominator: Any,
    mask: Any = None,
    *,
    prefix: str = DISCREPANCY_PREFIX,
    threshold: float = 2.0,
) -> dict[str, float]:
    """One term's diagnostics; ρ = π_num / π_den per token (verl: "training" / "rollout").

    - ``kl`` = mean(log π_den − log π_num) (k1 of KL(π_den ‖ π_num); can be negative)
    - ``k3_kl`` = mean(ρ − 1 − log ρ)
    - ``chi2_token`` = mean(ρ²) − 1; ``chi2_seq`` = mean over sequences of Π ρ² − 1
    - ``training_ppl``/``rollout_ppl`` = mean over sequences of exp(−mean log π); their
      ``…_log_ppl``; ``log_ppl_diff`` = mean over sequences of (mean log π_den − mean log π_num);
      ``ppl_ratio`` = mean over sequences of exp(that)
    - ``rollout_is_mean/std/min/max`` of the token ratio ρ (before any truncation)
    - ``rollout_is_eff_sample_size`` = 1 / mean((w / mean w)²), w = ρ clamped to [1/thr, thr]
    - ``rollout_is_ratio_fraction_high/low``: fraction of tokens with ρ > thr, ρ < 1/thr
    - ``num_tokens``, ``num_sequences`` (non-empty ones)
    Means are over selected tokens; sequence means over non-empty sequences (last dimension).
    """
    import torch

    thr = check_positive(threshold, "threshold")
    num = as_float(numerator, name="numerator").detach().double()
    den = as_float(denominator, like=num, name="denominator").detach().double()
    check_same_shape(num.shape, den, "denominator")
    m = as_mask(mask, num.shape, like=num)
    raw = num - den
    m = m & ~torch.isnan(raw)
    zero = torch.zeros((), dtype=torch.float64, device=num.device)
    lr = torch.where(m, raw, zero).clamp(-SAFETY_BOUND, SAFETY_BOUND)  # [B, T]
    n_tok = int(masked_count(m))
    if num.dim() == 0:
        m2, lr2 = m.reshape(1, 1), lr.reshape(1, 1)
    elif num.dim() == 1:
        m2, lr2 = m.unsqueeze(0), lr.unsqueeze(0)  # one sequence
    else:
        m2, lr2 = m, lr
    nonempty = masked_count(m2, dim=-1) > 0  # [B]
    n_seq = int(nonempty.sum())
    out: dict[str, float] = {"num_tokens": float(n_tok), "num_sequences": float(n_seq)}
    if n_tok == 0:
        out.update(_NEUTRAL)
        return {prefix + k: v for k, v in out.items()}

    def floored(x: Tensor) -> Tensor:
        return torch.where(m, x, zero).nan_to_num(nan=0.0).clamp(min=LOGPROB_FLOOR)

    num_f = floored(num).reshape(lr2.shape)
    den_f = floored(den).reshape(lr2.shape)
    rho = torch.exp(lr)
    out["kl"] = float(masked_mean(-lr, m))
    out["k3_kl"] = float(masked_mean(torch.expm1(lr) - lr, m))
    out["chi2_token"] = float(masked_mean(rho * rho, m)) - 1.0
    seq_lr = masked_sum(lr2, m2, dim=-1).clamp(-SAFETY_BOUND, SAFETY_BOUND)  # [B]
    out["chi2_seq"] = float(masked_mean(torch.exp(2.0 * seq_lr), nonempty)) - 1.0
    mean_num = masked_mean(num_f, m2, dim=-1)  # [B]
    mean_den = masked_mean(den_f, m2, dim=-1)
    out["training_log_ppl"] = float(masked_mean(-mean_num, nonempty))
    out["rollout_log_ppl"] = float(masked_mean(-mean_den, nonempty))
    out["training_ppl"] = float(masked_mean(torch.exp(-mean_num), nonempty))
    out["rollout_ppl"] = float(masked_mean(torch.exp(-mean_den), nonempty))
    log_ppl_diff = masked_mean(-lr2, m2, dim=-1)  # [B] = mean log π_den − mean log π_num
    out["log_ppl_diff"] = float(masked_mean(log_ppl_diff, nonempty))
    out["ppl_ratio"] = float(masked_mean(torch.exp(log_ppl_diff), nonempty))
    mean_rho = masked_mean(rho, m)
    var = masked_mean((rho - mean_rho) ** 2, m)
    out["rollout_is_mean"] = float(mean_rho)
    out["rollout_is_std"] = math.sqrt(max(float(var), 0.0)) if n_tok > 1 else 0.0
    inf = torch.full((), math.inf, dtype=torch.float64, device=num.device)
    out["rollout_is_min"] = float(torch.where(m, rho, inf).min())
    out["rollout_is_max"] = float(torch.where(m, rho, -inf).max())
    w = rho.clamp(1.0 / thr, thr)
    w_norm = w / masked_mean(w, m)
    out["rollout_is_eff_sample_size"] = 1.0 / float(masked_mean(w_norm * w_norm, m))
    out["rollout_is_ratio_fraction_high"] = float(masked_mean((lr > math.log(thr)).double(), m))
    out["rollout_is_ratio_fraction_low"] = float(masked_mean((lr < -math.log(thr)).double(), m))
    return {prefix + k: v for k, v in out.items()}


# What a term with no selected token reports: "no evidence of a mismatch", never NaN.
_NEUTRAL: dict[str, float] = {
    "kl": 0.0,
    "k3_kl": 0.0,
    "chi2_token": 0.0,
    "chi2_seq": 0.0,
    "training_log_ppl": 0.0,
    "rollout_log_ppl": 0.0,
    "training_ppl": 1.0,
    "rollout_ppl": 1.0,
    "log_ppl_diff": 0.0,
    "ppl_ratio": 1.0,
    "rollout_is_mean": 1.0,
    "rollout_is_std": 0.0,
    "rollout_is_min": 1.0,
    "rollout_is_max": 1.0,
    "rollout_is_eff_sample_size": 1.0,
    "rollout_is_ratio_fraction_high": 0.0,
    "rollout_is_ratio_fraction_low": 0.0,
}


def two_term_metrics(
    current: Any, old: Any, behaviour: Any, mask: Any = None, *, threshold: float = 2.0
) -> dict[str, float]:
    """Both terms: ``rollout_corr/…`` for π_old vs μ and ``staleness_corr/…`` for π_θ vs π_old."""
    out = term_metrics(old, behaviour, mask, prefix=DISCREPANCY_PREFIX, threshold=threshold)
    out.update(term_metrics(current, old, mask, prefix=STALENESS_PREFIX, threshold=threshold))
    return out


@dataclass(frozen=True)
class HealthThresholds:
    """verl's documented warning thresholds (``docs/algo/rollout_corr.md``), applied per term."""

    weight_mean_low: float = 0.5  # mean ratio below this: the other side puts far less mass
    weight_mean_high: float = 2.0
    ess_min: float = 0.3  # effective sample size below this: a few tokens dominate
    abs_kl_max: float = 0.1  # |k1 KL| above this: the two distributions differ materially
    chi2_token_max: float = 1.0  # χ² above this: importance weights have high variance


@dataclass(frozen=True)
class HealthFlag:
    name: str  # e.g. "kl_high"
    metric: str  # the metric it looked at, e.g. "staleness_corr/kl"
    value: float
    bound: str  # the documented threshold, e.g. "|kl| <= 0.1"
    message: str


def health_flags(
    metrics: Mapping[str, float],
    *,
    thresholds: HealthThresholds = HealthThresholds(),
    prefixes: tuple[str, ...] = (DISCREPANCY_PREFIX, STALENESS_PREFIX),
) -> list[HealthFlag]:
    """Warnings for each term whose metrics cross a documented threshold.

    Besides verl's four thresholds, a term whose ratio is exactly 1 on every token is flagged
    (``ratio_identically_one``): for the staleness term it means "old" was recomputed at the
    current weights, so clipping does nothing (SkyRL #1315, AReaL #201); for the discrepancy
    term it means "old" is the behaviour logprobs, so numerical mismatch sits in the trust
    region. Both are expected only for strictly on-policy, bitwise-identical numerics.
    """
    t = thresholds
    flags: list[HealthFlag] = []
    for p in prefixes:
        if metrics.get(p + "num_tokens", 0.0) <= 0:
            continue
        term = "staleness" if p == STALENESS_PREFIX else "discrepancy"
        mean = metrics.get(p + "rollout_is_mean", 1.0)
        ess = metrics.get(p + "rollout_is_eff_sample_size", 1.0)
        kl = metrics.get(p + "kl", 0.0)
        chi2 = metrics.get(p + "chi2_token", 0.0)
        lo, hi = metrics.get(p + "rollout_is_min", 0.0), metrics.get(p + "rollout_is_max", 0.0)
        one = (
            "pi_theta == pi_old on every token: 'old' was recomputed at the current weights, "
            "so clipping does nothing"
            if p == STALENESS_PREFIX
            else "pi_old == mu on every token: 'old' is the behaviour logprobs, so the "
            "train-inference mismatch sits inside the trust region"
        )
        checks = [  # (name, metric, bad, bound, why)
            (
                "weight_mean_out_of_range",
                "rollout_is_mean",
                not (t.weight_mean_low <= mean <= t.weight_mean_high),
                f"{t.weight_mean_low} <= rollout_is_mean <= {t.weight_mean_high}",
                "the mean ratio is far from 1",
            ),
            (
                "ess_low",
                "rollout_is_eff_sample_size",
                ess < t.ess_min,
                f"rollout_is_eff_sample_size >= {t.ess_min}",
                "a few tokens dominate the weights",
            ),
            ("kl_high", "kl", abs(kl) > t.abs_kl_max, f"|kl| <= {t.abs_kl_max}", "large KL"),
            (
                "chi2_high",
                "chi2_token",
                chi2 > t.chi2_token_max,
                f"chi2_token <= {t.chi2_token_max}",
                "high-variance importance weights",
            ),
            ("ratio_identically_one", "rollout_is_max", lo == 1.0 == hi, "some ratio != 1", one),
        ]
        for name, key, bad, bound, why in checks:
            if bad:
                value = float(metrics[p + key])
                flags.append(HealthFlag(name, p + key, value, bound, f"{term}: {why}"))
    for f in flags:
        logger.debug("health flag %s: %s = %g (%s)", f.name, f.metric, f.value, f.bound)
    return flags
