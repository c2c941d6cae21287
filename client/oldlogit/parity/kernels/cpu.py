"""How a CPU computes the definition: row tiles for GEMMs, fixed blocks for pointwise ops.

GEMMs (``tiled_mm``). A CPU GEMM kernel is picked by the row count (measured in
tests/unit/test_tiles.py), so the rows run in tiles of exactly ``tile_rows`` rows (the last one
zero-padded), one GEMM shape per tile, the tiles of one input the same way whatever their
number (``tile_strategy``, a function of dtype and N only):
- float32, N > 1: one ``bmm`` over a [tiles, T, K] view and a stride-0 view of the weight. A
  lone tile gets a zero tile beside it: a one-matrix bmm is one GEMM that the BLAS may spread
  over the threads, splitting its reduction — other bits than the same tile among others, where
  every matrix of the batch runs on one thread (measured: MKL, 2 threads, AVX-512, K >= 896);
- N == 1 (a one-output projection such as Qwen2-MoE's shared-expert gate): one ``mm`` per tile,
  because a batched matrix-vector product's bits change with the number of tiles (measured:
  16 vs 17 rows at tile 16);
- bfloat16/float16: one ``mm`` per tile (``bmm`` in bf16 is several times slower than ``mm``).
The whole tiles of an input run as chunks of up to ``CHUNK_ROWS`` rows (``THIN_CHUNK_ROWS``
for a thin GEMM; a multiple of the tile) per GEMM where that gives each of its tiles the
very bits of the tiles: checked once per process for each GEMM shape and chunk size (device,
weight shape and strides, dtype, bias, thread count) on random rows against the real weight
and on operands whose products cancel (``chunk_verified``; random rows alone missed another
order in a bf16 output), tiles otherwise.
The chunk is only a faster way to compute the tiles' bits (a 64-row GEMM runs at a third of a
512-row GEMM's speed in bf16 and a 64-row ``bmm`` below one ``mm`` in float32, measured at
Qwen2.5-0.5B's shapes). A device that is neither CPU nor CUDA runs the same code (``loop``).

Pointwise ops (``blockwise``). torch's CPU loops compute the elements of a vector body and of
a scalar tail with different code, and which elements fall in a tail depends on the tensor's
size and the thread count; the definition is contiguous blocks of ``GRAIN`` elements, the last
one zero-padded to a multiple of 64, computed in one call where that was checked to give the
blocks' bits. The tensor-parallel head's ``exp``/``log`` use the same blocks on every device.
Imports nothing from the rest of ``oldlogit.parity``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import torch
from torch import Tensor

from .probes import Probe, probe_cancelling, probe_randn

__all__ = [
    "CHUNK_ROWS",
    "GRAIN",
    "THIN_CHUNK_ROWS",
    "TileStrategy",
    "blockwise",
    "chunk_verified",
    "tile_strategy",
    "tiled_mm",
]

TileStrategy = Literal["bmm", "loop"]

# Rows per GEMM call for the bulk of a long input, where verified to reproduce the tiles; not
# numerics (see the module docstring). A thin GEMM (K or N at most THIN: a LoRA factor's
# rank-r side) moves little data per row, so its per-call cost weighs more: it goes
# THIN_CHUNK_ROWS rows per call (measured on 2 AMD EPYC cores, float32, 2,048 rows: one call
# 20-45 % faster than four 512-row calls at K or N = 16).
CHUNK_ROWS = 512
THIN = 64
THIN_CHUNK_ROWS = 2048

# torch's CPU parallel grain (at::internal::GRAIN_SIZE): a loop over at most this many elements
# runs on one thread. A pointwise block, and a tensor-parallel sum block, is one grain: a
# multiple of every CPU vector body (no scalar tail) that one thread computes and never splits.
GRAIN = 32768
_ALIGN = 64

# ------------------------------------------------------------------------------ GEMM tiles

_chunks = Probe()


def chunk_verified(weight: Tensor, bias: Tensor | None, tile_rows: int, chunk_rows: int) -> bool:
    """Whether one ``chunk_rows``-row GEMM against ``weight`` gives every row the bits of the
    ``tile_rows``-row calls (its tiles), on this process's kernels and thread count."""
    key = (
        weight.device,  # two devices of one type may differ
        weight.dtype,
        weight.shape,
        weight.stride(),
        bias is not None,
        tile_rows,
        chunk_rows,
        torch.get_num_threads(),
    )

    w = weight.detach()
    b = None if bias is None else bias.detach()
    n_out, k = w.shape
    strategy = tile_strategy(w.device, w.dtype, n_out)

    def agree(rows: Tensor, w: Tensor, b: Tensor | None) -> bool:
        whole = _gemm(rows, w.t(), b, rows.new_empty(chunk_rows, n_out))
        tiles = rows.new_empty(chunk_rows, n_out)
        _tiles(rows, w.t(), b, tiles, tile_rows, strategy)
        return bool(torch.equal(whole, tiles))

    def check() -> bool:
        (rows,) = probe_randn((chunk_rows, k), dtype=w.dtype, device=w.device)
        if not agree(rows, w, b):
            return False
        # Random rows can miss another accumulation order where the output is bf16 (measured
        # on an AMX Xeon, 896 -> 128 with a bias: a 256-row GEMM passed against one layer's
        # weight, not another's; tests/unit/test_tiles.py): operands whose products cancel show
        # it, in a weight of the real one's strides (the kernel is picked by shapes, not values).
        x, pw = probe_cancelling(chunk_rows, n_out, k, dtype=w.dtype, device=w.device)
        pb = None
        if b is not None:
            (pb,) = probe_randn(tuple(b.shape), dtype=b.dtype, device=b.device, scale=2.0**-16)
        return agree(x, torch.empty_like(w).copy_(pw), pb)

    return _chunks(key, check)


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
    x: Tensor, weight: Tensor, tile_rows: int, bias: Tensor | None, out: Tensor | None
) -> Tensor:
    """x [M, K] @ weight [N, K]ᵀ (+ bias [N]) → [M, N] by the tiles (``tiles.tiled_mm``).

    The bias is added by the GEMM itself (``baddbmm``/``addmm``: one pass over the output),
    the same way on every tile. The rows, the last tile zero-padded, go in chunks of at most
    ``CHUNK_ROWS``: one GEMM per chunk where that was verified to give its tiles' bits
    (``chunk_verified``), the tiles themselves otherwise. ``out`` (a contiguous [M, N])
    receives the result (the same kernels write it; a padded input is copied in).
    """
    m, k = x.shape
    n_out = weight.shape[0]
    if m == 0:
        return x.new_empty(0, n_out) if out is None else out
    x = x.contiguous()
    w_t = weight.t()  # [K, N], a view: the same layout on every path and in the backward
    rows = -(-m // tile_rows) * tile_rows
    chunk = THIN_CHUNK_ROWS if min(k, n_out) <= THIN else CHUNK_ROWS
    step = max(tile_rows, chunk - chunk % tile_rows)

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
        if tiles == 1:  # a lone tile: a zero tile beside it (the module docstring)
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


# -------------------------------------------------------------------------- pointwise blocks


def blockwise(func: Callable[..., Any], x: Tensor, *rest: Any, **kwargs: Any) -> Tensor:
    """``func(x, *rest, **kwargs)`` elementwise over x such that every element goes through
    the same vector code whatever the tensor's size: on contiguous blocks of ``GRAIN``
    elements (the last one zero-padded to a multiple of 64), or in one call where torch's own
    threads then each get a whole number of 64-element groups and that was checked to give
    the blocks' bits (``_one_call_verified``). An ``inplace=True`` call writes the result
    back into x."""
    inplace = bool(kwargs.pop("inplace", False))
    n = x.numel()
    if not inplace and n <= GRAIN and n % _ALIGN == 0 and x.is_contiguous():
        # One block already, in memory order: torch's loop sees it as the flat block it is.
        out_: Tensor = func(x, *rest, **kwargs)
        return out_
    flat = x.reshape(-1)
    if n % _ALIGN == 0 and (n <= GRAIN or _one_call_verified(func, flat, n, rest, kwargs)):
        out: Tensor = func(flat, *rest, **kwargs).view(x.shape)
    else:
        out = _blocks(func, flat, rest, kwargs)[:n].view(x.shape)
    if inplace:
        with torch.no_grad():
            x.copy_(out)
        return x
    return out


def _blocks(
    func: Callable[..., Any], flat: Tensor, rest: tuple[Any, ...], kwargs: dict[str, Any]
) -> Tensor:
    """The definition: blocks of ``GRAIN`` elements, the last zero-padded to 64."""
    n = flat.numel()
    padded = -(-n // _ALIGN) * _ALIGN
    if padded != n:
        flat = torch.cat([flat, flat.new_zeros(padded - n)])
    # One split (not one slice per block): its backward is one concatenation, where a slice
    # per block would make autograd allocate and add a full-size gradient per block.
    parts = [func(block, *rest, **kwargs) for block in torch.split(flat, GRAIN)]
    out: Tensor = parts[0] if len(parts) == 1 else torch.cat(parts)
    return out


# torch's CPU loops split n elements over min(threads, ⌈n / GRAIN⌉) threads in equal chunks of
# ⌈n / that⌉ (at::parallel_for); each thread runs the vector body over its chunk and scalar
# code on the chunk's tail. When every chunk is a whole number of 64-element groups there is no
# tail, so one call computes every element as the blocks do — checked per (function, dtype,
# arguments, threads used) on random values before it is relied on.
_one_call = Probe()


def _one_call_verified(
    func: Callable[..., Any], flat: Tensor, n: int, rest: tuple[Any, ...], kwargs: dict[str, Any]
) -> bool:
    if flat.device.type != "cpu" or any(isinstance(a, Tensor) for a in rest):
        return False
    used = min(torch.get_num_threads(), -(-n // GRAIN))
    if n % (_ALIGN * used):
        return False
    try:
        key = (func, flat.dtype, used, rest, tuple(sorted(kwargs.items())))
        hash(key)
    except TypeError:  # an unhashable argument: the blocks
        return False

    def check() -> bool:
        # Chunks that are not a multiple of the grain, and random values the vector and
        # scalar code round differently.
        if used == torch.get_num_threads():
            size = used * (GRAIN + 7 * _ALIGN)  # ⌈size / GRAIN⌉ ≥ used: all threads
        else:
            size = used * (GRAIN - 3 * _ALIGN)  # ⌈size / GRAIN⌉ = used
        (probe,) = probe_randn((size,), dtype=flat.dtype, scale=3.0)
        return bool(torch.equal(func(probe, *rest, **kwargs), _blocks(func, probe, rest, kwargs)))

    return _one_call(key, check)
