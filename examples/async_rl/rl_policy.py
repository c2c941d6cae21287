"""The tiny causal LM on both sides: the trainer's float32 module and the sampler's bf16 copy.

The trainer computes π_θ in float32 (as the oldlogit service does, ``--dtype float32``). The
rollout worker plays an FP8 inference engine: weights quantized to float8 e4m3 with one scale
per tensor, bfloat16 compute. Its behaviour logprobs μ differ from the training side by a
realistic mismatch (KL ≈ 5e-4, |log ρ| up to ≈ 0.2) — the discrepancy term that oldlogit lets
a trainer see separately from staleness.
"""

from __future__ import annotations

from pathlib import Path

import torch
from rl_task import VOCAB
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, Qwen2Config


def build_model(seed: int) -> torch.nn.Module:
    """A 2-layer Qwen2 with a 16-token vocabulary, float32, deterministic init."""
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        max_position_embeddings=64,
        initializer_range=0.02,
        tie_word_embeddings=False,
    )
    config.architectures = ["Qwen2ForCausalLM"]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model


def save_model_dir(model: torch.nn.Module, path: Path) -> Path:
    """config.json + model.safetensors: what ``oldlogit serve --model DIR`` reads as version 0."""
    path.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(path)
    save_file(state_dict(model), str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The parameters by name, float32, detached copies (what the trainer publishes)."""
    return {n: p.detach().clone().contiguous() for n, p in model.named_parameters()}


def token_logprobs(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """[B, T] float32: log p(ids[:, t] | ids[:, :t]); column 0 is 0 (no prefix)."""
    logits = model(input_ids=ids).logits[:, :-1].float()  # [B, T-1, V]
    lp = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None])[..., 0]  # [B, T-1]
    return torch.cat([torch.zeros_like(lp[:, :1]), lp], dim=1)


def fp8_roundtrip(w: torch.Tensor) -> torch.Tensor:
    """Per-tensor scaled float8 e4m3 quantization and back (what an FP8 engine computes with)."""
    fp8 = torch.float8_e4m3fn
    scale = w.abs().max().clamp_min(1e-12) / torch.finfo(fp8).max
    return (w / scale).to(fp8).to(torch.float32) * scale


class Sampler:
    """The inference engine: one version's weights as FP8 (or bf16), multinomial sampling."""

    def __init__(self, seed: int, engine: str = "fp8") -> None:
        if engine not in ("fp8", "bf16"):
            raise ValueError(f"engine must be 'fp8' or 'bf16', got {engine!r}")
        self.module = build_model(seed).to(torch.bfloat16).eval()
        self.engine = engine
        self.version = -1

    def load(self, version: int, weights: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for n, p in self.module.named_parameters():
                w = weights[n].float()
                p.copy_((fp8_roundtrip(w) if self.engine == "fp8" else w).to(torch.bfloat16))
        self.version = version

    @torch.no_grad()
    def step(self, ids: torch.Tensor, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """One more token for each [B, t] row: ([B] token ids, [B] their logprobs μ)."""
        logits = self.module(input_ids=ids).logits[:, -1].float()  # [B, V]
        logp = torch.log_softmax(logits, dim=-1)
        nxt = torch.multinomial(logp.exp(), 1, generator=gen)[:, 0]  # [B]
        return nxt, logp.gather(-1, nxt[:, None])[:, 0]
