"""The CUDA definition's Triton kernels (client/oldlogit/parity/kernels/cuda/) against the torch
ops they stand for, and each row's bits independent of the other rows.

Without CUDA they run under TRITON_INTERPRET=1 on CPU tensors (tests/conftest.py sets it): that
proves the structure (fixed tiles, independent rows) and the order of operations; on a GPU the
same tests run the compiled kernels on cuda tensors, bfloat16 included.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

import torch.nn.functional as F  # noqa: E402
from torch import Tensor  # noqa: E402

from oldlogit.parity.kernels.cuda import (  # noqa: E402
    log_softmax,
    matmul,
    rms_norm,
    row_cumsum,
    row_reduce,
)

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICES = ["cpu"] if INTERPRETED else (["cuda"] if torch.cuda.is_available() else [])
if not DEVICES:
    pytest.skip("neither CUDA nor TRITON_INTERPRET=1", allow_module_level=True)

ROW_COUNTS = (1, 2, 3, 17, 64, 65, 130)
# The interpreter runs one program after another, each costly: half the rows on CPU.
ROWS = 65 if INTERPRETED else 130


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def _randn(*shape: int, device: str, dtype: torch.dtype = torch.float32, seed: int = 0) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)


def assert_rows_invariant(fn: Callable[[Tensor], Tensor], x: Tensor) -> None:
    """A row's result is bitwise the same alone, among 1…130 rows, and at another place among
    other rows."""
    full = fn(x)
    for n in ROW_COUNTS:
        if n < x.shape[0]:
            assert torch.equal(fn(x[:n]), full[:n]), f"first {n} rows"
    for i in (0, x.shape[0] - 1):
        assert torch.equal(fn(x[i : i + 1]), full[i : i + 1]), f"row {i} alone"
    # Rows from other places of the batch, computed at the start of a call: a row's bits do not
    # depend on where it sits in a tile (the interpreter's BLAS dot once did: tests/
    # triton_interpreter.py).
    for s in (1, 4, 6, 17, 33):
        if s + 5 <= x.shape[0]:
            assert torch.equal(fn(x[s : s + 5]), full[s : s + 5]), f"rows {s}..{s + 4}"
    others = _randn(17, *x.shape[1:], device=str(x.device), dtype=x.dtype, seed=99)
    others[5] = x[-1]
    assert torch.equal(fn(others)[5], full[-1]), "the last row among other rows"


def _bf16_tol() -> dict[str, float]:
    return {"rtol": 2**-7, "atol": 2**-7}  # one bfloat16 ulp: the sums' orders differ


def test_rows_look_the_same_to_every_launch() -> None:
    from oldlogit.parity.kernels.cuda._rows import as_rows

    x = torch.randn(6, 70)
    assert as_rows(x).data_ptr() == x.data_ptr()  # contiguous and aligned: no copy
    assert as_rows(x[:1]).data_ptr() == x.data_ptr()
    for view in (x[1:2], x[:, 1:], x[:, :35], x.t(), x.view(2, 3, 70)[:, 1]):
        rows = as_rows(view)
        assert rows.data_ptr() % 16 == 0 and rows.is_contiguous()
        assert torch.equal(rows, view.reshape(-1, view.shape[-1]))


# ── matmul ────────────────────────────────────────────────────────────────────────────────────


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [True, False])
def test_matmul_matches_linear(device: str, dtype: torch.dtype, with_bias: bool) -> None:
    x = _randn(65, 96, device=device, dtype=dtype)
    w = _randn(80, 96, device=device, dtype=dtype, seed=1)
    b = _randn(80, device=device, dtype=dtype, seed=2) if with_bias else None
    y = matmul.matmul(x, w, b)
    assert y.dtype == dtype and y.shape == (65, 80)
    # fp32 products and sums, one cast: the reference does the same on float32 copies.
    ref = F.linear(x.double(), w.double(), None if b is None else b.double()).float()
    if dtype == torch.float32:
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    else:
        torch.testing.assert_close(y.float(), ref.to(dtype).float(), **_bf16_tol())


def test_matmul_rows_invariant(device: str) -> None:
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    x = _randn(ROWS, 72, device=device, dtype=dtype)
    w = _randn(40, 72, device=device, dtype=dtype, seed=1)
    b = _randn(40, device=device, dtype=dtype, seed=2)
    assert_rows_invariant(lambda rows: matmul.matmul(rows, w, b), x)
    # The first rows of a larger M (more tiles than one) keep their bits.
    big = torch.cat([x, _randn(200, 72, device=device, dtype=dtype, seed=3)])
    assert torch.equal(matmul.matmul(big, w, b)[:ROWS], matmul.matmul(x, w, b))


def test_matmul_persistent_programs_walk_every_tile(
    device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    x = _randn(300, 40, device=device)
    w = _randn(260, 40, device=device, seed=1)  # 3 x 3 tiles of 128 x 128
    b = _randn(260, device=device, seed=2)
    one_per_tile = matmul.matmul(x, w, b)
    monkeypatch.setattr(matmul, "_programs", lambda device, tiles: min(2, tiles))
    assert torch.equal(matmul.matmul(x, w, b), one_per_tile)  # 2 programs, 9 tiles
    torch.testing.assert_close(one_per_tile, F.linear(x, w, b), rtol=1e-5, atol=1e-5)


def test_matmul_strides_and_edges(device: str) -> None:
    x = _randn(17, 70, device=device)
    w_t = _randn(70, 33, device=device, seed=1).t()  # [33, 70], a transposed view
    assert not w_t.is_contiguous()
    y = matmul.matmul(x, w_t)
    torch.testing.assert_close(y, F.linear(x, w_t), rtol=1e-5, atol=1e-5)
    assert torch.equal(y, matmul.matmul(x, w_t.contiguous()))
    x_t = _randn(70, 17, device=device, seed=2).t()  # non-contiguous rows
    torch.testing.assert_close(matmul.matmul(x_t, w_t), F.linear(x_t, w_t), rtol=1e-5, atol=1e-5)
    assert matmul.matmul(x[:0], w_t).shape == (0, 33)
    torch.testing.assert_close(matmul.matmul(x[:1], w_t), F.linear(x[:1], w_t))
    with pytest.raises(ValueError):
        matmul.matmul(x, w_t[:, :60])


def test_matmul_config_never_names_rows() -> None:
    name = matmul.config_name(4096, 1024, torch.bfloat16)
    assert name == "triton-gemm bf16 128x128x64 w8 s3"
    assert matmul.config_for(32, 7, torch.bfloat16) == matmul.CONFIG[torch.bfloat16]
    assert {matmul.config_name(8, 8, d) for d in matmul.CONFIG} == {
        c.name for c in matmul.CONFIG.values()
    }
    with pytest.raises(ValueError):
        matmul.config_for(8, 8, torch.int32)


# ── rms_norm ──────────────────────────────────────────────────────────────────────────────────


def _qwen2_rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    # transformers' Qwen2RMSNorm.forward, line for line (the Llama family's order)
    input_dtype = x.dtype
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return weight * h.to(input_dtype)


def _gemma2_rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    # transformers' Gemma2RMSNorm.forward, line for line
    output = x.float()
    output = output * torch.rsqrt(output.pow(2).mean(-1, keepdim=True) + eps)
    output = output * (1.0 + weight.float())
    return output.type_as(x)


@pytest.mark.parametrize(
    ("dtype", "max_block"),  # max_block 32: several blocks, the last one partial
    [
        (torch.float32, None),
        (torch.float32, 32),
        (torch.float16, 32),
        (torch.bfloat16, None),
    ],
)
def test_rms_norm_matches_the_model_orders(
    device: str, dtype: torch.dtype, max_block: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    if max_block is not None:
        monkeypatch.setattr(rms_norm, "MAX_BLOCK", max_block)
    h = 100
    x = _randn(2, 9, h, device=device, dtype=dtype) * 3
    w = _randn(h, device=device, dtype=dtype, seed=1)
    ref_qwen, ref_gemma = _qwen2_rms_norm(x, w, 1e-6), _gemma2_rms_norm(x, w, 1e-6)
    if device == "cpu" and dtype == torch.bfloat16:
        # The interpreter has no bfloat16: float32 in, one cast out (the Llama order's inner
        # cast is skipped, hence the tolerance).
        x, w = x.float(), w.float()
        y_qwen = rms_norm.rms_norm(x, w, 1e-6).bfloat16()
        y_gemma = rms_norm.rms_norm(x, w, 1e-6, offset=1.0, cast_before_weight=False).bfloat16()
    else:
        y_qwen = rms_norm.rms_norm(x, w, 1e-6)
        y_gemma = rms_norm.rms_norm(x, w, 1e-6, offset=1.0, cast_before_weight=False)
    assert y_qwen.dtype == ref_qwen.dtype and y_gemma.dtype == ref_gemma.dtype
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else _bf16_tol()
    if dtype == torch.bfloat16:
        tol = {"rtol": 2**-6, "atol": 2**-6}  # two bf16 ulps: cast, then weight, then cast
    torch.testing.assert_close(y_qwen.float(), ref_qwen.float(), **tol)
    torch.testing.assert_close(y_gemma.float(), ref_gemma.float(), **tol)


def test_rms_norm_rows_invariant(device: str) -> None:
    dtype = torch.float16 if device == "cpu" else torch.bfloat16
    x = _randn(ROWS, 80, device=device, dtype=dtype)
    w = _randn(80, device=device, dtype=dtype, seed=1)
    assert_rows_invariant(lambda rows: rms_norm.rms_norm(rows, w, 1e-6), x)
    gemma = rms_norm.rms_norm(x[:17], w, 1e-6, offset=1.0, cast_before_weight=False)
    for i in (0, 16):
        one = rms_norm.rms_norm(x[i : i + 1], w, 1e-6, offset=1.0, cast_before_weight=False)
        assert torch.equal(one, gemma[i : i + 1])


def test_rms_norm_edges(device: str) -> None:
    x = _randn(5, 37, device=device)
    ref = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
    torch.testing.assert_close(rms_norm.rms_norm(x, None, 1e-5), ref, rtol=1e-5, atol=1e-5)
    w32 = _randn(37, device=device, seed=1)
    x16 = x.half()  # a float32 weight on half rows: the product promotes to float32
    y = rms_norm.rms_norm(x16, w32, 1e-5)
    assert y.dtype == torch.float32
    ref16 = (
        w32 * (x16.float() * torch.rsqrt(x16.float().pow(2).mean(-1, keepdim=True) + 1e-5)).half()
    )
    torch.testing.assert_close(y, ref16, rtol=1e-3, atol=1e-3)
    assert rms_norm.rms_norm(x[:0], w32, 1e-5).shape == (0, 37)
    w_view = torch.cat([w32[:1], w32])[1:]  # a weight that starts off a 16-byte boundary
    assert torch.equal(rms_norm.rms_norm(x16, w_view, 1e-5), y)
    x_t = _randn(37, 5, device=device, seed=2).t()  # rows with a stride ≠ 1 along H
    assert torch.equal(
        rms_norm.rms_norm(x_t, w32, 1e-5), rms_norm.rms_norm(x_t.contiguous(), w32, 1e-5)
    )
    if device == "cpu":
        with pytest.raises(ValueError, match="bfloat16"):
            rms_norm.rms_norm(x.bfloat16(), None, 1e-5)


# ── log_softmax / token_logprobs ──────────────────────────────────────────────────────────────


def _logits(rows: int, v: int, device: str, dtype: torch.dtype = torch.float32) -> Tensor:
    x = _randn(rows, v, device=device) * 4
    x[1, : v - 7] = float("-inf")  # a row masked but for its tail (top-k / top-p leave these)
    return x.to(dtype)


@pytest.mark.parametrize(
    ("dtype", "temperature", "max_block"),  # max_block 64: the running max/sum over 5 blocks
    [
        (torch.float32, 1.0, None),
        (torch.float32, 0.7, 64),
        (torch.bfloat16, 0.7, None),
        (torch.bfloat16, 1.0, 64),
    ],
)
def test_log_softmax_matches_torch(
    device: str,
    dtype: torch.dtype,
    temperature: float,
    max_block: int | None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if max_block is not None:
        monkeypatch.setattr(log_softmax, "MAX_BLOCK", max_block)
    x = _logits(6, 300, device, dtype)
    y = log_softmax.log_softmax(x, temperature)
    ref = torch.log_softmax(x.float() / temperature, -1)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    targets = torch.randint(0, 300, (6,), generator=torch.Generator().manual_seed(1)).to(device)
    targets[1] = 297  # unmasked in the masked row
    t = log_softmax.token_logprobs(x, targets, temperature)
    assert torch.equal(t, y.gather(1, targets[:, None])[:, 0])


def test_log_softmax_rows_invariant(device: str) -> None:
    x = _logits(ROWS, 70, device, torch.float32 if device == "cpu" else torch.bfloat16)
    assert_rows_invariant(lambda rows: log_softmax.log_softmax(rows, 0.7), x)
    targets = torch.arange(ROWS, device=device) % 70
    full = log_softmax.token_logprobs(x, targets, 0.7)
    for n in (1, 17):
        assert torch.equal(log_softmax.token_logprobs(x[:n], targets[:n], 0.7), full[:n])


def test_token_logprobs_backward(device: str) -> None:
    x = _logits(4, 50, device)
    x[1] = x[1].clamp(min=-30.0)  # finite: the reference's gradient has no -inf - -inf
    targets = torch.tensor([3, 49, 0, 7], device=device)
    g = _randn(4, device=device, seed=3)
    xk = x.clone().requires_grad_()
    log_softmax.token_logprobs(xk, targets, 0.7).backward(g)
    xr = x.clone().requires_grad_()
    torch.log_softmax(xr / 0.7, -1).gather(1, targets[:, None])[:, 0].backward(g)
    assert xk.grad is not None and xr.grad is not None
    torch.testing.assert_close(xk.grad, xr.grad, rtol=1e-5, atol=1e-6)


def test_token_logprobs_edges(device: str) -> None:
    x = _logits(3, 40, device)
    bad = log_softmax.token_logprobs(x, torch.tensor([-1, 40, 5], device=device))
    assert bad[:2].isnan().all() and bad[2].isfinite()
    xk = x.clone().requires_grad_()
    log_softmax.token_logprobs(xk, torch.tensor([-100, 3, 5], device=device)).sum().backward()
    assert xk.grad is not None and torch.equal(xk.grad[0], torch.zeros_like(xk.grad[0]))
    three_d = _randn(2, 3, 40, device=device)
    t3 = torch.zeros(2, 3, dtype=torch.long, device=device)
    assert log_softmax.token_logprobs(three_d, t3).shape == (2, 3)
    assert log_softmax.log_softmax(x[:0]).shape == (0, 40)
    with pytest.raises(ValueError):
        log_softmax.token_logprobs(x, torch.zeros(4, dtype=torch.long, device=device))
    with pytest.raises(ValueError):
        log_softmax.log_softmax(x, 0.0)


# ── row_sum / row_mean ────────────────────────────────────────────────────────────────────────


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_row_reduce_matches_torch(
    device: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(row_reduce, "MAX_BLOCK", 32)
    x = _randn(3, 5, 100, device=device, dtype=dtype)
    s, m = row_reduce.row_sum(x), row_reduce.row_mean(x)
    assert s.dtype == m.dtype == dtype and s.shape == m.shape == (3, 5)
    # fp32 accumulation, one cast: against a float64 reference cast like torch's
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype in (torch.float32, torch.float64) else _bf16_tol()
    torch.testing.assert_close(s, x.double().sum(-1).to(dtype), **tol)
    torch.testing.assert_close(m, x.double().mean(-1).to(dtype), **tol)
    torch.testing.assert_close(s.double(), x.sum(-1).double(), **tol)


def test_row_reduce_rows_invariant_and_edges(device: str) -> None:
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    x = _randn(ROWS, 70, device=device, dtype=dtype)
    assert_rows_invariant(row_reduce.row_mean, x)  # row_sum is the same kernel without ÷ H
    empty = _randn(4, 0, device=device)
    assert torch.equal(row_reduce.row_sum(empty), torch.zeros(4, device=device))
    assert row_reduce.row_mean(empty).isnan().all()
    assert row_reduce.row_sum(x[:0]).shape == (0,)
    with pytest.raises(ValueError):
        row_reduce.row_sum(torch.ones(3, 4, dtype=torch.long, device=device))


# ── row_cumsum ────────────────────────────────────────────────────────────────────────────────


@pytest.mark.parametrize("max_block", [None, 32])  # 32: the running total over several blocks
def test_row_cumsum_matches_torch(
    device: str, max_block: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    if max_block is not None:
        monkeypatch.setattr(row_cumsum, "MAX_BLOCK", max_block)
    probs = torch.softmax(_randn(2, 4, 150, device=device) * 3, -1).sort(-1, descending=True)[0]
    c = row_cumsum.row_cumsum(probs)
    assert c.dtype == torch.float32 and c.shape == probs.shape
    torch.testing.assert_close(c, probs.double().cumsum(-1).float(), rtol=1e-6, atol=1e-6)
    if max_block is not None:  # each block starts from the last value written before it
        after, last = c[..., max_block::max_block], c[..., max_block - 1 :: max_block]
        assert torch.equal(after, last[..., : after.shape[-1]] + probs[..., max_block::max_block])
    c16 = row_cumsum.row_cumsum(probs.bfloat16())  # any float dtype in, float32 out
    torch.testing.assert_close(c16, probs.bfloat16().float().cumsum(-1), rtol=1e-5, atol=1e-5)


def test_row_cumsum_rows_invariant_and_edges(device: str) -> None:
    x = torch.rand(ROWS, 70, generator=torch.Generator().manual_seed(0)).to(device)
    assert_rows_invariant(row_cumsum.row_cumsum, x)
    assert row_cumsum.row_cumsum(x[:0]).shape == (0, 70)
    assert row_cumsum.row_cumsum(x[:, :0]).shape == (ROWS, 0)
    one = torch.tensor([0.5, 0.25, 0.125], device=device)
    assert torch.equal(row_cumsum.row_cumsum(one), torch.tensor([0.5, 0.75, 0.875], device=device))


# ── compiled for a GPU, on any machine ────────────────────────────────────────────────────────

_COMPILE_FOR_SM90 = r"""
import json
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from oldlogit.parity.kernels.cuda import log_softmax, matmul, rms_norm, row_cumsum, row_reduce

def ptx(fn, sig, constexprs, num_warps, num_stages=3, aligned=()):
    names = list(sig)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
    options = {"num_warps": num_warps, "num_stages": num_stages}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]

facts = {}
for dtype, cfg in matmul.CONFIG.items():
    t = cfg.dtype
    sig = {n: f"*{t}" for n in ("x_ptr", "w_ptr", "b_ptr", "out_ptr")}
    sig |= {n: "i32" for n in ("M", "N", "K", "stride_xm", "stride_xk", "stride_wn",
                               "stride_wk", "stride_om", "stride_on", "NUM_PROGRAMS")}
    sig |= {n: "constexpr" for n in ("HAS_BIAS", "PRECISION", "BLOCK_M", "BLOCK_N", "BLOCK_K",
                                     "GROUP_M")}
    code = ptx(matmul._matmul_kernel, sig, {"HAS_BIAS": True,
               "PRECISION": matmul.dot_precision(dtype), "BLOCK_M": cfg.block_m,
               "BLOCK_N": cfg.block_n, "BLOCK_K": cfg.block_k, "GROUP_M": cfg.group_m},
               cfg.num_warps, cfg.num_stages, aligned=("x_ptr", "w_ptr", "out_ptr", "K"))
    facts[t] = {"wgmma": "wgmma" in code, "fma": "fma.rn.f32" in code}
sig = {"x_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "H": "i32", "eps": "fp32",
       "offset": "fp32", "HAS_WEIGHT": "constexpr", "CAST_BEFORE_WEIGHT": "constexpr",
       "OFFSET_IS_ZERO": "constexpr", "BLOCK": "constexpr"}
code = ptx(rms_norm._rms_norm_kernel, sig, {"HAS_WEIGHT": True, "CAST_BEFORE_WEIGHT": True,
           "OFFSET_IS_ZERO": True, "BLOCK": 1024}, 8)
facts["rms_norm"] = {"div.full": "div.full" in code, "cvt.rn.bf16": "cvt.rn.bf16.f32" in code}
sig = {"x_ptr": "*bf16", "targets_ptr": "*i64", "out_ptr": "*fp32", "lse_ptr": "*fp32",
       "V": "i32", "temperature": "fp32", "GATHER": "constexpr", "BLOCK": "constexpr"}
for gather in (True, False):
    code = ptx(log_softmax._log_softmax_kernel, sig, {"GATHER": gather, "BLOCK": 4096}, 8)
    facts[f"log_softmax gather={gather}"] = {"div.full": "div.full" in code}
sig = {"x_ptr": "*fp32", "out_ptr": "*fp32", "H": "i32", "MEAN": "constexpr",
       "FP64": "constexpr", "BLOCK": "constexpr"}
code = ptx(row_reduce._row_reduce_kernel, sig, {"MEAN": True, "FP64": False, "BLOCK": 1024}, 8)
facts["row_mean"] = {"div.full": "div.full" in code}
sig = {"x_ptr": "*fp32", "out_ptr": "*fp32", "V": "i32", "BLOCK": "constexpr"}
ptx(row_cumsum._row_cumsum_kernel, sig, {"BLOCK": 4096}, 8)
print(json.dumps(facts))
"""


@pytest.mark.slow
def test_kernels_compile_for_sm90() -> None:
    """Every kernel compiles to sm_90 PTX with the installed Triton (no GPU needed: its bundled
    ptxas), bf16/fp16 GEMMs on wgmma, the fp32 GEMM exact (FMA, no TF32), IEEE divisions."""
    import json
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run(
        [sys.executable, "-c", _COMPILE_FOR_SM90], env=env, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr[-3000:]
    facts = json.loads(run.stdout.strip().splitlines()[-1])
    assert facts["bf16"] == facts["fp16"] == {"wgmma": True, "fma": False}
    assert facts["fp32"] == {"wgmma": False, "fma": True}
    assert facts["rms_norm"] == {"div.full": False, "cvt.rn.bf16": True}
    for name in ("log_softmax gather=True", "log_softmax gather=False", "row_mean"):
        assert facts[name] == {"div.full": False}, name
