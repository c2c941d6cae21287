"""Shared plumbing of the correction toolkit: the lazy torch import, input coercion, masked sums.

torch is imported inside each function (``import oldlogit.correction`` must not pull it in).
Inputs may be torch tensors or numpy arrays (the client's results: float32, NaN where not
scored); everything becomes a torch tensor on the device of the trainer's tensor. Masked
reductions select with ``torch.where`` before reducing, never multiply by the mask: a NaN or
±inf under a zero mask must not leak into a sum (NaN · 0 = NaN).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from oldlogit.contract.errors import InvalidRequest

if TYPE_CHECKING:
    import torch
    from torch import Tensor

logger = logging.getLogger(__name__)

# verl's SAFETY_BOUND: log ratios are clamped to [-20, 20] before exponentiating (e^20 ≈ 4.9e8).
SAFETY_BOUND = 20.0


def as_float(x: Any, *, like: Tensor | None = None, name: str) -> Tensor:
    """``x`` as a floating tensor (at least float32) on ``like``'s device; grad is kept."""
    import torch

    if isinstance(x, torch.Tensor):
        t = x
    else:
        try:
            t = torch.as_tensor(x)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise InvalidRequest(
                f"{name} must be a tensor or an array of numbers", parameter=name
            ) from exc
    if not (t.is_floating_point() or t.dtype in (torch.int32, torch.int64, torch.bool)):
        raise InvalidRequest(f"{name} must hold numbers, got {t.dtype}", parameter=name)
    dtype = torch.promote_types(t.dtype, torch.float32) if t.is_floating_point() else torch.float32
    if like is not None:
        return t.to(device=like.device, dtype=dtype)
    return t.to(dtype=dtype)


def as_mask(mask: Any, shape: torch.Size, *, like: Tensor, name: str = "mask") -> Tensor:
    """``mask`` as a bool tensor of ``shape`` (None: everything), nonzero meaning selected."""
    import torch

    if mask is None:
        return torch.ones(shape, dtype=torch.bool, device=like.device)
    m = mask if isinstance(mask, torch.Tensor) else torch.as_tensor(mask)
    m = m.to(like.device)
    if m.dtype != torch.bool:
        m = m != 0
    if m.shape != shape:
        raise InvalidRequest(
            f"{name} has shape {list(m.shape)}, expected {list(shape)}", parameter=name
        )
    return m


def check_same_shape(shape: torch.Size, other: Tensor, name: str) -> None:
    if other.shape != shape:
        raise InvalidRequest(
            f"{name} has shape {list(other.shape)}, expected {list(shape)}", parameter=name
        )


def check_positive(value: float, name: str) -> float:
    if not (isinstance(value, (int, float)) and value > 0 and value == value):
        raise InvalidRequest(f"{name} must be a number > 0, got {value!r}", parameter=name)
    return float(value)


def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    import torch

    picked = torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device))
    return picked.sum() if dim is None else picked.sum(dim)


def masked_count(mask: Tensor, dim: int | None = None) -> Tensor:
    return mask.sum() if dim is None else mask.sum(dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean over selected entries; 0 where nothing is selected (never 0/0)."""
    count = masked_count(mask, dim).clamp_min(1).to(x.dtype)
    return masked_sum(x, mask, dim) / count
