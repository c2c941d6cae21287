"""Which kernel computes one linear's GEMM on CUDA: cuBLASLt where probed row-invariant, else
the fixed-tile Triton GEMM (matmul.py); and the one call over all rows that follows.

The choice is a function of a ``GemmKey`` alone, never of the process's history, and the probe
is seeded from the key: a trainer and a service on the same platform choose alike.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Literal

import torch
from torch import Tensor

from ..probes import probe_cancelling

__all__ = [
    "LADDER",
    "M_MAX",
    "Choice",
    "GemmKey",
    "blas_version",
    "choice_for",
    "choose",
    "decided",
    "gemm",
    "key_for",
    "pinned_cublaslt",
    "probe",
    "seed_of",
    "torch_gemm",
    "triton_config",
    "workspace_setting",
]

Choice = Literal["cublaslt", "triton"]

# Row counts the probe computes alone against the first rows of one M_MAX-row call. cuBLASLt's
# heuristics see M through a few thresholds — powers of two (tile heights 64/128/256, the wave
# count over the SMs) and the M == 1 GEMV and small-M (< 16) kernels — so each power of two from
# 8 to M_MAX is here with its neighbours on both sides (2^k - 1, 2^k, 2^k + 1; M_MAX + 1 is past
# the probe), plus 1-4, 7 and 1,000 (a non-power mid-size). A kernel that changed between two
# rungs of the ladder, inside one bucket, would escape; none of the public evidence (vLLM's
# M=1 vs 8…2048 check, thinking-machines' split-K analysis) points at one.
LADDER = (
    1, 2, 3, 4, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129, 255, 256, 257, 511,
    512, 513, 1000, 1023, 1024, 1025, 2047, 2048, 2049, 4095, 4096, 4097, 8191, 8192,
)  # fmt: skip
# The probe's largest row count; a cuBLASLt call covers at most this many rows, so an input
# above it runs as consecutive M_MAX-row calls (each probed like any other row count).
M_MAX = LADDER[-1]


@dataclasses.dataclass(frozen=True)
class GemmKey:
    """Everything a GEMM's kernel choice depends on. ``n``/``k``: the linear's weight [N, K];
    ``transposed``: the weight is handed over as the transpose of a row-major [K, N] (an input
    gradient's ``g @ W``) — cuBLAS sees another problem (operand layouts) than for a row-major
    [N, K]; ``device``: the GPU's name and compute capability; ``torch``/``blas``/``triton``:
    the builds whose kernels and heuristics are chosen among."""

    n: int
    k: int
    dtype: str
    bias: bool
    transposed: bool
    device: str
    torch: str
    blas: str
    triton: str


def seed_of(key: GemmKey) -> int:
    """The probe's seed: a hash of the key, nothing else."""
    text = repr(dataclasses.astuple(key)).encode()
    return int.from_bytes(hashlib.sha256(text).digest()[:8], "little") & (2**63 - 1)


Gemm = Callable[[Tensor, Tensor, "Tensor | None"], Tensor]


def probe(
    key: GemmKey, gemm: Gemm, device: torch.device | str, ladder: tuple[int, ...] = LADDER
) -> int | None:
    """The first row count of ``ladder`` whose rows computed alone differ in any bit from the
    same rows of one ``max(ladder)``-row call; None where none does. Seeded random rows and
    weight (and bias) of the key's shape, layout and dtype, generated on ``device``."""
    dtype = getattr(torch, key.dtype)
    gen = torch.Generator(device=device).manual_seed(seed_of(key))

    def randn(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=gen, device=device).to(dtype)

    rows = max(ladder)
    x = randn(rows, key.k)  # [M_max, K]
    weight = randn(key.k, key.n).t() if key.transposed else randn(key.n, key.k)  # [N, K]
    bias = randn(key.n) if key.bias else None
    # Random rows alone are a weak check in bf16/fp16 (two accumulation orders can agree at
    # every rounded output): operands whose products cancel exactly are run too
    # (``probes.probe_cancelling``), with the same layout and bias.
    x_cancel, w_cancel = probe_cancelling(rows, key.n, key.k, dtype=dtype, device=device)
    if key.transposed:
        w_cancel = w_cancel.t().contiguous().t()
    with torch.no_grad():
        for a, w in ((x, weight), (x_cancel, w_cancel)):
            whole = gemm(a, w, bias)  # [M_max, N]
            for m in ladder:
                alone = gemm(a[:m].clone(), w, bias)  # a fresh, aligned input of m rows
                if not torch.equal(alone, whole[:m]):
                    return m
    return None


_decided: dict[GemmKey, Choice] = {}
_lock = threading.Lock()


def choose(
    key: GemmKey, gemm: Gemm, device: torch.device | str, ladder: tuple[int, ...] = LADDER
) -> Choice:
    """The key's choice: "cublaslt" where ``probe`` finds no row count that differs, else
    "triton". Probed once per key per process."""
    choice = _decided.get(key)
    if choice is not None:
        return choice
    with _lock:
        choice = _decided.get(key)
        if choice is None:
            choice = "cublaslt" if probe(key, gemm, device, ladder) is None else "triton"
            _decided[key] = choice
    return choice


def decided() -> dict[str, Choice]:
    """The choices this process has made, by a readable key (``/v1/info``)."""
    with _lock:
        items = list(_decided.items())
    return {
        f"{k.n}x{k.k} {k.dtype}{' +bias' if k.bias else ''}{' transposed' if k.transposed else ''}"
        f" on {k.device}": c
        for k, c in items
    }


@functools.cache
def blas_version() -> str:
    """The cuBLASLt library torch calls (its runtime version), else the CUDA toolkit torch
    was built with."""
    for name in ("libcublasLt.so.13", "libcublasLt.so.12", "libcublasLt.so.11", "libcublasLt.so"):
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        fn = lib.cublasLtGetVersion
        fn.restype = ctypes.c_size_t
        return f"cublasLt={int(fn())}"
    return f"cuda={torch.version.cuda or '-'}"


def workspace_setting() -> str:
    """The cuBLASLt workspace this process runs with. ``CUBLASLT_WORKSPACE_SIZE`` (KiB) is read
    when a cuBLASLt handle is created, so it cannot be pinned per forward: it is left as the
    process set it, and named here (a smaller workspace rules out some kernels, so two sides
    with different settings may choose differently; the spec then says so)."""
    return f"ws={os.environ.get('CUBLASLT_WORKSPACE_SIZE', 'default')}"


@functools.cache
def triton_config() -> str:
    """The Triton GEMM's fixed configuration, as matmul.py names it."""
    try:
        from . import matmul
    except ImportError:  # triton not installed: no Triton GEMM
        return "unavailable"
    configs = getattr(matmul, "CONFIG", None)
    if isinstance(configs, dict):
        return "; ".join(sorted(str(getattr(c, "name", c)) for c in configs.values()))
    return "fixed-tile"


def key_for(weight: Tensor, bias: Tensor | None) -> GemmKey:
    """The key of a linear with ``weight`` [N, K] (row-major, or the transpose of a row-major
    [K, N]) on its CUDA device."""
    device = weight.device
    index = device.index if device.index is not None else torch.cuda.current_device()
    name, blas, triton = _platform(index)
    return GemmKey(
        n=int(weight.shape[0]),
        k=int(weight.shape[1]),
        dtype=str(weight.dtype).removeprefix("torch."),
        bias=bias is not None,
        transposed=not weight.is_contiguous(),
        device=name,
        torch=str(torch.__version__),
        blas=blas,
        triton=triton,
    )


@functools.cache
def _platform(index: int) -> tuple[str, str, str]:
    """(GPU name and compute capability, cuBLASLt build, Triton release) of a CUDA device."""
    from .. import triton_version

    major, minor = torch.cuda.get_device_capability(index)
    name = f"{torch.cuda.get_device_name(index)} sm_{major}{minor}"
    return name, blas_version(), triton_version()


# Blocks of ``pinned_cublaslt`` open in this process (the settings are process-wide): inside
# one, a nested block finds them pinned already and reads nothing (a GEMM's per-call cost).
# Counted under a lock: a forward's thread and autograd's backward threads open blocks at once;
# the settings the first block changed are given back when the last one closes.
_pinned_depth = 0
_pinned_saved: list[tuple[Callable[[Any], Any], Any]] = []
_pinned_lock = threading.Lock()


@contextmanager
def pinned_cublaslt() -> Iterator[None]:
    """cuBLASLt preferred, split-K and reduced-precision reductions off (bf16 and fp16), TF32
    off, for a block; what the process had before, once the last open block closes. Free when
    nested in another such block, in any thread (the invariant forward pins them for its
    duration: settings.py); a backward runs outside the forward, so each of its calls pins
    them itself."""
    global _pinned_depth
    with _pinned_lock:
        if not _pinned_depth:
            for read, write, want in _pins():
                was = read()
                if was != want:
                    write(want)
                    _pinned_saved.append((write, was))
        _pinned_depth += 1
    try:
        yield
    finally:
        with _pinned_lock:
            _pinned_depth -= 1
            if not _pinned_depth:
                for write, was in reversed(_pinned_saved):
                    write(was)
                _pinned_saved.clear()


@functools.cache
def _pins() -> tuple[tuple[Callable[[], Any], Callable[[Any], Any], Any], ...]:
    matmul = torch.backends.cuda.matmul
    out: list[tuple[Callable[[], Any], Callable[[Any], Any], Any]] = []
    for name in (
        "allow_bf16_reduced_precision_reduction",
        "allow_fp16_reduced_precision_reduction",
    ):
        if hasattr(matmul, name + "_split_k"):  # torch >= 2.10: (reduced precision, split-K)

            def read(name: str = name) -> Any:
                return (bool(getattr(matmul, name)), bool(getattr(matmul, name + "_split_k")))

            want: Any = (False, False)
        else:  # older torch: split-K cannot be switched off; the probe decides alone

            def read(name: str = name) -> Any:
                return bool(getattr(matmul, name))

            want = False
        out.append((read, functools.partial(setattr, matmul, name), want))
    if hasattr(matmul, "fp32_precision"):  # torch's per-backend precision settings
        precision = (
            lambda: matmul.fp32_precision,
            functools.partial(setattr, matmul, "fp32_precision"),
        )
        out.append((*precision, "ieee"))
    else:
        tf32 = (lambda: matmul.allow_tf32, functools.partial(setattr, matmul, "allow_tf32"))
        out.append((*tf32, False))
    if torch.cuda.is_available():  # a CPU build cannot name cuBLASLt at all
        blas = torch.backends.cuda.preferred_blas_library
        out.append((lambda: blas(), blas, torch._C._BlasBackend.Cublaslt))
    return tuple(out)


def torch_gemm(x: Tensor, weight: Tensor, bias: Tensor | None, out: Tensor | None = None) -> Tensor:
    """x [M, K] @ weight [N, K]ᵀ (+ bias) in one torch call under ``pinned_cublaslt``, as the
    probe calls it (never with ``out=``: torch's ``addmm`` into a given output takes another
    path), then copied into ``out`` when one is given."""
    with pinned_cublaslt():
        w_t = weight.t()
        y = torch.mm(x, w_t) if bias is None else torch.addmm(bias, x, w_t)
    return y if out is None else out.copy_(y)


def triton_gemm(
    x: Tensor, weight: Tensor, bias: Tensor | None, out: Tensor | None = None
) -> Tensor:
    """x [M, K] @ weight [N, K]ᵀ (+ bias) by the fixed-tile Triton GEMM (matmul.py)."""
    from .matmul import matmul

    y: Tensor = matmul(x, weight, bias)
    return y if out is None else out.copy_(y)


# (N, K, dtype, bias, transposed, device index) -> the choice ``choose`` made for the key those
# name in this process (the rest of a key is fixed per device and process): a GEMM's lookup
# without building its key.
_by_shape: dict[tuple[int, int, torch.dtype, bool, bool, int | None], Choice] = {}


def choice_for(weight: Tensor, bias: Tensor | None) -> Choice:
    """The choice for this linear: probed on its CUDA device; "triton" off CUDA (the test
    switch of ``kernels.forced_cuda``: there is no cuBLASLt on a CPU)."""
    device = weight.device
    if device.type != "cuda":
        return "triton"
    shape = (
        weight.shape[0],
        weight.shape[1],
        weight.dtype,
        bias is not None,
        not weight.is_contiguous(),
        device.index,
    )
    found = _by_shape.get(shape)
    if found is None:
        found = choose(key_for(weight, bias), torch_gemm, device)
        _by_shape[shape] = found
    return found


def gemm(
    x: Tensor, weight: Tensor, bias: Tensor | None = None, out: Tensor | None = None
) -> Tensor:
    """x [M, K] @ weight [N, K]ᵀ (+ bias [N]) → [M, N], each row's bits independent of M: one
    cuBLASLt call per ``M_MAX`` rows where the key was probed row-invariant, else one Triton
    call. No autograd. ``weight`` is row-major [N, K] or the transpose of a row-major [K, N];
    any other layout is copied to row-major first."""
    if not (weight.is_contiguous() or weight.t().is_contiguous()):
        weight = weight.contiguous()
    if weight.data_ptr() % 16:  # a view at an odd offset: cuBLAS reads the alignment
        weight = weight.clone()
    if bias is not None and (not bias.is_contiguous() or bias.data_ptr() % 16):
        bias = bias.clone(memory_format=torch.contiguous_format)
    m = x.shape[0]
    if m == 0:
        return x.new_empty(0, weight.shape[0]) if out is None else out
    if not x.is_contiguous() or x.data_ptr() % 16:
        x = x.contiguous() if not x.is_contiguous() else x.clone()  # cuBLAS reads the alignment
    if choice_for(weight, bias) == "triton":
        return triton_gemm(x, weight, bias, out)
    if m <= M_MAX:
        return torch_gemm(x, weight, bias, out)
    out = x.new_empty(m, weight.shape[0]) if out is None else out
    for start in range(0, m, M_MAX):
        part = x[start : start + M_MAX]
        torch_gemm(part if part.data_ptr() % 16 == 0 else part.clone(), weight, bias,
                   out[start : start + M_MAX])  # fmt: skip
    return out
