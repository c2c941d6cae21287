"""The architecture matrix: tiny configs of decoder-only families transformers builds.

Every option that changes the numerics is set to a non-default value, so an option the service
skipped would show: rope scaling (linear, dynamic, yarn, longrope, per layer type), sliding
windows narrower than the test sequences, attention and final logit soft-capping, logit
scaling (Granite ``logits_scaling``, Cohere ``logit_scale``), embedding/residual/attention
multipliers, q/k norms, biases, tied embeddings, MoE routing (top-k renormalisation, shared
experts, DeepSeek-V3's grouped routing with a non-zero ``e_score_correction_bias``).
``model_dir`` writes one with ``save_pretrained`` (the hub layout: MoE experts per expert) or,
with ``fused=True``, the state dict as transformers holds it in memory.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

VOCAB = 160
WINDOW = 6  # narrower than every test sequence past the first few tokens

BASE: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 48,
    "max_position_embeddings": 256,
    "initializer_range": 0.2,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}

ARCHS: dict[str, dict[str, Any]] = {
    "llama": {
        "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 5000.0},
        "attention_bias": True,
        "mlp_bias": True,
    },
    "qwen2": {
        "use_sliding_window": True,
        "sliding_window": WINDOW,
        "max_window_layers": 1,
        "rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
    },
    "qwen3": {
        "head_dim": 8,
        "use_sliding_window": True,
        "sliding_window": WINDOW,
        "max_window_layers": 1,
        "rope_parameters": {
            "rope_type": "yarn",
            "factor": 2.0,
            "rope_theta": 10000.0,
            "original_max_position_embeddings": 128,
        },
    },
    "mistral": {"sliding_window": WINDOW, "head_dim": 8},
    "gemma": {"head_dim": 8, "tie_word_embeddings": True},
    "gemma2": {
        "head_dim": 8,
        "sliding_window": WINDOW,
        "final_logit_softcapping": 3.0,
        "attn_logit_softcapping": 4.0,
        "query_pre_attn_scalar": 12,
    },
    "gemma3_text": {
        "head_dim": 8,
        "sliding_window": WINDOW,
        "final_logit_softcapping": 3.0,
        "query_pre_attn_scalar": 12,
        "layer_types": ["sliding_attention", "full_attention"],
        "rope_parameters": {
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 500.0},
        },
    },
    "phi3": {
        "sliding_window": WINDOW,
        "rope_parameters": {
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "short_factor": [1.0, 1.1, 1.2, 1.3],
            "long_factor": [2.0, 2.1, 2.2, 2.3],
            "original_max_position_embeddings": 64,
        },
    },
    "olmo2": {},
    "granite": {
        "logits_scaling": 4.0,
        "embedding_multiplier": 3.0,
        "residual_multiplier": 0.5,
        "attention_multiplier": 0.2,
    },
    "cohere": {"logit_scale": 0.3, "use_qk_norm": True, "tie_word_embeddings": True},
    "qwen2_moe": {
        "moe_intermediate_size": 16,
        "shared_expert_intermediate_size": 24,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
    },
    "qwen3_moe": {
        "head_dim": 8,
        "moe_intermediate_size": 16,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
        "mlp_only_layers": [0],
    },
    "mixtral": {
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "sliding_window": WINDOW,
        "head_dim": 8,
    },
    "deepseek_v3": {
        "num_key_value_heads": 4,
        "moe_intermediate_size": 16,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "n_group": 2,
        "topk_group": 1,
        "first_k_dense_replace": 1,
        "q_lora_rank": 16,
        "kv_lora_rank": 16,
        "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 8,
        "v_head_dim": 8,
        "routed_scaling_factor": 1.7,
        "n_shared_experts": 1,
        "rope_parameters": {
            "rope_type": "yarn",
            "factor": 2.0,
            "rope_theta": 10000.0,
            "original_max_position_embeddings": 128,
        },
    },
}

MOE = ("qwen2_moe", "qwen3_moe", "mixtral", "deepseek_v3")


def config(arch: str) -> Any:
    from transformers import AutoConfig

    return AutoConfig.for_model(arch, **{**BASE, **ARCHS[arch]})


def hf_model(arch: str, seed: int = 0, dtype: torch.dtype = torch.float32) -> Any:
    """A seeded random model; constant-initialised tensors (norms, biases, the routing bias)
    get noise too, so every weight moves the logits."""
    from transformers import AutoModelForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config(arch), dtype=torch.float32)
        with torch.no_grad():
            for _, t in [*model.named_parameters(), *model.named_buffers()]:
                if t.is_floating_point() and t.numel() > 1 and bool((t == t.flatten()[0]).all()):
                    t.add_(0.1 * torch.randn_like(t))
    return model.to(dtype).eval()


def attention_windows(arch: str) -> list[list[int]]:
    """[layer index, sliding window (0: none)] each layer's attention computes with under
    ``trainer_numerics``, as the service records them at start-up."""
    from oldlogit.parity import token_logprobs, trainer_numerics
    from oldlogit.parity.attention import recording_windows

    model = hf_model(arch)
    with trainer_numerics(model), recording_windows() as seen:
        token_logprobs(model, torch.arange(3, 13)[None])
    return [list(x) for x in sorted(seen.items())]


def persistent_state(model: Any) -> dict[str, torch.Tensor]:
    """What a trainer publishes: ``model.state_dict()`` as it is (tied entries included)."""
    return {k: v.detach() for k, v in model.state_dict().items()}


def model_dir(path: Path, arch: str, *, seed: int = 0, fused: bool = False) -> Path:
    """``save_pretrained`` of the seeded model (hub layout), or its in-memory state dict."""
    model = hf_model(arch, seed)
    path.mkdir(parents=True, exist_ok=True)
    if not fused:
        model.save_pretrained(path)
        return path
    model.config.save_pretrained(path)
    state = {k: v.contiguous() for k, v in persistent_state(model).items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def word_tokenizer(vocab_size: int) -> Any:
    """A word-level tokenizer over a tiny model's vocabulary ("w0" … "w{V-4}", then unk, pad
    and eos): no hub, no download."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(vocab_size - 3)}
    vocab.update({"<unk>": vocab_size - 3, "<pad>": vocab_size - 2, "<eos>": vocab_size - 1})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", eos_token="<eos>"
    )
