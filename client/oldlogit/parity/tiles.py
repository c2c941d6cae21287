"""Fixed-shape row tiles for every matmul: a row's bits never depend on the other rows.

In: rows x [..., K] and a weight [N, K] (the ``F.linear`` convention). Out: x @ Wᵀ (+ b)
[..., N] as the definition says: the rows cut into tiles of exactly ``tile_rows`` rows (the
last one zero-padded), one GEMM shape on every tile. A GEMM kernel is picked by its shape, so
one shape means one kernel and one reduction order: a row gets the same bits whatever the
number of rows, its place in its tile, or what the other rows hold. A plain ``F.linear`` does
not have that property (measured in tests/unit/test_tiles.py).

How each device computes it (``kernels.for_device``, once per call):
- CPU: the tiles, in verified chunks (kernels/cpu.py);
- CUDA: no tiles — one GEMM over all rows whose row bits do not depend on the row count,
  cuBLASLt where probed so for the shape, else a fixed-tile Triton GEMM
  (kernels/cuda/gemm_choice.py); ``tile_rows`` does not enter.
The backward: the input gradient goes the same way (a linear with weight Wᵀ); the weight
gradient is one 2-D GEMM over all rows (a reduction over the batch by definition), so no
per-tile weight gradients exist.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from oldlogit.contract.numerics import DEFAULT_TILE_ROWS

from .kernels import cpu, for_device

__all__ = ["tiled_linear", "tiled_mm"]


def tiled_mm(
    x: Tensor,
    weight: Tensor,
    tile_rows: int = DEFAULT_TILE_ROWS,
    bias: Tensor | None = None,
    *,
    out: Tensor | None = None,
) -> Tensor:
    """x [M, K] @ weight [N, K]ᵀ (+ bias [N]) → [M, N] through tiles of ``tile_rows`` rows,
    on the kernels of x's device (the module docstring). No autograd. ``out`` (a contiguous
    [M, N]) receives the result."""
    if tile_rows <= 0:
        raise ValueError(f"tile_rows must be positive, got {tile_rows}")
    if for_device(x.device) == "cuda":
        from .kernels.cuda.gemm_choice import gemm

        return gemm(x, weight, bias, out)
    return cpu.tiled_mm(x, weight, tile_rows, bias, out)


class _TiledLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, bias: Tensor | None, tile_rows: int) -> Tensor:
        x2d = x.reshape(-1, x.shape[-1])  # [M, K]
        y = tiled_mm(x2d, weight, tile_rows, bias)  # [M, N]
        ctx.save_for_backward(x2d, weight)
        ctx.tile_rows = tile_rows
        ctx.has_bias = bias is not None
        return y.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        x2d, weight = ctx.saved_tensors
        g2d = grad_out.reshape(-1, grad_out.shape[-1])  # [M, N]
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            # dL/dx = g @ W: row-wise, so tiled like the forward (its rows stay invariant).
            grad_x = tiled_mm(g2d, weight.t(), ctx.tile_rows).reshape(
                *grad_out.shape[:-1], x2d.shape[-1]
            )
        if ctx.needs_input_grad[1]:
            grad_w = g2d.t().mm(x2d)  # [N, K]: one GEMM over all rows
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = g2d.sum(0)
        return grad_x, grad_w, grad_b, None


def tiled_linear(
    x: Tensor, weight: Tensor, bias: Tensor | None = None, *, tile_rows: int = DEFAULT_TILE_ROWS
) -> Tensor:
    """``F.linear`` through fixed-shape tiles: x [..., K], weight [N, K], bias [N] → [..., N].

    Differentiable: the input gradient is tiled too, the weight gradient is one GEMM.
    """
    if not torch.is_grad_enabled() or not (
        x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    ):  # no graph to record: the same forward without autograd.Function's per-call cost
        y = tiled_mm(x.reshape(-1, x.shape[-1]), weight, tile_rows, bias)
        return y.view(*x.shape[:-1], weight.shape[0])  # y is a fresh [M, N]
    out: Tensor = _TiledLinear.apply(x, weight, bias, tile_rows)  # type: ignore[no-untyped-call]
    return out
