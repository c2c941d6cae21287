"""MoE routing replay with adapter versions: a job with a LoRA adapter and a routing record, packed
with others, is bitwise what a PEFT trainer under ``trainer_numerics`` computes replaying the same
record (``token_logprobs(routed_experts=…)``), for Qwen2-MoE (adapters on the shared expert too)
and Mixtral, tiny models of ``tests/architectures.py``. LoRA applies to ``nn.Linear`` modules
only, which in these models see every row in order (attention, the shared expert and its gate);
a router as a target is refused by name (fused experts, 3-D, by the adapter's checks)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from oldlogit.contract.errors import InvalidRequest
from oldlogit.parity import token_logprobs, trainer_numerics
from oldlogit.parity.lora import adapter_from_peft
from oldlogit_service.model.checkpoints import load_weights
from oldlogit_service.model.engine import Engine, Job, LoraWeights
from oldlogit_service.model.loaded import load_model
from tests.architectures import VOCAB, model_dir

peft = pytest.importorskip("peft")

LENGTHS = (6, 19, 27)
TARGETS = {
    "qwen2_moe": ["q_proj", "v_proj", "shared_expert.gate_proj", "shared_expert_gate"],
    "mixtral": ["q_proj", "o_proj"],
}


def _records(n: int, layers: int, k: int, experts: int, gen: torch.Generator) -> torch.Tensor:
    """[n, layers, k] distinct ids per (row, layer); the first rows and the last route freely."""
    rows = [torch.randperm(experts, generator=gen)[:k] for _ in range(n * layers)]
    out = torch.stack(rows).view(n, layers, k).to(torch.int32)
    out[:2] = -1
    out[-1] = -1
    return out


@pytest.mark.parametrize("arch", ["qwen2_moe", pytest.param("mixtral", marks=pytest.mark.slow)])
def test_adapter_jobs_replaying_routing_are_the_peft_trainers_bits(
    arch: str, tmp_path: Path
) -> None:
    hub = model_dir(tmp_path, arch)
    model = load_model(hub, dtype="float32", device="cpu", tile_rows=16)
    weights = load_weights(hub, model)
    assert weights is not None
    engine = Engine(model, max_batch_tokens=64)
    moe = engine.moe
    assert moe is not None
    layers, k, experts = len(moe.layers), moe.top_k, moe.num_experts

    trainer = AutoModelForCausalLM.from_pretrained(hub, dtype=torch.float32).eval()
    pm = peft.get_peft_model(
        trainer, peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=TARGETS[arch])
    )
    gen = torch.Generator().manual_seed(len(arch))
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if ".lora_A." in name or ".lora_B." in name:  # PEFT starts lora_B at 0
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    adapter = adapter_from_peft(pm)
    lora = LoraWeights("ab" * 32, adapter.spec.as_dict(), dict(adapter.tensors))

    seqs = [torch.randint(3, VOCAB, (n,), generator=gen) for n in LENGTHS]
    records = [_records(len(s), layers, k, experts, gen) for s in seqs]
    pos = [torch.arange(1, len(s)) for s in seqs]
    jobs = [Job(s, p, routing=r, adapter=lora) for s, p, r in zip(seqs, pos, records, strict=True)]
    jobs += [
        Job(seqs[0], pos[0], routing=records[0]),  # the bare weights, the same routing
        Job(seqs[1], pos[1], adapter=lora),  # the adapter, routing freely
    ]
    got = engine.run(weights, jobs)  # one packed forward (and the tail in another)

    with trainer_numerics(pm, tile_rows=16), torch.no_grad():
        for s, r, g in zip(seqs, records, got[:3], strict=True):
            want = token_logprobs(pm, s[None], routed_experts=r[None].long())[0]
            assert torch.equal(want[1:], g)
        packed = token_logprobs(
            pm,
            torch.cat(seqs)[None],
            position_ids=torch.cat([torch.arange(len(s)) for s in seqs])[None],
            routed_experts=torch.cat(records)[None].long(),
        )[0]
        at = 0
        for s, g in zip(seqs, got[:3], strict=True):
            assert torch.equal(packed[at + 1 : at + len(s)], g)
            at += len(s)
        assert torch.equal(token_logprobs(pm, seqs[1][None])[0][1:], got[4])
        with pm.disable_adapter():
            bare = token_logprobs(pm, seqs[0][None], routed_experts=records[0][None].long())[0]
        assert torch.equal(bare[1:], got[3])
    assert not torch.equal(got[0], got[3])  # the adapter counts under the same routing
    assert not torch.equal(got[1], got[4])  # and so does the routing under the same adapter


def test_a_router_as_an_adapter_target_is_refused_by_name(
    tmp_path: Path,
) -> None:
    hub = model_dir(tmp_path, "mixtral")
    model = load_model(hub, dtype="float32", device="cpu", tile_rows=16)
    weights = load_weights(hub, model)
    assert weights is not None
    router = "model.layers.0.mlp.gate"
    out_f, in_f = model.param_specs[f"{router}.weight"][1]
    tensors: dict[str, Any] = {
        f"{router}.lora_A": torch.zeros(2, in_f),
        f"{router}.lora_B": torch.zeros(out_f, 2),
    }
    spec = {
        "rank": 2,
        "alpha": 4.0,
        "use_rslora": False,
        "target_modules": [router],
        "dtype": "float32",
    }
    x = torch.arange(3, 12)
    with pytest.raises(InvalidRequest, match=r"mlp\.gate.*not an nn\.Linear"):
        Engine(model).run(
            weights, [Job(x, torch.arange(1, 9), adapter=LoraWeights("cd" * 32, spec, tensors))]
        )
