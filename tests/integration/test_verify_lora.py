"""``oldlogit.parity.verify`` on a PEFT LoRA model against an adapter version.

A PEFT model over the served base version, its adapter published with ``publish_adapter``:
the canary passes bitwise (its base checked against the base version's hash, its adapter
against the adapter version's). One perturbed lora_B is caught twice: by the adapter's hash
(``WeightsMismatch``) and, with ``check_weights=False``, by the canary itself — ``ParityBroken``
naming the layer whose attention holds the perturbed LoRA layer. A PEFT model against a
full-weights version, and a plain model against an adapter version, are ``WeightsMismatch``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from oldlogit import Client
from oldlogit.contract.errors import WeightsMismatch
from oldlogit.parity import ParityBroken, verify

from .conftest import WRITE_TOKEN, Served, start_served

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.integration

BASE, ADAPTER = 3, 20
TARGETS = ["q_proj", "v_proj", "down_proj"]


@pytest.fixture(scope="module")
def published(
    tmp_path_factory: pytest.TempPathFactory, model_dir: Path
) -> Iterator[tuple[Served, Any]]:
    """The service with adapter version ``ADAPTER`` over ``BASE``, and the PEFT model it is."""
    s = start_served(tmp_path_factory.mktemp("verify-lora"), model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    model.load_state_dict(s.weights[BASE])
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=TARGETS)
    pm = peft.get_peft_model(model, config)
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if ".lora_A." in name or ".lora_B." in name:  # PEFT starts lora_B at 0
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    with Client(s.server.grpc_url, token=WRITE_TOKEN) as c:
        c.publish_adapter(ADAPTER, pm, base_version=BASE)
    yield s, pm
    s.server.stop()


def test_verify_passes_on_the_adapter_version(
    published: tuple[Served, Any], transport: str
) -> None:
    served, pm = published
    pm.train()  # verify scores in eval mode and restores the mode
    with Client(served.url(transport)) as c:
        report = verify(pm, c, ADAPTER, temperature=0.7)
    assert report.policy_version == ADAPTER and report.tokens > 100
    assert pm.training


def test_a_perturbed_lora_b_is_found_and_named(published: tuple[Served, Any]) -> None:
    served, pm = published
    lora_b = pm.base_model.model.model.layers[1].self_attn.v_proj.lora_B["default"].weight
    saved = lora_b.detach().clone()
    try:
        with torch.no_grad():
            lora_b[0, 0] += 0.5
        with Client(served.server.grpc_url) as c:
            with pytest.raises(WeightsMismatch, match="adapter of version 20") as hashed:
                verify(pm, c, ADAPTER)
            assert hashed.value.parameter == "version"
            with pytest.raises(ParityBroken) as broken:
                verify(pm, c, ADAPTER, check_weights=False)
    finally:
        with torch.no_grad():
            lora_b.copy_(saved)
    err = broken.value
    assert err.stage == "model.layers.1.self_attn", str(err)
    assert 0 < err.tokens_off <= err.tokens
    message = str(err)
    assert "layer 1's attention output" in message
    assert "(the 8 stages before agree)" in message  # the embeddings to layer 1's norm
    assert "model.layers.1.self_attn.q_proj, model.layers.1.self_attn.v_proj" in message
    assert "lora_A/lora_B" in message and "Usually" not in message  # the adapter's hint


def test_the_wrong_kind_of_version_is_named(published: tuple[Served, Any], model_dir: Path) -> None:
    served, pm = published
    plain = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    plain.load_state_dict(served.weights[BASE])
    with Client(served.server.grpc_url) as c:
        with pytest.raises(WeightsMismatch, match="is full weights, the model has PEFT LoRA"):
            verify(pm, c, BASE)
        with pytest.raises(WeightsMismatch, match="adapter version over base version 3"):
            verify(plain, c, ADAPTER)
        assert verify(plain, c, BASE).tokens > 100  # the base itself
