"""A real TRL ``GRPOTrainer`` with π_old from the service and π_θ from ``token_logprobs``.

The trainer publishes its weights after every optimizer step (the version the next samples are
generated with), asks the service for π_old of each completion at that version, and computes
π_θ with the model patched for the whole run (``patch_numerics``: forward, backward and
activation-checkpoint recomputation; generation runs the model's own forward). With one PPO
iteration per generation (zero staleness) the
ratio π_θ / π_old is exactly 1 on every completion token — measured inside TRL's loss on the
same tensors it uses, not TRL's own detached logps (which would make it 1 trivially). TRL's
plain bf16 forward, by contrast, is off from the service.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from oldlogit import Client, Sequence
from oldlogit.parity import patch_numerics, token_logprobs
from oldlogit_service.config import Settings
from oldlogit_service.server import ServerThread
from tests.integration.conftest import WRITE_TOKEN

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")


def _tokenizer(vocab_size: int) -> Any:
    """A word-level tokenizer over the tiny model's vocabulary (no hub, no download)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(vocab_size - 3)}
    vocab.update({"<unk>": vocab_size - 3, "<pad>": vocab_size - 2, "<eos>": vocab_size - 1})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", eos_token="<eos>"
    )


class ServicePiOldGRPO(trl.GRPOTrainer):  # type: ignore[misc]
    """GRPO with π_old from an oldlogit service and π_θ under the shared numerics."""

    def __init__(self, *args: Any, oldlogit: Client, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.oldlogit = oldlogit
        self.numerics = patch_numerics(self.model, like=oldlogit.info().numerics_spec())
        self.ratios: list[torch.Tensor] = []  # π_θ / π_old on scored tokens, every micro-batch
        self.plain_gaps: list[float] = []  # |TRL's own logp − π_old|, for contrast
        self._published = -1
        self._publish()

    def _publish(self) -> None:
        """The weights the next samples are drawn with become version ``global_step``."""
        version = int(self.state.global_step)
        if version > self._published:
            state = {k: v.detach() for k, v in self.model.state_dict().items()}
            self.oldlogit.publish(version, state, delta=True, fallback_full=True)
            self._published = version

    def _get_per_token_logps_and_entropies(  # type: ignore[override]
        self,
        model: torch.nn.Module,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        logits_to_keep: int,
        batch_size: int | None = None,
        compute_entropy: bool = False,
        compute_aux_loss: bool = False,
        **_: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None, None]:
        logps = token_logprobs(
            model,
            input_ids,
            attention_mask,
            logits_to_keep=logits_to_keep,
            temperature=self.temperature,
        )
        return logps, (torch.zeros_like(logps) if compute_entropy else None), None

    def _generate_and_score_completions(self, inputs: Any) -> dict[str, Any]:
        self._publish()
        out: dict[str, Any] = super()._generate_and_score_completions(inputs)
        version = self._published
        prompt_ids, prompt_mask = out["prompt_ids"], out["prompt_mask"]
        comp_ids, comp_mask = out["completion_ids"], out["completion_mask"]
        seqs, starts = [], []
        for p, pm, c, cm in zip(prompt_ids, prompt_mask, comp_ids, comp_mask, strict=True):
            prompt = p[pm.bool()].tolist()
            seqs.append(
                Sequence(
                    token_ids=prompt + c[cm.bool()].tolist(),
                    policy_version=version,
                    score_from=len(prompt),
                )
            )
            starts.append(len(prompt))
        results = self.oldlogit.logprobs_batch(seqs, temperature=self.temperature, use_cache=False)
        old = torch.zeros(comp_ids.shape, dtype=torch.float32)
        for i, (res, start) in enumerate(zip(results, starts, strict=True)):
            values = torch.from_numpy(res.logprobs[start:].copy())
            old[i, : values.shape[0]] = values
        # For contrast: TRL's own forward (fused head, bf16 logits ÷ temperature) at the same
        # weights, unpatched.
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
        self.plain_gaps.append(float(((plain.float() - old).abs() * comp_mask).max()))
        out["old_per_token_logps"] = old.to(comp_ids.device)
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
        self.ratios.append(torch.exp(theta - inputs["old_per_token_logps"])[mask])
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


def test_grpo_ratio_is_exactly_one_at_zero_staleness(fresh_server, model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    vocab = model.config.vocab_size
    tokenizer = _tokenizer(vocab)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    rng = np.random.default_rng(0)
    prompts = [" ".join(f"w{t}" for t in rng.integers(0, vocab - 3, 5)) for _ in range(8)]
    dataset = datasets.Dataset.from_dict({"prompt": prompts})

    def reward(completions: list[str], **_: Any) -> list[float]:
        return [float(len(c.split()) % 3) for c in completions]  # any signal: advantages ≠ 0

    args = trl.GRPOConfig(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=8,
        max_steps=3,
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
    with Client(fresh_server.grpc_url, token=WRITE_TOKEN) as client:
        trainer = ServicePiOldGRPO(
            model=model,
            reward_funcs=reward,
            args=args,
            train_dataset=dataset,
            processing_class=tokenizer,
            oldlogit=client,
        )
        trainer.train()
        trainer.numerics.restore()
        versions = [v.policy_version for v in client.versions()]
    ratios = torch.cat(trainer.ratios)
    assert trainer.state.global_step == 3 and {1, 2} <= set(versions)  # published every step
    assert ratios.numel() >= 3 * 4  # completion tokens scored over three steps
    assert bool((ratios == 1.0).all()), ratios
    # The weights moved between steps (so the versions differ), and TRL's own bf16 forward is
    # not the service's numerics: the gap the shared forward closes.
    assert max(trainer.plain_gaps) > 0.0
