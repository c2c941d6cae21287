"""tls-vs-plaintext: what TLS costs the gRPC transport — throughput with TLS ÷ without.

Two real `oldlogit serve` subprocesses on the same tiny model, one plaintext and one with TLS
(a private CA made here with the ``cryptography`` package, tests/tls_certs.py). C concurrent
clients each send the same sequence over and over with the result cache on, so after the first
answer every request is transport and runtime only: the worst case for TLS, whose cost is
per byte and per connection. Measured for small requests (``--tls-tokens`` tokens, one
sequence) and large ones (``--tls-batch`` sequences of ``--tls-tokens`` each, the bytes of a
big logprobs batch). Rounds alternate plaintext and TLS; the figure is the median of the
per-round ratios.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.common import Figure, ServerProcess, concurrent


def _model(root: Path) -> Path:
    from oldlogit_service.demo.tiny import make_tiny_model_dir

    return make_tiny_model_dir(
        root / "model", arch="qwen2", seed=0, vocab_size=1024, hidden_size=64, num_layers=2
    )


def _throughput(url: str, seqs: list[Any], args: argparse.Namespace, **tls: Any) -> float:
    """Requests per second of ``args.tls_clients`` clients, each sending ``seqs`` repeatedly."""
    from oldlogit import Client

    clients = [Client(url, timeout_s=600, **tls) for _ in range(args.tls_clients)]
    try:
        for c in clients:  # connections up, the answers cached
            c.logprobs_batch(seqs)

        def one(i: int) -> None:
            for _ in range(args.tls_requests):
                clients[i].logprobs_batch(seqs)

        wall = concurrent(args.tls_clients, one)
    finally:
        for c in clients:
            c.close()
    return args.tls_clients * args.tls_requests / wall


def run(args: argparse.Namespace) -> list[Figure]:
    from oldlogit import Sequence

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ of the checkout
    from tests.tls_certs import CertAuthority

    root = Path(tempfile.mkdtemp(prefix="oldlogit-bench-tls-"))
    model_dir = _model(root)
    ca = CertAuthority(root / "pki", "bench CA")
    pair = ca.issue("server")
    common = ["--model", str(model_dir), "--dtype", "float32", "--max-wait-ms", "0"]
    plain = ServerProcess([*common, "--snapshot-dir", str(root / "plain")])
    secure = ServerProcess(
        [
            *common,
            "--snapshot-dir",
            str(root / "tls"),
            "--tls-cert-file",
            str(pair.cert),
            "--tls-key-file",
            str(pair.key),
        ]
    )
    rng = random.Random(0)
    figures: list[Figure] = []
    try:
        for label, batch in (("small", 1), ("large", args.tls_batch)):
            seqs = [
                Sequence(
                    token_ids=[rng.randrange(1024) for _ in range(args.tls_tokens)],
                    policy_version=0,
                )
                for _ in range(batch)
            ]
            rounds: list[dict[str, float]] = []
            for _ in range(args.tls_rounds):
                p = _throughput(plain.grpc_url, seqs, args)
                t = _throughput(f"grpcs://{secure.ports['grpc']}", seqs, args, ca_file=ca.pem)
                rounds.append({"plain_rps": p, "tls_rps": t, "ratio": t / p})
            ratio = statistics.median(r["ratio"] for r in rounds)
            figures.append(
                Figure(
                    "tls-vs-plaintext",
                    f"grpc TLS ÷ plaintext, {label} cached requests",
                    ratio,
                    "ratio",
                    ">= 0.8",
                    {
                        "rounds": rounds,
                        "sequences_per_request": batch,
                        "tokens_per_sequence": args.tls_tokens,
                        "clients": args.tls_clients,
                        "requests_per_client": args.tls_requests,
                        "printed": (
                            f"{label}: {batch} × {args.tls_tokens} tokens, "
                            f"{args.tls_clients} clients; plaintext "
                            f"{statistics.median(r['plain_rps'] for r in rounds):.0f} req/s, "
                            f"TLS {statistics.median(r['tls_rps'] for r in rounds):.0f} req/s"
                        ),
                    },
                )
            )
    finally:
        plain.stop()
        secure.stop()
    return figures


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tls-clients", type=int, default=8, help="concurrent clients")
    p.add_argument("--tls-requests", type=int, default=300, help="requests per client")
    p.add_argument("--tls-tokens", type=int, default=128, help="tokens per sequence")
    p.add_argument("--tls-batch", type=int, default=64, help="sequences per large request")
    p.add_argument("--tls-rounds", type=int, default=3, help="alternating rounds")


def smoke(args: argparse.Namespace) -> None:
    args.tls_clients, args.tls_requests, args.tls_tokens = 2, 10, 16
    args.tls_batch, args.tls_rounds = 4, 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit("run it as: oldlogit bench tls")
