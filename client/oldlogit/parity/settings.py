"""The process-wide kernel settings that change a forward's bits, pinned for the forward.

A trainer's process may switch on reduced-precision float32 GEMMs (CUDA's TF32 through
``allow_tf32`` or ``torch.set_float32_matmul_precision("high")``, oneDNN's ``fp32_precision =
"bf16"`` on CPUs with bfloat16 units), switch oneDNN off
(``torch.backends.mkldnn.flags(enabled=False)``: bfloat16 GEMMs take another kernel), change
cuBLAS's reductions, or switch attention kernels off
(``torch.backends.cuda.enable_flash_sdp(False)``, a surrounding
``torch.nn.attention.sdpa_kernel``; they choose the CPU kernel too). Each makes the same GEMM or
attention call give other bits (measured on this CPU: oneDNN's bf16 setting, oneDNN off and
flash attention switched off all did, silently). ``default_kernel_settings`` runs the invariant
forward with torch's defaults — but cuDNN's attention kernel, off: its forward is not
deterministic — on the trainer's side and the service's alike, and gives the process its own
settings back afterwards. A forward on CUDA also runs with cuBLASLt preferred and its split-K
and reduced-precision reductions off (kernels/cuda/gemm_choice.py, ``pinned_cublaslt``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

__all__ = ["default_kernel_settings"]

# Attention kernels in the order torch tries them, as this process started with (torch's
# default; a trainer's ``sdpa_kernel(..., set_priority=True)`` reorders it for its duration).
_get_order = getattr(torch._C, "_get_sdp_priority_order", None)
_set_order = getattr(torch._C, "_set_sdp_priority_order", None)
_DEFAULT_ORDER: list[int] | None = list(_get_order()) if callable(_get_order) else None


@functools.cache
def _settings() -> tuple[tuple[Callable[[], Any], Callable[[Any], Any], Any], ...]:
    """(read, write, torch's default) for each setting this torch build has."""
    cuda = torch.backends.cuda
    matmul = cuda.matmul
    out: list[tuple[Callable[[], Any], Callable[[Any], Any], Any]] = []

    def attribute(obj: Any, name: str, default: Any) -> None:
        try:
            getattr(obj, name)
        except (AttributeError, RuntimeError):  # not in this build
            return
        if name.endswith("reduced_precision_reduction"):  # its split-k half goes with it

            def read() -> Any:
                return (bool(getattr(obj, name)), bool(getattr(obj, name + "_split_k", True)))

        else:

            def read() -> Any:
                return getattr(obj, name)

        out.append((read, functools.partial(setattr, obj, name), default))

    attribute(torch.backends.mkldnn, "enabled", True)  # off: bf16 GEMMs take another kernel
    attribute(torch.backends.cudnn, "enabled", True)  # cuDNN's attention kernel needs it
    attribute(matmul, "allow_fp16_reduced_precision_reduction", (True, True))
    attribute(matmul, "allow_bf16_reduced_precision_reduction", (True, True))
    attribute(matmul, "allow_fp16_accumulation", False)
    mkldnn = getattr(getattr(torch.backends, "mkldnn", None), "matmul", None)
    if mkldnn is not None and hasattr(mkldnn, "fp32_precision"):
        attribute(matmul, "fp32_precision", "ieee")
        attribute(mkldnn, "fp32_precision", "ieee")
    else:  # torch before the per-backend precision settings
        attribute(matmul, "allow_tf32", False)
    for kernel in ("flash", "mem_efficient", "math", "cudnn"):
        read = getattr(cuda, f"{kernel}_sdp_enabled", None)
        write = getattr(cuda, f"enable_{kernel}_sdp", None)
        if callable(read) and callable(write):
            # All on, as torch starts, but cuDNN's attention: torch documents its forward as
            # not deterministic (``use_deterministic_algorithms`` excludes it), and on an H100
            # the same operands gave other rows in two calls. Flash, memory-efficient and math
            # forwards are deterministic; a GPU's calls pick among them.
            out.append((read, write, kernel != "cudnn"))
    read = getattr(cuda, "fp16_bf16_reduction_math_sdp_allowed", None)
    write = getattr(cuda, "allow_fp16_bf16_reduction_math_sdp", None)
    if callable(read) and callable(write):
        out.append((read, write, False))
    if _DEFAULT_ORDER is not None and callable(_get_order) and callable(_set_order):
        default = list(_DEFAULT_ORDER)
        out.append((lambda: list(_get_order()), _set_order, default))
    return tuple(out)


@contextmanager
def default_kernel_settings(cuda: bool = False) -> Iterator[None]:
    """torch's default kernel settings for the duration (see the module docstring), then the
    process's own again; ``cuda``: with the CUDA definition's GEMM settings too."""
    changed: list[tuple[Callable[[Any], Any], Any]] = []
    try:
        for read, write, default in _settings():
            was = read()
            if was != default:
                write(default)
                changed.append((write, was))
        if cuda:
            from .kernels.cuda.gemm_choice import pinned_cublaslt

            with pinned_cublaslt():
                yield
        else:
            yield
    finally:
        for write, was in reversed(changed):
            write(was)
