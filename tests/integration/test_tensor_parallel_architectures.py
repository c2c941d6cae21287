"""The tensor-parallel definition across model families: each dense family of
tests/architectures.py, split at TP 2 by torch's ``parallelize_module`` after the model's own
plan (two gloo ranks, one thread each; tests/integration/tp_arch_worker.py), gives the bits of
the unsplit model under ``trainer_numerics(tp_chunks=8)`` in this process (two threads) on
every token, raw and processed, and its backward reaches every parameter; the service's engine
on each rank's weight shards (one thread) gives the bits of one engine on whole weights (two
threads), over packed sequences of lengths 3 to 70. What the split must
carry differs: attention and MLP biases (llama), sliding windows narrower than the sequences
(qwen2, qwen3, mistral, gemma2, gemma3, phi3), per-head q/k norms (qwen3), a head tied to the
embedding (gemma), attention and final logit soft-capping (gemma2), mixed layer types
(gemma3), q/k norms over the whole projection with q/k/v gathered (olmo2), fused qkv and
gate/up projections (phi3), logit, embedding, residual and attention multipliers (granite).
Cohere with ``use_qk_norm`` is absent: its [heads, head_dim] norm weights do not follow its
own plan's column split, and transformers' code fails on that split with or without oldlogit.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.architectures import model_dir
from tests.integration import tp_arch_worker, tp_worker
from tests.integration.conftest import run_ranks

pytestmark = pytest.mark.integration

FAMILIES = (
    "llama",
    "qwen2",
    "qwen3",
    "mistral",
    "gemma",
    "gemma2",
    "gemma3_text",
    "olmo2",
    "granite",
    "phi3",
)


def test_every_dense_family_at_tp2_is_its_tp1_bits(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from oldlogit.parity import tensor_parallel, token_logprobs, trainer_numerics

    whole = tensor_parallel.TensorParallel()
    single, engines = {}, {}
    for arch in FAMILIES:
        model = AutoModelForCausalLM.from_pretrained(
            str(model_dir(tmp_path / arch, arch)), dtype=torch.float32
        )
        ids = tp_arch_worker.samples(int(model.config.vocab_size))
        with trainer_numerics(model, tp_chunks=8), torch.no_grad():
            single[arch] = (
                token_logprobs(model, ids, temperature=0.8),
                token_logprobs(model, ids, **tp_arch_worker.PROCESSED),  # type: ignore[arg-type]
            )
        if arch not in tp_arch_worker.RANKS_REFUSE:
            engines[arch] = tp_worker.engine_logprobs(str(tmp_path / arch), "float32", whole)

    def argv(rank: int) -> list[str]:
        out = str(tmp_path / f"rank{rank}.pt")
        return [str(rank), "2", str(tmp_path / "init"), str(tmp_path), out, *FAMILIES]

    ranks = run_ranks("tests.integration.tp_arch_worker", argv, 2, threads="1", timeout_s=300)
    for rank, (code, log) in enumerate(ranks):
        assert code == 0, log[-4000:]
        seen = torch.load(tmp_path / f"rank{rank}.pt")
        for arch in FAMILIES:
            raw, processed = single[arch]
            assert torch.isinf(processed).any(), arch  # top-k/top-p removed some targets
            assert torch.equal(seen[arch]["raw"], raw), (arch, rank)
            assert torch.equal(seen[arch]["processed"], processed), (arch, rank)
            if arch in engines:  # the service's ranks (1 thread) vs one engine (2 threads)
                assert torch.equal(seen[arch]["engine"], engines[arch]["engine"]), (arch, rank)
            grads, params = seen[arch]["grads"].tolist()
            assert grads == params, f"{arch}: {grads} of {params} parameters got a gradient"
