"""Stands for ``F.linear(x, weight, bias)``: x [M, K] @ weight[N, K]ᵀ (+ bias[N]) → [M, N].

Rows independent: fixed output tiles per (N, K, dtype), never per M; each tile runs the full K
loop into an fp32 accumulator in one order (no split-K), bias added after the loop in fp32, one
cast to x's dtype at the end. Must not autotune or pick a config from M.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch
import triton
import triton.language as tl
from torch import Tensor

__all__ = ["CONFIG", "GemmConfig", "config_for", "config_name", "dot_precision", "matmul"]


@dataclass(frozen=True)
class GemmConfig:
    """One launch configuration; ``name`` is what a numerics spec records."""

    dtype: str
    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int

    @property
    def name(self) -> str:
        return (
            f"triton-gemm {self.dtype} {self.block_m}x{self.block_n}x{self.block_k} "
            f"w{self.num_warps} s{self.num_stages}"
        )


# One config per dtype (bf16/fp16 as in thinking-machines' batch_invariant_ops; fp32 with a
# shorter K step, its tiles twice the bytes). Changing one changes every GEMM's bits.
CONFIG: dict[torch.dtype, GemmConfig] = {
    torch.bfloat16: GemmConfig("bf16", 128, 128, 64, 8, 8, 3),
    torch.float16: GemmConfig("fp16", 128, 128, 64, 8, 8, 3),
    torch.float32: GemmConfig("fp32", 128, 128, 32, 8, 8, 3),
}


def config_for(n: int, k: int, dtype: torch.dtype) -> GemmConfig:
    """The config for a weight [n, k] of ``dtype``; the row count has no say."""
    del n, k  # one config per dtype today; the signature leaves room for (N, K) buckets
    try:
        return CONFIG[dtype]
    except KeyError:
        raise ValueError(f"matmul: no Triton GEMM config for dtype {dtype}") from None


def config_name(n: int, k: int, dtype: torch.dtype) -> str:
    return config_for(n, k, dtype).name


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot``'s input precision: float32 exact ("ieee": FMA, never TF32, as the definition
    pins for torch's matmuls); half types run on the tensor cores whatever it says."""
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit(do_not_specialize=["M", "NUM_PROGRAMS"])  # type: ignore[untyped-decorator]
def _matmul_kernel(  # type: ignore[no-untyped-def]
    x_ptr,
    w_ptr,
    b_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_xk,
    stride_wn,
    stride_wk,
    stride_om,
    stride_on,
    NUM_PROGRAMS,
    HAS_BIAS: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    start = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_tiles = num_pid_m * num_pid_n
    num_in_group = GROUP_M * num_pid_n
    offs_k = tl.arange(0, BLOCK_K)
    # Persistent: a program walks tiles start, start + NUM_PROGRAMS, ...; a tile's arithmetic
    # is the same whichever program computes it.
    for tile in range(start, num_tiles, NUM_PROGRAMS):
        group = tile // num_in_group
        first_m = group * GROUP_M
        group_size = min(num_pid_m - first_m, GROUP_M)
        pid_m = first_m + (tile % num_in_group) % group_size
        pid_n = (tile % num_in_group) // group_size
        offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
        mask_m = offs_m < M
        mask_n = offs_n < N
        x_tile = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk
        w_tile = w_ptr + offs_k[:, None] * stride_wk + offs_n[None, :] * stride_wn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kb in range(0, tl.cdiv(K, BLOCK_K)):
            k_left = K - kb * BLOCK_K
            a = tl.load(x_tile, mask=mask_m[:, None] & (offs_k[None, :] < k_left), other=0.0)
            b = tl.load(w_tile, mask=(offs_k[:, None] < k_left) & mask_n[None, :], other=0.0)
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
            x_tile += BLOCK_K * stride_xk
            w_tile += BLOCK_K * stride_wk
        if HAS_BIAS:
            bias = tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
            acc = acc + bias[None, :]
        out = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@cache
def _num_sms(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).multi_processor_count)


def _programs(device: torch.device, tiles: int) -> int:
    """Persistent on CUDA: one program per SM, each walking its share of the tiles; on CPU (the
    interpreter, one program after another) one per tile."""
    if device.type == "cuda":
        return min(_num_sms(device.index or 0), tiles)
    return tiles


def matmul(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x [M, K] @ weight[N, K]ᵀ (+ bias[N]) → [M, N] in x's dtype; any strides."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"matmul: x {tuple(x.shape)} and weight {tuple(weight.shape)}")
    if weight.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
        raise ValueError("matmul: x, weight and bias must share one dtype")
    if x.device.type == "cpu" and x.dtype == torch.bfloat16:
        # TRITON_INTERPRET=1 reads bfloat16 as uint16 in tl.dot and truncates on the cast back:
        # float32 in (bf16 products are exact in fp32), one round-to-nearest cast out, as on CUDA.
        b32 = bias.float() if bias is not None else None
        return matmul(x.float(), weight.float(), b32).to(torch.bfloat16)
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"matmul: bias {tuple(bias.shape)} for weight {tuple(weight.shape)}")
    m, k = x.shape
    n = weight.shape[0]
    cfg = config_for(n, k, x.dtype)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.copy_(bias.expand(m, n)) if bias is not None else out.zero_()
    programs = _programs(x.device, triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n))
    _matmul_kernel[(programs,)](
        x,
        weight,
        bias if bias is not None else x,  # not read without HAS_BIAS
        out,
        m,
        n,
        k,
        x.stride(0),
        x.stride(1),
        weight.stride(0),
        weight.stride(1),
        out.stride(0),
        out.stride(1),
        programs,
        HAS_BIAS=bias is not None,
        PRECISION=dot_precision(x.dtype),
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        GROUP_M=cfg.group_m,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out
