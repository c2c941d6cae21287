"""The architecture matrix, in process: every family loads, serves exactly and means the same.

For each family of ``tests/architectures.py`` (tiny configs with every numerics option set to a
non-default value) from a ``save_pretrained`` directory — and for MoE also from the fused
layout transformers holds in memory:
- the weights read onto the canonical names equal what ``from_pretrained`` loads, bitwise;
- in both profiles the engine, packing sequences (invariant) or one forward each (hf), is
  bitwise equal to the reference, whatever the sampling; the invariant self-check passes;
- the served logprobs are the HF model's own forward (close within float32 rounding), so a
  skipped option — softcapping, logit scaling, a window, rope scaling, routing bias — shows;
- the tripwire: ``trainer_numerics(strict=True)`` covers every matmul the family runs, and a
  padded trainer batch gets the served bits.
The served side (real servers, publishing each model's own state dict) is
tests/integration/test_architectures_served.py.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from oldlogit.parity import token_logprobs, trainer_numerics
from oldlogit_service.model.checkpoints import load_weights
from oldlogit_service.model.engine import Engine, Job, self_check
from oldlogit_service.model.loaded import load_model
from oldlogit_service.model.numerics import SamplingParams
from oldlogit_service.model.reference import reference_logprobs
from tests.architectures import ARCHS, MOE, VOCAB, WINDOW, model_dir

LENGTHS = (3, WINDOW + 3, 23, 41)  # most longer than the sliding window
SAMPLINGS = (SamplingParams(), SamplingParams(0.7, 5, 0.9))


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, bool], Path]:
    return {}


def _dir(dirs: dict[tuple[str, bool], Path], tmp: pytest.TempPathFactory, arch: str, fused: bool):
    key = (arch, fused)
    if key not in dirs:
        dirs[key] = model_dir(
            tmp.mktemp(f"{arch}-{'fused' if fused else 'hub'}"), arch, fused=fused
        )
    return dirs[key]


def _sequences(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=gen) for n in LENGTHS]


@pytest.mark.parametrize("arch", list(ARCHS))
def test_family_loads_serves_exactly_and_means_what_hf_means(arch, dirs, tmp_path_factory):
    hub = _dir(dirs, tmp_path_factory, arch, fused=False)
    hf = AutoModelForCausalLM.from_pretrained(hub, dtype=torch.float32).eval()
    hf_state = hf.state_dict()
    seqs = _sequences(len(arch))
    for profile in ("invariant", "hf"):
        model = load_model(hub, dtype="float32", device="cpu", numerics=profile, tile_rows=16)
        weights = load_weights(hub, model)
        assert weights is not None and list(weights) == list(model.param_specs)
        for name, tensor in weights.items():  # what from_pretrained loads, bitwise
            assert torch.equal(tensor, hf_state[name]) and tensor.dtype == hf_state[name].dtype
        if arch in MOE:
            assert model.layout.sources, "a hub checkpoint holds MoE experts one by one"
            fused = load_weights(_dir(dirs, tmp_path_factory, arch, fused=True), model)
            assert fused is not None and all(torch.equal(fused[k], weights[k]) for k in weights)
        engine = Engine(model, max_batch_tokens=60)
        for sampling in SAMPLINGS:
            jobs = [Job(s, torch.arange(1, len(s)), sampling) for s in seqs]
            outs = engine.run(weights, jobs)
            for s, out in zip(seqs, outs, strict=True):
                ref = reference_logprobs(model, weights, s, sampling)
                assert np.array_equal(out.numpy(), ref[1:]), (profile, sampling, len(s))
        if profile == "invariant":
            assert self_check(engine, weights) > 0
        # Semantics: the HF model's own forward, raw distribution.
        for s, out in zip(
            seqs, engine.run(weights, [Job(s, torch.arange(1, len(s))) for s in seqs]), strict=True
        ):
            with torch.no_grad():
                logits = hf(s[None]).logits[0, :-1].float()
            plain = torch.log_softmax(logits, -1).gather(-1, s[1:, None])[:, 0]
            assert torch.allclose(out, plain, atol=2e-5, rtol=0), (profile, len(s))


@pytest.mark.parametrize("arch", list(ARCHS))
def test_tripwire_strict_numerics_cover_every_matmul_and_a_padded_batch_is_served_bits(
    arch, dirs, tmp_path_factory
):
    hub = _dir(dirs, tmp_path_factory, arch, fused=False)
    trainer = AutoModelForCausalLM.from_pretrained(hub, dtype=torch.float32).eval()
    served = load_model(hub, dtype="float32", device="cpu", tile_rows=16)
    weights = load_weights(hub, served)
    assert weights is not None
    seqs = _sequences(len(arch) + 1)
    width = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):  # left padding, as a trainer's prompts are
        ids[i, width - len(s) :], mask[i, width - len(s) :] = s, 1
    with torch.no_grad(), trainer_numerics(trainer, tile_rows=16, strict=True):
        logp = token_logprobs(trainer, ids, mask, temperature=0.7, top_k=5)
    for i, s in enumerate(seqs):
        ref = reference_logprobs(served, weights, s, SamplingParams(0.7, 5))
        assert np.array_equal(logp[i, width - len(s) + 1 :].numpy(), ref[1:]), (arch, len(s))
