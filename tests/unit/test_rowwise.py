"""The GPU reduction rule's mechanics, run on CPU: which calls it takes, and that the blocks and
verified chunks give every row what the plain call gives (on CPU a reduction over the last
dimension already computes each row alone, so the two must be bitwise equal). Its reason to
exist — CUDA's row-count-dependent launch configuration — is tested in test_parity_cuda.py."""

from __future__ import annotations

import pytest
import torch

from oldlogit.parity import rowwise


def _calls(x: torch.Tensor) -> list[tuple[object, tuple, dict]]:
    return [
        (torch.Tensor.mean, (x, -1), {"keepdim": True}),
        (torch.mean, (x,), {"dim": -1}),
        (torch.Tensor.sum, (x, [x.dim() - 1]), {}),
        (torch.sum, (x, -1), {"dtype": torch.float64}),
        (torch.Tensor.var, (x, -1), {"keepdim": True, "unbiased": False}),
        (torch.std, (x,), {"dim": -1, "correction": 0}),
        (torch.logsumexp, (x, -1), {}),
        (torch.Tensor.norm, (x, 2, -1, True), {}),
        (torch.linalg.vector_norm, (x,), {"ord": 2, "dim": -1}),
    ]


@pytest.mark.parametrize("rows", [1, 7, 63, 64, 65, 130, 1000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blocks_give_the_plain_calls_bits_on_cpu(rows: int, dtype: torch.dtype) -> None:
    x = torch.randn(2, rows, 96, generator=torch.Generator().manual_seed(rows)).to(dtype)
    for func, args, kwargs in _calls(x):
        got = rowwise.by_definition(func, args, dict(kwargs))
        want = func(*args, **kwargs)
        assert got is not None, func
        assert got.shape == want.shape and got.dtype == want.dtype, func
        assert torch.equal(got, want), (func, rows)


def test_other_reductions_are_left_alone() -> None:
    x = torch.randn(4, 5, 6)
    assert rowwise.by_definition(torch.sum, (x,), {}) is None  # the whole tensor
    assert rowwise.by_definition(torch.mean, (x, 1), {}) is None  # not the last dimension
    assert rowwise.by_definition(torch.sum, (x, (1, 2)), {}) is None
    assert rowwise.by_definition(torch.sum, (x[0, 0],), {"dim": -1}) is None  # one row
    assert rowwise.by_definition(torch.sum, (x, -1), {"out": torch.empty(4, 5)}) is None
    assert rowwise.last_dim_rows(torch.mean, (x, -1), {}) is None  # CPU: as it is


def test_a_chunk_that_does_not_verify_runs_its_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[int] = []
    x = torch.randn(700, 32)

    def counting(rows: torch.Tensor) -> torch.Tensor:
        seen.append(rows.shape[0])
        return rows.sum(-1)

    monkeypatch.setattr(rowwise, "_chunk_verified", lambda *a: False)
    out = rowwise._by_blocks(counting, x, ("k",))
    assert torch.equal(out, x.sum(-1))
    assert seen == [64] * 11  # 700 rows: 10 whole blocks, none merged, and the padded last
    seen.clear()
    monkeypatch.setattr(rowwise, "_chunk_verified", lambda *a: True)
    assert torch.equal(rowwise._by_blocks(counting, x, ("k",)), x.sum(-1))
    assert seen == [640, 64]  # one call for the whole blocks, one for the padded last


def test_the_definition_has_the_plain_calls_gradient() -> None:
    """A trainer's backward runs through the blocks (padding rows take no gradient)."""
    x = torch.randn(3, 70, 48, requires_grad=True)
    out = rowwise.by_definition(torch.Tensor.var, (x, -1), {"keepdim": True, "correction": 0})
    assert out is not None
    (grad,) = torch.autograd.grad(out.square().sum(), x)
    y = x.detach().requires_grad_()
    (want,) = torch.autograd.grad(y.var(-1, keepdim=True, correction=0).square().sum(), y)
    assert torch.equal(grad, want)
