"""Stands for ``torch.cumsum(x.float(), -1)``: the inclusive running sum along the last dim
(top-p over probabilities sorted in each row).

Rows independent: one program per row, BLOCK fixed by the row length, a scan inside each block
plus the total carried from the blocks before it (the last value written). In: x [..., V] of
any float dtype. Out: float32 [..., V]. Must not depend on the number of rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ._rows import as_rows

__all__ = ["block_for", "row_cumsum"]

MAX_BLOCK = 4096


def block_for(v: int) -> tuple[int, int]:
    """(BLOCK, num_warps) for rows of length ``v``: a function of v alone."""
    block = min(MAX_BLOCK, max(16, triton.next_power_of_2(v)))
    return block, 4 if block <= 1024 else 8


@triton.jit  # type: ignore[untyped-decorator]
def _row_cumsum_kernel(  # type: ignore[no-untyped-def]
    x_ptr,
    out_ptr,
    V,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * V  # rows contiguous (_rows.py)
    out_row = out_ptr + row * V
    cols = tl.arange(0, BLOCK)
    carry = tl.full([], 0.0, tl.float32)
    for start in range(0, V, BLOCK):
        mask = start + cols < V
        x = tl.load(x_row + start + cols, mask=mask, other=0.0).to(tl.float32)
        c = tl.cumsum(x, axis=0) + carry
        tl.store(out_row + start + cols, c, mask=mask)
        # The next block continues from the last value written (exact: one lane, the rest 0).
        carry = tl.sum(tl.where(cols == BLOCK - 1, c, 0.0), axis=0)


def row_cumsum(x: Tensor) -> Tensor:
    """float32 inclusive cumulative sum of x [..., V] along its last dim → [..., V]."""
    if not x.is_floating_point() or x.dim() == 0:
        raise ValueError(f"row_cumsum: needs a floating tensor with a last dim, got {x.dtype}")
    v = x.shape[-1]
    rows = as_rows(x)  # [R, V]
    out = torch.empty(rows.shape, dtype=torch.float32, device=x.device)
    if rows.shape[0] > 0 and v > 0:
        block, num_warps = block_for(v)
        _row_cumsum_kernel[(rows.shape[0],)](rows, out, v, BLOCK=block, num_warps=num_warps)
    return out.reshape(x.shape)
