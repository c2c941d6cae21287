"""invariant-vs-plain: what the batch-invariant numerics cost in process, no server.

transformers' own forward + float32 log-softmax +
gather ÷ the invariant forward and processing (``trainer_numerics`` + ``token_logprobs``)
on the same batch, per model and batch × tokens (fp32 hidden 256 / 4 layers / vocab 4,096;
bf16 at Qwen2.5-0.5B's layer shapes with vocab 32,768, 4 layers; 1 × 128, 16 × 128,
4 × 512); the two variants interleaved, median of the per-round ratios.

``oldlogit bench invariant`` runs this figure alone; the ``parity`` suite includes it.
``--device cuda`` runs both forwards on the GPU (each timed call waits for its kernels).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import statistics
import tempfile
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import Figure, interleaved

# Qwen2.5-0.5B's layer shapes with a 32,768-token vocabulary (invariant-vs-plain's bf16 model).
BF16_05B_LAYERS = {
    "hidden_size": 896,
    "num_heads": 14,
    "num_kv_heads": 2,
    "intermediate_size": 4864,
    "vocab_size": 32768,
}


def _plain_logprobs(model: Any, ids: torch.Tensor) -> torch.Tensor:
    """transformers' own forward, then a float32 log-softmax and a gather: [B, T - 1]."""
    logits = model(input_ids=ids, use_cache=False).logits[:, :-1]  # [B, T-1, V]
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, ids[:, 1:, None])[..., 0]


def fp32_model_dir(root: Path, hidden: int, vocab: int) -> Path:
    """invariant-vs-plain's float32 model: Qwen2, 4 layers, ``hidden`` wide (heads of 32)."""
    from oldlogit_service.demo.tiny import make_tiny_model_dir

    return make_tiny_model_dir(
        root / "inv-fp32",
        arch="qwen2",
        seed=0,
        vocab_size=vocab,
        hidden_size=hidden,
        num_layers=4,
        num_heads=max(1, hidden // 64) * 2,
        num_kv_heads=max(1, hidden // 64),
        intermediate_size=3 * hidden,
        max_positions=4096,
        dtype="float32",
        initializer_range=0.02,
    )


def models(args: argparse.Namespace, root: Path) -> dict[str, Path]:
    """The figure's two model directories: "fp32" (small) and "bf16" (0.5B layer shapes)."""
    from oldlogit_service.demo.tiny import make_tiny_model_dir

    h, v = args.invariant_small
    return {
        "fp32": fp32_model_dir(root, h, v),
        "bf16": make_tiny_model_dir(
            root / "inv-bf16",
            arch="qwen2",
            seed=0,
            num_layers=4,
            max_positions=4096,
            dtype="bfloat16",
            initializer_range=0.02,
            **args.invariant_bf16_shape,
        ),
    }


def shapes(args: argparse.Namespace) -> list[tuple[int, int]]:
    """batch × tokens rows of the table."""
    return [(1, 128), (16, 128), (4, 512)] if not args.smoke else [(1, 32), (4, 32)]


def figures(args: argparse.Namespace, root: Path) -> list[Figure]:
    from transformers import AutoModelForCausalLM

    from oldlogit.parity import token_logprobs, trainer_numerics

    figures = []
    device = torch.device(getattr(args, "device", "cpu"))
    # Work on a GPU is asynchronous: each timed call ends when its kernels have.
    settle = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for label, model_dir in models(args, root).items():
        dtype = torch.float32 if label == "fp32" else torch.bfloat16
        model: Any = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).eval()
        model = model.to(device)
        vocab = int(model.config.vocab_size)
        for batch, tokens in shapes(args):
            ids = torch.randint(
                0, vocab, (batch, tokens), generator=torch.Generator().manual_seed(0)
            ).to(device)

            def plain(ids: torch.Tensor = ids, model: Any = model) -> None:
                with torch.inference_mode():
                    _plain_logprobs(model, ids)
                settle()

            def invariant(ids: torch.Tensor = ids, model: Any = model) -> None:
                with torch.inference_mode():
                    token_logprobs(model, ids)
                settle()

            plain_s, inv_s, ratios = interleaved(
                (contextlib.nullcontext, plain),
                (functools.partial(trainer_numerics, model), invariant),
                rounds=args.invariant_rounds,
                reps=args.invariant_reps,
            )
            figures.append(
                Figure(
                    "invariant-vs-plain",
                    f"{label} {batch} × {tokens}: plain time ÷ invariant time, in process"
                    + ("" if device.type == "cpu" else f" on {device.type}"),
                    statistics.median(ratios),
                    "ratio",
                    ">= 0.95",
                    {
                        "plain_ms": 1e3 * statistics.median(plain_s),
                        "invariant_ms": 1e3 * statistics.median(inv_s),
                        "ratios": ratios,
                        "model": f"{label}: hidden {model.config.hidden_size}, 4 layers, "
                        f"vocab {vocab}",
                        "device": str(device),
                    },
                )
            )
        del model
    return figures


def run(args: argparse.Namespace) -> list[Figure]:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    return figures(args, Path(tempfile.mkdtemp(prefix="oldlogit-bench-invariant-")))


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--invariant-rounds", type=int, default=4, help="invariant-vs-plain: interleaved rounds"
    )
    p.add_argument(
        "--invariant-reps", type=int, default=5, help="invariant-vs-plain: timed calls per round"
    )
    # invariant-vs-plain's models: fp32 (hidden, vocab); bf16 at Qwen2.5-0.5B's layer shapes.
    p.set_defaults(invariant_small=(256, 4096), invariant_bf16_shape=BF16_05B_LAYERS)


def smoke(args: argparse.Namespace) -> None:
    args.invariant_small = (64, 512)
    args.invariant_bf16_shape = {
        "hidden_size": 64,
        "num_heads": 2,
        "num_kv_heads": 1,
        "intermediate_size": 192,
        "vocab_size": 512,
    }
    args.invariant_rounds, args.invariant_reps = 1, 1
