"""Tensor parallelism: what the TP-invariant definition costs on one device, and TP N vs TP 1.

tp-definition-cost  the single-device invariant forward + processing (``trainer_numerics`` +
                    ``token_logprobs``) ÷ the same under the tensor-parallel definition
                    (``tp_chunks=8``), in process, on invariant-vs-plain's models and shapes
                    (benchmarks/invariant.py); the two interleaved, median of the per-round
                    ratios. Below 1: the definition's cost (why it is an option).
tp-serve            ``oldlogit serve --tensor-parallel N --tp-chunks 8`` ÷ ``--tensor-parallel
                    1 --tp-chunks 8`` throughput (scored tokens/s) on the same closed-loop
                    workload, the two servers one after the other, and each rank's resident
                    weight bytes from ``/v1/info``. On a CPU machine the ranks share the cores,
                    so slower is expected; the figure says by how much.

``oldlogit bench tp`` runs both.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path
from typing import Any

import torch

from benchmarks import invariant
from benchmarks.common import Figure, timed


def definition_cost(args: argparse.Namespace, root: Path) -> list[Figure]:
    from transformers import AutoModelForCausalLM

    from oldlogit.parity import token_logprobs, trainer_numerics

    figures = []
    for label, model_dir in invariant.models(args, root).items():
        dtype = torch.float32 if label == "fp32" else torch.bfloat16
        model: Any = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).eval()
        vocab = int(model.config.vocab_size)
        for batch, tokens in invariant.shapes(args):
            ids = torch.randint(
                0, vocab, (batch, tokens), generator=torch.Generator().manual_seed(0)
            )

            def score(ids: torch.Tensor = ids, model: Any = model) -> None:
                with torch.inference_mode():
                    token_logprobs(model, ids)

            default_s, tp_s, ratios = [], [], []
            for _ in range(args.invariant_rounds):  # interleaved: the same machine state
                with trainer_numerics(model):
                    d = statistics.median(timed(score, reps=args.invariant_reps, warmup=1))
                with trainer_numerics(model, tp_chunks=8):
                    t = statistics.median(timed(score, reps=args.invariant_reps, warmup=1))
                default_s.append(d)
                tp_s.append(t)
                ratios.append(d / t)
            figures.append(
                Figure(
                    "tp-definition-cost",
                    f"{label} {batch} × {tokens}: default time ÷ tp_chunks=8 time, one device",
                    statistics.median(ratios),
                    "ratio",
                    "report",
                    {
                        "default_ms": 1e3 * statistics.median(default_s),
                        "tp_chunks_8_ms": 1e3 * statistics.median(tp_s),
                        "ratios": ratios,
                        "model": f"{label}: hidden {model.config.hidden_size}, 4 layers, "
                        f"vocab {vocab}",
                    },
                )
            )
        del model
    return figures


def run(args: argparse.Namespace) -> list[Figure]:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    root = Path(tempfile.mkdtemp(prefix="oldlogit-bench-tp-"))
    return definition_cost(args, root)
