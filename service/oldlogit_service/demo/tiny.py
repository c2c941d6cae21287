"""A seeded random causal LM written to disk (config.json + safetensors): offline test models.

In: the architecture and sizes. Out: an HF-format directory. Used by the demo, the tests and
the benchmarks; never by the serving path.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import Tensor

from oldlogit_service.model.backends import auto_causal_lm

__all__ = ["make_tiny_model_dir"]


def make_tiny_model_dir(
    path: str | Path,
    *,
    arch: str = "qwen2",
    seed: int = 0,
    vocab_size: int = 512,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    max_positions: int = 2048,
    tie_word_embeddings: bool = False,
    dtype: str = "float32",
    shards: int = 1,
    initializer_range: float = 0.2,
) -> Path:
    """Write a seeded random causal LM (config.json + safetensors) to ``path``; offline.

    ``initializer_range`` 0.2 (HF uses 0.02) gives peaked, non-trivial distributions, and the
    constant-initialised parameters (norm weights, biases) get noise too, so every parameter
    moves the logits. ``shards > 1`` writes HF-style shards with a
    ``model.safetensors.index.json``. Does not disturb the global RNG.
    """
    from transformers import LlamaConfig, Qwen2Config

    common: dict[str, Any] = {
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "intermediate_size": intermediate_size,
        "max_position_embeddings": max_positions,
        "tie_word_embeddings": tie_word_embeddings,
        "initializer_range": initializer_range,
    }
    if arch == "qwen2":
        config: Any = Qwen2Config(**common)
        config.architectures = ["Qwen2ForCausalLM"]
    elif arch == "llama":
        config = LlamaConfig(**common)
        config.architectures = ["LlamaForCausalLM"]
    else:
        raise ValueError(f"unknown tiny architecture {arch!r}: use 'qwen2' or 'llama'")
    torch_dtype = getattr(torch, dtype.removeprefix("torch."), None)
    if not isinstance(torch_dtype, torch.dtype) or not torch_dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating torch dtype name, got {dtype!r}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        hf_model = auto_causal_lm().from_config(config, dtype=torch.float32)
        params = dict(hf_model.named_parameters())  # canonical: a tied head appears once
        tensors: dict[str, Tensor] = {}
        for name, param in params.items():
            value = param.detach().float()
            if value.numel() > 1 and bool((value == value.flatten()[0]).all()):
                value = value + 0.1 * torch.randn_like(value)  # norms = 1, biases = 0
            tensors[name] = value.to(torch_dtype).contiguous()

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    config.dtype = torch_dtype  # the dtype the weights are saved in, as HF records it
    config.save_pretrained(out)  # config.json
    names = list(tensors)
    shards = max(1, min(shards, len(names)))
    if shards == 1:
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        return out
    weight_map: dict[str, str] = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        lo, hi = i * len(names) // shards, (i + 1) * len(names) // shards
        part = {n: tensors[n] for n in names[lo:hi]}
        save_file(part, str(out / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return out
