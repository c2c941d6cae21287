"""invariant-vs-plain: what the batch-invariant numerics cost in process, no server.

transformers' own forward + float32 log-softmax +
gather ÷ the invariant forward and processing (``trainer_numerics`` + ``token_logprobs``)
on the same batch, per model and batch × tokens (fp32 hidden 256 / 4 layers / vocab 4,096;
bf16 at Qwen2.5-0.5B's layer shapes with vocab 32,768, 4 layers; 1 × 128, 16 × 128,
4 × 512); the two variants interleaved, median of the per-round ratios.

``oldlogit bench invariant`` runs this figure alone; the ``parity`` suite includes it.
``--device cuda`` runs both forwards on the GPU (each timed call waits for its kernels).
``--shapes qwen2.5-1.5b`` (benchmarks/shapes.py) runs one bf16 model at Qwen2.5-1.5B's layer
shapes (8 layers, built in memory on the device) at 1 × 512, 16 × 512 and 4 × 2048, goal
>= 0.90, and reports whether each result is bitwise batch-invariant there (the batch's first
and last sequence alone equal their rows in the batch), for the invariant and the plain path.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import statistics
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from benchmarks import shapes as named_shapes
from benchmarks.common import Figure, interleaved

# (label, model, batch × tokens rows, goal, model description): one model of the table.
Loaded = tuple[str, Any, list[tuple[int, int]], str, str]

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


def _loaded(args: argparse.Namespace, root: Path, device: torch.device) -> Iterator[Loaded]:
    """(label, model, batch × tokens rows, goal, model description) per model of the table."""
    from transformers import AutoModelForCausalLM

    if named_shapes.name(args) is not None:
        fields = named_shapes.config(args)
        model = named_shapes.build(fields, device=device)
        yield "bf16", model, named_shapes.rows(args), ">= 0.90", named_shapes.describe(fields)
        del model
        return
    for label, model_dir in models(args, root).items():
        dtype = torch.float32 if label == "fp32" else torch.bfloat16
        model: Any = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).eval()
        model = model.to(device)
        described = (
            f"{label}: hidden {model.config.hidden_size}, 4 layers, "
            f"vocab {int(model.config.vocab_size)}"
        )
        yield label, model, shapes(args), ">= 0.95", described
        del model  # before the next one loads


def batch_invariance(model: Any, ids: torch.Tensor) -> dict[str, bool]:
    """Whether the batch's first and last sequence, scored alone, equal their rows of the
    batch bit for bit: under ``trainer_numerics`` (the invariant path) and without (plain)."""
    from oldlogit.parity import token_logprobs, trainer_numerics

    picked = sorted({0, ids.shape[0] - 1})
    out: dict[str, bool] = {}
    with torch.inference_mode():
        with trainer_numerics(model):
            full = token_logprobs(model, ids)
            out["invariant"] = all(
                torch.equal(full[i : i + 1], token_logprobs(model, ids[i : i + 1])) for i in picked
            )
        full = _plain_logprobs(model, ids)
        out["plain"] = all(
            torch.equal(full[i : i + 1], _plain_logprobs(model, ids[i : i + 1])) for i in picked
        )
    return out


def figures(args: argparse.Namespace, root: Path) -> list[Figure]:
    from oldlogit.parity import token_logprobs, trainer_numerics

    figures = []
    device = torch.device(getattr(args, "device", "cpu"))
    # Work on a GPU is asynchronous: each timed call ends when its kernels have.
    settle = functools.partial(named_shapes.settle, device)
    for label, model, rows, goal, described in _loaded(args, root, device):
        vocab = int(model.config.vocab_size)
        for batch, tokens in rows:
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
            detail: dict[str, Any] = {
                "plain_ms": 1e3 * statistics.median(plain_s),
                "invariant_ms": 1e3 * statistics.median(inv_s),
                "ratios": ratios,
                "model": described,
                "device": str(device),
            }
            if named_shapes.name(args) is not None:
                detail["shapes"] = named_shapes.name(args)
                if batch > 1:
                    detail["batch_invariant"] = batch_invariance(model, ids)
                if device.type == "cuda":
                    detail["device_name"] = torch.cuda.get_device_name(device)
            figures.append(
                Figure(
                    "invariant-vs-plain",
                    f"{label} {batch} × {tokens}: plain time ÷ invariant time, in process"
                    + ("" if device.type == "cpu" else f" on {device.type}"),
                    statistics.median(ratios),
                    "ratio",
                    goal,
                    detail,
                )
            )
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
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
