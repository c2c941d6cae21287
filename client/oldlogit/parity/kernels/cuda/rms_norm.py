"""Stands for transformers' RMSNorm over the last dim: Qwen2RMSNorm's order (cast, then weight)
or Gemma2RMSNorm's ((x·r)·(offset + weight) in fp32, then cast).

Rows independent: one program per row, BLOCK fixed by H, the sum of squares in fp32 over the
row's chunks in one order. In: x [..., H], weight [H] or None. Out: x's shape (dtype as torch
would give). Must not depend on the number of rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ._rows import as_rows

__all__ = ["block_for", "rms_norm"]

MAX_BLOCK = 1024


def block_for(h: int) -> tuple[int, int]:
    """(BLOCK, num_warps) for rows of length ``h``: a function of h alone."""
    block = min(MAX_BLOCK, max(16, triton.next_power_of_2(h)))
    return block, 4 if block <= 512 else 8


@triton.jit  # type: ignore[untyped-decorator]
def _rms_norm_kernel(  # type: ignore[no-untyped-def]
    x_ptr,
    w_ptr,
    out_ptr,
    H,
    eps,
    offset,
    HAS_WEIGHT: tl.constexpr,
    CAST_BEFORE_WEIGHT: tl.constexpr,
    OFFSET_IS_ZERO: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * H  # rows contiguous (_rows.py)
    out_row = out_ptr + row * H
    cols = tl.arange(0, BLOCK)
    # Pass 1: Σ x² in fp32, lane-wise over the chunks, then one tree over the lanes.
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, H, BLOCK):
        x = tl.load(x_row + start + cols, mask=start + cols < H, other=0.0).to(tl.float32)
        acc += x * x
    mean = tl.math.div_rn(tl.sum(acc, axis=0), tl.cast(H, tl.float32))  # IEEE, not div.full
    r = tl.rsqrt(mean + eps)
    # Pass 2: y = x·r, then the weight in the model's order.
    for start in range(0, H, BLOCK):
        mask = start + cols < H
        x = tl.load(x_row + start + cols, mask=mask, other=0.0).to(tl.float32)
        y = x * r
        if HAS_WEIGHT:
            w = tl.load(w_ptr + start + cols, mask=mask, other=0.0)
            if CAST_BEFORE_WEIGHT:
                # weight * (x·r).to(input dtype): the product rounds once to the output dtype
                y = y.to(x_ptr.dtype.element_ty).to(tl.float32)
                if not OFFSET_IS_ZERO:
                    w = (w.to(tl.float32) + offset).to(w_ptr.dtype.element_ty)
                y = w.to(tl.float32) * y
            else:
                # ((x·r) * (offset + weight.float())).to(input dtype)
                y = y * (offset + w.to(tl.float32))
        tl.store(out_row + start + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: Tensor,
    weight: Tensor | None,
    eps: float,
    *,
    offset: float = 0.0,
    cast_before_weight: bool = True,
) -> Tensor:
    """RMSNorm of x over its last dim; see the module docstring for the two orders."""
    h = x.shape[-1]
    if weight is not None and weight.shape != (h,):
        raise ValueError(f"rms_norm: weight {tuple(weight.shape)} for rows of {h}")
    if weight is not None and cast_before_weight:
        out_dtype = torch.promote_types(weight.dtype, x.dtype)
    else:
        out_dtype = x.dtype
    dtypes = (x.dtype, out_dtype, weight.dtype if weight is not None else x.dtype)
    if x.device.type == "cpu" and torch.bfloat16 in dtypes:
        # TRITON_INTERPRET=1 truncates float32 -> bfloat16 where CUDA rounds to nearest even.
        raise ValueError("rms_norm: bfloat16 runs on CUDA only (the Triton interpreter has none)")
    rows = as_rows(x)  # [R, H]
    out = torch.empty(rows.shape, dtype=out_dtype, device=x.device)
    if rows.shape[0] == 0 or h == 0:
        return out.reshape(x.shape)
    block, num_warps = block_for(h)
    _rms_norm_kernel[(rows.shape[0],)](
        rows,
        as_rows(weight) if weight is not None else rows,  # aligned too; unread without weight
        out,
        h,
        eps,
        offset,
        HAS_WEIGHT=weight is not None,
        CAST_BEFORE_WEIGHT=cast_before_weight,
        OFFSET_IS_ZERO=offset == 0.0,
        BLOCK=block,
        num_warps=num_warps,
    )
    return out.reshape(x.shape)
