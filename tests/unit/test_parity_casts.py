"""Module casts and autocast across every architecture family: bitwise with the service.

Per family of ``tests/architectures.py`` (rotary variants, Gemma's embedding scale, soft-capping,
q/k norms, MoE routing, DeepSeek-V3's float32 routing bias …): the service's skeleton in
bfloat16 with the checkpoint's weights (``reference_logprobs``, what the service answers) against
a trainer that loaded the float32 checkpoint and then ran ``model.to(torch.bfloat16)`` — which
also casts every non-persistent buffer and every tensor transformers keeps in float32 — and one
that keeps float32 masters under ``torch.autocast(bfloat16)``. Under ``trainer_numerics(model,
like=service spec)`` both score a left-padded batch bitwise equal to the service on every token.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from oldlogit.parity import token_logprobs, trainer_numerics
from oldlogit_service.model.checkpoints import load_weights
from oldlogit_service.model.loaded import load_model
from oldlogit_service.model.reference import reference_logprobs
from tests.architectures import ARCHS, VOCAB, hf_model, model_dir
from tests.parity_setups import left_padded


@pytest.mark.parametrize("setup", ["module_cast", "autocast"])
@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_bitwise_with_the_service(arch: str, setup: str, tmp_path: Path) -> None:
    hub = model_dir(tmp_path / "m", arch, seed=4)
    service = load_model(hub, dtype="bfloat16", device="cpu")
    weights = load_weights(hub, service)
    assert weights is not None
    rng = np.random.default_rng(1)
    seqs = [rng.integers(0, VOCAB, n) for n in (5, 23, 40)]
    served = [reference_logprobs(service, weights, s)[1:] for s in seqs]

    trainer = hf_model(arch, seed=4)  # the checkpoint's float32 weights
    if setup == "module_cast":
        trainer = trainer.to(torch.bfloat16)
    ids, mask = left_padded(seqs)
    width = ids.shape[1]
    around = (
        torch.autocast("cpu", dtype=torch.bfloat16)
        if setup == "autocast"
        else torch.autocast("cpu", enabled=False)
    )
    with torch.no_grad(), trainer_numerics(trainer, like=service.numerics_spec(False)), around:
        out = token_logprobs(trainer, ids, mask)
    for i, (s, want) in enumerate(zip(seqs, served, strict=True)):
        got = out[i, width - len(s) + 1 :].numpy()
        assert np.array_equal(got, want), (arch, setup, i, float(np.abs(got - want).max()))
