"""Reductions over the last dimension whose every row gets the same bits whatever the number of
rows, on a GPU: sums and means by a Triton row kernel, the others in fixed row blocks.

In: a reduction torch call (``sum``, ``mean``, ``var``, ``std``, ``logsumexp``, ``norm``, …) over
the last dimension of a tensor on a GPU. Out: the same values as the definition — the rows in
blocks of exactly ``BLOCK_ROWS`` rows, the last one zero-padded, one call per block — computed
in one call per chunk of up to ``CHUNK_ROWS`` rows where that was checked to give the blocks'
bits. On CUDA torch picks a reduction's launch configuration (how a row is split over a block's
threads and, for long rows, over blocks) from the number of rows as well as their length, so a
row's sum can change with the other rows (measured on an H100: a float32 mean over 896 values
gives other bits for 1–15 rows than for 1,000). On CUDA (``kernels.for_device``) a ``sum`` or
``mean`` over the last dimension runs instead as one call of a Triton kernel that computes one
row per program (kernels/cuda/row_reduce.py); ``var``, ``std``, ``norm``, ``logsumexp`` keep the
blocks. A CPU reduction computes each row in the same vector code whatever the rows, and is
left as it is. Used by ``ops.TileMode``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from .kernels import for_device
from .kernels.probes import Probe, probe_cancelling, probe_randn

__all__ = ["BLOCK_ROWS", "CHUNK_ROWS", "REDUCTIONS", "by_definition", "last_dim_rows"]

BLOCK_ROWS = 64
# Rows per call where verified; not numerics (see the module docstring). The rule runs on GPUs
# only, where one call costs about what one block's does: large chunks, few launches.
CHUNK_ROWS = 4096

# Each reduction with the place of its ``dim`` argument after the input.
REDUCTIONS: dict[Callable[..., Any], int] = {
    f: pos
    for names, pos in (
        (("sum", "mean", "nansum", "nanmean", "var", "std", "logsumexp"), 1),
        (("norm",), 2),
    )
    for name in names
    for f in (getattr(torch, name, None), getattr(torch.Tensor, name, None))
    if f is not None
} | {torch.linalg.vector_norm: 2}

_chunks = Probe()


def _dim_of(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    pos = REDUCTIONS[func]
    return kwargs.get("dim", args[pos] if len(args) > pos else None)


def last_dim_rows(
    func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Tensor | None:
    """The call's result by the definition when it reduces a GPU tensor of two or more
    dimensions over its last dimension alone; None when the rule does not apply (CPU, a whole
    tensor, other dimensions: the call runs as it is)."""
    x = args[0] if args else kwargs.get("input")
    if not isinstance(x, Tensor):
        return None
    cuda = for_device(x.device) == "cuda"
    if x.device.type == "cpu" and not cuda:
        return None
    if cuda and func in _ROW_KERNELS:
        out = _row_kernel(func, x, args, kwargs)
        if out is not None:
            return out
    return by_definition(func, args, kwargs)


_ROW_KERNELS = frozenset({torch.sum, Tensor.sum, torch.mean, Tensor.mean})


def _row_kernel(
    func: Callable[..., Any], x: Tensor, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Tensor | None:
    """A sum or mean over the last dimension alone (``dim``, ``keepdim``; no ``dtype``, no
    ``out``) of a floating tensor by the Triton row kernel (one row per program, float32
    accumulation: kernels/cuda/row_reduce.py), in the input's dtype as torch returns it; None
    for any other form of the call."""
    names = ("dim", "keepdim")
    bound = {**dict(zip(names, args[1:], strict=False)), **kwargs}
    bound.pop("input", None)
    if set(bound) - set(names) or x.dim() < 2 or x.numel() == 0 or not x.is_floating_point():
        return None
    dim = bound.get("dim")
    if isinstance(dim, Sequence) and not isinstance(dim, str):
        dim = dim[0] if len(dim) == 1 else None
    if not isinstance(dim, int) or dim % x.dim() != x.dim() - 1:
        return None
    from .kernels.cuda import differentiable

    kernel = differentiable.row_sum if func in (torch.sum, Tensor.sum) else differentiable.row_mean
    out: Tensor = kernel(x.reshape(-1, x.shape[-1])).to(x.dtype)  # [R]
    shape = (*x.shape[:-1], 1) if bool(bound.get("keepdim", False)) else x.shape[:-1]
    return out.reshape(shape)


def by_definition(
    func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Tensor | None:
    """``last_dim_rows`` on any device (tests run it on CPU, where the plain call already gives
    each row the same bits)."""
    x = args[0] if args else kwargs.get("input")
    if not isinstance(x, Tensor) or x.dim() < 2 or kwargs.get("out") is not None:
        return None
    dim = _dim_of(func, args, kwargs)
    if isinstance(dim, Sequence) and not isinstance(dim, str):
        if len(dim) != 1:
            return None
        dim = dim[0]
    if not isinstance(dim, int) or dim % x.dim() != x.dim() - 1:
        return None
    pos = REDUCTIONS[func]
    rest = list(args[1:])
    call_kwargs = dict(kwargs)
    call_kwargs.pop("input", None)
    if "dim" in call_kwargs:
        call_kwargs["dim"] = -1
    else:
        rest[pos - 1] = -1

    def reduce(rows: Tensor) -> Tensor:  # [r, H] → [r] or [r, 1]
        out: Tensor = func(rows, *rest, **call_kwargs)
        return out

    width = x.shape[-1]
    flat = x.reshape(-1, width)  # [R, H]
    out = _by_blocks(
        reduce, flat, (func, tuple(map(repr, rest)), repr(sorted(call_kwargs.items())))
    )
    return out.reshape(*x.shape[:-1], *out.shape[1:])


def _by_blocks(reduce: Callable[[Tensor], Tensor], flat: Tensor, key: tuple[Any, ...]) -> Tensor:
    """The definition over [R, H] rows: blocks of BLOCK_ROWS (the last zero-padded), one call
    each, or one call per verified chunk of whole blocks; only a partial last block is copied
    (into its padded block)."""
    count, width = flat.shape
    whole = count - count % BLOCK_ROWS
    parts = []
    for start in range(0, whole, CHUNK_ROWS):
        chunk = flat[start : min(start + CHUNK_ROWS, whole)]
        size = chunk.shape[0]
        if size == BLOCK_ROWS or _chunk_verified(reduce, flat, size, key):
            parts.append(reduce(chunk))
        else:
            parts.extend(reduce(block) for block in torch.split(chunk, BLOCK_ROWS))
    if whole < count:
        tail = torch.cat([flat[whole:], flat.new_zeros(BLOCK_ROWS - (count - whole), width)])
        parts.append(reduce(tail)[: count - whole])
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _chunk_verified(
    reduce: Callable[[Tensor], Tensor], like: Tensor, size: int, key: tuple[Any, ...]
) -> bool:
    """Whether one call over ``size`` rows gives each row its block's bits: checked once per
    (call, device, dtype, row length, size) on random rows and on rows whose sums cancel
    (``probe_cancelling``'s x: in a bfloat16 result random rows can round alike under two
    orders; kernels/probes.py)."""
    full = (*key, like.device, like.dtype, like.shape[1], size)

    def check() -> bool:
        (rows,) = probe_randn((size, like.shape[1]), dtype=like.dtype, device=like.device)
        cancelling, _ = probe_cancelling(
            size, 1, like.shape[1], dtype=like.dtype, device=like.device
        )
        for probe in (rows, cancelling):
            blocks = torch.cat([reduce(b) for b in torch.split(probe, BLOCK_ROWS)])
            if not torch.equal(reduce(probe), blocks):
                return False
        return True

    return _chunks(full, check)
