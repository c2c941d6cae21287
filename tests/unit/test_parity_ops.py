"""Op-level rules of the invariant numerics (oldlogit.parity.ops): routing, pointwise, tripwire.

MoE routing picks experts by one explicit top-k rule (ties to the lower index, descending
order), pointwise transcendental ops give an element the same bits whatever the tensor's size,
and the grouped/batched expert kernels — whose rows are not tiled — are refused in strict mode.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from oldlogit.parity import token_logprobs, trainer_numerics
from oldlogit.parity.kernels.cpu import GRAIN, blockwise
from oldlogit.parity.numerics import RandomForward, UncoveredMatmul
from oldlogit.parity.ops import TileMode, stable_topk
from tests.architectures import hf_model


def test_stable_topk_breaks_ties_to_the_lower_index_in_descending_order():
    x = torch.tensor([[1.0, 3.0, 3.0, 2.0, 3.0], [0.0, 0.0, 0.0, 0.0, 0.0]])
    out = stable_topk(x, 2)
    assert out.indices.tolist() == [[1, 2], [0, 1]]
    assert out.values.tolist() == [[3.0, 3.0], [0.0, 0.0]]
    assert stable_topk(x, 2, largest=False).indices.tolist() == [[0, 3], [0, 1]]
    # The same values as torch.topk, always sorted (sorted=False asks for no order at all).
    y = torch.randn(50, 16)
    assert torch.equal(stable_topk(y, 4).values, torch.topk(y, 4).values)


def test_a_patched_router_resolves_ties_by_the_rule():
    """Experts 1, 2 and 3 score the same for every token (expert 0 the opposite): top-2 takes
    the lower indices among the tied, so expert 3 is never chosen, alone or batched."""
    model = hf_model("qwen3_moe")
    layer = model.model.layers[1].mlp
    with torch.no_grad():
        layer.gate.weight[2] = layer.gate.weight[1]
        layer.gate.weight[3] = layer.gate.weight[1]
        layer.gate.weight[0] = -layer.gate.weight[1]
    picked: list[torch.Tensor] = []
    hook = layer.gate.register_forward_hook(lambda _m, _a, out: picked.append(out[2]))
    ids = torch.randint(3, 150, (3, 20), generator=torch.Generator().manual_seed(0))
    try:
        with torch.no_grad(), trainer_numerics(model, tile_rows=16):
            token_logprobs(model, ids)
            token_logprobs(model, ids[:1])
    finally:
        hook.remove()
    for indices in picked:  # [tokens, k]
        assert not bool((indices == 3).any())
        rows = {tuple(r) for r in indices.tolist()}
        assert rows <= {(1, 2), (0, 1)}, rows  # descending value, ties by index
    assert torch.equal(picked[1], picked[0][:20])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "fn",
    [torch.sigmoid, F.silu, lambda t: F.gelu(t, approximate="tanh"), torch.tanh, torch.exp],
    ids=["sigmoid", "silu", "gelu_tanh", "tanh", "exp"],
)
def test_blockwise_pointwise_gives_an_element_the_same_bits_whatever_the_size(fn, dtype):
    x = (torch.randn(3 * GRAIN + 77, generator=torch.Generator().manual_seed(1)) * 3).to(dtype)
    full = blockwise(fn, x)
    # 2 blocks and 2 blocks + 128: one call where torch's threads get whole 64-groups.
    sizes = (1, 5, 17, 63, 64, 65, 1000, GRAIN + 3, 2 * GRAIN + 128)
    for n in (*sizes, 2 * GRAIN, x.numel()):
        assert torch.equal(blockwise(fn, x[:n].clone()), full[:n]), n
    assert torch.equal(blockwise(fn, x.view(-1, 1)[7:40]).view(-1), full[7:40])


def test_blockwise_keeps_shape_grad_and_inplace():
    x = torch.randn(5, 7, requires_grad=True)
    y = blockwise(F.silu, x)
    assert y.shape == (5, 7) and torch.allclose(y, F.silu(x))
    y.sum().backward()
    assert x.grad is not None and x.grad.shape == (5, 7)
    z = torch.randn(3, 9)
    expected = F.silu(z)
    assert blockwise(F.silu, z, inplace=True) is z and torch.allclose(z, expected)


def _grad_fns(t):
    seen, todo = set(), [t.grad_fn]
    while todo:
        f = todo.pop()
        if f is not None and f not in seen:
            seen.add(f)
            todo.extend(n for n, _ in f.next_functions)
    return [type(f).__name__ for f in seen]


def test_blockwise_backward_is_blockwise_too_and_one_split_not_a_slice_per_block():
    # The gradient of an element must not depend on the tensor's size either, and autograd
    # must not build (and sum) one full-size gradient per block: a trainer's backward through
    # a [tokens, intermediate] activation would pay that once per block.
    x = torch.randn(3 * GRAIN + 77, generator=torch.Generator().manual_seed(2))
    g = torch.randn_like(x)

    def grad(n):
        leaf = x[:n].clone().requires_grad_(True)
        blockwise(F.silu, leaf).backward(g[:n])
        return leaf.grad

    full = grad(x.numel())
    for n in (5, 65, GRAIN + 3, 2 * GRAIN + 128):
        assert torch.equal(grad(n), full[:n]), n
    assert torch.allclose(full, torch.func.vjp(F.silu, x)[1](g)[0], atol=1e-6)
    leaf = x.clone().requires_grad_(True)
    names = _grad_fns(blockwise(F.silu, leaf))
    assert names.count("SplitBackward0") == 1 and names.count("SliceBackward0") <= 1, names


def test_the_plain_profile_mode_changes_nothing_but_the_head():
    x = torch.randn(9, 4)
    with TileMode(None, strict=True, head=None, fp32=False):
        assert torch.equal(torch.sigmoid(x), torch.sigmoid(x))
        torch.matmul(x, x.t())  # not refused: the plain profile makes no promise


@pytest.mark.parametrize("kernel", ["grouped_mm", "batched_mm"])
def test_expert_kernels_outside_the_tiles_are_refused(kernel):
    model = hf_model("qwen3_moe")
    original = model.config._experts_implementation
    ids = torch.randint(3, 150, (1, 12), generator=torch.Generator().manual_seed(2))
    with trainer_numerics(model):
        assert model.config._experts_implementation == "eager"  # what the patch runs
        model.config._experts_implementation_internal = kernel
        with pytest.raises(UncoveredMatmul, match="outside oldlogit's tiles"):
            token_logprobs(model, ids)
    assert model.config._experts_implementation == original  # restored on exit


def test_random_draws_in_a_training_forward_are_refused():
    """Mixtral's router jitter multiplies a training forward's hidden states by uniform noise:
    two calls differ, and so would the service. Strict mode refuses the draw by name; with the
    jitter at 0 the training forward has the eval bits."""
    model = hf_model("mixtral")
    ids = torch.randint(3, 150, (2, 20), generator=torch.Generator().manual_seed(0))
    with trainer_numerics(model):
        want = token_logprobs(model, ids)
    blocks = [m for m in model.modules() if hasattr(m, "jitter_noise")]
    assert blocks
    for block in blocks:
        block.jitter_noise = 0.3
    model.train()
    with trainer_numerics(model), pytest.raises(RandomForward, match="uniform_ draws random"):
        token_logprobs(model, ids)
    for block in blocks:
        block.jitter_noise = 0.0
    with trainer_numerics(model):
        assert torch.equal(token_logprobs(model, ids), want)
    x = torch.randn(3, 4)
    with TileMode(64, True, None, False):
        for draw in (lambda: torch.rand(3), lambda: torch.randn_like(x), lambda: x.normal_()):
            with pytest.raises(RandomForward):
                draw()
    with TileMode(64, False, None, False):
        torch.rand(3)  # strict=False: allowed
    with TileMode(None, True, None, False):
        torch.rand(3)  # the plain profile promises nothing


def test_one_call_pointwise_is_checked_then_used_with_several_threads():
    """With 2+ threads a large aligned tensor runs in one call (every thread a whole number of
    64-element groups) once that was checked against the blocks; the bits are the blocks'."""
    from oldlogit.parity.kernels import cpu

    if torch.get_num_threads() < 2:
        pytest.skip("one thread: the blocks are one call each anyway")
    x = torch.randn(8, GRAIN // 2, generator=torch.Generator().manual_seed(3))
    assert torch.equal(
        blockwise(F.silu, x), cpu._blocks(F.silu, x.reshape(-1), (), {}).view(x.shape)
    )
    used = min(torch.get_num_threads(), -(-x.numel() // cpu.GRAIN))
    assert cpu._one_call.get((F.silu, torch.float32, used, (), ())) is True


class _FullSize(TorchDispatchMode):
    """The ops that allocate a tensor of at least ``numel`` elements (views and in-place ops
    of their inputs not counted), by name."""

    def __init__(self, numel: int) -> None:
        super().__init__()
        self.numel, self.ops = numel, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and out.numel() >= self.numel:
            inputs = [a for a in (*args, *(kwargs or {}).values()) if isinstance(a, torch.Tensor)]
            storage = out.untyped_storage().data_ptr()
            if all(a.untyped_storage().data_ptr() != storage for a in inputs):
                self.ops.append(func.__name__)
        return out


@pytest.mark.parametrize("patched", [False, True])
def test_the_scored_rows_backward_builds_no_full_size_zero_gradient_per_chunk(patched):
    """A trainer's backward through token_logprobs at a large vocabulary must not pay one
    zero-filled [rows, vocabulary] gradient per processed chunk or per sequence (a slice's
    backward does: 17 of them for 8 × 129 rows at 64 rows a chunk, and a float32 [1032, 151936]
    is 627 MB): the logits are cut by one split, whose backward is one concatenation."""
    from transformers import AutoModelForCausalLM

    from tests.architectures import config

    cfg = config("qwen2")
    cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size = 128, 256, 2048  # [S, V] the largest
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, model.config.vocab_size, (8, 80), generator=gen)
    mask = torch.ones_like(ids)
    for b in range(8):  # left-padded prompts and right-padded completions: a span per row
        mask[b, : b * 3] = 0
        mask[b, 80 - b * 2 :] = 0
    keep = 70  # 8 × 71 logits rows: several PROCESS_ROWS chunks
    with trainer_numerics(model) if patched else contextlib.nullcontext():
        lp = token_logprobs(model, ids, mask, logits_to_keep=keep)
        full = _FullSize(8 * (keep + 1) * model.config.vocab_size)
        with full:
            (lp * mask[:, -keep:]).sum().backward()
    assert len(full.ops) <= 1, full.ops  # the concatenated gradient (the old code: 13)
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
