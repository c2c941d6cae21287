"""MoE routing replay: what replaying a routing record costs, and how big a record travels.

``routing-replay-cost``: a Qwen3-MoE-shaped model (``--routing-hidden`` 512, ``--routing-layers``
8 MoE layers, ``--routing-experts`` 16 experts, top-``--routing-top-k`` 4; random float32
weights, no hub) scores S × T tokens (every position) in process through the engine, three
ways in interleaved rounds: free routing; replaying a routing record (the free routing, recorded
once: the same experts, so only the replay's own work differs); and free routing returning its
routing (``return_routing``). Rows: tokens/s of replay ÷ free and of return_routing ÷ free
(medians of per-round ratios), and the same replay ÷ free over gRPC against an ``oldlogit serve``
subprocess (the record's encoding, validation and packing included; the result cache off).

``routing-record-size``: the encoded bytes of one routing record per 1,000 tokens for a
48-layer, top-8, 128-expert model (Qwen3-30B-A3B's routing shape) in a request, on each
transport: JSON, msgpack (HTTP) and protobuf (gRPC) — the request's size with the record minus
without it. Returned records (``SequenceResult.routed_experts``) use the same encodings.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.common import Figure, ServerProcess


def add_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("routing (MoE routing replay)")
    g.add_argument("--routing-hidden", type=int, default=512)
    g.add_argument("--routing-layers", type=int, default=8)
    g.add_argument("--routing-experts", type=int, default=16)
    g.add_argument("--routing-top-k", type=int, default=4)
    g.add_argument("--routing-vocab", type=int, default=8192)
    g.add_argument("--routing-seqs", type=int, default=8, help="sequences per batch")
    g.add_argument("--routing-seq-len", type=int, default=256)
    g.add_argument("--routing-rounds", type=int, default=5, help="interleaved rounds")


def smoke(args: argparse.Namespace) -> None:
    args.routing_hidden, args.routing_layers, args.routing_experts = 64, 2, 4
    args.routing_top_k, args.routing_vocab = 2, 512
    args.routing_seqs, args.routing_seq_len, args.routing_rounds = 2, 32, 1


def _model_dir(root: Path, args: argparse.Namespace) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    h = args.routing_hidden
    config = AutoConfig.for_model(
        "qwen3_moe",
        vocab_size=args.routing_vocab,
        hidden_size=h,
        intermediate_size=3 * h,
        moe_intermediate_size=3 * h // 8,  # Qwen3-30B-A3B's ratio (768 / 2048)
        num_hidden_layers=args.routing_layers,
        num_attention_heads=max(1, h // 64),
        num_key_value_heads=max(1, h // 128),
        head_dim=64 if h >= 64 else h,
        num_experts=args.routing_experts,
        num_experts_per_tok=args.routing_top_k,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    path = root / "model"
    model.save_pretrained(path)
    return path


def _rounds(fns: dict[str, Any], rounds: int) -> list[dict[str, float]]:
    """Seconds of each call, the calls interleaved round by round (one warm-up each)."""
    for fn in fns.values():
        fn()
    out = []
    for _ in range(rounds):
        row = {}
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            row[name] = time.perf_counter() - t0
        out.append(row)
    return out


def _engine_figures(model_dir: Path, args: argparse.Namespace) -> list[Figure]:
    from oldlogit_service.model.checkpoints import load_weights
    from oldlogit_service.model.engine import Engine, Job
    from oldlogit_service.model.loaded import load_model

    model = load_model(model_dir, dtype="float32", device="cpu")
    weights = load_weights(model_dir, model)
    assert weights is not None
    engine = Engine(model)
    gen = torch.Generator().manual_seed(1)
    n = args.routing_seq_len
    seqs = [
        torch.randint(0, args.routing_vocab, (n,), generator=gen) for _ in range(args.routing_seqs)
    ]
    free = [Job(s, torch.arange(1, n)) for s in seqs]
    recording = [Job(s, torch.arange(1, n), record_routing=True) for s in seqs]
    records = engine.score(weights, recording)
    replay = []
    for s, got in zip(seqs, records, strict=True):
        assert got.routing is not None
        rows = torch.full((n, *got.routing.shape[1:]), -1, dtype=torch.int32)
        rows[:-1] = got.routing
        replay.append(Job(s, torch.arange(1, n), routing=rows))
    same = all(
        torch.equal(a, b.logprobs)
        for a, b in zip(engine.run(weights, replay), records, strict=True)
    )
    rounds = _rounds(
        {
            "free": lambda: engine.run(weights, free),
            "replay": lambda: engine.run(weights, replay),
            "record": lambda: engine.score(weights, recording),
        },
        args.routing_rounds,
    )
    tokens = args.routing_seqs * n
    shape = (
        f"hidden {args.routing_hidden}, {args.routing_layers} MoE layers, "
        f"{args.routing_experts} experts, top-{args.routing_top_k}; {args.routing_seqs} × {n} "
        f"tokens, {torch.get_num_threads()} threads"
    )
    figures = []
    for name, label in (("replay", "replay"), ("record", "return_routing")):
        ratio = statistics.median(r["free"] / r[name] for r in rounds)
        figures.append(
            Figure(
                "routing-replay-cost",
                f"engine {label} ÷ free routing, tokens/s",
                ratio,
                "ratio",
                ">= 0.9",
                {
                    "rounds_s": rounds,
                    "free_tokens_per_s": tokens / statistics.median(r["free"] for r in rounds),
                    f"{name}_tokens_per_s": tokens / statistics.median(r[name] for r in rounds),
                    "replay_of_own_routing_is_free_bits": same,
                    "printed": shape,
                },
            )
        )
    return figures


def _served_figure(model_dir: Path, root: Path, args: argparse.Namespace) -> Figure:
    from oldlogit import Client, Sequence

    server = ServerProcess(
        ["--model", str(model_dir), "--dtype", "float32", "--snapshot-dir", str(root / "snap")]
    )
    try:
        rng = np.random.default_rng(2)
        n = args.routing_seq_len
        seqs = [rng.integers(0, args.routing_vocab, size=n) for _ in range(args.routing_seqs)]
        with Client(server.grpc_url, timeout_s=600) as c:
            got = c.logprobs_batch(
                [Sequence(token_ids=s, policy_version=0) for s in seqs], return_routing=True
            )
            free = [Sequence(token_ids=s, policy_version=0) for s in seqs]
            replay = [
                Sequence(token_ids=s, policy_version=0, routed_experts=r.routed_experts[0])  # type: ignore[index]
                for s, r in zip(seqs, got, strict=True)
            ]
            record_bytes = sum(
                int(r.routed_experts[0].ids.size) * 2 for r in got if r.routed_experts
            )
            rounds = _rounds(
                {
                    "free": lambda: c.logprobs_batch(free, use_cache=False),
                    "replay": lambda: c.logprobs_batch(replay, use_cache=False),
                },
                args.routing_rounds,
            )
    finally:
        server.stop()
    tokens = args.routing_seqs * n
    return Figure(
        "routing-replay-cost",
        "grpc replay ÷ free routing, tokens/s",
        statistics.median(r["free"] / r["replay"] for r in rounds),
        "ratio",
        ">= 0.9",
        {
            "rounds_s": rounds,
            "free_tokens_per_s": tokens / statistics.median(r["free"] for r in rounds),
            "replay_tokens_per_s": tokens / statistics.median(r["replay"] for r in rounds),
            "record_bytes_per_request": record_bytes,
        },
    )


def _size_figures() -> list[Figure]:
    """Bytes of a 48-layer, top-8, 128-expert record of 1,000 tokens in a request."""
    from oldlogit.contract import convert, wire
    from oldlogit.contract.types import LogprobsRequest, RoutedExperts, Sequence

    layers, k, experts, tokens = 48, 8, 128, 1000
    rng = np.random.default_rng(0)
    ids = np.stack([rng.permutation(experts)[:k] for _ in range(tokens * layers)]).reshape(
        tokens, layers, k
    )
    token_ids = rng.integers(0, 150000, size=tokens + 1)
    bare = LogprobsRequest(sequences=[Sequence(token_ids=token_ids, policy_version=3)])
    routed = LogprobsRequest(
        sequences=[
            Sequence(
                token_ids=token_ids,
                policy_version=3,
                routed_experts=RoutedExperts(ids=ids, start=0),
            )
        ]
    )
    sizes = {
        "json (HTTP)": len(wire.encode_request(routed, wire.JSON_TYPE))
        - len(wire.encode_request(bare, wire.JSON_TYPE)),
        "msgpack (HTTP)": len(wire.encode_request(routed, wire.MSGPACK_TYPE))
        - len(wire.encode_request(bare, wire.MSGPACK_TYPE)),
        "protobuf (gRPC)": convert.request_to_proto(routed).ByteSize()
        - convert.request_to_proto(bare).ByteSize(),
    }
    raw = tokens * layers * k * 2
    return [
        Figure(
            "routing-record-size",
            f"{name}: one record, 1,000 tokens × 48 layers × top-8",
            float(size),
            "bytes",
            "",
            {"int16_payload_bytes": raw, "overhead": size / raw - 1.0},
        )
        for name, size in sizes.items()
    ]


def run(args: argparse.Namespace) -> list[Figure]:
    root = Path(tempfile.mkdtemp(prefix="oldlogit-bench-routing-"))
    model_dir = _model_dir(root, args)
    figures = _engine_figures(model_dir, args)
    figures.append(_served_figure(model_dir, root, args))
    figures.extend(_size_figures())
    return figures


if __name__ == "__main__":  # pragma: no cover
    sys.exit("run it as: oldlogit bench routing")
