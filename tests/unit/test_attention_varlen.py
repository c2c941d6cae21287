"""The CUDA attention route: one varlen call per layer over all packed sequences.

On CPU: the token-major plan and its round trip (per-sequence SDPA through it gives the CPU
path's bits), the route choice as pure logic, and torch's varlen ops taking our arguments on
meta tensors. On CUDA (``gpu``): a sequence's bits alone and packed, its gradient, one call a layer.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np
import pytest
import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode

from oldlogit.parity import attention as attention_module
from oldlogit.parity.attention import SEGMENTS_KWARG, plan_segments
from oldlogit.parity.kernels.cuda.varlen_attention import (
    EAGER,
    EFFICIENT,
    FLASH,
    SDPA,
    OpSupport,
    Route,
    choose_route,
    pack_rows,
    unpack_rows,
)

FLASH_OP = torch.ops.aten._flash_attention_forward.default
EFFICIENT_OP = torch.ops.aten._efficient_attention_forward.default
ALL_OPS = OpSupport(flash=True, flash_window=True, flash_num_splits=True, efficient=True)


class _Layer(nn.Module):
    is_causal = True
    layer_idx = 0


def _sequences(
    lengths: list[int], heads: int, kv_heads: int, dim: int, dtype: torch.dtype, seed: int = 0
) -> list[tuple[Tensor, Tensor, Tensor]]:
    """Per sequence (q [H, L, D], k [Hkv, L, D], v [Hkv, L, D]), seeded."""
    gen = torch.Generator().manual_seed(seed)
    return [
        tuple(torch.randn(h, n, dim, generator=gen).to(dtype) for h in (heads, kv_heads, kv_heads))  # type: ignore[misc]
        for n in lengths
    ]


def _batch(
    seqs: list[tuple[Tensor, Tensor, Tensor]], layout: str
) -> tuple[list[Tensor], Tensor, Tensor | None, list[tuple[int, int]]]:
    """q/k/v [B, H(kv), T, D] holding ``seqs`` right- or left-padded (one a row) or packed (two
    rows, positions restarting at 0 per sequence), the [B, T] mask, the position ids (packed
    only) and where each sequence sits (batch row, start)."""
    lengths = [q.shape[1] for q, _, _ in seqs]
    if layout == "packed":
        rows: list[list[int]] = [[], []]
        for i in range(len(lengths)):
            rows[i % 2].append(i)
        width = max(sum(lengths[i] for i in r) for r in rows) + 3  # some padding at the end
        batch = 2
    else:
        rows = [[i] for i in range(len(seqs))]
        width, batch = max(lengths) + 2, len(seqs)
    out = [t.new_zeros(batch, t.shape[0], width, t.shape[2]) for t in seqs[0]]
    mask = torch.zeros(batch, width, dtype=torch.int64)
    positions = torch.zeros(batch, width, dtype=torch.int64)
    where: list[tuple[int, int]] = [(0, 0)] * len(seqs)
    for b, members in enumerate(rows):
        start = width - lengths[members[0]] if layout == "left" else 0
        for i in members:
            n = lengths[i]
            for dst, src in zip(out, seqs[i], strict=True):
                dst[b, :, start : start + n] = src
            mask[b, start : start + n] = 1
            positions[b, start : start + n] = torch.arange(n)
            where[i] = (b, start)
            start += n
    return out, mask, positions if layout == "packed" else None, where


def _params(window: int | None, dim: int) -> dict[str, Any]:
    return {"scaling": dim**-0.5, "sliding_window": window, "softcap": None, "dropout": 0.0}


def _attend(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    segments: Any,
    window: int | None,
    layer: int = 0,
    softcap: float | None = None,
) -> Tensor:
    """The invariant attention's call as HF makes it → [B, T, H, Dv]."""
    kwargs: dict[str, Any] = {SEGMENTS_KWARG: segments, "sliding_window": window}
    if softcap is not None:
        kwargs["softcap"] = softcap
    module = _Layer()
    module.layer_idx = layer
    with torch._C.DisableTorchFunction():
        out, _ = attention_module._attention(module, q, k, v, None, 0.0, kwargs)
    return out


CASES = [
    ("right", 4, 4, None),
    ("left", 4, 4, None),
    ("packed", 4, 4, None),
    ("packed", 8, 2, None),  # grouped-query heads
    ("left", 8, 2, 5),  # a window narrower than most sequences
    ("packed", 4, 4, 5),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("layout", "heads", "kv_heads", "window"), CASES)
def test_per_sequence_attention_through_the_varlen_plan_gives_the_cpu_paths_bits(
    layout, heads, kv_heads, window, dtype
):
    seqs = _sequences([7, 3, 7, 12, 1, 9], heads, kv_heads, 16, dtype)
    (q, k, v), mask, positions, _ = _batch(seqs, layout)
    segments, _ = plan_segments(q.shape[0], q.shape[2], mask, positions)
    cpu_path = _attend(q, k, v, segments, window)
    plan = segments.varlen(q.device)
    assert plan.lengths == (7, 3, 7, 12, 1, 9) or layout == "packed"
    assert sorted(plan.lengths) == [1, 3, 7, 7, 9, 12]
    call = attention_module._per_sequence_varlen(_params(window, 16))
    with torch._C.DisableTorchFunction():
        through_plan = attention_module._varlen_attention(q, k, v, plan, call)
    assert torch.equal(through_plan, cpu_path)


def test_the_plan_marks_each_sequence_and_round_trips():
    seqs = _sequences([5, 2, 4], 2, 2, 8, torch.float32)
    (q, _, _), mask, positions, where = _batch(seqs, "packed")
    segments, _ = plan_segments(q.shape[0], q.shape[2], mask, positions)
    plan = segments.varlen(q.device)
    assert plan.cu_seqlens.dtype == torch.int32
    assert plan.cu_seqlens.tolist() == [0, 5, 9, 11]  # row 0: sequences 0, 2; row 1: sequence 1
    assert (plan.max_len, plan.total) == (5, 11)
    assert segments.varlen(q.device) is plan  # once per forward
    rows = pack_rows(q, plan)
    assert rows.shape == (11, 2, 8) and rows.is_contiguous()
    b, s = where[2]
    assert torch.equal(rows[5:9], q[b, :, s : s + 4].transpose(0, 1))
    back = unpack_rows(rows, plan)
    assert torch.equal(back, q.transpose(1, 2) * mask[:, :, None, None])
    whole, _ = plan_segments(3, 6, None, None)  # every row one whole sequence: no index
    assert whole.varlen(q.device).index is None


def _route(**over: Any) -> Route:
    args: dict[str, Any] = {
        "device_type": "cuda",
        "dtype": torch.bfloat16,
        "softcap": None,
        "dropout": 0.0,
        "window": None,
        "head_dim": 128,
        "v_dim": 128,
        "support": ALL_OPS,
    }
    args.update(over)
    return choose_route(**args)


def test_the_route_is_chosen_from_device_dtype_and_settings():
    assert _route(device_type="cpu") == Route(SDPA)  # the CPU path and its bits, unchanged
    assert _route(device_type="cpu", softcap=50.0).kernel == EAGER
    assert _route() == Route(FLASH)
    assert _route(dtype=torch.float16, window=4096) == Route(FLASH)
    assert _route(dtype=torch.float32).kernel == EFFICIENT
    assert "float32: FlashAttention-2 takes fp16/bf16" in _route(dtype=torch.float32).why
    capped = _route(softcap=50.0)
    assert capped.kernel == EAGER and "attn_logit_softcapping=50.0" in capped.why
    assert _route(dropout=0.1).kernel == EAGER
    wide = _route(head_dim=320, v_dim=320)
    assert wide.kernel == EFFICIENT and "head_dim 320" in wide.why
    latent = _route(head_dim=192, v_dim=128)  # multi-head latent attention
    assert latent.kernel == EFFICIENT and "value head_dim 128" in latent.why
    odd = _route(head_dim=12, v_dim=12)
    assert odd.kernel == SDPA and "head_dim 12" in odd.why and "multiples of 8" in odd.why
    fp32_window = _route(dtype=torch.float32, window=4096)
    assert fp32_window.kernel == SDPA and "sliding_window=4096" in fp32_window.why
    old = _route(support=OpSupport(efficient=True, torch_version="2.1"))
    assert old.kernel == EFFICIENT and "this torch (2.1)" in old.why
    no_window = _route(window=64, support=OpSupport(flash=True, efficient=True))
    assert no_window.kernel == SDPA and "sliding_window=64" in no_window.why
    assert _route(support=OpSupport()).kernel == SDPA
    assert attention_module.route_name(Route(FLASH)) == "oldlogit_invariant/varlen-flash"


class _Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[Any] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.calls[func] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(("route", "dtype"), [(FLASH, torch.bfloat16), (EFFICIENT, torch.float32)])
def test_torchs_varlen_op_takes_the_call_on_meta_tensors_with_a_backward(route, dtype):
    """The arguments this torch's op schema and meta function accept (shapes, GQA, a window),
    once per layer, and an autograd graph: the plumbing a GPU run will take, not its bits."""
    seqs = _sequences([7, 3, 12], 8, 2, 64, dtype)
    (q, k, v), mask, positions, _ = _batch(seqs, "packed")
    segments, _ = plan_segments(q.shape[0], q.shape[2], mask, positions)
    q, k, v = (t.to("meta").requires_grad_() for t in (q, k, v))
    plan = segments.varlen(torch.device("meta"))
    params = _params(5 if route == FLASH else None, 64)
    call = attention_module._varlen_call(Route(route), params, ALL_OPS)
    with _Count() as count, torch._C.DisableTorchFunction():
        out = attention_module._varlen_attention(q, k, v, plan, call)
    assert out.shape == (q.shape[0], q.shape[2], 8, 64)
    assert count.calls[FLASH_OP if route == FLASH else EFFICIENT_OP] == 1
    assert out.grad_fn is not None  # torch's backward formula for the op (a GPU runs it)


# ---- on a GPU -------------------------------------------------------------------------------

gpu = pytest.mark.gpu  # skipped without CUDA (tests/conftest.py)


def _alone_and_packed(
    dtype: torch.dtype, heads: int, kv_heads: int, window: int | None, others: int, layout: str
) -> tuple[Tensor, Tensor]:
    """Sequence 0's attention rows alone and in a batch with ``others`` sequences of mixed
    lengths, on CUDA."""
    rng = np.random.default_rng(others)
    lengths = [37] + [int(x) for x in rng.integers(1, 90, size=others)]
    seqs = [tuple(t.cuda() for t in s) for s in _sequences(lengths, heads, kv_heads, 64, dtype)]
    q0, k0, v0 = (t[None] for t in seqs[0])
    alone = _attend(q0, k0, v0, plan_segments(1, 37, None, None)[0], window)[0]
    (q, k, v), mask, positions, where = _batch(seqs, layout)  # type: ignore[arg-type]
    segments, _ = plan_segments(q.shape[0], q.shape[2], mask, positions)
    out = _attend(q, k, v, segments, window)
    b, s = where[0]
    return alone, out[b, s : s + 37]


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("others", [1, 3, 7])
@pytest.mark.parametrize("layout", ["right", "left", "packed"])
@pytest.mark.parametrize(("heads", "kv_heads", "window"), [(8, 8, None), (8, 2, None), (8, 8, 16)])
def test_a_sequence_alone_and_packed_has_the_same_bits_on_cuda(
    dtype, others, layout, heads, kv_heads, window
):
    alone, packed = _alone_and_packed(dtype, heads, kv_heads, window, others, layout)
    assert torch.equal(alone, packed)


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("window", [None, 16, 40])  # 40: wider than sequence 0, not the batch
def test_the_varlen_route_computes_attention(dtype, window):
    """Against float64 math: the window's edge (keys i - j < W) and the causal mask hold."""
    seqs = [tuple(t.cuda() for t in s) for s in _sequences([37, 80], 8, 2, 64, dtype)]
    (q, k, v), mask, positions, where = _batch(seqs, "packed")  # type: ignore[arg-type]
    segments, _ = plan_segments(q.shape[0], q.shape[2], mask, positions)
    out = _attend(q, k, v, segments, window)
    for i, (sq, sk, sv) in enumerate(seqs):
        n = sq.shape[1]
        i_, j_ = torch.arange(n)[:, None], torch.arange(n)[None, :]
        allowed = (j_ <= i_) & ((i_ - j_ < window) if window else True)
        kk, vv = (t.double().repeat_interleave(4, dim=0) for t in (sk, sv))
        scores = (sq.double() @ kk.transpose(1, 2)) * 64**-0.5
        scores = scores.masked_fill(~allowed.cuda(), float("-inf"))
        ref = (scores.softmax(-1) @ vv).transpose(0, 1)  # [L, H, D]
        b, s = where[i]
        tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
        torch.testing.assert_close(out[b, s : s + n].double(), ref, atol=tol, rtol=tol)


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_route_on_cuda_is_one_varlen_call(dtype):
    route = attention_module.layer_route(torch.device("cuda"), dtype, _params(None, 64), 64, 64)
    assert route.kernel == (FLASH if dtype == torch.bfloat16 else EFFICIENT), route.why
    seqs = [tuple(t.cuda() for t in s) for s in _sequences([37, 5, 80, 12], 8, 2, 64, dtype)]
    (q, k, v), mask, positions, _ = _batch(seqs, "packed")  # type: ignore[arg-type]
    segments, _ = plan_segments(q.shape[0], q.shape[2], mask, positions)
    with _Count() as count:
        _attend(q, k, v, segments, None)
    attention_calls = {f: n for f, n in count.calls.items() if "attention" in str(f)}
    assert attention_calls == {FLASH_OP if dtype == torch.bfloat16 else EFFICIENT_OP: 1}


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_models_forward_is_one_attention_call_a_layer(dtype):
    from oldlogit.parity import token_logprobs, trainer_numerics
    from tests.architectures import VOCAB
    from tests.unit.test_parity_invariance import _model, _padded

    model = _model("qwen2", dtype, seed=1).cuda()
    layers = model.config.num_hidden_layers
    rng = np.random.default_rng(0)
    seqs = [torch.from_numpy(rng.integers(0, VOCAB, size=n)) for n in (9, 31, 17)]
    ids, mask = _padded(seqs, "left")
    with trainer_numerics(model), _Count() as count:
        token_logprobs(model, ids.cuda(), mask.cuda(), temperature=0.7)
    op = FLASH_OP if dtype == torch.bfloat16 else EFFICIENT_OP
    assert count.calls[op] == layers
    assert not any("scaled_dot_product" in str(f) for f in count.calls)


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kv_heads", [8, 2])
def test_the_backward_runs_and_a_sequences_gradient_alone_and_packed(dtype, kv_heads):
    """The backward is torch's formula for each op. FlashAttention-2's gives a sequence's dK
    and dV from its own key blocks' loops (asserted bitwise in bf16 without grouped heads);
    it adds dQ across key blocks atomically, and grouped heads' dK/dV are summed by a CUDA
    reduction, and the memory-efficient kernel may split keys by the batch's shape: those
    are reported (xfail) where they differ, not promised (docs/exactness.md)."""
    seqs = [tuple(t.cuda() for t in s) for s in _sequences([37, 64, 9, 80], 8, kv_heads, 64, dtype)]
    grads_out = torch.randn(37, 8, 64, generator=torch.Generator().manual_seed(3)).to(dtype)

    def grads(batch: list[tuple[Tensor, ...]], layout: str) -> list[Tensor]:
        leaves = [tuple(t.clone().requires_grad_() for t in s) for s in batch]
        (q, k, v), mask, positions, where = _batch(leaves, layout)  # type: ignore[arg-type]
        segments, _ = plan_segments(q.shape[0], q.shape[2], mask, positions)
        out = _attend(q, k, v, segments, None)
        b, s = where[0]
        out[b, s : s + 37].backward(grads_out.cuda())
        return [t.grad for t in leaves[0]]  # type: ignore[misc]

    alone = grads(seqs[:1], "right")
    packed = grads(seqs, "packed")
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    for a, p in zip(alone, packed, strict=True):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(p, a, atol=tol, rtol=tol)
    if dtype == torch.bfloat16 and kv_heads == 8:
        assert torch.equal(alone[1], packed[1]) and torch.equal(alone[2], packed[2])  # dK, dV
    differ = [n for n, a, p in zip("qkv", alone, packed, strict=True) if not torch.equal(a, p)]
    if differ:
        pytest.xfail(f"d{', d'.join(differ)} differ alone vs packed (gradients not promised)")


def test_each_layers_route_is_recorded_by_name():
    from oldlogit.parity.attention import recording_routes

    q, k, v = (t[None] for t in _sequences([7], 4, 2, 16, torch.float32)[0])
    segments, _ = plan_segments(1, 7, None, None)
    with recording_routes() as routes:
        _attend(q, k, v, segments, None)
        _attend(q, k, v, segments, None, layer=1, softcap=30.0)
    assert routes == {0: "oldlogit_invariant/sdpa", 1: "oldlogit_invariant/eager"}


def test_the_varlen_branch_in_a_models_forward_gives_the_cpu_paths_bits(monkeypatch):
    """The varlen route's place in the invariant attention, through a model with grouped-query
    heads and left padding, with the per-sequence stand-in for the GPU kernel."""
    from oldlogit.parity import token_logprobs, trainer_numerics
    from oldlogit.parity.attention import recording_routes
    from tests.architectures import VOCAB
    from tests.unit.test_parity_invariance import _model, _padded

    model = _model("qwen2", torch.float32)
    rng = np.random.default_rng(0)
    seqs = [torch.from_numpy(rng.integers(0, VOCAB, size=n)) for n in (9, 4, 13)]
    ids, mask = _padded(seqs, "left")
    with trainer_numerics(model), torch.no_grad():
        expected = token_logprobs(model, ids, mask, temperature=0.7)
    monkeypatch.setattr(attention_module, "layer_route", lambda *args: Route(FLASH))
    monkeypatch.setattr(
        attention_module,
        "_varlen_call",
        lambda route, params, support: attention_module._per_sequence_varlen(params),
    )
    # (on CPU the route is looked up only while it is recorded)
    with trainer_numerics(model), torch.no_grad(), recording_routes() as routes:
        got = token_logprobs(model, ids, mask, temperature=0.7)
    assert routes == {0: "oldlogit_invariant/varlen-flash", 1: "oldlogit_invariant/varlen-flash"}
    assert torch.equal(got, expected)


def test_the_gradient_through_the_varlen_plan_is_the_cpu_paths():
    seqs = _sequences([7, 3, 12, 1], 4, 2, 16, torch.float32)
    (q, k, v), mask, positions, _ = _batch(seqs, "packed")
    segments, _ = plan_segments(q.shape[0], q.shape[2], mask, positions)
    weight = torch.randn(q.shape[0], q.shape[2], 4, 16, generator=torch.Generator().manual_seed(1))

    def grads(through_plan: bool) -> list[Tensor]:
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        if through_plan:
            call = attention_module._per_sequence_varlen(_params(None, 16))
            with torch._C.DisableTorchFunction():
                out = attention_module._varlen_attention(*leaves, segments.varlen(q.device), call)
        else:
            out = _attend(*leaves, segments, None)
        (out * weight).sum().backward()
        return [t.grad for t in leaves]  # type: ignore[misc]

    for a, b in zip(grads(True), grads(False), strict=True):
        assert torch.equal(a, b)


def test_the_spec_names_the_attention_route_each_config_takes(monkeypatch):
    """On CUDA the spec's attention names the route its layers take (decided as a call's is);
    on CPU it is the one invariant name it always was."""
    from transformers import Gemma2Config, Qwen2Config

    from oldlogit.parity import attention
    from oldlogit.parity.kernels.cuda.varlen_attention import OpSupport

    every = OpSupport(flash=True, flash_window=True, flash_num_splits=True, efficient=True)
    monkeypatch.setattr(attention, "op_support", lambda index: every)
    cuda = torch.device("cuda", 0)
    qwen = Qwen2Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2)
    name = attention.config_attention_name
    assert name(qwen, torch.bfloat16, cuda) == "oldlogit_invariant/varlen-flash"
    assert name(qwen, torch.float32, cuda) == "oldlogit_invariant/varlen-efficient"
    windowed = Qwen2Config(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=4,
        use_sliding_window=True,
        sliding_window=16,
        max_window_layers=2,
    )
    # fp32 with a window goes per sequence (the efficient kernel's window is not checked).
    routes = name(windowed, torch.float32, cuda).removeprefix("oldlogit_invariant/").split("+")
    assert "sdpa" in routes
    gemma = Gemma2Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    assert name(gemma, torch.bfloat16, cuda).endswith("/eager")
    assert name(qwen, torch.bfloat16, torch.device("cpu")) == "oldlogit_invariant/sdpa"
