"""Pointwise ops whose every element goes through the same vector code, whatever the size.

In: a unary pointwise torch function (sigmoid, SiLU, exp, …) and a CPU tensor. Out: the same
values as the definition — contiguous blocks of ``POINTWISE_BLOCK`` elements, the last one
zero-padded to a multiple of 64 — computed in one call where that was checked to give the
blocks' bits. torch's CPU loops compute the elements of a vector body and of a scalar tail with
different code, and which elements fall in a tail depends on the tensor's size (and on the
thread count); the blocks fix it. Used by ``ops.TileMode`` (every pointwise call of a patched
model) and by ``tensor_parallel`` (the head's chunked log-softmax). A leaf: imports no other
module of ``oldlogit.parity``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

__all__ = ["POINTWISE_BLOCK", "blockwise", "seeded_randn"]

# Elements per pointwise call: a multiple of every CPU vector body (no scalar tail) and at most
# torch's parallel grain (32768), so one thread computes the block and never splits it.
POINTWISE_BLOCK = 32768
_ALIGN = 64


def seeded_randn(*shape: int, generator: torch.Generator) -> torch.Tensor:
    """Standard-normal values for a once-per-process kernel check (float32, CPU), drawn
    outside any torch-function mode: the invariant numerics refuse random draws in a model's
    forward (``ops.RandomForward``), and a check may run inside one."""
    with torch._C.DisableTorchFunction():
        return torch.randn(*shape, generator=generator)


def blockwise(func: Callable[..., Any], x: Tensor, *rest: Any, **kwargs: Any) -> Tensor:
    """``func(x, *rest, **kwargs)`` elementwise over x such that every element goes through
    the same vector code whatever the tensor's size: on contiguous blocks of
    ``POINTWISE_BLOCK`` elements (the last one zero-padded to a multiple of 64), or in one
    call where torch's own threads then each get a whole number of 64-element groups and
    that was checked to give the blocks' bits (``_one_call_verified``). An ``inplace=True``
    call writes the result back into x."""
    inplace = bool(kwargs.pop("inplace", False))
    n = x.numel()
    if not inplace and n <= POINTWISE_BLOCK and n % _ALIGN == 0 and x.is_contiguous():
        # One block already, in memory order: torch's loop sees it as the flat block it is.
        out_: Tensor = func(x, *rest, **kwargs)
        return out_
    flat = x.reshape(-1)
    if n % _ALIGN == 0 and (
        n <= POINTWISE_BLOCK or _one_call_verified(func, flat, n, rest, kwargs)
    ):
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
    """The definition: blocks of ``POINTWISE_BLOCK`` elements, the last zero-padded to 64."""
    n = flat.numel()
    padded = -(-n // _ALIGN) * _ALIGN
    if padded != n:
        flat = torch.cat([flat, flat.new_zeros(padded - n)])
    # One split (not one slice per block): its backward is one concatenation, where a slice
    # per block would make autograd allocate and add a full-size gradient per block.
    parts = [func(block, *rest, **kwargs) for block in torch.split(flat, POINTWISE_BLOCK)]
    out: Tensor = parts[0] if len(parts) == 1 else torch.cat(parts)
    return out


# torch's CPU loops split n elements over min(threads, ⌈n / GRAIN⌉) threads in equal chunks of
# ⌈n / that⌉ (at::parallel_for); each thread runs the vector body over its chunk and scalar
# code on the chunk's tail. When every chunk is a whole number of 64-element groups there is no
# tail, so one call computes every element as the blocks do — checked per (function, dtype,
# arguments, threads used) on random values before it is relied on.
_GRAIN = 32768
_one_call: dict[tuple[Any, ...], bool] = {}
_one_call_lock = threading.Lock()


def _one_call_verified(
    func: Callable[..., Any], flat: Tensor, n: int, rest: tuple[Any, ...], kwargs: dict[str, Any]
) -> bool:
    if flat.device.type != "cpu" or any(isinstance(a, Tensor) for a in rest):
        return False
    used = min(torch.get_num_threads(), -(-n // _GRAIN))
    if n % (_ALIGN * used):
        return False
    try:
        key = (func, flat.dtype, used, rest, tuple(sorted(kwargs.items())))
        hash(key)
    except TypeError:  # an unhashable argument: the blocks
        return False
    ok = _one_call.get(key)
    if ok is None:
        with _one_call_lock, torch.no_grad():
            gen = torch.Generator().manual_seed(used)
            # Chunks that are not a multiple of the grain, and random values the vector and
            # scalar code round differently.
            if used == torch.get_num_threads():
                size = used * (_GRAIN + 7 * _ALIGN)  # ⌈size / GRAIN⌉ ≥ used: all threads
            else:
                size = used * (_GRAIN - 3 * _ALIGN)  # ⌈size / GRAIN⌉ = used
            probe = (seeded_randn(size, generator=gen) * 3).to(flat.dtype)
            ok = bool(torch.equal(func(probe, *rest, **kwargs), _blocks(func, probe, rest, kwargs)))
            _one_call[key] = ok
    return ok
