"""Named model shapes for the GPU figures (``oldlogit bench ... --shapes NAME``).

``--shapes qwen2.5-1.5b``: Qwen2.5-1.5B's layer shapes (hidden 1536, intermediate 8960, 12
query / 2 key-value heads of 128, vocab 151,936, rope theta 1e6, tied head), 8 of its 28
layers, random bf16 weights from a transformers Qwen2Config (no download); the batch × tokens
rows 1 × 512, 16 × 512 and 4 × 2048. `invariant-vs-plain`, `patched-step-cost` and
`models-vs-hf-forward` run at them (scripts/gpu_checks.sh, docs/performance.md "On a GPU").
With ``--smoke`` the same figures run at a tiny model of the same family and short rows (the
CPU rehearsal of scripts/gpu_checks.sh). Without ``--shapes`` every figure keeps its own
defaults.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

# Qwen2.5-1.5B's config.json (the architecture, not its weights), 8 layers of its 28.
QWEN25_15B: dict[str, Any] = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 1536,
    "intermediate_size": 8960,
    "num_hidden_layers": 8,
    "num_attention_heads": 12,
    "num_key_value_heads": 2,
    "head_dim": 128,
    "vocab_size": 151936,
    "max_position_embeddings": 32768,
    "max_window_layers": 8,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "sliding_window": 32768,
    "use_sliding_window": False,
    "tie_word_embeddings": True,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "bos_token_id": 151643,
    "eos_token_id": 151643,
}
# The rehearsal's model: the same family, tiny.
SMOKE: dict[str, Any] = {
    **QWEN25_15B,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 512,
    "max_window_layers": 2,
    "bos_token_id": 1,
    "eos_token_id": 2,
}

SHAPES: dict[str, dict[str, Any]] = {"qwen2.5-1.5b": QWEN25_15B}
ROWS: dict[str, list[tuple[int, int]]] = {"qwen2.5-1.5b": [(1, 512), (16, 512), (4, 2048)]}
SMOKE_ROWS = [(1, 32), (4, 32), (2, 64)]


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--shapes",
        choices=sorted(SHAPES),
        default=None,
        help="invariant, parity's patched-step-cost, models: run at this model's layer shapes "
        "(bf16, random weights) and its batch × tokens rows (the GPU figures)",
    )


def name(args: argparse.Namespace) -> str | None:
    """The ``--shapes`` asked for, or None (each figure's own defaults)."""
    shapes: str | None = getattr(args, "shapes", None)
    return shapes


def config(args: argparse.Namespace) -> dict[str, Any]:
    """The transformers config fields of ``--shapes`` (tiny with ``--smoke``)."""
    shapes = name(args)
    if shapes is None:
        raise ValueError("no --shapes given")
    return SMOKE if getattr(args, "smoke", False) else SHAPES[shapes]


def rows(args: argparse.Namespace) -> list[tuple[int, int]]:
    """The batch × tokens rows of ``--shapes`` (short ones with ``--smoke``)."""
    shapes = name(args)
    if shapes is None:
        raise ValueError("no --shapes given")
    return SMOKE_ROWS if getattr(args, "smoke", False) else ROWS[shapes]


def describe(fields: dict[str, Any]) -> str:
    return (
        f"qwen2: hidden {fields['hidden_size']}, {fields['num_hidden_layers']} layers, "
        f"{fields['num_attention_heads']}/{fields['num_key_value_heads']} heads, "
        f"vocab {fields['vocab_size']}"
    )


def hf_config(fields: dict[str, Any]) -> Any:
    from transformers import AutoConfig

    kept = {k: v for k, v in fields.items() if k != "model_type"}
    return AutoConfig.for_model(fields["model_type"], **kept)


def build(
    fields: dict[str, Any], *, device: torch.device, dtype: torch.dtype = torch.bfloat16
) -> Any:
    """The HF model with random weights (seed 0), built on ``device``, in eval mode; transformers'
    sdpa attention (the plain forward the figures compare against)."""
    from transformers import AutoModelForCausalLM

    with torch.random.fork_rng(devices=[]), torch.device(device):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(
            hf_config(fields), dtype=dtype, attn_implementation="sdpa"
        )
    return model.eval()


def settle(device: torch.device) -> None:
    """Wait for the device's queued kernels (a timed call ends when its work has)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
