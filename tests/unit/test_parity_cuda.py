"""The invariant numerics on CUDA: one GEMM per linear over all rows (cuBLASLt where probed
row-invariant, else Triton), Triton row kernels, per-sequence attention.

Skipped without CUDA (``gpu`` marker). The same properties as the CPU tests: a row's bits do not
depend on the other rows, a trainer's micro-batch, padding or packing changes no bit, and a
trainer on the GPU scores what the service's engine serves from it, bitwise, in every
architecture family. The GEMM choice's probe at a 1.5B model's shapes prints what it chose.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from oldlogit.parity import rowwise, tiled_mm, token_logprobs, trainer_numerics
from oldlogit_service.model.checkpoints import load_weights
from oldlogit_service.model.engine import Engine, Job
from oldlogit_service.model.loaded import load_model
from oldlogit_service.model.numerics import SamplingParams
from tests.architectures import ARCHS, VOCAB, hf_model, model_dir
from tests.parity_setups import left_padded
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


@pytest.mark.parametrize("setup", ["module_cast", "autocast"])
@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_a_trainer_on_cuda_is_bitwise_with_the_service_on_cuda(
    arch: str, setup: str, tmp_path: Path
) -> None:
    """The parity contract on a GPU, per architecture family: a trainer that cast its float32
    checkpoint to bfloat16 or keeps float32 masters under CUDA autocast scores a left-padded
    batch with the very bits the service's engine serves from the same GPU."""
    hub = model_dir(tmp_path / "m", arch, seed=4)
    service = load_model(hub, dtype="bfloat16", device="cuda")
    weights = load_weights(hub, service)
    assert weights is not None
    weights = {k: v.cuda() for k, v in weights.items()}
    rng = np.random.default_rng(1)
    seqs = [rng.integers(0, VOCAB, n) for n in (5, 23, 40)]
    jobs = [
        Job(torch.from_numpy(s.astype(np.int64)), torch.arange(1, len(s)), SamplingParams())
        for s in seqs
    ]
    served = [out.numpy() for out in Engine(service).run(weights, jobs)]

    trainer = hf_model(arch, seed=4).cuda()  # the checkpoint's float32 weights
    if setup == "module_cast":
        trainer = trainer.to(torch.bfloat16)
    ids, mask = left_padded(seqs)
    width = ids.shape[1]
    around = torch.autocast("cuda", dtype=torch.bfloat16, enabled=setup == "autocast")
    with torch.no_grad(), trainer_numerics(trainer, like=service.numerics_spec(False)), around:
        out = token_logprobs(trainer, ids.cuda(), mask.cuda()).cpu()
    for i, (s, want) in enumerate(zip(seqs, served, strict=True)):
        got = out[i, width - len(s) + 1 :].numpy()
        assert np.array_equal(got, want), (arch, setup, i, float(np.abs(got - want).max()))


@pytest.mark.parametrize("width", [896, 32768])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reductions_on_cuda_are_row_invariant(width: int, dtype: torch.dtype) -> None:
    """CUDA's reduction kernels pick their launch configuration from the number of rows too (a
    mean over 896 floats gives other bits for 1–15 rows than for 1,000 on an H100): under the
    rule every row gets the bits it gets among any other rows."""
    gen = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(1000, width, generator=gen, device="cuda").to(dtype)
    calls = [
        (torch.Tensor.mean, (-1,), {"keepdim": True}),
        (torch.Tensor.sum, (-1,), {"dtype": torch.float32}),
        (torch.logsumexp, (-1,), {}),
        (torch.Tensor.var, (-1,), {"unbiased": False}),
    ]
    for func, rest, kwargs in calls:
        whole = rowwise.last_dim_rows(func, (x, *rest), dict(kwargs))
        assert whole is not None
        for n in (1, 2, 3, 7, 15, 16, 40, 64, 65, 513, 999):
            part = rowwise.last_dim_rows(func, (x[1000 - n :], *rest), dict(kwargs))
            assert torch.equal(part, whole[1000 - n :]), (func, n)


@pytest.mark.parametrize("draw", ["checkpoint", "start-up"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_packed_and_alone_agree_at_a_real_width_on_cuda(
    tmp_path: Path, dtype: str, draw: str
) -> None:
    """The service's start-up check (sequences of 2–130 tokens packed together and each alone)
    on a model 0.5B models are as wide (12 layers, hidden 896, 28 query and 14 key-value heads,
    a 32,768-token vocabulary), several draws: where the tiny models of the other tests cannot
    show a kernel picked by the row count or the alignment, this one does. "start-up" draws
    the weights `oldlogit serve` checks with when its store is empty (small random values:
    the case that still differed on an H100 once the operands were fresh copies)."""
    from oldlogit_service.demo.tiny import make_tiny_model_dir
    from oldlogit_service.model.engine import self_check

    hub = make_tiny_model_dir(
        tmp_path / "m",
        arch="qwen2",
        seed=0,
        vocab_size=32768,
        hidden_size=896,
        num_layers=12,
        num_heads=28,
        num_kv_heads=14,
        intermediate_size=2688,
        max_positions=2048,
        dtype=dtype,
    )
    model = load_model(hub, dtype=dtype, device="cuda")
    weights = load_weights(hub, model)
    assert weights is not None
    engine = Engine(model, max_batch_tokens=32768)
    weights = {k: v.cuda() for k, v in weights.items()}
    if draw == "start-up":
        gen = torch.Generator().manual_seed(0)
        weights = {
            name: (torch.randn(shape, generator=gen) * 0.05).to("cuda", model.weight_dtype(name))
            for name, (_, shape) in model.param_specs.items()
        }
    for seed in range(4):
        assert self_check(engine, weights, seed=seed) > 0


# Qwen2.5-1.5B's linears (weight [N, K], bias): q, k/v, o, gate/up, down, the head.
QWEN_1_5B = [
    (1536, 1536, True),
    (256, 1536, True),
    (1536, 1536, False),
    (8960, 1536, False),
    (1536, 8960, False),
    (151936, 1536, False),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16])
def test_gemm_choice_at_1_5b_shapes_is_row_invariant_and_repeatable(dtype):
    """The probe decides each shape (forward, and the input gradient's transposed weight); the
    decision is printed (``-s``), repeated identically with a cleared cache, and the GEMM it
    picked gives each row its bits whatever the row count, beyond M_MAX rows too."""
    from oldlogit.parity.kernels.cuda import gemm_choice

    gen = torch.Generator(device="cuda").manual_seed(5)
    chosen = {}
    for n, k, bias in QWEN_1_5B:
        weight = (torch.randn(n, k, generator=gen, device="cuda") * 0.05).to(dtype)
        b = torch.randn(n, generator=gen, device="cuda").to(dtype) if bias else None
        for w, bb in ((weight, b), (weight.t(), None)):  # a linear and its input gradient
            choice = gemm_choice.choice_for(w, bb)
            key = gemm_choice.key_for(w, bb)
            chosen[key] = choice
            x = torch.randn(gemm_choice.M_MAX + 300, w.shape[1], generator=gen, device="cuda")
            x = x.to(dtype)
            whole = gemm_choice.gemm(x, w, bb)
            for m in (1, 5, 64, 100, 1000, 4097, gemm_choice.M_MAX + 1):
                assert torch.equal(gemm_choice.gemm(x[:m], w, bb), whole[:m]), (key, choice, m)
            del x, whole
    print({f"{k.n}x{k.k}{' bias' if k.bias else ''}{' T' if k.transposed else ''}": c
           for k, c in chosen.items()})  # fmt: skip
    print(gemm_choice.blas_version(), gemm_choice.workspace_setting())
    saved = dict(gemm_choice._decided)
    gemm_choice._decided.clear()
    try:
        for key, choice in chosen.items():
            assert gemm_choice.choose(key, gemm_choice.torch_gemm, "cuda") == choice, key
    finally:
        gemm_choice._decided.update(saved)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_patched_forward_on_cuda_runs_one_gemm_per_linear(dtype, monkeypatch):
    """No 64-row tiles on CUDA: each linear (2 layers of 7, and the head) is one GEMM call,
    cuBLASLt or Triton, whatever the batch; the norms are one Triton call each."""
    from oldlogit.parity.kernels import cpu
    from oldlogit.parity.kernels.cuda import gemm_choice, rms_norm

    calls = {"gemm": 0, "norm": 0}

    def counting(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(gemm_choice, "torch_gemm", counting("gemm", gemm_choice.torch_gemm))
    monkeypatch.setattr(gemm_choice, "triton_gemm", counting("gemm", gemm_choice.triton_gemm))
    monkeypatch.setattr(rms_norm, "rms_norm", counting("norm", rms_norm.rms_norm))
    monkeypatch.setattr(cpu, "_tiles", None)  # reached: a TypeError
    model = _model("qwen2", dtype, seed=4).cuda()
    ids = torch.randint(3, 200, (3, 150), device="cuda")
    with torch.no_grad(), trainer_numerics(model):
        token_logprobs(model, ids[:, :2])  # the probes run here, through torch_gemm
        calls.update(gemm=0, norm=0)
        token_logprobs(model, ids)
    assert calls == {"gemm": 2 * 7 + 1, "norm": 2 * 2 + 1}
