"""APPROXIMATE proximal logprobs without any old weights: AReaL's log-linear interpolation.

In: behaviour logprobs μ [B, T], the trainer's current logprobs [B, T], each token's sampling
version (−1 = prompt) and the current version. Out: approximate log π_prox [B, T], detached.
This is a guess, never the exact old logits: use oldlogit's exact answer when it exists, and
report results obtained with this as approximate.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from oldlogit.contract.errors import InvalidRequest
from oldlogit.correction._common import as_float, check_same_shape

if TYPE_CHECKING:
    from torch import Tensor

logger = logging.getLogger(__name__)

__all__ = ["approx_loglinear_proximal"]


def approx_loglinear_proximal(
    behaviour: Any, current: Any, versions: Any, current_version: int
) -> Tensor:
    """log π_prox ≈ log μ + α (log π_θ − log μ), α = clamp((v_prox − v) / (v_θ − v), 0, 1).

    v_prox = v_θ − 1 (the policy one update behind the current one), v = the token's version.
    α = 0 where v < 0 (prompt) or v ≥ v_θ, so those tokens get μ unchanged. APPROXIMATE: it
    assumes log-probabilities move linearly in the version number and that μ is the
    training-side policy at v, i.e. it ignores the train–inference discrepancy altogether.
    """
    import torch

    if isinstance(current_version, bool) or not isinstance(current_version, int):
        raise InvalidRequest(
            f"current_version must be an integer, got {current_version!r}",
            parameter="current_version",
        )
    cur = as_float(current, name="current").detach()
    beh = as_float(behaviour, like=cur, name="behaviour").detach()
    check_same_shape(cur.shape, beh, "behaviour")
    v = torch.as_tensor(versions, device=cur.device)
    check_same_shape(cur.shape, v, "versions")
    v = v.to(torch.float64)
    v_theta = float(current_version)
    gap = v_theta - v  # [B, T]
    generated = (v >= 0) & (gap > 0)
    safe_gap = torch.where(generated, gap, torch.ones_like(gap))
    alpha = torch.where(generated, (v_theta - 1.0 - v) / safe_gap, torch.zeros_like(gap))
    alpha = alpha.clamp(0.0, 1.0).to(cur.dtype)
    # Interpolate only where α > 0: keeps μ (and its −inf, if any) untouched elsewhere.
    delta = torch.where(alpha > 0, cur - beh, torch.zeros_like(cur))
    return beh + alpha * delta
