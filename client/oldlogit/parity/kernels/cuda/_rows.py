"""How the one-program-per-row kernels see their input: x [..., H] as rows [R, H], each row at
``row * H`` from a 16-byte aligned start (copied when a view is not).

Triton specializes a kernel on its pointers' alignment and its strides' divisibility by 16, and
the vector width it then picks decides how a row's reduction is grouped; a row must therefore
look the same to every launch whatever tensor it was cut from. Imports no triton.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["as_rows"]


def as_rows(x: Tensor) -> Tensor:
    """x [..., H] → [R, H], contiguous and 16-byte aligned (a no-op for a fresh tensor)."""
    h = x.shape[-1]
    rows = x.reshape(x.shape[:-1].numel(), h)
    r = rows.shape[0]
    laid_out = rows.stride(-1) == 1 or h <= 1
    if not laid_out or (r > 1 and rows.stride(0) != h) or rows.data_ptr() % 16 != 0:
        rows = rows.clone(memory_format=torch.contiguous_format)
    return rows
