"""The service against the in-process engine, on the same batches.

inprocess-throughput: the engine in this process, S sequences × T tokens (tokens/s).
service-vs-inprocess: one request of S × T; service tokens/s ÷ in-process engine tokens/s over
gRPC and HTTP (msgpack).
concurrent-vs-sequential: C clients each sending one sequence at once vs the same C sequences
sent one after another. The server is a real `oldlogit serve` subprocess; the
in-process baseline runs the engine in this process with the same model and thread count.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import threading
from pathlib import Path

import torch

from benchmarks.common import Figure, ServerProcess, summary, timed


def build_model(args: argparse.Namespace, root: Path) -> Path:
    from oldlogit_service.demo.tiny import make_tiny_model_dir

    return make_tiny_model_dir(
        root / "model",
        arch="qwen2",
        seed=0,
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        num_layers=args.layers,
        num_heads=max(1, args.hidden // 64) * 2,
        num_kv_heads=max(1, args.hidden // 64),
        intermediate_size=args.hidden * 3,
        max_positions=max(2048, args.seq_len * 2),
    )


def run(args: argparse.Namespace) -> list[Figure]:
    from oldlogit import Client, Sequence
    from oldlogit_service.model.checkpoints import load_weights
    from oldlogit_service.model.engine import Engine, Job
    from oldlogit_service.model.loaded import load_model
    from oldlogit_service.model.numerics import SamplingParams

    root = Path(tempfile.mkdtemp(prefix="oldlogit-bench-"))
    model_dir = build_model(args, root)
    dtype = getattr(torch, args.dtype)
    model = load_model(model_dir, dtype=dtype, device=torch.device(args.device))
    weights = load_weights(model_dir, model)
    assert weights is not None
    weights = {k: v.to(model.device) for k, v in weights.items()}
    engine = Engine(model, mode=args.mode)
    rng = random.Random(0)
    seqs_ids = [[rng.randrange(args.vocab) for _ in range(args.seq_len)] for _ in range(args.seqs)]
    jobs = [
        Job(
            token_ids=torch.tensor(ids),
            positions=torch.arange(1, args.seq_len),
            sampling=SamplingParams(),
        )
        for ids in seqs_ids
    ]
    tokens = args.seqs * args.seq_len
    figures: list[Figure] = []

    inproc = summary(timed(lambda: engine.run(weights, jobs), reps=args.reps))
    inproc_tps = tokens / inproc["median_s"]
    figures.append(
        Figure(
            "inprocess-throughput",
            f"in-process engine, {args.seqs} × {args.seq_len} tokens",
            inproc_tps,
            "tokens/s",
            "",
            {**inproc, "tokens": tokens},
        )
    )

    server = ServerProcess(
        [
            "--model",
            str(model_dir),
            "--snapshot-dir",
            str(root / "snap"),
            "--dtype",
            args.dtype,
            "--mode",
            args.mode,
            "--device",
            args.device,
            "--max-batch-tokens",
            str(tokens),
            "--cache-budget-mib",
            "0",
            "--max-wait-ms",
            "1",
        ]
    )
    try:
        seqs = [Sequence(token_ids=ids, policy_version=0) for ids in seqs_ids]
        for name, url, goal in (
            ("grpc", server.grpc_url, ">= 0.95"),
            ("http msgpack", server.http_url, ">= 0.90"),
        ):
            with Client(url, timeout_s=600) as c:
                res = summary(
                    timed(lambda c=c: c.logprobs_batch(seqs, use_cache=False), reps=args.reps)
                )
            tps = tokens / res["median_s"]
            figures.append(
                Figure(
                    "service-vs-inprocess",
                    f"{name} ÷ in-process engine",
                    tps / inproc_tps,
                    "ratio",
                    goal,
                    {**res, "tokens_per_s": tps},
                )
            )

        # 64 concurrent single-sequence clients vs the same requests one after another.
        conc = args.concurrency
        single = [
            Sequence(token_ids=seqs_ids[i % args.seqs][: args.single_len], policy_version=0)
            for i in range(conc)
        ]
        clients = [Client(server.grpc_url, timeout_s=600) for _ in range(conc)]

        def concurrent() -> None:
            barrier = threading.Barrier(conc)
            errors: list[BaseException] = []

            def one(i: int) -> None:
                try:
                    barrier.wait()
                    clients[i].logprobs_batch([single[i]], use_cache=False)
                except BaseException as exc:
                    errors.append(exc)

            ts = [threading.Thread(target=one, args=(i,)) for i in range(conc)]
            for t in ts:
                t.start()
            for t in ts:
                t.join()
            if errors:
                raise errors[0]

        def sequential() -> None:
            for s in single:
                clients[0].logprobs_batch([s], use_cache=False)

        c_res = summary(timed(concurrent, reps=args.reps))
        s_res = summary(timed(sequential, reps=args.reps))
        for c in clients:
            c.close()
        figures.append(
            Figure(
                "concurrent-vs-sequential",
                f"{conc} concurrent ÷ {conc} sequential clients",
                s_res["median_s"] / c_res["median_s"],
                "speed-up",
                "> 1",
                {"concurrent": c_res, "sequential": s_res, "tokens_each": args.single_len},
            )
        )
    finally:
        server.stop()
    return figures


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--dtype", default="float32")
    p.add_argument(
        "--device",
        default="cpu",
        help="serving, invariant, throughput: where the forwards run (cuda); the naive baseline "
        "runs there too",
    )
    p.add_argument("--mode", default="deterministic")
    p.add_argument("--seqs", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--single-len", type=int, default=128)
    p.add_argument("--reps", type=int, default=3)
