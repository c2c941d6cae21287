"""The CUDA definition's GEMM choice as pure logic, on CPU: fake GEMMs whose rows do or do not
depend on the row count decide "cublaslt" or "triton"; the key, the probe's seeding and the
cache (client/oldlogit/parity/kernels/cuda/gemm_choice.py)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import Tensor

from oldlogit.parity.kernels.cuda import gemm_choice
from oldlogit.parity.kernels.cuda.gemm_choice import (
    LADDER,
    M_MAX,
    GemmKey,
    choose,
    decided,
    pinned_cublaslt,
    probe,
    seed_of,
)

SMALL = (1, 2, 3, 7, 8, 15, 16, 17, 31, 32, 33, 64)  # the ladder's shape, at test sizes

KEY = GemmKey(
    n=24,
    k=40,
    dtype="float32",
    bias=True,
    transposed=False,
    device="Fake GPU sm_90",
    torch="2.13.0",
    blas="cublasLt=130000",
    triton="3.7.1",
)


@pytest.fixture(autouse=True)
def _fresh_cache() -> Iterator[None]:
    saved = dict(gemm_choice._decided)
    gemm_choice._decided.clear()
    yield
    gemm_choice._decided.clear()
    gemm_choice._decided.update(saved)


class Recording:
    """A GEMM computed in float64 and rounded (rows independent), made to change the rows'
    bits for row counts in ``bad``; records every call's operands."""

    def __init__(self, bad: range = range(0)) -> None:
        self.bad = bad
        self.calls: list[tuple[Tensor, Tensor, Tensor | None]] = []

    def __call__(self, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        self.calls.append((x.clone(), weight.clone(), None if bias is None else bias.clone()))
        y = x.double() @ weight.double().t()
        if bias is not None:
            y = y + bias.double()
        out = y.to(x.dtype)
        if x.shape[0] in self.bad:  # a split-K-like kernel for this bucket: last bits differ
            out = torch.nextafter(out, torch.full_like(out, float("inf")))
        return out


def test_ladder_covers_each_power_of_two_and_neighbours() -> None:
    assert M_MAX == max(LADDER) == 8192 and list(LADDER) == sorted(set(LADDER))
    assert {1, 2, 3, 4} <= set(LADDER)  # the GEMV and smallest-M kernels
    for p in range(3, 14):
        assert 2**p in LADDER and 2**p - 1 in LADDER
        assert 2**p + 1 in LADDER or 2**p == M_MAX


def test_row_invariant_gemm_is_cublaslt_and_probed_once() -> None:
    gemm = Recording()
    assert probe(KEY, gemm, "cpu", SMALL) is None
    gemm = Recording()
    assert choose(KEY, gemm, "cpu", SMALL) == "cublaslt"
    # one M_max call, then each rung alone; on random operands, then on cancelling ones
    assert len(gemm.calls) == 2 * (1 + len(SMALL))
    assert choose(KEY, gemm, "cpu", SMALL) == "cublaslt"
    assert len(gemm.calls) == 2 * (1 + len(SMALL))  # cached on the key
    assert decided() == {"24x40 float32 +bias on Fake GPU sm_90": "cublaslt"}


def test_a_bucket_whose_rows_change_makes_it_triton() -> None:
    gemm = Recording(bad=range(17, 32))
    assert probe(KEY, gemm, "cpu", SMALL) == 17
    assert choose(KEY, Recording(bad=range(17, 32)), "cpu", SMALL) == "triton"
    # Only the M_max call differing (every smaller rung agrees with each other) counts too.
    other = dataclasses.replace(KEY, n=25)
    assert choose(other, Recording(bad=range(64, 65)), "cpu", SMALL) == "triton"


def test_rows_that_differ_only_where_sums_cancel_make_it_triton() -> None:
    """A kernel whose other order shows only where partial sums cancel (random bf16 rows can
    agree at every rounded output) is caught by the probe's cancelling operands."""

    def only_where_sums_cancel(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        exact = x.double() @ weight.double().t()
        out = (exact if bias is None else exact + bias.double()).to(x.dtype)
        values = x.sort(dim=1).values  # a cancelling row holds each value and its negation
        cancelling = torch.equal(values, (-values).flip(1))
        if x.shape[0] in range(17, 32) and cancelling:
            out = torch.nextafter(out, torch.full_like(out, float("inf")))
        return out

    assert probe(KEY, only_where_sums_cancel, "cpu", SMALL) == 17
    assert choose(KEY, only_where_sums_cancel, "cpu", SMALL) == "triton"


def test_the_probe_is_seeded_from_the_key_alone() -> None:
    first = Recording()
    probe(KEY, first, "cpu", SMALL)
    # Another key's probe in between (the process's history) changes nothing.
    probe(dataclasses.replace(KEY, k=41, bias=False), Recording(), "cpu", SMALL)
    torch.manual_seed(1234)  # nor does the global generator
    again = Recording()
    probe(KEY, again, "cpu", SMALL)
    for (x1, w1, b1), (x2, w2, b2) in zip(first.calls, again.calls, strict=True):
        assert torch.equal(x1, x2) and torch.equal(w1, w2)
        assert b1 is not None and b2 is not None and torch.equal(b1, b2)
    x, w, b = first.calls[0]
    assert x.shape == (64, 40) and w.shape == (24, 40) and b is not None and b.shape == (24,)
    assert w.is_contiguous()
    # The seed is a function of every field of the key.
    changed: dict[str, Any] = {
        "n": 25,
        "k": 41,
        "dtype": "bfloat16",
        "bias": False,
        "transposed": True,
        "device": "Other GPU sm_80",
        "torch": "2.11.0",
        "blas": "cublasLt=120000",
        "triton": "3.6.0",
    }
    assert set(changed) == {f.name for f in dataclasses.fields(GemmKey)}
    seeds = {seed_of(KEY)} | {
        seed_of(dataclasses.replace(KEY, **{name: value})) for name, value in changed.items()
    }
    assert len(seeds) == 1 + len(changed)
    assert seed_of(KEY) == seed_of(dataclasses.replace(KEY))  # equal keys, equal seeds


def test_a_transposed_key_probes_the_transposed_layout() -> None:
    gemm = Recording()
    key = dataclasses.replace(KEY, transposed=True, bias=False, dtype="bfloat16")
    probe(key, gemm, "cpu", SMALL)
    x, w, b = gemm.calls[0]
    assert x.dtype == w.dtype == torch.bfloat16 and b is None
    assert w.shape == (24, 40)  # the recorded clone is contiguous; the operand was a view
    seen: list[bool] = []

    def layout(x: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
        seen.append(w.is_contiguous())
        return x @ w.t()

    probe(key, layout, "cpu", SMALL)
    assert seen and not any(seen)


def test_pinned_settings_turn_reduced_precision_and_split_k_off_and_give_them_back() -> None:
    matmul = torch.backends.cuda.matmul
    was = matmul.allow_bf16_reduced_precision_reduction
    matmul.allow_bf16_reduced_precision_reduction = (True, True)
    try:
        with pinned_cublaslt():
            assert not matmul.allow_bf16_reduced_precision_reduction
            assert not matmul.allow_bf16_reduced_precision_reduction_split_k
            assert not matmul.allow_fp16_reduced_precision_reduction_split_k
        assert matmul.allow_bf16_reduced_precision_reduction
        assert matmul.allow_bf16_reduced_precision_reduction_split_k
    finally:
        matmul.allow_bf16_reduced_precision_reduction = was


def test_a_nested_pinned_block_reads_nothing_and_the_outer_one_gives_the_settings_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A GEMM inside the forward's pinned block pays no settings reads; the block that set
    the settings is the one that restores them, whatever was nested in it."""
    matmul = torch.backends.cuda.matmul
    reads = {"n": 0}
    pins = gemm_choice._pins()

    def counted() -> tuple:
        out = []
        for read, write, want in pins:

            def counting(read=read):
                reads["n"] += 1
                return read()

            out.append((counting, write, want))
        return tuple(out)

    monkeypatch.setattr(gemm_choice, "_pins", counted)
    was = matmul.allow_bf16_reduced_precision_reduction
    matmul.allow_bf16_reduced_precision_reduction = (True, True)
    try:
        with pinned_cublaslt():
            outer = reads["n"]
            assert outer == len(pins)
            for _ in range(3):
                with pinned_cublaslt():
                    assert not matmul.allow_bf16_reduced_precision_reduction
            assert reads["n"] == outer  # the nested blocks read nothing
            assert not matmul.allow_bf16_reduced_precision_reduction_split_k
        assert matmul.allow_bf16_reduced_precision_reduction
        assert matmul.allow_bf16_reduced_precision_reduction_split_k
        assert gemm_choice._pinned_depth == 0
        with pytest.raises(RuntimeError), pinned_cublaslt():  # an error inside: still undone
            raise RuntimeError("boom")
        assert gemm_choice._pinned_depth == 0
        assert matmul.allow_bf16_reduced_precision_reduction_split_k
    finally:
        matmul.allow_bf16_reduced_precision_reduction = was


def test_the_choice_off_cuda_is_triton_and_the_spec_names_the_kernel_set() -> None:
    from oldlogit.parity.kernels import CPU_KERNELS, forced_cuda, kernel_set

    w = torch.zeros(3, 4)
    assert gemm_choice.choice_for(w, None) == "triton"
    assert not gemm_choice._decided  # nothing probed off CUDA
    assert kernel_set("cpu") == CPU_KERNELS
    with forced_cuda():
        name = kernel_set("cpu")
    assert name.startswith("cuda/one-gemm(cublaslt no-split-k ws=")
    assert "else triton" in name and "/triton-rows/" in name


def test_the_spec_compares_and_carries_the_kernel_set() -> None:
    from oldlogit.contract.convert import from_proto, info_to_proto
    from oldlogit.contract.numerics import NumericsSpec
    from oldlogit.contract.types import Info

    cuda = "cuda/one-gemm(cublaslt no-split-k ws=default ...)/triton-rows/cublasLt=1/triton=3.7.1"
    here = NumericsSpec("invariant", "bfloat16", "cuda", 64, 0, False, kernels=cuda)
    assert f"/kernels={cuda}" in here.key
    other = dataclasses.replace(here, kernels=cuda.replace("triton=3.7.1", "triton=3.6.0"))
    (line,) = here.mismatches(other)
    assert line.startswith(f"kernels: {cuda} here, ")
    assert here.mismatches(dataclasses.replace(here, kernels="")) == []  # an older service
    choices = {"1536x8960 bfloat16 on NVIDIA H100 sm_90": "triton"}
    info = Info(
        model_type="qwen2",
        architecture="Qwen2ForCausalLM",
        vocab_size=64,
        max_positions=128,
        num_parameters=1,
        dtype="bfloat16",
        head_dtype="bfloat16",
        device="cuda:0",
        mode="deterministic",
        numerics="invariant",
        tile_rows=64,
        kernels=cuda,
        gemm_choices=choices,
    )
    back = from_proto(info_to_proto(info), Info)
    assert back.kernels == cuda and back.gemm_choices == choices
    assert back.numerics_spec().kernels == cuda


def test_the_settings_stay_pinned_until_the_last_open_block_closes_in_any_thread() -> None:
    """A forward's block and a backward's block in another thread overlap: the first to close
    does not unpin the settings under the other; the last one gives them back."""
    import threading

    matmul = torch.backends.cuda.matmul
    was = matmul.allow_bf16_reduced_precision_reduction
    matmul.allow_bf16_reduced_precision_reduction = (True, True)
    entered, release, done = threading.Event(), threading.Event(), threading.Event()
    seen: list[bool] = []

    def other() -> None:
        with pinned_cublaslt():
            entered.set()
            release.wait(10)
            seen.append(bool(matmul.allow_bf16_reduced_precision_reduction_split_k))
        done.set()

    try:
        outer = pinned_cublaslt()
        outer.__enter__()
        t = threading.Thread(target=other)
        t.start()
        assert entered.wait(10)
        outer.__exit__(None, None, None)  # the first block closes while the other is open
        assert not matmul.allow_bf16_reduced_precision_reduction_split_k  # still pinned
        release.set()
        assert done.wait(10)
        t.join(10)
        assert seen == [False]
        assert matmul.allow_bf16_reduced_precision_reduction_split_k  # given back at the end
        assert gemm_choice._pinned_depth == 0
    finally:
        matmul.allow_bf16_reduced_precision_reduction = was
