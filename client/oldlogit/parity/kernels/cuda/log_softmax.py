"""Stands for ``torch.log_softmax(x.float() / temperature, -1)`` and its gather at one target
per row (``token_logprobs``, with an analytic backward).

Rows independent: one program per row, BLOCK fixed by V; a running max and sum over the row's
blocks in one order, then y − max − log(sum). In: x [..., V] of any float dtype. Out: float32.
Both wrappers run the same kernel, so a token's logprob has the bits of the full row's.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor

from ._rows import as_rows

__all__ = ["block_for", "log_softmax", "token_logprobs"]

MAX_BLOCK = 4096


def block_for(v: int) -> tuple[int, int]:
    """(BLOCK, num_warps) for rows of length ``v``: a function of v alone."""
    block = min(MAX_BLOCK, max(16, triton.next_power_of_2(v)))
    return block, 4 if block <= 1024 else 8


@triton.jit  # type: ignore[untyped-decorator]
def _log_softmax_kernel(  # type: ignore[no-untyped-def]
    x_ptr,
    targets_ptr,
    out_ptr,
    lse_ptr,
    V,
    temperature,
    GATHER: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * V  # rows contiguous (_rows.py)
    cols = tl.arange(0, BLOCK)
    # Pass 1: running max m and running Σ exp(y − m), block by block.
    m = tl.full([], float("-inf"), tl.float32)
    s = tl.full([], 0.0, tl.float32)
    for start in range(0, V, BLOCK):
        mask = start + cols < V
        y = tl.load(x_row + start + cols, mask=mask, other=float("-inf")).to(tl.float32)
        y = tl.math.div_rn(y, temperature)  # IEEE: Triton's `/` is div.full (2 ulp)
        m_new = tl.maximum(m, tl.max(y, axis=0))
        # While the row so far is all −inf (masked tokens), shift by 0 rather than by −inf.
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        s = s * tl.exp(m - shift) + tl.sum(tl.exp(y - shift), axis=0)
        m = m_new
    log_s = tl.log(s)
    if GATHER:
        t = tl.load(targets_ptr + row).to(tl.int64)
        valid = (t >= 0) & (t < V)  # out of range → NaN, never a read outside the row
        y_t = tl.load(x_row + t, mask=valid, other=float("nan")).to(tl.float32)
        y_t = tl.math.div_rn(y_t, temperature)
        tl.store(out_ptr + row, (y_t - m) - log_s)
        tl.store(lse_ptr + row, m + log_s)
    else:
        # Pass 2: (y − max) − log(sum), as torch's log_softmax orders it.
        out_row = out_ptr + row * V
        for start in range(0, V, BLOCK):
            mask = start + cols < V
            y = tl.load(x_row + start + cols, mask=mask, other=0.0).to(tl.float32)
            y = tl.math.div_rn(y, temperature)
            tl.store(out_row + start + cols, (y - m) - log_s, mask=mask)


def _launch(rows: Tensor, targets: Tensor | None, temperature: float) -> tuple[Tensor, Tensor]:
    """out ([R, V], or [R] with targets) and the per-row lse ([R], with targets only)."""
    r, v = rows.shape
    gather = targets is not None
    out = torch.empty((r,) if gather else (r, v), dtype=torch.float32, device=rows.device)
    lse = torch.empty((r,) if gather else (0,), dtype=torch.float32, device=rows.device)
    if r == 0:
        return out, lse
    if v == 0:
        if gather:
            out.fill_(float("nan"))
            lse.fill_(float("-inf"))
        return out, lse
    block, num_warps = block_for(v)
    _log_softmax_kernel[(r,)](
        rows,
        targets if targets is not None else rows,  # not read without GATHER
        out,
        lse if gather else out,  # not written without GATHER (a 0-element tensor has no pointer)
        v,
        float(temperature),
        GATHER=gather,
        BLOCK=block,
        num_warps=num_warps,
    )
    return out, lse


def _check_temperature(temperature: float) -> None:
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")


def log_softmax(x: Tensor, temperature: float = 1.0) -> Tensor:
    """float32 ``log_softmax(x.float() / temperature, -1)`` of x [..., V] → [..., V]."""
    _check_temperature(temperature)
    out, _ = _launch(as_rows(x), None, temperature)
    return out.reshape(x.shape)


class _TokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, targets: Tensor, temperature: float) -> Tensor:
        rows = as_rows(x)  # [R, V]
        flat_targets = targets.reshape(-1).contiguous()  # [R]
        out, lse = _launch(rows, flat_targets, temperature)
        ctx.save_for_backward(rows, flat_targets, lse)
        ctx.temperature = temperature
        ctx.x_shape = x.shape
        return out.reshape(targets.shape)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, None, None]:
        if not ctx.needs_input_grad[0]:
            return None, None, None
        rows, targets, lse = ctx.saved_tensors
        v = rows.shape[-1]
        # d/dx of (x_t/T − lse) = (onehot(t) − softmax(x/T)) / T, elementwise per row.
        grad_x = torch.exp(rows.float() / ctx.temperature - lse[:, None]).neg_()  # [R, V]
        valid = (targets >= 0) & (targets < v)
        grad_x.scatter_add_(1, targets.clamp(0, max(v - 1, 0))[:, None], valid.float()[:, None])
        g = torch.where(valid, grad.reshape(-1).float(), 0.0)  # [R]
        grad_x.mul_(g[:, None]).div_(ctx.temperature)
        return grad_x.to(rows.dtype).reshape(ctx.x_shape), None, None


def token_logprobs(x: Tensor, targets: Tensor, temperature: float = 1.0) -> Tensor:
    """float32 ``log_softmax(x.float() / temperature)`` at ``targets``: x [..., V], targets [...]
    → [...], without writing [..., V]; the bits of ``log_softmax(x, temperature)`` gathered.
    A target outside [0, V) gives NaN (and no gradient)."""
    _check_temperature(temperature)
    if targets.shape != x.shape[:-1]:
        raise ValueError(f"token_logprobs: targets {tuple(targets.shape)} for x {tuple(x.shape)}")
    if targets.device != x.device or targets.is_floating_point() or targets.is_complex():
        raise ValueError(f"token_logprobs: integer targets on {x.device}, got {targets.dtype}")
    out: Tensor = _TokenLogprobs.apply(x, targets, temperature)  # type: ignore[no-untyped-call]
    return out
