"""Trainer parity and packed batching: what the batch-invariant numerics cost and buy.

linear-row-invariance  rows of a plain ``F.linear`` whose bits change with the row count
    (share of 7 counts), against fixed-shape tiles (always 0): why the tiles exist.
packed-vs-padded  packed deterministic service ÷ padded (``fast``, ``--numerics hf``) service:
    64 concurrent single-sequence gRPC clients sending short sequences (32 tokens), where
    batching pays most on a CPU; both servers up at once, rounds interleaved, median of the
    per-round ratios.
patched-step-cost  a patched trainer step (forward + backward) ÷ the plain one: a Qwen2-style
    bf16 model, TRL's layout (left-padded prompts, right-padded completions,
    ``logits_to_keep``); patched-step-cost-05b: the same at Qwen2.5-0.5B's layer shapes
    (hidden 896, intermediate 4864, 14/2 heads, vocab 151,936, tied head; 4 layers).
patched-step-cost-rl  the same step at an RL trainer's shape: micro-batch 8 of left-padded
    prompts (up to 32 pad tokens of 64) and 128 completion tokens each, every completion token
    scored, vocabulary 151,936 (Qwen2.5's), hidden 512, 4 layers, bf16 (goal <= 1.10).
    With ``--shapes qwen2.5-1.5b`` (benchmarks/shapes.py): one row per batch × tokens row of
    those shapes, forward + backward of the mean token logprob, on ``--device``, goal <= 1.10.
invariant-vs-plain  (benchmarks/invariant.py; also ``oldlogit bench invariant`` alone).
trainer-parity-table  a TRL-style bf16 trainer forward (logits ÷ temperature in bf16, then a
    per-row log-softmax, as TRL's ``selective_log_softmax`` does for bf16) against the service,
    plain and under ``trainer_numerics``, per micro-batch size (``oldlogit.parity.compare``).
"""

from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks import invariant
from benchmarks import shapes as named_shapes
from benchmarks.common import Figure, ServerProcess, concurrent, interleaved

# The figures `--parity-only` can pick (default: all of them, in this order).
PARTS = (
    "linear-row-invariance",
    "invariant-vs-plain",
    "packed-vs-padded",
    "patched-step-cost",
    "patched-step-cost-rl",
    "trainer-parity-table",
)
# patched-step-cost-rl's shape: Qwen2.5's vocabulary; prompts of PROMPT tokens, each left-padded
# by 0..RL_PAD_MAX; RL_COMPLETION completion tokens each, all scored.
RL_VOCAB = 151936
RL_PROMPT, RL_PAD_MAX, RL_COMPLETION = 64, 32, 128


def _model_dir(root: Path, *, hidden: int, layers: int, vocab: int, dtype: str) -> Path:
    from oldlogit_service.demo.tiny import make_tiny_model_dir

    return make_tiny_model_dir(
        root,
        arch="qwen2",
        seed=0,
        vocab_size=vocab,
        hidden_size=hidden,
        num_layers=layers,
        num_heads=max(1, hidden // 64) * 2,
        num_kv_heads=max(1, hidden // 64),
        intermediate_size=hidden * 3,
        max_positions=4096,
        dtype=dtype,
        initializer_range=0.02,
    )


def _linear_row_changes() -> Figure:
    from oldlogit.parity import tiled_mm

    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(1536, 512, generator=gen) * 0.05
    rows = torch.randn(1100, 512, generator=gen)
    counts = [1, 3, 7, 64, 65, 200, 1100]
    plain = [
        not torch.equal(
            torch.nn.functional.linear(rows[:m], weight)[0],
            torch.nn.functional.linear(rows[:1], weight)[0],
        )
        for m in counts
    ]
    tiled = [
        not torch.equal(tiled_mm(rows[:m], weight)[0], tiled_mm(rows[:1], weight)[0])
        for m in counts
    ]
    return Figure(
        "linear-row-invariance",
        "F.linear fp32: share of row counts that change a row's bits",
        sum(plain) / len(counts),
        "share",
        "",
        {
            "row_counts": counts,
            "plain_changed": plain,
            "tiled_changed": tiled,
            "printed": f"tiled: {sum(tiled)} of {len(counts)} counts change a bit",
        },
    )


def _requests_per_s(clients: list[Any], seqs: list[list[int]], rounds: int) -> float:
    def one(i: int) -> None:
        for _ in range(rounds):
            clients[i].logprobs(seqs[i], policy_version=0, use_cache=False)

    return len(clients) * rounds / concurrent(len(clients), one)


def _packed_vs_padded(args: argparse.Namespace, root: Path) -> Figure:
    from oldlogit import Client

    model_dir = _model_dir(
        root / "packed-model",
        hidden=args.hidden,
        layers=args.layers,
        vocab=args.vocab,
        dtype="float32",
    )
    rng = random.Random(0)
    conc, length = args.concurrency, args.parity_len
    seqs = [[rng.randrange(args.vocab) for _ in range(length)] for _ in range(conc)]
    configs = {
        "packed": ["--numerics", "invariant", "--mode", "deterministic"],
        "padded": ["--numerics", "hf", "--mode", "fast"],
    }
    servers = {
        name: ServerProcess(
            [
                "--model",
                str(model_dir),
                "--snapshot-dir",
                str(root / f"packed-vs-padded-{name}"),
                "--dtype",
                "float32",
                "--cache-budget-mib",
                "0",
                "--max-wait-ms",
                "2",
                *extra,
            ]
        )
        for name, extra in configs.items()
    }
    try:
        clients = {
            n: [Client(s.grpc_url, timeout_s=600) for _ in range(conc)] for n, s in servers.items()
        }
        for name in servers:
            _requests_per_s(clients[name], seqs, 1)  # warm-up
        rps: dict[str, list[float]] = {n: [] for n in servers}
        ratios = []
        for _ in range(args.parity_reps):
            got = {n: _requests_per_s(clients[n], seqs, args.concurrent_rounds) for n in servers}
            for n, v in got.items():
                rps[n].append(v)
            ratios.append(got["packed"] / got["padded"])
        for cs in clients.values():
            for c in cs:
                c.close()
    finally:
        for s in servers.values():
            s.stop()
    med = {n: statistics.median(v) for n, v in rps.items()}
    return Figure(
        "packed-vs-padded",
        f"packed deterministic ÷ padded fast, {conc} clients × {length} tokens",
        statistics.median(ratios),
        "ratio",
        ">= 0.9",
        {
            "requests_per_s": med,
            "ratios": ratios,
            "printed": f"{med['packed']:.0f} vs {med['padded']:.0f} req/s (medians of "
            f"{len(ratios)} interleaved rounds; ratios {min(ratios):.2f}–{max(ratios):.2f})",
        },
    )


def _trl_batch(vocab: int, batch: int, prompt: int, completion: int, seed: int) -> tuple[Any, Any]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, prompt + completion), generator=gen)
    mask = torch.ones_like(ids)
    for b in range(batch):
        p = int(torch.randint(prompt // 2, prompt + 1, (1,), generator=gen))
        c = int(torch.randint(completion // 2, completion + 1, (1,), generator=gen))
        mask[b, : prompt - p] = 0  # left-padded prompt
        mask[b, prompt + c :] = 0  # right-padded completion
    return ids, mask


def _rl_batch(
    vocab: int, batch: int, prompt: int, pad_max: int, completion: int, seed: int
) -> tuple[Any, Any]:
    """An RL micro-batch: prompts left-padded by 0..``pad_max`` tokens, completions whole."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, prompt + completion), generator=gen)
    mask = torch.ones_like(ids)
    for b in range(batch):
        pad = int(torch.randint(0, pad_max + 1, (1,), generator=gen))
        mask[b, :pad] = 0
    mask[-1, :pad_max] = 0  # the longest padding is in every batch
    return ids, mask


def _shaped_step_cost(args: argparse.Namespace) -> list[Figure]:
    """patched-step-cost at ``--shapes`` on ``--device``: forward + backward of the mean token
    logprob over a batch × tokens row, patched (``trainer_numerics``) ÷ plain, interleaved
    rounds (``--parity-reps``), each arm the median of two timed steps after a warm-up."""
    import functools

    from oldlogit.parity import token_logprobs, trainer_numerics

    device = torch.device(getattr(args, "device", "cpu"))
    fields = named_shapes.config(args)
    model = named_shapes.build(fields, device=device)
    figures = []
    for batch, tokens in named_shapes.rows(args):
        gen = torch.Generator().manual_seed(1)
        ids = torch.randint(0, int(fields["vocab_size"]), (batch, tokens), generator=gen)
        ids = ids.to(device)

        def step(ids: torch.Tensor = ids) -> None:
            model.zero_grad(set_to_none=True)
            token_logprobs(model, ids).mean().backward()
            named_shapes.settle(device)

        plain_s, patched_s, speedups = interleaved(
            (contextlib.nullcontext, step),
            (functools.partial(trainer_numerics, model), step),
            rounds=args.parity_reps,
            reps=2,
        )
        ratios = [1 / r for r in speedups]  # patched ÷ plain
        figures.append(
            Figure(
                "patched-step-cost",
                f"patched trainer forward+backward ÷ plain, bf16 {batch} × {tokens}"
                + ("" if device.type == "cpu" else f" on {device.type}"),
                statistics.median(ratios),
                "ratio",
                "<= 1.10",
                {
                    "plain_ms": 1e3 * statistics.median(plain_s),
                    "patched_ms": 1e3 * statistics.median(patched_s),
                    "ratios": ratios,
                    "model": named_shapes.describe(fields),
                    "shapes": named_shapes.name(args),
                    "device": str(device),
                    "loss": "mean of the token logprobs",
                },
            )
        )
    model.zero_grad(set_to_none=True)
    return figures


def _rl_step_cost(args: argparse.Namespace, root: Path) -> Figure:
    vocab = args.trainer_rl_vocab
    model_dir = _model_dir(
        root / "step-rl", hidden=args.trainer_hidden, layers=4, vocab=vocab, dtype="bfloat16"
    )
    batch = _rl_batch(vocab, 8, RL_PROMPT, RL_PAD_MAX, RL_COMPLETION, seed=1)
    figure = _step_cost(
        args,
        model_dir,
        vocab,
        "patched-step-cost-rl",
        f"patched trainer forward+backward ÷ plain, an RL micro-batch (bf16, 8 × ({RL_PROMPT} "
        f"left-padded by 0-{RL_PAD_MAX} + {RL_COMPLETION}) tokens, vocab {vocab:,}, hidden "
        f"{args.trainer_hidden})",
        batch=batch,
        prompt=RL_PROMPT,
        completion=RL_COMPLETION,
    )
    figure.goal = "<= 1.10"
    return figure


def _trainer_step_cost(args: argparse.Namespace, root: Path) -> list[Figure]:
    from oldlogit_service.demo.tiny import make_tiny_model_dir

    if named_shapes.name(args) is not None:
        return _shaped_step_cost(args)

    small = _model_dir(
        root / "step-model", hidden=args.trainer_hidden, layers=4, vocab=8192, dtype="bfloat16"
    )
    figures = [
        _step_cost(
            args,
            small,
            8192,
            "patched-step-cost",
            "patched trainer forward+backward ÷ plain (bf16, 8 × (64 + 128) tokens)",
        )
    ]
    if args.trainer_05b_layers > 0:
        shaped = make_tiny_model_dir(
            root / "step-05b",
            arch="qwen2",
            seed=0,
            vocab_size=151936,
            hidden_size=896,
            num_layers=args.trainer_05b_layers,
            num_heads=14,
            num_kv_heads=2,
            intermediate_size=4864,
            tie_word_embeddings=True,
            max_positions=4096,
            dtype="bfloat16",
            initializer_range=0.02,
        )
        figures.append(
            _step_cost(
                args,
                shaped,
                151936,
                "patched-step-cost-05b",
                "patched trainer forward+backward ÷ plain at Qwen2.5-0.5B's layer shapes "
                f"({args.trainer_05b_layers} layers, bf16, 8 × (64 + 128) tokens)",
            )
        )
    return figures


def _step_cost(
    args: argparse.Namespace,
    model_dir: Path,
    vocab: int,
    figure: str,
    name: str,
    *,
    batch: tuple[Any, Any] | None = None,
    prompt: int = 64,
    completion: int = 128,
) -> Figure:
    """A trainer step (forward + backward of the completion tokens' logprobs, TRL's
    ``logits_to_keep``) patched ÷ plain, interleaved rounds; ``batch``: (ids, mask) of
    ``prompt`` + ``completion`` columns (default: ``_trl_batch``'s)."""
    from transformers import AutoModelForCausalLM

    from oldlogit.parity import token_logprobs, trainer_numerics

    model: Any = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16)
    ids, mask = batch if batch is not None else _trl_batch(vocab, 8, prompt, completion, seed=1)

    def step() -> None:
        model.zero_grad(set_to_none=True)
        lp = token_logprobs(model, ids, mask, logits_to_keep=completion, temperature=0.7)
        (-(lp * mask[:, prompt:]).sum()).backward()

    def best_of(reps: int) -> float:
        step()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    ratios, plain_s, patched_s = [], [], []
    for _ in range(args.parity_reps):  # interleaved: the machine's drift hits both alike
        plain = best_of(2)
        with trainer_numerics(model):
            patched = best_of(2)
        plain_s.append(plain)
        patched_s.append(patched)
        ratios.append(patched / plain)
    return Figure(
        figure,
        name,
        statistics.median(ratios),
        "ratio",
        "<= 1.15",
        {
            "plain_s": statistics.median(plain_s),
            "patched_s": statistics.median(patched_s),
            "ratios": ratios,
            "pad_tokens": int((mask[:, :prompt] == 0).sum()),
            "scored_tokens": int(mask[:, prompt:].sum()),
        },
    )


def trl_style_logprobs(
    model: Any, ids: torch.Tensor, mask: torch.Tensor, sampling: dict[str, Any]
) -> torch.Tensor:
    """What a TRL-style bf16 trainer computes: logits ÷ temperature in the model dtype, then a
    log-softmax per row in that dtype and a gather ([B, T] aligned; 0 at position 0)."""
    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]  # [B, T-1, V], bf16
    logits = logits / sampling["temperature"]
    rows = [torch.log_softmax(row, dim=-1) for row in logits]  # per row, in bf16
    picked = torch.stack(rows).gather(-1, ids[:, 1:, None])[..., 0]  # [B, T-1]
    return torch.cat([picked.new_zeros(ids.shape[0], 1), picked], dim=1).float()


def _parity_table(args: argparse.Namespace, root: Path) -> list[Figure]:
    from transformers import AutoModelForCausalLM

    from oldlogit import Client
    from oldlogit.parity import compare

    model_dir = _model_dir(
        root / "parity-model", hidden=args.trainer_hidden, layers=4, vocab=8192, dtype="bfloat16"
    )
    srv = ServerProcess(
        [
            "--model",
            str(model_dir),
            "--snapshot-dir",
            str(root / "parity-snap"),
            "--dtype",
            "bfloat16",
        ]
    )
    try:
        model: Any = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16)
        rng = random.Random(2)
        samples = []
        for _ in range(args.parity_samples):
            p, c = rng.randint(16, 64), rng.randint(32, 128)
            samples.append(([rng.randrange(8192) for _ in range(p + c)], p))
        with Client(srv.grpc_url, timeout_s=600) as client:
            plain = compare(
                model,
                client,
                samples,
                policy_version=0,
                forwards=("plain",),
                temperature=0.7,
                logprob_fn=trl_style_logprobs,
            )
            patched = compare(
                model, client, samples, policy_version=0, forwards=("patched",), temperature=0.7
            )
    finally:
        srv.stop()
    figures = []
    for label, report in (("TRL-style plain", plain), ("patched", patched)):
        for row in report.rows:
            figures.append(
                Figure(
                    "trainer-parity-table",
                    f"{label} bf16 trainer, micro-batch {row.micro_batch}: max |Δ logprob|",
                    row.max_abs,
                    "nats",
                    "0" if label == "patched" else "",
                    {
                        "tokens": row.tokens,
                        "share_off": {str(k): v for k, v in row.share_off.items()},
                        "printed": "tokens with ratio ≠ 1: "
                        + ", ".join(f">{k:g}: {100 * v:.1f} %" for k, v in row.share_off.items()),
                    },
                )
            )
    return figures


def run(args: argparse.Namespace) -> list[Figure]:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    root = Path(tempfile.mkdtemp(prefix="oldlogit-bench-parity-"))
    parts = set(getattr(args, "parity_only", None) or PARTS)
    figures = []
    if "linear-row-invariance" in parts:
        figures.append(_linear_row_changes())
    if "invariant-vs-plain" in parts:
        figures.extend(invariant.figures(args, root))
    if "packed-vs-padded" in parts:
        figures.append(_packed_vs_padded(args, root))
    if "patched-step-cost" in parts:
        figures.extend(_trainer_step_cost(args, root))
    if "patched-step-cost-rl" in parts and named_shapes.name(args) is None:
        figures.append(_rl_step_cost(args, root))
    if "trainer-parity-table" in parts:
        figures.extend(_parity_table(args, root))
    return figures


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--parity-only",
        nargs="+",
        choices=PARTS,
        default=None,
        help="parity: run only these figures (default: all)",
    )
    p.add_argument(
        "--parity-len", type=int, default=32, help="packed-vs-padded: tokens per sequence"
    )
    p.add_argument(
        "--parity-reps",
        type=int,
        default=7,
        help="packed-vs-padded, patched-step-cost: interleaved rounds",
    )
    p.add_argument(
        "--parity-samples", type=int, default=32, help="trainer-parity-table: sequences compared"
    )
    p.add_argument(
        "--trainer-hidden",
        type=int,
        default=512,
        help="patched-step-cost, trainer-parity-table: model width",
    )
    invariant.add_args(p)
    p.add_argument(
        "--trainer-05b-layers",
        type=int,
        default=4,
        help="patched-step-cost-05b: layers at 0.5B shapes (0: off)",
    )
    p.add_argument(
        "--trainer-rl-vocab",
        type=int,
        default=RL_VOCAB,
        help="patched-step-cost-rl: vocabulary (default Qwen2.5's)",
    )


def smoke(args: argparse.Namespace) -> None:
    args.parity_len, args.parity_reps, args.parity_samples, args.trainer_hidden = 16, 1, 4, 64
    args.trainer_05b_layers = 0
    args.trainer_rl_vocab = 1024
    invariant.smoke(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit("run it as: oldlogit bench parity")
