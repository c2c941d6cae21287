"""The CUDA definition's dispatch, run on CPU: under ``kernels.forced_cuda`` a CPU model's
GEMMs, norms, reductions and head processing take the Triton kernels (``TRITON_INTERPRET=1``,
tests/conftest.py; the GEMM is always the Triton one, there is no cuBLASLt here) and a token's
logprob still depends on its own sequence alone. The interpreter proves the structure (one call
over all rows, no tiles, rows independent), not a GPU's bits (tests/unit/test_parity_cuda.py).
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM, Qwen2Config

pytest.importorskip("triton")

from oldlogit.parity import (
    local_spec,
    token_logprobs,
    trainer_numerics,
)
from oldlogit.parity.kernels import CPU_KERNELS, cpu, forced_cuda, kernel_set
from oldlogit.parity.kernels.cuda import (
    gemm_choice,
    log_softmax,
    matmul,
    rms_norm,
    row_cumsum,
)
from tests.packed import packed_logprobs

VOCAB = 64


def _model(seed: int = 0) -> nn.Module:
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        initializer_range=0.2,
        max_position_embeddings=256,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        for p in model.parameters():  # norms and biases get noise too
            if p.numel() > 1 and bool((p == p.flatten()[0]).all()):
                p.data += 0.1 * torch.randn_like(p)
    return model.eval()


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> Iterator[collections.Counter[str]]:
    """Calls of each Triton wrapper; the CPU tile path made to fail if reached."""
    calls: collections.Counter[str] = collections.Counter()

    def count(module: Any, name: str) -> None:
        original: Callable[..., Any] = getattr(module, name)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            calls[name] += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(module, name, wrapper)

    count(matmul, "matmul")
    count(rms_norm, "rms_norm")
    count(log_softmax, "token_logprobs")
    count(log_softmax, "log_softmax")
    count(row_cumsum, "row_cumsum")

    def no_tiles(*_a: Any, **_k: Any) -> None:
        raise AssertionError("64-row tiles under the CUDA definition")

    monkeypatch.setattr(cpu, "_tiles", no_tiles)
    monkeypatch.setattr(cpu, "chunk_verified", no_tiles)
    with forced_cuda():
        yield calls


def _padded(seqs: list[torch.Tensor], side: str) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, s in enumerate(seqs):
        sl = slice(0, len(s)) if side == "right" else slice(width - len(s), width)
        ids[i, sl] = s
        mask[i, sl] = 1
    return ids, mask


def _batches(model: nn.Module, seqs: list[torch.Tensor], sizes: tuple[int, ...]) -> None:
    """Each sequence alone, then in micro-batches of each size, left- and right-padded, and
    packed: the same bits."""
    alone = [token_logprobs(model, s[None])[0] for s in seqs]
    for size in sizes:
        for side in ("left", "right"):
            for first in range(0, len(seqs), size):
                group = seqs[first : first + size]
                ids, mask = _padded(group, side)
                out = token_logprobs(model, ids, mask)
                for i, s in enumerate(group):
                    row = out[i, : len(s)] if side == "right" else out[i, out.shape[1] - len(s) :]
                    assert torch.equal(row, alone[first + i]), (size, side, first + i)
    for i, got in enumerate(packed_logprobs(model, seqs)):
        assert torch.equal(got, alone[i]), ("packed", i)


def test_one_gemm_per_linear_and_rows_independent_of_the_batch(
    counted: collections.Counter[str],
) -> None:
    model = _model()
    rng = np.random.default_rng(3)
    seqs = [torch.from_numpy(rng.integers(0, VOCAB, int(n))) for n in (3, 5, 2, 6, 4)]
    with torch.no_grad(), trainer_numerics(model):
        token_logprobs(model, seqs[0][None])
        # One forward: 7 linears in the layer and the head, one GEMM each; three norms; one
        # fused head call.
        assert counted == {"matmul": 8, "rms_norm": 3, "token_logprobs": 1}
        _batches(model, seqs, (5,))  # micro-batches of 1: the sequences alone
        spec = local_spec(model, profile="invariant", tile_rows=64, lm_head_fp32=False)
    assert spec.kernels == kernel_set("cpu") != CPU_KERNELS and "/kernels=cuda/" in spec.key
    assert not gemm_choice._decided  # no cuBLASLt probe off CUDA


@pytest.mark.slow
def test_micro_batches_of_three(counted: collections.Counter[str]) -> None:
    model = _model(seed=2)
    rng = np.random.default_rng(6)
    seqs = [torch.from_numpy(rng.integers(0, VOCAB, int(n))) for n in (4, 7, 2, 8, 5)]
    with torch.no_grad(), trainer_numerics(model):
        _batches(model, seqs, (3, 5))


def test_top_k_top_p_and_the_backward(counted: collections.Counter[str]) -> None:
    model = _model(seed=1)
    rng = np.random.default_rng(4)
    seqs = [torch.from_numpy(rng.integers(0, VOCAB, int(n))) for n in (5, 8)]
    sampling: dict[str, Any] = {"temperature": 0.7, "top_k": 20, "top_p": 0.9}
    with trainer_numerics(model):
        with torch.no_grad():
            alone = [token_logprobs(model, s[None], **sampling)[0] for s in seqs]
        assert counted["row_cumsum"] == len(seqs) and counted["log_softmax"] == len(seqs)
        ids, mask = _padded(seqs, "left")
        out = token_logprobs(model, ids, mask, **sampling)
        for i, s in enumerate(seqs):
            assert torch.equal(out[i, out.shape[1] - len(s) :], alone[i])
        assert torch.isneginf(out).any()  # tokens outside the support
        before = counted["matmul"]
        torch.where(torch.isfinite(out), out, 0.0).sum().backward()
    # The backward's input gradients go through the Triton GEMM too (weight transposed).
    assert counted["matmul"] > before
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert all(g is not None and torch.isfinite(g).all() for g in grads.values())
    plain = _model(seed=1)
    from oldlogit.parity.logprobs import token_logprobs as plain_logprobs

    ref = plain_logprobs(plain, ids, mask, **sampling)
    torch.where(torch.isfinite(ref), ref, 0.0).sum().backward()
    for n, p in plain.named_parameters():
        got = grads[n]
        assert got is not None and p.grad is not None
        torch.testing.assert_close(got, p.grad, rtol=1e-3, atol=1e-4, msg=n)


def test_the_service_engine_serves_the_trainers_bits(
    tmp_path: Any, counted: collections.Counter[str]
) -> None:
    """The service's engine (packed forward, head on the scored rows, processing in slices)
    and a trainer's left-padded micro-batch under ``like=`` the service's spec agree bitwise
    under the CUDA definition's kernels, as they do on CPU (tests/unit/test_engine.py)."""
    from oldlogit_service.demo.tiny import make_tiny_model_dir
    from oldlogit_service.model.checkpoints import load_weights
    from oldlogit_service.model.engine import Engine, Job
    from oldlogit_service.model.loaded import load_model
    from oldlogit_service.model.numerics import SamplingParams

    hub = make_tiny_model_dir(
        tmp_path / "m",
        vocab_size=VOCAB,
        hidden_size=32,
        num_layers=1,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=64,
        max_positions=256,
    )
    service = load_model(hub, dtype="float32", device="cpu")
    weights = load_weights(hub, service)
    assert weights is not None
    rng = np.random.default_rng(5)
    seqs = [torch.from_numpy(rng.integers(0, VOCAB, n)) for n in (4, 9, 6)]
    sampling = SamplingParams(temperature=0.8)
    jobs = [Job(s, torch.arange(1, len(s)), sampling) for s in seqs]
    served = Engine(service).run(weights, jobs)
    assert counted["matmul"] and counted["token_logprobs"]
    trainer = AutoModelForCausalLM.from_pretrained(hub, dtype=torch.float32).eval()
    spec = service.numerics_spec(False)
    assert spec.kernels == kernel_set("cpu") != CPU_KERNELS
    ids, mask = _padded(seqs, "left")
    with torch.no_grad(), trainer_numerics(trainer, like=spec):
        out = token_logprobs(trainer, ids, mask, temperature=0.8)
    width = out.shape[1]
    for i, (s, want) in enumerate(zip(seqs, served, strict=True)):
        assert torch.equal(out[i, width - len(s) + 1 :], want), i


def test_gemma_norms_take_the_kernel(counted: collections.Counter[str]) -> None:
    """Gemma 2's RMSNorm (× (1 + weight) in float32, then the cast) is one kernel call per norm
    under the CUDA definition: four per layer and the final one."""
    from transformers import Gemma2Config

    config = Gemma2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=64,
        initializer_range=0.2,
        max_position_embeddings=256,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
        for p in model.parameters():
            if p.numel() > 1 and bool((p == p.flatten()[0]).all()):
                p.data += 0.1 * torch.randn_like(p)
    rng = np.random.default_rng(8)
    seqs = [torch.from_numpy(rng.integers(0, VOCAB, int(n))) for n in (3, 6, 4)]
    with torch.no_grad(), trainer_numerics(model):
        alone = [token_logprobs(model, s[None])[0] for s in seqs]
        assert counted["rms_norm"] == 5 * len(seqs)
        ids, mask = _padded(seqs, "left")
        out = token_logprobs(model, ids, mask)
    for i, s in enumerate(seqs):
        assert torch.equal(out[i, out.shape[1] - len(s) :], alone[i]), i
