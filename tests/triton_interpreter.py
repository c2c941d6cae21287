"""Triton's CPU interpreter with a GPU's row invariance in ``tl.dot``.

The interpreter computes ``tl.dot`` with ``np.matmul``, i.e. the CPU's BLAS, and a BLAS may sum
a row's products in an order that depends on where the row sits in the block: on an AMD EPYC
(OpenBLAS 0.3.31's Zen kernels, numpy 2.4) rows 4-23 of a 128 × 32 @ 32 × 128 float32 product
differ from the same rows computed at rows 0-4. A GPU's Triton GEMM sums every row of a tile
in one order, which the CUDA definition relies on and tests/unit/test_parity_cuda.py checks on
the card. Under the interpreter the tests check the definition's structure (one call over all
rows, rows independent of the batch), so ``install`` gives its ``tl.dot`` that property: each
output element is the sum over k in increasing k, accumulated in float32 like the GPU's
accumulator, whatever its row or column.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def _rowwise_matmul(a: np.ndarray, b: np.ndarray, dtype: Any) -> np.ndarray:
    """a [M, K] @ b [K, N] (batched leading dims allowed) summed k = 0, 1, … for every element:
    no element's order depends on its position."""
    a = a.astype(dtype, copy=False)
    b = b.astype(dtype, copy=False)
    out = np.zeros((*a.shape[:-1], b.shape[-1]), dtype=dtype)
    for k in range(a.shape[-1]):
        out += a[..., :, k : k + 1] * b[..., k : k + 1, :]
    return out


def install() -> bool:
    """Patch the interpreter's dot (once); False where triton is not installed."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return False
    builder = interpreter.InterpreterBuilder
    if getattr(builder.create_dot, "_oldlogit_rowwise", False):
        return True
    original = builder.create_dot

    def create_dot(self: Any, a: Any, b: Any, d: Any, *args: Any, **kwargs: Any) -> Any:
        if a.dtype.primitive_bitwidth == 8 or b.dtype.primitive_bitwidth == 8:
            return original(self, a, b, d, *args, **kwargs)  # fp8/int8: as triton does it
        acc = d.data.dtype
        out = _rowwise_matmul(a.data, b.data, acc) + d.data
        return interpreter.TensorHandle(out, d.dtype.scalar)

    create_dot._oldlogit_rowwise = True  # type: ignore[attr-defined]
    builder.create_dot = create_dot
    return True
