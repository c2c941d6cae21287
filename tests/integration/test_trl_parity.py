"""A real TRL ``GRPOTrainer`` with π_old from the service: ``oldlogit.integrations.trl``.

The trainer publishes its weights after every optimizer step (the version the next samples are
generated with), asks the service for π_old of each completion at that version, and computes
π_θ with the model patched for the whole run (``patch_numerics``: forward, backward and
activation-checkpoint recomputation; generation runs the model's own forward). With one PPO
iteration per generation (zero staleness) the ratio π_θ / π_old is exactly 1 on every
completion token — measured inside TRL's loss on the same tensors it uses, not TRL's own
detached logps (which would make it 1 trivially). TRL's plain bf16 forward, by contrast, is off
from the service. With two optimizer steps per generation the second step trains on samples of
the previous version: π_old is still the service's answer at that older version (bitwise), and
the ratio then measures the staleness only. With ``peft_config`` (LoRA) every version is an
adapter version over one base version, and the ratio is exactly 1 all the same.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from oldlogit import Client
from oldlogit.integrations.trl import OldLogitGRPOTrainer
from oldlogit.parity import patch_numerics
from oldlogit.parity.numerics import active_patch
from oldlogit_service.config import Settings
from oldlogit_service.server import ServerThread
from tests.architectures import word_tokenizer
from tests.integration.conftest import WRITE_TOKEN

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")


class ServicePiOldGRPO(OldLogitGRPOTrainer):
    """The integration, recording π_θ / π_old inside TRL's loss and TRL's own plain forward."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.ratios: list[tuple[int, torch.Tensor]] = []  # (generated at, π_θ / π_old) per step
        self.plain_gaps: list[float] = []  # |TRL's own logp − π_old|, for contrast
        self.old_seen: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def _generate_and_score_completions(self, inputs: Any) -> dict[str, Any]:
        out = super()._generate_and_score_completions(inputs)
        prompt_ids, comp_ids = out["prompt_ids"], out["completion_ids"]
        prompt_mask, comp_mask = out["prompt_mask"], out["completion_mask"]
        # For contrast: TRL's own forward (fused head, bf16 logits ÷ temperature) at the same
        # weights, unpatched.
        assert self.numerics is not None
        self.numerics.restore()
        with torch.no_grad():
            plain, _, _ = trl.GRPOTrainer._get_per_token_logps_and_entropies(
                self,
                self.model,
                torch.cat([prompt_ids, comp_ids], 1),
                torch.cat([prompt_mask, comp_mask], 1),
                comp_ids.shape[1],
            )
        self.numerics = patch_numerics(self.model, like=self.numerics.spec)
        old = out["old_per_token_logps"]
        self.plain_gaps.append(float(((plain.float() - old).abs() * comp_mask).max()))
        ids = torch.cat([prompt_ids, comp_ids], 1)
        mask = torch.cat([prompt_mask, comp_mask], 1)
        self.old_seen.append((self.generated_version, ids, mask, old))
        return out

    def _compute_loss(self, model: torch.nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
        prompt_ids, comp_ids = inputs["prompt_ids"], inputs["completion_ids"]
        mask = inputs["completion_mask"].bool()
        with torch.no_grad():
            theta, _, _ = self._get_per_token_logps_and_entropies(
                model,
                torch.cat([prompt_ids, comp_ids], 1),
                torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1),
                comp_ids.shape[1],
            )
        ratio = torch.exp(theta - inputs["old_per_token_logps"])[mask]
        self.ratios.append((self.generated_version, int(self.state.global_step), ratio))
        loss: torch.Tensor = super()._compute_loss(model, inputs)
        return loss


@pytest.fixture
def fresh_server(tmp_path: Path, model_dir: Path) -> Iterator[ServerThread]:
    """A service holding only version 0 (the directory's weights), as a trainer starts."""
    settings = Settings(
        model=model_dir,
        snapshot_dir=tmp_path / "snapshots",
        http_port=0,
        grpc_port=0,
        dtype="bfloat16",
        write_token=WRITE_TOKEN,
    )
    server = ServerThread(settings).start()
    yield server
    server.stop()


def _run(
    server: Any,
    model_dir: Path,
    tmp_path: Path,
    steps_per_generation: int,
    cast: bool = False,
    **trainer_kwargs: Any,
) -> Any:
    from transformers import AutoModelForCausalLM

    if cast:  # a whole-module cast, as many scripts and DeepSpeed's bf16 mode do
        model = AutoModelForCausalLM.from_pretrained(model_dir).to(torch.bfloat16)
        assert model.model.rotary_emb.inv_freq.dtype == torch.bfloat16
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    vocab = model.config.vocab_size
    tokenizer = word_tokenizer(vocab)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    rng = np.random.default_rng(0)
    prompts = [" ".join(f"w{t}" for t in rng.integers(0, vocab - 3, 5)) for _ in range(16)]
    dataset = datasets.Dataset.from_dict({"prompt": prompts})

    def reward(completions: list[str], **_: Any) -> list[float]:
        # Any content signal, so advantages are not all 0 and every step moves the weights.
        return [float(sum(w.startswith("w1") for w in c.split())) for c in completions]

    args = trl.GRPOConfig(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=4,
        num_generations=4,
        steps_per_generation=steps_per_generation,
        max_completion_length=8,
        max_steps=4 if steps_per_generation > 1 else 3,
        learning_rate=1e-2,
        temperature=0.7,
        beta=0.0,
        num_iterations=1,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        bf16=False,
        seed=0,
        dataloader_num_workers=0,
    )
    client = Client(server.grpc_url, token=WRITE_TOKEN)
    trainer = ServicePiOldGRPO(
        model=model,
        reward_funcs=reward,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        oldlogit=client,
        **trainer_kwargs,
    )
    trainer.train()
    trainer.numerics.restore()
    return trainer, client


def test_grpo_ratio_is_exactly_one_at_zero_staleness(fresh_server, model_dir, tmp_path):
    trainer, client = _run(fresh_server, model_dir, tmp_path, steps_per_generation=1)
    with client:
        hashes = {v.policy_version: v.weight_sha256 for v in client.versions()}
    ratios = torch.cat([r for _, _, r in trainer.ratios])
    assert trainer.state.global_step == 3 and {0, 1, 2, 3} <= set(hashes)  # every step
    assert len({hashes[v] for v in (0, 1, 2, 3)}) == 4  # and every step moved the weights
    assert ratios.numel() >= 3 * 4  # completion tokens scored over three steps
    assert bool((ratios == 1.0).all()), ratios
    # The weights moved between steps (so the versions differ), and TRL's own bf16 forward is
    # not the service's numerics: the gap the shared forward closes.
    assert max(trainer.plain_gaps) > 0.0


def test_grpo_with_a_module_cast_model_ratio_is_exactly_one(fresh_server, model_dir, tmp_path):
    """``from_pretrained()`` then ``.to(torch.bfloat16)`` casts the rotary ``inv_freq`` too;
    under the patch the forward reads the config's values, so the ratio is still exactly 1
    (the trainer's parity canary, run on its first version, passed before any step)."""
    trainer, client = _run(fresh_server, model_dir, tmp_path, steps_per_generation=1, cast=True)
    ratios = torch.cat([r for _, _, r in trainer.ratios])
    assert trainer.verified_version == 0
    assert ratios.numel() >= 3 * 4 and bool((ratios == 1.0).all()), ratios
    with client:  # every step published (the bf16 weights as the trainer holds them)
        assert {0, 1, 2, 3} <= {v.policy_version for v in client.versions()}
    # The model is as the trainer made it once the patch is gone: its buffers still bf16.
    assert trainer.model.model.rotary_emb.inv_freq.dtype == torch.bfloat16


def test_grpo_samples_of_an_older_version_get_that_versions_pi_old(
    fresh_server, model_dir, tmp_path
):
    """Two optimizer steps per generation: the second trains on samples of the version before."""
    trainer, client = _run(fresh_server, model_dir, tmp_path, steps_per_generation=2)
    by_step = {step: (gen, r) for gen, step, r in trainer.ratios}
    assert sorted(by_step) == [0, 1, 2, 3]
    for step, (generated, ratio) in by_step.items():
        assert generated == step - step % 2  # generated at the block's first step
        if step % 2 == 0:
            assert bool((ratio == 1.0).all()), step  # zero staleness: exactly 1
        else:
            assert not bool((ratio == 1.0).all()), step  # the weights moved since
    with client:
        for generated, ids, mask, old in trainer.old_seen:  # the older version's answer
            width = ids.shape[1] - old.shape[1]
            for version in (generated, generated + 1):
                again = client.logprobs_padded(
                    ids, mask, score_from=width, policy_version=version, temperature=0.7
                )
                same = torch.equal(again.logprobs[:, width:], old)
                assert same is (version == generated), version


@pytest.mark.parametrize(("base_version", "first_version"), [(None, 0), (0, 5)])
def test_grpo_with_peft_config_publishes_adapters_ratio_exactly_one(
    fresh_server, model_dir, tmp_path, base_version, first_version
):
    """LoRA (``peft_config``): the base once (published by the trainer at ``first_version``,
    a no-op when the service holds it, or named by ``base_version``), then one adapter version
    per step over it; π_θ of the PEFT model is the service's π_old at the adapter version."""
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    trainer, client = _run(
        fresh_server,
        model_dir,
        tmp_path,
        steps_per_generation=1,
        peft_config=config,
        base_version=base_version,
        first_version=first_version,
    )
    first = first_version + (1 if base_version is None else 0)  # the first adapter version
    assert trainer.base_version == 0 and trainer.verified_version == first
    assert trainer.published_version == first + 3
    ratios = torch.cat([r for _, _, r in trainer.ratios])
    assert [gen for gen, _, _ in trainer.ratios] == [first, first + 1, first + 2]
    assert ratios.numel() >= 3 * 4 and bool((ratios == 1.0).all()), ratios
    with client:
        infos = {v.policy_version: v for v in client.versions()}
    adapters = [infos[v] for v in range(first, first + 4)]
    assert all(a.kind == "adapter" and a.adapter_of == 0 for a in adapters)
    assert len({a.weight_sha256 for a in adapters}) == 4  # every step moved the adapter
    assert infos[0].kind != "adapter" and set(infos) == {0, *range(first, first + 4)}
    assert max(trainer.plain_gaps) > 0.0


def test_grpo_lora_base_version_refusals(fresh_server, model_dir, tmp_path):
    """A ``base_version`` whose weights are not the model's base, and one given to a model
    without LoRA, are refused before any step."""
    from transformers import AutoModelForCausalLM

    from oldlogit.contract.errors import WeightsMismatch

    peft = pytest.importorskip("peft")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    other = {k: v + 1 if v.is_floating_point() else v for k, v in model.state_dict().items()}
    tokenizer = word_tokenizer(model.config.vocab_size)
    args = trl.GRPOConfig(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=4,
        num_generations=4,
        max_steps=1,
        report_to=[],
        use_cpu=True,
    )
    dataset = datasets.Dataset.from_dict({"prompt": ["w1 w2"] * 4})
    common = dict(
        reward_funcs=lambda completions, **_: [0.0] * len(completions),
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
    )
    with Client(fresh_server.grpc_url, token=WRITE_TOKEN) as client:
        client.publish(1, other)
        config = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"])
        with pytest.raises(WeightsMismatch, match="base weights are not version 1's") as err:
            OldLogitGRPOTrainer(
                model=model,
                peft_config=config,
                oldlogit=client,
                base_version=1,
                first_version=2,
                **common,
            )
        assert err.value.parameter == "base_version"
        plain = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
        with pytest.raises(ValueError, match="no PEFT LoRA layers"):
            OldLogitGRPOTrainer(
                model=plain, oldlogit=client, base_version=0, first_version=2, **common
            )
        assert {v.policy_version for v in client.versions()} == {0, 1}  # nothing published
    assert active_patch(model) is None and active_patch(plain) is None  # the patch undone
