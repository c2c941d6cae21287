"""Real size: a Qwen2.5-0.5B-shaped model end to end — start, publish, score.

The config is Qwen2.5-0.5B's (hidden 896, 24 layers, 14/2 heads, vocab 151,936, tied head;
random bf16 weights: no hub). A real ``oldlogit serve --model DIR`` subprocess is timed from
launch to its ports (version 0 read from the directory, the numerics self-check run); a trainer
in this process (the HF model) publishes ``--models-versions`` versions with
``Client.publish(..., delta=True)`` — the first sends everything, later ones the elements an
optimizer-like step changed (``--models-change`` of them) — timed per version as seconds per GB
of model, with the server's RSS after each; then the service scores S × T tokens at the newest
version over gRPC, against the in-process HF forward of the same batch (tokens/s ratio; the two
take turns over ``--models-rounds`` rounds, the median of the rounds' ratios).
Not in the default suite (minutes and GBs): ``oldlogit bench models``; ``--smoke`` shrinks it.
``--device cuda`` runs the server (``--device cuda``) and the trainer's forward on the GPU;
``--shapes qwen2.5-1.5b`` (benchmarks/shapes.py) takes that model's layer shapes instead of
0.5B's and scores each of its batch × tokens rows (one ``models-vs-hf-forward`` row each,
goal >= 0.85), the server's log at INFO so its start-up self-check line is recorded.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks import shapes as named_shapes
from benchmarks.common import Figure, ServerProcess, interleaved, summary

# Qwen2.5-0.5B's config.json (the architecture, not its weights).
QWEN25_05B: dict[str, Any] = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "vocab_size": 151936,
    "max_position_embeddings": 32768,
    "max_window_layers": 24,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "sliding_window": 32768,
    "use_sliding_window": False,
    "tie_word_embeddings": True,
    "hidden_act": "silu",
    "bos_token_id": 151643,
    "eos_token_id": 151643,
}
SMOKE: dict[str, Any] = {
    **QWEN25_05B,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def add_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("models (real size)")
    g.add_argument("--models-versions", type=int, default=8, help="versions published")
    g.add_argument("--models-change", type=float, default=0.02, help="share changed per step")
    g.add_argument("--models-seqs", type=int, default=4, help="sequences scored")
    g.add_argument("--models-seq-len", type=int, default=128)
    g.add_argument(
        "--models-rounds", type=int, default=3, help="scoring: service and HF forward in turns"
    )
    g.add_argument("--models-reps", type=int, default=1, help="scoring: timed calls per round")


def smoke(args: argparse.Namespace) -> None:
    args.models_smoke = True
    args.models_versions, args.models_seqs, args.models_seq_len = 3, 2, 32


def build(
    root: Path, config: dict[str, Any], device: torch.device | None = None
) -> tuple[Path, Any]:
    """A model directory with random bf16 weights, and the HF model (the trainer's copy);
    initialised on ``device`` (a GPU's is fast) when one is given, else on the CPU."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = {k: v for k, v in config.items() if k != "model_type"}
    hf_config = AutoConfig.for_model(config["model_type"], **fields)
    on = torch.device(device) if device is not None else contextlib.nullcontext()
    with torch.random.fork_rng(devices=[]), on:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.bfloat16).eval()
    model.save_pretrained(root / "model")
    return root / "model", model


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _step(model: Any, share: float, seed: int) -> None:
    """An optimizer-like step: ``share`` of the elements move by about one bf16 spacing."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            mask = (torch.rand(p.shape, generator=gen) < share).to(p.device)
            p.copy_(torch.where(mask, (p.float() * 1.01 + 1e-3).to(p.dtype), p))


def run(args: argparse.Namespace) -> list[Figure]:
    from oldlogit import Client, Sequence

    device = torch.device(getattr(args, "device", "cpu"))
    shaped = named_shapes.name(args) is not None
    if shaped:
        config = named_shapes.config(args)
        rows = named_shapes.rows(args)
    else:
        config = SMOKE if getattr(args, "models_smoke", False) else QWEN25_05B
        rows = [(args.models_seqs, args.models_seq_len)]
    root = Path(tempfile.mkdtemp(prefix="oldlogit-bench-models-"))
    # Built on the device (fast on a GPU); the CPU figures keep their CPU build.
    model_dir, trainer = build(root, config, device if shaped or device.type != "cpu" else None)
    nbytes = sum(t.numel() * t.element_size() for t in trainer.state_dict().values())
    nbytes -= trainer.lm_head.weight.numel() * 2  # tied: one copy
    gb = nbytes / 1e9
    serve = ["--model", str(model_dir), "--snapshot-dir", str(root / "snap"), "--dtype", "bfloat16"]
    if device.type != "cpu":
        serve += ["--device", device.type]
    t0 = time.perf_counter()
    server = ServerProcess(serve, log_level="INFO" if shaped else "WARNING")
    start_s = time.perf_counter() - t0
    start_detail: dict[str, Any] = {"GB": gb}
    if shaped:
        start_detail["self_check"] = [line for line in server.lines if "self-check" in line]
        start_detail["device"] = str(device)
    figures = [
        Figure("models-start", "start (version 0 + self-check)", start_s, "s", "", start_detail)
    ]
    try:
        publish_s: list[float] = []
        rss = [_rss_mib(server.proc.pid)]
        scored: list[tuple[int, list[float], list[float], list[float]]] = []
        with Client(server.grpc_url, timeout_s=1800) as c:
            for v in range(1, args.models_versions + 1):
                if v > 1:
                    _step(trainer, args.models_change, v)
                t = time.perf_counter()
                c.publish(v, trainer.state_dict(), delta=True)
                publish_s.append(time.perf_counter() - t)
                rss.append(_rss_mib(server.proc.pid))
            gen = torch.Generator().manual_seed(1)
            for batch, tokens in rows:
                ids = torch.randint(0, config["vocab_size"], (batch, tokens), generator=gen)
                on_device = ids.to(device)
                seqs = [Sequence(token_ids=row, policy_version=args.models_versions) for row in ids]

                def hf_forward(on_device: torch.Tensor = on_device) -> None:
                    with torch.inference_mode():
                        trainer(on_device)
                    named_shapes.settle(device)

                def served(seqs: list[Sequence] = seqs) -> None:
                    c.logprobs_batch(seqs, use_cache=False)

                # The service and the in-process forward take turns (this machine's speed drifts
                # between minutes); the figure is the median of the rounds' ratios.
                hf_s, served_s, ratios = interleaved(  # ratios: HF seconds ÷ service seconds
                    (contextlib.nullcontext, hf_forward),
                    (contextlib.nullcontext, served),
                    rounds=args.models_rounds,
                    reps=args.models_reps,
                )
                scored.append((ids.numel(), hf_s, served_s, ratios))
            kinds = [x.kind for x in c.versions()]
        half = len(rss) // 2
        figures += [
            Figure(
                "models-first-publish",
                "first publish (full)",
                publish_s[0] / gb,
                "s/GB",
                "",
                {"seconds": publish_s[0]},
            ),
            Figure(
                "models-delta-publish",
                "delta publish",
                statistics.median(publish_s[1:]) / gb if len(publish_s) > 1 else float("nan"),
                "s/GB",
                "",
                {
                    "seconds": publish_s[1:],
                    "per_GB": [s / gb for s in publish_s[1:]],
                    "change": args.models_change,
                    "kinds": kinds,
                },
            ),
            Figure(
                "models-rss",
                "server RSS after the last version",
                rss[-1],
                "MiB",
                "",
                {"rss_mib": rss, "model_mib": nbytes / 2**20},
            ),
            Figure(
                "models-rss-growth",
                "server RSS growth per version, second half",
                (rss[-1] - rss[half]) / max(1, len(rss) - 1 - half),
                "MiB",
                "",
                {"from_version": half, "note": "the device tier fills first (budget 4 GiB)"},
            ),
        ]
        for (batch, tokens), (n, hf_s, served_s, ratios) in zip(rows, scored, strict=True):
            served_sum, hf = summary(served_s), summary(hf_s)
            detail: dict[str, Any] = {
                "ratios": ratios,
                "service_tokens_per_s": n / served_sum["median_s"],
                "hf_tokens_per_s": n / hf["median_s"],
                "tokens": n,
                "printed": f"{gb:.2f} GB model; RSS MiB per version: "
                + ", ".join(f"{r:.0f}" for r in rss),
            }
            name = "service ÷ in-process HF forward"
            if shaped:
                name += f", bf16 {batch} × {tokens}" + (
                    "" if device.type == "cpu" else f" on {device.type}"
                )
                detail |= {
                    "model": named_shapes.describe(config),
                    "shapes": named_shapes.name(args),
                    "device": str(device),
                }
            figures.append(
                Figure(
                    "models-vs-hf-forward",
                    name,
                    statistics.median(ratios),
                    "ratio",
                    ">= 0.85" if shaped else ">= 0.9",
                    detail,
                )
            )
    finally:
        server.stop()
    return figures
