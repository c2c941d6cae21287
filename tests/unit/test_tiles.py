"""Fixed-shape tiles: a row's bits do not depend on the other rows (oldlogit.parity.tiles;
on CPU oldlogit.parity.kernels.cpu)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from oldlogit.parity import tiled_linear, tiled_mm
from oldlogit.parity.kernels.cpu import tile_strategy

# (K, N): a one-output projection (an MoE shared-expert gate), tiny, small, model-like. The
# second model-like size is `slow` here (~10 s on 2 cores, bf16 tiles run one by one); the
# default run has it in test_chunks_give_every_row_its_tiles_bits below.
SHAPES = [
    (32, 1),
    (8, 3),
    (64, 48),
    (256, 768),
    pytest.param(512, 1536, marks=pytest.mark.slow),
]
ROW_COUNTS = [1, 2, 7, 63, 64, 65, 130, 641]  # fewer rows than threads, one tile, many tiles


def _place(
    rows: torch.Tensor, target: int, count: int, at: int, seed: int
) -> tuple[torch.Tensor, int]:
    """``count`` rows holding row ``target`` at position ``at`` among random other rows."""
    gen = torch.Generator().manual_seed(seed)
    others = torch.randperm(rows.shape[0], generator=gen)
    others = others[others != target][: count - 1].tolist()
    at = min(at, len(others))
    order = [*others[:at], target, *others[at:]]
    return rows[order], at


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("k", "n"), SHAPES)
@pytest.mark.parametrize("tile_rows", [16, 64])
def test_a_row_gets_the_same_bits_whatever_else_is_tiled(dtype, k, n, tile_rows):
    gen = torch.Generator().manual_seed(k * n)
    weight = (torch.randn(n, k, generator=gen) * 0.05).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype)
    rows = torch.randn(700, k, generator=gen).to(dtype)
    alone = tiled_mm(rows[5:6], weight, tile_rows)  # [1, N]
    alone_b = tiled_mm(rows[5:6], weight, tile_rows, bias)
    for count in ROW_COUNTS:
        for at in (0, 3, tile_rows - 1, tile_rows + 2, count - 1):
            x, pos = _place(rows, 5, count, at, seed=count * 31 + at)
            assert torch.equal(tiled_mm(x, weight, tile_rows)[pos], alone[0]), (count, at)
            assert torch.equal(tiled_mm(x, weight, tile_rows, bias)[pos], alone_b[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiles_are_the_same_on_1_2_and_4_threads(dtype):
    """Measured on the CI machine kind: the tiled GEMMs do not depend on the thread count
    (the numerics still name the thread count: other CPUs and other ops may)."""
    gen = torch.Generator().manual_seed(1)
    weight = (torch.randn(1536, 512, generator=gen) * 0.05).to(dtype)
    x = torch.randn(300, 512, generator=gen).to(dtype)
    before = torch.get_num_threads()
    outs = []
    try:
        for threads in (1, 2, 4):
            torch.set_num_threads(threads)
            outs.append(tiled_mm(x, weight, 64))
            outs.append(tiled_mm(x[:3], weight, 64))  # fewer rows than threads
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(outs[0], o) for o in outs[0::2])
    assert all(torch.equal(outs[1], o) for o in outs[1::2])
    assert torch.equal(outs[1], outs[0][:3])


def test_strategy_depends_on_device_dtype_and_outputs_only():
    cpu = torch.device("cpu")
    assert tile_strategy(cpu, torch.float32) == "bmm"
    assert tile_strategy(cpu, torch.bfloat16) == "loop"
    assert tile_strategy(torch.device("cuda"), torch.float32) == "loop"
    # A batched matrix-vector product changes bits with the tile count (16 vs 17 rows).
    assert tile_strategy(cpu, torch.float32, 1) == "loop"


def test_tiled_linear_is_linear():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(3, 50, 64, generator=gen)
    w = torch.randn(32, 64, generator=gen)
    b = torch.randn(32, generator=gen)
    out = tiled_linear(x, w, b, tile_rows=16)
    assert out.shape == (3, 50, 32)
    torch.testing.assert_close(out, F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    assert tiled_linear(torch.empty(0, 64), w).shape == (0, 32)
    with pytest.raises(ValueError, match="tile_rows"):
        tiled_mm(x[0], w, 0)


def test_gradients_are_exact_in_float64():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 9, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(5, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    b = torch.randn(5, generator=gen, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w, b: tiled_linear(x, w, b, tile_rows=4), (x, w, b))


def test_input_gradient_rows_are_tiled_and_invariant():
    gen = torch.Generator().manual_seed(4)
    w = torch.randn(48, 64, generator=gen, requires_grad=True)
    x = torch.randn(130, 64, generator=gen)
    g = torch.randn(130, 48, generator=gen)

    def grad_x(rows: slice) -> torch.Tensor:
        xi = x[rows].clone().requires_grad_(True)
        tiled_linear(xi, w, tile_rows=64).backward(g[rows])
        assert xi.grad is not None
        return xi.grad

    full = grad_x(slice(0, 130))
    assert torch.equal(grad_x(slice(70, 71))[0], full[70])
    assert torch.equal(grad_x(slice(60, 75))[10], full[70])


class _Shapes(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.outputs: list[tuple[str, tuple[int, ...], int]] = []  # (op, shape, storage numel)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage().nbytes() // t.element_size()
                self.outputs.append((str(func), tuple(t.shape), storage))
        return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weight_gradient_is_one_gemm_without_per_tile_copies(dtype):
    """The backward never holds a per-tile weight gradient ([tiles, N, K]) nor a per-tile copy
    of the weight: the weight gradient is one [N, M] @ [M, K] GEMM."""
    n_out, k, rows, tile = 96, 80, 640, 64
    gen = torch.Generator().manual_seed(5)
    w = (torch.randn(n_out, k, generator=gen) * 0.1).to(dtype).requires_grad_(True)
    x = torch.randn(rows, k, generator=gen).to(dtype).requires_grad_(True)
    y = tiled_linear(x, w, tile_rows=tile)
    grad = torch.randn_like(y)
    with _Shapes() as rec:
        y.backward(grad)
    # Nothing holds tiles × N × K elements (a stride-0 view of the weight holds N × K).
    tiles = rows // tile
    assert not [o for o in rec.outputs if o[2] >= tiles * n_out * k], rec.outputs
    weight_sized = [o for o in rec.outputs if o[1] in {(n_out, k), (k, n_out)} and "mm" in o[0]]
    assert len(weight_sized) == 1, weight_sized
    assert w.grad is not None and x.grad is not None
    ref_w = w.detach().float().requires_grad_(True)
    ref_x = x.detach().float().requires_grad_(True)
    F.linear(ref_x, ref_w).backward(grad.float())
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(w.grad.float(), ref_w.grad, rtol=tol, atol=tol * 10)
    torch.testing.assert_close(x.grad.float(), ref_x.grad, rtol=tol, atol=tol * 10)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(
    ("k", "n", "bias"),
    [(512, 1536, False), (896, 128, True), (64, 8192, False), (256, 16, False), (16, 768, False)],
)
def test_chunks_give_every_row_its_tiles_bits(dtype, k, n, bias, monkeypatch):
    """The whole tiles of an input run up to CHUNK_ROWS rows per GEMM (THIN_CHUNK_ROWS for a
    thin one: a LoRA factor's rank-16 side) only where one such call was checked to reproduce
    its 64-row tiles; either way every row gets exactly the bits of the tile it falls in
    (computed here as the definition says: one 64-row call at a time, or for float32 one bmm
    over the tiles), whatever the row count."""
    from oldlogit.parity.kernels import cpu as kernels_cpu

    gen = torch.Generator().manual_seed(k + n)
    weight = (torch.randn(n, k, generator=gen) * 0.05).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    chunk = kernels_cpu.THIN_CHUNK_ROWS if min(k, n) <= kernels_cpu.THIN else kernels_cpu.CHUNK_ROWS
    x = torch.randn(chunk * 2 + 77, k, generator=gen).to(dtype)

    def reference(rows: torch.Tensor) -> torch.Tensor:
        padded = torch.zeros(-(-rows.shape[0] // 64) * 64, k, dtype=dtype)
        padded[: rows.shape[0]] = rows
        if dtype == torch.float32:  # one bmm over the tiles, never a batch of one (kernels/cpu.py)
            if padded.shape[0] == 64:
                padded = torch.cat([padded, torch.zeros_like(padded)])
            a = padded.view(-1, 64, k)
            w = weight.t().unsqueeze(0).expand(a.shape[0], k, n)
            out = torch.bmm(a, w) if b is None else torch.baddbmm(b.expand(*a.shape[:2], n), a, w)
            return out.reshape(-1, n)[: rows.shape[0]]
        parts = [
            (torch.addmm(b, t, weight.t()) if b is not None else t @ weight.t())
            for t in padded.split(64)
        ]
        return torch.cat(parts)[: rows.shape[0]]

    for m in (1, 64, 100, 128, 448, kernels_cpu.CHUNK_ROWS, chunk, chunk + 1, x.shape[0]):
        assert torch.equal(tiled_mm(x[:m], weight, 64, b), reference(x[:m])), m
    # The check says what this machine's kernels do (which shapes verify depends on the CPU's
    # kernels: a 896 -> 128 bf16 GEMM with a bias does on some Xeons and not on others): one
    # CHUNK_ROWS-row call gives its tiles' bits where the check passed (random rows may agree
    # where it did not: two orders can round alike at every bf16 output) ...
    rows = x[:chunk]
    whole = torch.addmm(b, rows, weight.t()) if b is not None else rows @ weight.t()
    # (float32 tiles are one bmm: the check compares against that)
    if dtype != torch.float32 and kernels_cpu.chunk_verified(weight, b, 64, chunk):
        assert torch.equal(whole, reference(rows))
    # ... and where a check fails, the tiles run one by one with the same bits.
    monkeypatch.setattr(kernels_cpu, "chunk_verified", lambda *a: False)
    assert torch.equal(tiled_mm(x, weight, 64, b), reference(x))


@pytest.mark.parametrize("threads", [1, 2])
def test_float32_rows_alone_equal_rows_among_many_at_a_real_width(threads):
    """A float32 row's bits at a real model width (K = 896) are the same alone (one tile), in
    one tile of many, and past a chunk, at one and two threads: a one-matrix bmm may be one
    GEMM spread over the threads (other bits on MKL with AVX-512), so the tiles never run as a
    batch of one."""
    from oldlogit.parity.kernels import cpu as kernels_cpu

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        gen = torch.Generator().manual_seed(896)
        weight = torch.randn(128, 896, generator=gen) * 0.05
        bias = torch.randn(128, generator=gen)
        x = torch.randn(kernels_cpu.CHUNK_ROWS + 100, 896, generator=gen)
        many = tiled_mm(x, weight, 64, bias)
        for m in (1, 7, 64, 65, 128, 200):
            assert torch.equal(tiled_mm(x[:m], weight, 64, bias), many[:m]), m
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("threads", [1, 2])
def test_bf16_rows_alone_equal_rows_among_many_where_sums_cancel(threads, monkeypatch):
    """Qwen2.5-0.5B's k_proj (896 → 128, bias, bf16): a sequence's 7 rows get the same bits
    alone (one 64-row tile) as at rows 2–8 of a 246-row batch (one 256-row GEMM where the chunk
    check passed), at 1 and 2 threads, on rows whose products cancel, where any two
    accumulation orders show. On an AMX Xeon the 256-row and 64-row GEMMs accumulate in other
    orders, yet a check on random rows passed against some weights (bf16 products are exact in
    float32 and the output's rounding hides the rest), so a packed batch differed from the
    sequence alone (a 24-layer self-check, engine.py ``self_check``). The weight here is ±1/32:
    random rows against it sum almost exactly, so a random-row check passes it; the check now
    also runs on cancelling operands (kernels/probes.py ``probe_cancelling``)."""
    from oldlogit.parity.kernels import cpu as kernels_cpu
    from oldlogit.parity.kernels.probes import Probe

    monkeypatch.setattr(kernels_cpu, "_chunks", Probe())  # this test's weight decides the check
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        n, k = 128, 896
        gen = torch.Generator().manual_seed(0)
        sign = torch.randint(0, 2, (n, k // 2), generator=gen) * 2 - 1
        perm = torch.randperm(k, generator=gen)
        first, second = perm[0::2], perm[1::2]
        weight = torch.empty(n, k)
        weight[:, first] = sign / 32.0
        weight[:, second] = sign / 32.0
        weight = weight.to(torch.bfloat16)
        bias = (torch.randint(-64, 65, (n,), generator=gen) / 2.0**16).to(torch.bfloat16)
        spread = torch.exp2(torch.randint(-6, 7, (246, k // 2), generator=gen).float())
        half = torch.randn(246, k // 2, generator=gen) * spread
        x = torch.empty(246, k)
        x[:, first] = half
        x[:, second] = -half
        x = x.to(torch.bfloat16)
        many = tiled_mm(x, weight, 64, bias)
        alone = tiled_mm(x[2:9], weight, 64, bias)
        assert torch.equal(many[2:9], alone)
        tiles = torch.cat(
            [torch.addmm(bias, t, weight.t()) for t in torch.cat([x, x.new_zeros(10, k)]).split(64)]
        )[:246]
        assert torch.equal(many, tiles)  # every row: the definition's 64-row tiles
    finally:
        torch.set_num_threads(before)
