"""Head-of-line blocking: a hot version's latency while other versions load.

hot-p99-beside-cold  a client scoring the leased newest version, alone and then beside a
    second client that asks for random old versions, each another than the one before: with
    a device budget of exactly two versions (``--pipe-budget-versions``) the hot one holds one
    and every cold request is a load from disk (twelve versions of a ~40 M-parameter model
    stored as keyframes and patches; no room is left for decoded patches or a rebuild base).
    Figure: the hot client's p99 beside the cold loads ÷ its p99 alone (goal ≤ 2.0: loads and
    the rest of the background work yield to a waiting forward of a resident version); the
    cold requests' latency, and the disk loads per cold request (1.0: every one a load; more:
    the hot version was pushed out too), are reported with it.
hot-p99-beside-resident  the floor beside it: the same second client asking for one
    *resident* version, so nothing loads and only the compute stage is shared — what the
    second client's own forwards cost the hot one on this machine, loads or not.
The three conditions run in interleaved rounds.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import tempfile
import threading
import time
from pathlib import Path

from benchmarks.common import Figure, ServerProcess


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def run(args: argparse.Namespace) -> list[Figure]:
    import torch

    from oldlogit import Client
    from oldlogit_service.demo.deployment import demo_versions
    from oldlogit_service.demo.tiny import make_tiny_model_dir
    from oldlogit_service.model.checkpoints import load_weights
    from oldlogit_service.model.loaded import load_model

    root = Path(tempfile.mkdtemp(prefix="oldlogit-bench-pipeline-"))
    model_dir = make_tiny_model_dir(
        root / "model",
        hidden_size=args.pipe_hidden,
        num_layers=args.pipe_layers,
        intermediate_size=3 * args.pipe_hidden,
        vocab_size=args.pipe_vocab,
        num_heads=max(1, args.pipe_hidden // 64) * 2,
        num_kv_heads=max(1, args.pipe_hidden // 64),
        initializer_range=0.02,
    )
    model = load_model(model_dir, dtype=torch.float32, device="cpu")
    base = load_weights(model_dir, model)
    assert base is not None
    nversions = 12
    versions = demo_versions(base, nversions, changed_fraction=0.03)
    srv = ServerProcess(
        [
            "--model",
            str(model_dir),
            "--snapshot-dir",
            str(root / "snap"),
            "--dtype",
            "float32",
            "--cache-budget-mib",
            "0",
            "--device-budget-gib",
            # Rounded up: the budget holds the versions whole, and not a byte of patch more.
            f"{math.ceil(args.pipe_budget_versions * model.nbytes / 1024**3 * 1e9) / 1e9:.9f}",
        ]
    )
    rng = random.Random(0)
    hot_seq = [rng.randrange(args.pipe_vocab) for _ in range(args.pipe_tokens)]
    newest = nversions - 1
    try:
        with Client(srv.http_url, timeout_s=600) as c:
            for v in range(1, nversions):
                c.publish(v, versions[v])
            lease = c.lease(newest, ttl_s=3600)
            lease.__enter__()

        def hot_loop(n: int, out: list[float]) -> None:
            with Client(srv.grpc_url, timeout_s=600) as c:
                for _ in range(n):
                    t0 = time.perf_counter()
                    c.logprobs(hot_seq, policy_version=newest, use_cache=False)
                    out.append(time.perf_counter() - t0)

        pick = random.Random(1)

        def beside(versions_asked: list[int], hot: list[float], other: list[float]) -> None:
            """The hot loop while a second client asks for ``versions_asked``: at random, never
            the one it asked for last (with one version: that one each time)."""
            stop = threading.Event()

            def other_loop() -> None:
                with Client(srv.grpc_url, timeout_s=600) as c:
                    last = None
                    while not stop.is_set():
                        v = pick.choice([x for x in versions_asked if x != last] or versions_asked)
                        last = v
                        t0 = time.perf_counter()
                        c.logprobs(hot_seq, policy_version=v, use_cache=False)
                        other.append(time.perf_counter() - t0)

            t = threading.Thread(target=other_loop)
            t.start()
            time.sleep(0.5)
            try:
                hot_loop(args.pipe_requests, hot)
            finally:
                stop.set()
                t.join(600)

        import httpx

        def disk_loads() -> float:
            text = httpx.get(f"{srv.http_url}/metrics").text
            for line in text.splitlines():
                if line.startswith('oldlogit_weight_loads_total{source="disk"}'):
                    return float(line.split()[-1])
            return 0.0

        hot_loop(5, [])  # warm-up
        cold_loads = 0.0
        alone: list[float] = []
        warm: list[float] = []
        cold_hot: list[float] = []
        warm_other: list[float] = []
        cold: list[float] = []
        # Rounds interleave the three conditions, so the machine's drift hits them alike; the
        # samples of a condition are pooled over the rounds.
        for _ in range(args.pipe_rounds):
            hot_loop(args.pipe_requests, alone)
            # A second client on one other, resident version: the compute stage is shared,
            # nothing loads. What sharing the cores costs the hot client, loads or not.
            beside([newest - 1], warm, warm_other)
            # A second client on the old versions: every request a cold load.
            before = disk_loads()
            beside(list(range(newest)), cold_hot, cold)
            cold_loads += disk_loads() - before
        loads = disk_loads()
    finally:
        srv.stop()

    def ms(xs: list[float]) -> dict[str, float]:
        return {"p50": 1000 * statistics.median(xs), "p99": 1000 * _pct(xs, 0.99)}

    def p50_p99(xs: list[float]) -> str:
        return f"{1000 * statistics.median(xs):.0f}/{1000 * _pct(xs, 0.99):.0f} ms"

    p99_alone = _pct(alone, 0.99)
    return [
        Figure(
            "hot-p99-beside-cold",
            "hot-version p99 beside cold loads ÷ alone",
            _pct(cold_hot, 0.99) / p99_alone,
            "ratio",
            "<= 2.0",
            {
                "alone_ms": ms(alone),
                "beside_ms": ms(cold_hot),
                "cold_ms": ms(cold) if cold else {},
                "cold_requests": len(cold),
                "disk_loads": loads,
                "loads_per_cold_request": cold_loads / max(1, len(cold)),
                "budget_versions": args.pipe_budget_versions,
                "parameters": model.num_parameters,
                "rounds": args.pipe_rounds,
                "printed": (
                    f"hot p50/p99 alone {p50_p99(alone)}, beside {len(cold)} cold requests "
                    f"{p50_p99(cold_hot)}; cold requests {p50_p99(cold) if cold else '-'}, "
                    f"{cold_loads / max(1, len(cold)):.2f} disk loads each "
                    f"({args.pipe_rounds} interleaved rounds of {args.pipe_requests}, budget "
                    f"{args.pipe_budget_versions:g} versions)"
                ),
            },
        ),
        Figure(
            "hot-p99-beside-resident",
            "floor: hot p99 beside a resident version's client ÷ alone (nothing loads)",
            _pct(warm, 0.99) / p99_alone,
            "ratio",
            "-",
            {
                "beside_ms": ms(warm),
                "other_ms": ms(warm_other),
                "printed": (
                    f"hot beside {len(warm_other)} requests for a resident version "
                    f"{p50_p99(warm)}: on this machine the second client's forwards alone cost "
                    "the hot client this much"
                ),
            },
        ),
    ]


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pipe-hidden", type=int, default=512)
    p.add_argument("--pipe-layers", type=int, default=8)
    p.add_argument("--pipe-vocab", type=int, default=16384)
    p.add_argument("--pipe-tokens", type=int, default=128)
    p.add_argument(
        "--pipe-requests", type=int, default=40, help="hot-p99-beside-*: hot requests per phase"
    )
    p.add_argument(
        "--pipe-rounds", type=int, default=3, help="hot-p99-beside-*: interleaved rounds"
    )
    p.add_argument(
        "--pipe-budget-versions",
        type=float,
        default=2.0,
        help="hot-p99-beside-*: the server's device budget, in versions (2: the hot one and the "
        "one loaded for the cold client; the figures before this flag ran at 2.2)",
    )


def smoke(args: argparse.Namespace) -> None:
    args.pipe_hidden, args.pipe_layers, args.pipe_vocab = 64, 2, 512
    args.pipe_tokens, args.pipe_requests, args.pipe_rounds = 16, 10, 1
