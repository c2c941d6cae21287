"""Stands for ``torch.sum(x, -1)`` and ``torch.mean(x, -1)`` of floating x (keepdim=False).

Rows independent: one program per row, BLOCK fixed by the row length, fp32 accumulation
(float64 rows in float64), lane-wise over the row's blocks then one tree over the lanes. In:
x [..., H]. Out: [...] in x's dtype. Must not depend on the number of rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ._rows import as_rows

__all__ = ["block_for", "row_mean", "row_sum"]

MAX_BLOCK = 1024


def block_for(h: int) -> tuple[int, int]:
    """(BLOCK, num_warps) for rows of length ``h``: a function of h alone."""
    block = min(MAX_BLOCK, max(16, triton.next_power_of_2(h)))
    return block, 4 if block <= 512 else 8


@triton.jit  # type: ignore[untyped-decorator]
def _row_reduce_kernel(  # type: ignore[no-untyped-def]
    x_ptr,
    out_ptr,
    H,
    MEAN: tl.constexpr,
    FP64: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * H  # rows contiguous (_rows.py)
    cols = tl.arange(0, BLOCK)
    acc_type = tl.float64 if FP64 else tl.float32
    acc = tl.zeros((BLOCK,), dtype=acc_type)
    for start in range(0, H, BLOCK):
        acc += tl.load(x_row + start + cols, mask=start + cols < H, other=0.0).to(acc_type)
    total = tl.sum(acc, axis=0)
    if MEAN:
        if FP64:
            total = total / tl.cast(H, tl.float64)  # fp64 '/' is IEEE already
        else:
            total = tl.math.div_rn(total, tl.cast(H, tl.float32))  # IEEE, not div.full
    tl.store(out_ptr + row, total.to(out_ptr.dtype.element_ty))


def _reduce(x: Tensor, mean: bool) -> Tensor:
    name = "row_mean" if mean else "row_sum"
    if not x.is_floating_point() or x.dim() == 0:
        raise ValueError(f"{name}: needs a floating tensor with a last dim, got {x.dtype}")
    if x.device.type == "cpu" and x.dtype == torch.bfloat16:
        # TRITON_INTERPRET=1 truncates float32 -> bfloat16 where CUDA rounds to nearest even:
        # the same fp32 accumulation, and one round-to-nearest cast out, as on CUDA.
        return _reduce(x.float(), mean).to(torch.bfloat16)
    h = x.shape[-1]
    rows = as_rows(x)  # [R, H]
    out = torch.empty(rows.shape[0], dtype=x.dtype, device=x.device)  # [R]
    if h == 0:  # torch: an empty sum is 0, an empty mean NaN
        out.fill_(float("nan") if mean else 0.0)
    elif rows.shape[0] > 0:
        block, num_warps = block_for(h)
        _row_reduce_kernel[(rows.shape[0],)](
            rows,
            out,
            h,
            MEAN=mean,
            FP64=x.dtype == torch.float64,
            BLOCK=block,
            num_warps=num_warps,
        )
    return out.reshape(x.shape[:-1])


def row_sum(x: Tensor) -> Tensor:
    """``torch.sum(x, -1)``: x [..., H] → [...] in x's dtype."""
    return _reduce(x, mean=False)


def row_mean(x: Tensor) -> Tensor:
    """``torch.mean(x, -1)``: x [..., H] → [...] in x's dtype (NaN for H = 0, as torch)."""
    return _reduce(x, mean=True)
