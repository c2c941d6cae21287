"""What a patch installs as the model's non-weight buffers — the values a model built from its
config holds — is built once per model class, config and dtype in a process, and never shared
between models whose configs differ."""

from __future__ import annotations

import collections

import pytest
import torch

from oldlogit.parity import numerics, token_logprobs, trainer_numerics
from tests.architectures import VOCAB, config, hf_model


@pytest.fixture
def builds(monkeypatch: pytest.MonkeyPatch) -> list[torch.dtype]:
    """An empty reference cache for the test, and the dtypes of the skeletons it builds."""
    monkeypatch.setattr(numerics, "_REFERENCES", collections.OrderedDict())
    built: list[torch.dtype] = []
    real = numerics._skeleton_of

    def counting(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
        built.append(dtype)
        return real(model, dtype)

    monkeypatch.setattr(numerics, "_skeleton_of", counting)
    return built


def test_entering_again_builds_no_skeleton_and_gives_the_same_bits(
    builds: list[torch.dtype],
) -> None:
    model = hf_model("llama", seed=3, dtype=torch.bfloat16)
    ids = torch.randint(0, VOCAB, (2, 17), generator=torch.Generator().manual_seed(0))
    outs = []
    for _ in range(3):
        with torch.no_grad(), trainer_numerics(model):
            outs.append(token_logprobs(model, ids))
    assert builds == [torch.bfloat16]
    assert all(torch.equal(o, outs[0]) for o in outs[1:])
    # A second model of the same class and config shares it; float32 is another reference.
    with torch.no_grad(), trainer_numerics(hf_model("llama", seed=5, dtype=torch.bfloat16)):
        pass
    with torch.no_grad(), trainer_numerics(hf_model("llama", seed=3)):
        pass
    assert builds == [torch.bfloat16, torch.float32]


def test_a_config_that_changes_the_buffers_gets_its_own_reference(
    builds: list[torch.dtype],
) -> None:
    from transformers import AutoModelForCausalLM

    cfg = config("llama")
    cfg.rope_parameters = {**cfg.rope_parameters, "rope_theta": 777.0}
    other = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    want = other.model.rotary_emb.inv_freq.clone()  # what a model built from this config holds
    model = hf_model("llama", seed=3)
    with trainer_numerics(model):
        first = model.model.rotary_emb.inv_freq.clone()
    with trainer_numerics(other):
        assert torch.equal(other.model.rotary_emb.inv_freq, want)
    assert not torch.equal(first, want)
    assert builds == [torch.float32, torch.float32]


def test_the_cache_keeps_the_newest_within_its_count_and_bytes(
    builds: list[torch.dtype], monkeypatch: pytest.MonkeyPatch
) -> None:
    model = hf_model("llama", seed=3)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        model = model.to(dtype)
        with trainer_numerics(model):
            pass
    assert len(numerics._REFERENCES) == 3
    monkeypatch.setattr(numerics, "_REFERENCES_KEPT", 2)
    with trainer_numerics(hf_model("qwen2", seed=3)):
        pass
    assert len(numerics._REFERENCES) == 2
    monkeypatch.setattr(numerics, "_REFERENCES_BYTES", 1)  # less than any model's buffers
    with trainer_numerics(model.to(torch.bfloat16)):  # built again: it had been dropped
        pass
    assert len(numerics._REFERENCES) == 1
    assert builds == [torch.bfloat16, torch.float16, torch.float32, torch.float32, torch.bfloat16]
