"""The Triton row kernels with a backward: RMSNorm and last-dim sum/mean for a trainer's graph.

The forward is the kernel's (rms_norm.py, row_reduce.py); the backward is composed of torch ops
in float32 (a gradient is not compared with anything; only the forward's bits are the
definition). Without a graph to record the kernel is called as it is.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = ["rms_norm", "row_mean", "row_sum"]


def _graph(*tensors: Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


class _RmsNorm(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: Tensor, weight: Tensor | None, eps: float, offset: float, cast_first: bool
    ) -> Tensor:
        from .rms_norm import rms_norm as kernel

        ctx.save_for_backward(x, weight)
        ctx.eps, ctx.offset, ctx.cast_first = eps, offset, cast_first
        out: Tensor = kernel(x, weight, eps, offset=offset, cast_before_weight=cast_first)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        xf = x.float()
        r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + ctx.eps)  # [..., 1]
        n = xf * r  # the normalised rows, float32
        g = grad.float()
        grad_w = None
        if weight is None:
            dn = g
        elif ctx.cast_first:  # weight · n.to(x.dtype)
            dn = g * weight.float()
            if ctx.needs_input_grad[1]:
                grad_w = (g * n.to(x.dtype).float()).reshape(-1, x.shape[-1]).sum(0)
        else:  # (n · (offset + weight)).to(x.dtype)
            dn = g * (ctx.offset + weight.float())
            if ctx.needs_input_grad[1]:
                grad_w = (g * n).reshape(-1, x.shape[-1]).sum(0)
        grad_x = r * (dn - n * (dn * n).mean(-1, keepdim=True))
        return (
            grad_x.to(x.dtype),
            None if grad_w is None else grad_w.to(weight.dtype),
            None,
            None,
            None,
        )


def rms_norm(
    x: Tensor,
    weight: Tensor | None,
    eps: float,
    *,
    offset: float = 0.0,
    cast_before_weight: bool = True,
) -> Tensor:
    """``rms_norm.rms_norm`` with a backward where a graph is recorded."""
    if _graph(x, weight):
        out: Tensor = _RmsNorm.apply(x, weight, eps, offset, cast_before_weight)  # type: ignore[no-untyped-call]
        return out
    from .rms_norm import rms_norm as kernel

    return kernel(x, weight, eps, offset=offset, cast_before_weight=cast_before_weight)


class _RowReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, mean: bool) -> Tensor:
        from . import row_reduce

        ctx.width, ctx.mean, ctx.dtype = x.shape[-1], mean, x.dtype
        out: Tensor = (row_reduce.row_mean if mean else row_reduce.row_sum)(x)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        g = grad / ctx.width if ctx.mean else grad
        return g.unsqueeze(-1).expand(*g.shape, ctx.width).to(ctx.dtype), None


def _row_reduce(x: Tensor, mean: bool) -> Tensor:
    if _graph(x):
        out: Tensor = _RowReduce.apply(x, mean)  # type: ignore[no-untyped-call]
        return out
    from . import row_reduce

    return (row_reduce.row_mean if mean else row_reduce.row_sum)(x)


def row_sum(x: Tensor) -> Tensor:
    """``row_reduce.row_sum`` (x [R, H] → [R]) with a backward."""
    return _row_reduce(x, False)


def row_mean(x: Tensor) -> Tensor:
    """``row_reduce.row_mean`` (x [R, H] → [R]) with a backward."""
    return _row_reduce(x, True)
