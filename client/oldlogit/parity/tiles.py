"""Fixed-shape row tiles for every matmul: a row's bits never depend on the other rows.

In: rows x [..., K] and a weight [N, K] (the ``F.linear`` convention). Out: x @ Wᵀ (+ b)
[..., N], computed by cutting the rows into tiles of exactly ``tile_rows`` rows (the last one
zero-padded) and running one GEMM shape on every tile. A GEMM kernel is picked by its shape,
so one shape means one kernel and one reduction order: a row gets the same bits whatever the
number of rows, its place in its tile, or what the other rows hold. A plain ``F.linear`` does
not have that property (CPU kernels are picked by the row count; measured in
tests/unit/test_tiles.py).

How a tile is computed depends on (device, dtype, N) only, never on the number of rows — that
is the definition:
- CPU float32, N > 1: one ``bmm`` over a [tiles, T, K] view and a stride-0 view of the weight;
  N == 1 (a one-output projection such as Qwen2-MoE's shared-expert gate) loops like bf16,
  because a batched matrix-vector product's bits change with the number of tiles (measured:
  16 vs 17 rows at tile 16, tests/unit/test_tiles.py);
- CPU bfloat16/float16: one ``mm`` per tile (``bmm`` in bf16 is several times slower than
  ``mm`` on CPU);
- CUDA (``kernels.for_device``): no tiles — one GEMM over all rows whose row bits do not
  depend on the row count, cuBLASLt where probed so for the shape, else a fixed-tile Triton
  GEMM (kernels/cuda/gemm_choice.py); ``tile_rows`` does not enter. The input gradient goes
  the same way (a linear with weight Wᵀ).
On CPU the whole tiles of an input run as chunks of up to ``CHUNK_ROWS`` rows (a
multiple of the tile) per GEMM where that gives each of its tiles the very bits of the
definition: checked once per process for each GEMM shape and chunk size (device, weight shape
and strides, dtype, bias, thread count) on random rows against the real weight
(``chunk_verified``), tiles otherwise. A row's bits are still the tile's by definition; the
chunk is only a faster way to compute them (on CPU a 64-row GEMM runs at a third of a 512-row
GEMM's speed in bf16 and a 64-row ``bmm`` below one ``mm`` in float32, measured at
Qwen2.5-0.5B's shapes). The last, partial tile is zero-padded and computed as the definition
says. The backward is tiled the same way for the input gradient; the weight gradient is one 2-D GEMM
over all rows (a reduction over the batch by definition), so no per-tile weight gradients exist.
"""

from __future__ import annotations

import threading
from typing import Any, Literal

import torch
from torch import Tensor

from oldlogit.contract.numerics import DEFAULT_TILE_ROWS

from .kernels import for_device
from .pointwise import seeded_randn

__all__ = [
    "CHUNK_ROWS",
    "TileStrategy",
    "chunk_verified",
    "tile_strategy",
    "tiled_linear",
    "tiled_mm",
]

TileStrategy = Literal["bmm", "loop"]

# Rows per GEMM call for the bulk of a long input (CPU, low-precision loop strategy), when
# verified to reproduce the tiles; not numerics (see the module docstring).
CHUNK_ROWS = 512

_verified: dict[tuple[Any, ...], bool] = {}
_verify_lock = threading.Lock()


def chunk_verified(weight: Tensor, bias: Tensor | None, tile_rows: int, chunk_rows: int) -> bool:
    """Whether one ``chunk_rows``-row GEMM against ``weight`` gives every row the bits of the
    ``tile_rows``-row calls (its tiles), on this process's kernels and thread count. Checked
    once per key on seeded random rows (a kernel's reduction order does not depend on the
    values, and random full-precision rows make two different orders disagree)."""
    key = (
        weight.device,  # cuda:0 and cuda:1 may be different cards
        weight.dtype,
        weight.shape,
        weight.stride(),
        bias is not None,
        tile_rows,
        chunk_rows,
        torch.get_num_threads(),
    )
    ok = _verified.get(key)
    if ok is not None:
        return ok
    k = weight.shape[1]
    with _verify_lock, torch.no_grad():
        gen = torch.Generator().manual_seed(chunk_rows * 131 + k)
        rows = seeded_randn(chunk_rows, k, generator=gen).to(weight.device, weight.dtype)
        w = weight.detach()
        b = None if bias is None else bias.detach()
        whole = _gemm(rows, w.t(), b, rows.new_empty(chunk_rows, w.shape[0]))
        tiles = rows.new_empty(chunk_rows, w.shape[0])
        strategy = tile_strategy(w.device, w.dtype, w.shape[0])
        _tiles(rows, w.t(), b, tiles, tile_rows, strategy)
        ok = bool(torch.equal(whole, tiles))
        _verified[key] = ok
    return ok


def _gemm(a: Tensor, w_t: Tensor, bias: Tensor | None, out: Tensor) -> Tensor:
    if bias is None:
        return torch.mm(a, w_t, out=out)
    return torch.addmm(bias, a, w_t, out=out)


def tile_strategy(device: torch.device, dtype: torch.dtype, n_out: int = 2) -> TileStrategy:
    """How tiles of ``n_out`` outputs run on ``device`` for ``dtype``; see the module
    docstring."""
    if device.type == "cpu" and dtype == torch.float32 and n_out > 1:
        return "bmm"
    return "loop"


def tiled_mm(
    x: Tensor,
    weight: Tensor,
    tile_rows: int = DEFAULT_TILE_ROWS,
    bias: Tensor | None = None,
    *,
    out: Tensor | None = None,
) -> Tensor:
    """x [M, K] @ weight [N, K]ᵀ (+ bias [N]) → [M, N] through tiles of ``tile_rows`` rows.

    No autograd. The bias is added by the GEMM itself (``baddbmm``/``addmm``: one pass over
    the output), the same way on every tile. The rows, the last tile zero-padded, go in chunks
    of at most ``CHUNK_ROWS``: one GEMM per chunk where that was verified on CPU to give its
    tiles' bits (``chunk_verified``), the tiles themselves otherwise. ``out`` (a contiguous
    [M, N]) receives the result (the same kernels write it; a padded input is copied in).
    """
    if tile_rows <= 0:
        raise ValueError(f"tile_rows must be positive, got {tile_rows}")
    if for_device(x.device) == "cuda":  # one GEMM over all rows, no tiles (the docstring)
        from .kernels.cuda.gemm_choice import gemm

        return gemm(x, weight, bias, out)
    m, k = x.shape
    n_out = weight.shape[0]
    if m == 0:
        return x.new_empty(0, n_out) if out is None else out
    x = x.contiguous()
    w_t = weight.t()  # [K, N], a view: the same layout on every path and in the backward
    rows = -(-m // tile_rows) * tile_rows
    step = max(tile_rows, CHUNK_ROWS - CHUNK_ROWS % tile_rows)

    def rows_of(start: int, size: int) -> Tensor:  # [size, K], the last tile zero-padded
        if start + size <= m:
            return x[start : start + size]
        part = x.new_zeros(size, k)
        part[: m - start] = x[start:]
        return part

    if rows <= step and chunk_verified(weight, bias, tile_rows, rows):
        # The common short input: one GEMM, no output to assemble (per-call cost counts here).
        a = x if rows == m else rows_of(0, rows)
        if out is not None and rows == m:
            return _gemm(a, w_t, bias, out)
        y = torch.mm(a, w_t) if bias is None else torch.addmm(bias, a, w_t)
        y = y if rows == m else y[:m]
        return y if out is None else out.copy_(y)
    strategy = tile_strategy(x.device, x.dtype, n_out)
    given = out
    out = given if given is not None and rows == m else x.new_empty(rows, n_out)  # [rows, N]
    for start in range(0, rows, step):
        size = min(step, rows - start)
        part = rows_of(start, size)
        dst = out[start : start + size]
        if (size == tile_rows and strategy == "loop") or chunk_verified(
            weight, bias, tile_rows, size
        ):
            _gemm(part, w_t, bias, dst)
        else:
            _tiles(part, w_t, bias, dst, tile_rows, strategy)
    if given is not None and given is not out:
        return given.copy_(out[:m])
    return out if rows == m else out[:m]


def _tiles(
    x: Tensor, w_t: Tensor, bias: Tensor | None, out: Tensor, tile_rows: int, strategy: TileStrategy
) -> None:
    """The definition: x [t·T, K] → out [t·T, N], one GEMM shape per ``tile_rows`` rows."""
    if strategy == "bmm":
        tiles = x.shape[0] // tile_rows
        if tiles == 1:
            # A one-matrix bmm is one GEMM that the BLAS may spread over the threads, splitting
            # its reduction: other bits than the same tile among others, where every matrix of
            # the batch runs on one thread (measured: MKL, 2 threads, AVX-512, K >= 896 —
            # tests/unit/test_tiles.py). A zero tile beside it makes it a batch like any other.
            two = x.new_zeros(2 * tile_rows, x.shape[1])
            two[:tile_rows] = x
            pair = out.new_empty(2 * tile_rows, out.shape[1])
            _tiles(two, w_t, bias, pair, tile_rows, strategy)
            out.copy_(pair[:tile_rows])
            return
        a = x.view(tiles, tile_rows, x.shape[1])
        b = w_t.unsqueeze(0).expand(tiles, *w_t.shape)
        o = out.view(tiles, tile_rows, w_t.shape[1])
        if bias is None:
            torch.bmm(a, b, out=o)
        else:
            torch.baddbmm(bias.expand(tiles, tile_rows, w_t.shape[1]), a, b, out=o)
        return
    for s in range(0, x.shape[0], tile_rows):
        _gemm(x[s : s + tile_rows], w_t, bias, out[s : s + tile_rows])


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
