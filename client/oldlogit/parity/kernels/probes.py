"""Checks run once per key: does a faster call give the definition's bits on this process?

In: a key (what decides the kernel: shapes, dtype, the call's settings, the thread count) and a
check that compares the faster call with the definition on random inputs. Out: the check's
answer, computed the first time the key is seen and kept for the process. A kernel's reduction
order does not depend on the values, so one check per key stands for every call with that
key — given inputs on which two different orders disagree: random full-precision inputs, and
for a GEMM with a low-precision output also operands whose products cancel
(``probe_cancelling``: on random bf16 rows two orders can agree at every output).

One seeding rule: a check's inputs are drawn in order from one CPU generator seeded by their
shapes alone (``probe_randn``), outside any torch-function mode (the invariant numerics refuse
random draws in a model's forward, ``ops.RandomForward``, and a check may run inside one).
The CUDA GEMM choice seeds by its key instead (cuda/gemm_choice.py: on the device).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable

import torch
from torch import Tensor

__all__ = ["Probe", "probe_attention_cancelling", "probe_cancelling", "probe_randn", "seed_of"]


def seed_of(*shapes: tuple[int, ...]) -> int:
    """The seed of a check whose inputs have these shapes: every dimension folded in order
    (``seed · 131 + d``), so a [r, k] input is seeded ``r · 131 + k``."""
    seed = 0
    for shape in shapes:
        for d in shape:
            seed = (seed * 131 + d) % (2**63 - 1)
    return seed


def probe_randn(
    *shapes: tuple[int, ...],
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    scale: float = 1.0,
) -> list[Tensor]:
    """Standard-normal inputs (times ``scale``) of ``shapes`` for a check, drawn in float32 on
    the CPU from one generator seeded by ``seed_of(*shapes)``, then cast and moved."""
    gen = torch.Generator().manual_seed(seed_of(*shapes))
    with torch._C.DisableTorchFunction():
        drawn = [torch.randn(*shape, generator=gen) for shape in shapes]
        drawn = [t * scale for t in drawn] if scale != 1.0 else drawn
    return [t.to(device, dtype) for t in drawn]


def probe_cancelling(
    rows: int,
    n: int,
    k: int,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> tuple[Tensor, Tensor]:
    """GEMM operands x [rows, k] and w [n, k] on which two accumulation orders disagree in
    most outputs, even bfloat16 ones: the columns are paired at random (w equal, x opposite in a
    pair), so every product meets its exact negative and x @ wᵀ is exactly 0, and the values
    spread over 2^-4 … 2^4, so the partial sums round — what a kernel returns is the rounding
    of its own order. Random rows are a weak check in a low precision: bf16 products are exact
    in float32, most sums round alike and the output's rounding hides the rest, so two orders
    can agree at every output (measured on an AMX Xeon: a 256-row and a 64-row bf16 GEMM at
    896 → 128 agreed on random rows against one weight and not another;
    tests/unit/test_tiles.py). Seeded by the shapes alone, like ``probe_randn``; an odd k
    leaves one column at 0."""
    half = k // 2
    order, w_half, x_half, w_exp, x_exp = probe_randn(
        (k,), (n, half), (rows, half), (half,), (rows, half)
    )  # w's scale by column: a head's weight is large
    with torch._C.DisableTorchFunction():
        first, second = order.argsort()[:half], order.argsort()[half : 2 * half]
        w = torch.zeros(n, k)
        x = torch.zeros(rows, k)
        w[:, first] = w_half * torch.exp2((w_exp * 2).round().clamp(-4, 4))
        w[:, second] = w[:, first]
        x[:, first] = x_half * torch.exp2((x_exp * 2).round().clamp(-4, 4))
        x[:, second] = -x[:, first]
    return x.to(device, dtype), w.to(device, dtype)


def probe_attention_cancelling(
    q_shape: tuple[int, ...],
    k_shape: tuple[int, ...],
    v_shape: tuple[int, ...],
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> tuple[Tensor, Tensor, Tensor]:
    """Attention inputs [..., L, D] on which two accumulation orders disagree even in a
    bfloat16 output: queries near 0 (every key weighs almost alike), values in pairs of
    opposite signs along the sequence (position 2m + 1 is −(position 2m)) with magnitudes
    spread over 2^-4 … 2^4, so each row's weighted sum nearly cancels and what a kernel returns
    is mostly the rounding of its own order (random values round alike in most outputs, as
    ``probe_cancelling`` says of GEMMs). Seeded by the shapes alone."""
    q, k, v_half, v_exp = probe_randn(
        q_shape, k_shape, (*v_shape[:-2], (v_shape[-2] + 1) // 2, v_shape[-1]),
        (*v_shape[:-2], (v_shape[-2] + 1) // 2, v_shape[-1]),
    )  # fmt: skip
    with torch._C.DisableTorchFunction():
        half = v_half * torch.exp2((v_exp * 2).round().clamp(-4, 4))
        v = torch.stack([half, -half], dim=-2).flatten(-3, -2)[..., : v_shape[-2], :]
        q = q * 2.0**-10
    return q.to(device, dtype), k.to(device, dtype), v.contiguous().to(device, dtype)


class Probe:
    """A check's answers by key, each computed once per process (under a lock, without
    autograd) and kept. The lock is re-entrant: a check may rely on another key's answer."""

    def __init__(self) -> None:
        self._answers: dict[Hashable, bool] = {}
        self._lock = threading.RLock()

    def __call__(self, key: Hashable, check: Callable[[], bool]) -> bool:
        """The answer for ``key``: ``check()`` the first time, the kept answer after."""
        ok = self._answers.get(key)
        if ok is None:
            with self._lock, torch.no_grad():
                ok = self._answers.get(key)
                if ok is None:
                    ok = self._answers[key] = bool(check())
        return ok

    def get(self, key: Hashable) -> bool | None:
        """The kept answer for ``key``; None where it was never checked."""
        return self._answers.get(key)
