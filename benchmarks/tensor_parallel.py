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
import functools
import statistics
import tempfile
from pathlib import Path
from typing import Any

import torch

from benchmarks import invariant
from benchmarks.common import Figure, interleaved


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

            default_s, tp_s, ratios = interleaved(
                (functools.partial(trainer_numerics, model), score),
                (functools.partial(trainer_numerics, model, tp_chunks=8), score),
                rounds=args.invariant_rounds,
                reps=args.invariant_reps,
            )
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


def _serve_rate(
    model_dir: Path, root: Path, degree: int, args: argparse.Namespace
) -> dict[str, Any]:
    """Scored tokens/s of ``--tensor-parallel degree --tp-chunks 8`` under a closed loop of
    ``tp_clients`` clients, each sending ``tp_requests`` requests of ``tp_batch`` sequences
    of ``tp_tokens`` tokens; and /v1/info's ranks."""
    from benchmarks.common import ServerProcess, concurrent
    from oldlogit import Client, Sequence

    server = ServerProcess(
        [
            "--model",
            str(model_dir),
            "--snapshot-dir",
            str(root / f"snap-tp{degree}"),
            "--dtype",
            "bfloat16",
            "--tensor-parallel",
            str(degree),
            "--tp-chunks",
            "8",
            "--cache-budget-mib",
            "0",
            "--max-wait-ms",
            "2",
        ]
    )
    try:
        with Client(server.grpc_url, timeout_s=600) as client:
            info = client.info()
            vocab = info.vocab_size
            rng = torch.Generator().manual_seed(degree)
            batches = [
                [
                    Sequence(
                        token_ids=torch.randint(0, vocab, (args.tp_tokens,), generator=rng).numpy(),
                        policy_version=0,
                        score_from=1,
                    )
                    for _ in range(args.tp_batch)
                ]
                for _ in range(args.tp_clients * args.tp_requests)
            ]
            client.logprobs_batch(batches[0], use_cache=False)  # warm-up

            def one(i: int) -> None:
                with Client(server.grpc_url, timeout_s=600) as c:
                    for b in batches[i :: args.tp_clients]:
                        c.logprobs_batch(b, use_cache=False)

            wall = concurrent(args.tp_clients, one)
            info = client.info()
    finally:
        server.stop()
    tokens = len(batches) * args.tp_batch * (args.tp_tokens - 1)
    itemsize = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "I64": 8, "I32": 4}
    version_bytes = sum(
        itemsize.get(t.dtype, 4) * int(torch.tensor(t.shape).prod().item() if t.shape else 1)
        for t in info.weight_specs.values()
    )
    return {
        "tokens_per_s": tokens / wall,
        "version_bytes": version_bytes,
        "wall_s": wall,
        "ranks": [r.model_dump() for r in info.ranks],
        "threads": info.threads,
    }


def serve_figures(args: argparse.Namespace, root: Path) -> list[Figure]:
    model_dir = invariant.models(args, root)["bf16"]
    one = _serve_rate(model_dir, root, 1, args)
    many = _serve_rate(model_dir, root, args.tp_degree, args)
    # TP 1 holds the one version whole; each TP N rank its part (per-rank tiers in /v1/info).
    bytes_one = max((r["device_bytes"] for r in one["ranks"]), default=one["version_bytes"])
    bytes_many = [r["device_bytes"] for r in many["ranks"]]
    return [
        Figure(
            "tp-serve",
            f"TP {args.tp_degree} ÷ TP 1 scored tokens/s ({args.tp_clients} clients, "
            f"{args.tp_batch} × {args.tp_tokens} tokens per request, bf16, tp_chunks 8)",
            many["tokens_per_s"] / one["tokens_per_s"],
            "ratio",
            "report",
            {
                "tp1_tokens_per_s": one["tokens_per_s"],
                f"tp{args.tp_degree}_tokens_per_s": many["tokens_per_s"],
                "tp1": one,
                f"tp{args.tp_degree}": many,
            },
        ),
        Figure(
            "tp-resident-bytes",
            f"TP {args.tp_degree}: the largest rank's resident weight bytes ÷ TP 1's",
            max(bytes_many, default=0) / bytes_one if bytes_one else float("nan"),
            "ratio",
            "report",
            {"tp1_bytes": bytes_one, f"tp{args.tp_degree}_bytes_per_rank": bytes_many},
        ),
    ]


def run(args: argparse.Namespace) -> list[Figure]:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    root = Path(tempfile.mkdtemp(prefix="oldlogit-bench-tp-"))
    return definition_cost(args, root) + serve_figures(args, root)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tp-degree", type=int, default=2, help="tp-serve: the degree against TP 1")
    p.add_argument("--tp-clients", type=int, default=4, help="tp-serve: concurrent clients")
    p.add_argument("--tp-requests", type=int, default=6, help="tp-serve: requests per client")
    p.add_argument("--tp-batch", type=int, default=4, help="tp-serve: sequences per request")
    p.add_argument("--tp-tokens", type=int, default=256, help="tp-serve: tokens per sequence")


def smoke(args: argparse.Namespace) -> None:
    args.tp_clients, args.tp_requests, args.tp_batch, args.tp_tokens = 2, 2, 2, 32
    # Whole KV heads per rank at TP 2 (invariant's smoke model has one).
    args.invariant_bf16_shape = {**args.invariant_bf16_shape, "num_kv_heads": 2}
