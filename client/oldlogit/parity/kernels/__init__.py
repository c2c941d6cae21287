"""How each device computes the invariant forward: the kernels, apart from the definition.

``for_device`` is the one switch: "cpu" (``cpu.py``: fixed row tiles, blockwise pointwise ops)
or "cuda" (``cuda/``: one GEMM over all rows, chosen by ``cuda/gemm_choice.py``; Triton row
kernels). ``probes.py`` holds the once-per-key checks both rely on. ``kernel_set`` names the
choice in ``NumericsSpec.kernels``. Kernels import nothing from the rest of ``oldlogit.parity``
(a contract in pyproject.toml); the definition imports them.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator
from contextlib import contextmanager
from importlib import metadata
from typing import Literal

import torch

__all__ = ["CPU_KERNELS", "Backend", "for_device", "forced_cuda", "kernel_set", "triton_version"]

Backend = Literal["cpu", "cuda"]

CPU_KERNELS = "cpu/tiles"

# Tests only: run a CPU model with the CUDA definition's kernels (Triton under
# ``TRITON_INTERPRET=1``; the GEMM always "triton", there is no cuBLASLt on a CPU). Read once;
# ``forced_cuda`` switches it for a block (tests/unit/test_cuda_definition.py).
_forced = os.environ.get("OLDLOGIT_FORCE_CUDA_KERNELS", "") == "1"


def for_device(device: torch.device) -> Backend:
    """The kernel set a forward on ``device`` runs: "cuda" on a CUDA device, "cpu" otherwise
    (and "cuda" everywhere under the private test switch)."""
    return "cuda" if device.type == "cuda" or _forced else "cpu"


@contextmanager
def forced_cuda(on: bool = True) -> Iterator[None]:
    """The test switch for the duration of a block (process-wide: not for concurrent use)."""
    global _forced
    was, _forced = _forced, on
    try:
        yield
    finally:
        _forced = was


@functools.cache
def triton_version() -> str:
    """The installed Triton release, without importing it ("": not installed)."""
    try:
        return metadata.version("triton")
    except metadata.PackageNotFoundError:
        return ""


def kernel_set(device: torch.device | str) -> str:
    """``NumericsSpec.kernels`` for a forward on ``device``: what computes its GEMMs and row
    reductions, and the versions that decide a CUDA GEMM's choice (``cuda/gemm_choice.py``)."""
    device = torch.device(device)
    if for_device(device) == "cpu":
        return CPU_KERNELS
    from .cuda import gemm_choice
    from .cuda.gemm_choice import blas_version, workspace_setting

    blas = blas_version() if device.type == "cuda" else "none"
    return (
        f"cuda/one-gemm(cublaslt no-split-k {workspace_setting()} where probed row-invariant "
        f"over M<={gemm_choice.M_MAX}, else triton {gemm_choice.triton_config()})"
        f"/triton-rows/{blas}/triton={triton_version() or '-'}"
    )
