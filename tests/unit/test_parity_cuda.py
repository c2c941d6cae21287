"""The invariant numerics on CUDA: one cuBLAS shape per tile, per-sequence attention.

Skipped without CUDA (``gpu`` marker). The same properties as the CPU tests: a row's bits do not
depend on the other rows, and a trainer's micro-batch, padding or packing changes no bit.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from oldlogit.parity import tiled_mm, token_logprobs, trainer_numerics
from tests.unit.test_parity_invariance import _model, _padded, _sequences

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiles_on_cuda_are_row_invariant(dtype):
    gen = torch.Generator(device="cuda").manual_seed(0)
    weight = (torch.randn(1536, 512, generator=gen, device="cuda") * 0.05).to(dtype)
    rows = torch.randn(2000, 512, generator=gen, device="cuda").to(dtype)
    alone = tiled_mm(rows[7:8], weight, 64)
    for count in (1, 3, 64, 65, 640, 1999):
        x = torch.cat([rows[8 : 8 + count - 1], rows[7:8]])
        assert torch.equal(tiled_mm(x, weight, 64)[-1], alone[0]), count


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_trainer_batches_on_cuda_change_no_bit(dtype):
    model = _model("qwen2", dtype, seed=1).cuda()
    rng = np.random.default_rng(0)
    seqs = _sequences(rng, 8)
    with trainer_numerics(model):
        alone = [token_logprobs(model, s[None].cuda(), temperature=0.7)[0] for s in seqs]
        for side in ("left", "right"):
            ids, mask = _padded(seqs, side)
            out = token_logprobs(model, ids.cuda(), mask.cuda(), temperature=0.7)
            width = out.shape[1]
            for i, s in enumerate(seqs):
                row = out[i, : len(s)] if side == "right" else out[i, width - len(s) :]
                assert torch.equal(row, alone[i]), (side, i)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_trainer_with_tf32_or_other_reductions_on_scores_the_same_bits(dtype):
    """TF32 (``allow_tf32``, ``set_float32_matmul_precision("high")``) and cuBLAS's reduction
    settings change a GEMM's bits: under the numerics the forward runs with torch's defaults,
    as the service does, and the process's settings are back afterwards."""
    model = _model("qwen2", dtype, seed=2).cuda()
    ids = torch.randint(3, 200, (3, 150), device="cuda")
    with trainer_numerics(model):
        want = token_logprobs(model, ids)
    matmul = torch.backends.cuda.matmul
    before = (matmul.allow_tf32, matmul.allow_bf16_reduced_precision_reduction)
    try:
        matmul.allow_tf32 = True
        matmul.allow_bf16_reduced_precision_reduction = False
        with trainer_numerics(model):
            got = token_logprobs(model, ids)
        assert matmul.allow_tf32 and not matmul.allow_bf16_reduced_precision_reduction
    finally:
        matmul.allow_tf32 = before[0]
        matmul.allow_bf16_reduced_precision_reduction = before[1]
    assert torch.equal(got, want)
