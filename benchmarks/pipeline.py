"""Head-of-line blocking: a hot version's latency while other versions load.

L1  a client scoring the leased newest version, alone and then beside a second client that
    asks for old versions (each a cold load: a device budget of two versions, twelve versions
    of a ~40 M-parameter model stored as keyframes and patches). Figure: the hot client's p99
    beside the cold loads ÷ its p99 alone (goal ≤ 1.5: the load stage runs beside the compute
    stage instead of in front of it); the cold requests' latency is reported with it.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.common import Figure, ServerProcess


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def run(args: argparse.Namespace) -> list[Figure]:
    import torch

    from oldlogit import Client
    from oldlogit_service.demo import demo_versions
    from oldlogit_service.model import load_model, load_weights, make_tiny_model_dir

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
            f"{2.2 * model.nbytes / 1024**3:.9f}",
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

        warm: list[float] = []
        hot_loop(5, warm)
        alone: list[float] = []
        hot_loop(args.pipe_requests, alone)

        stop = threading.Event()
        cold: list[float] = []

        def cold_loop() -> None:
            order = [v for v in range(newest) for _ in range(1)]
            with Client(srv.grpc_url, timeout_s=600) as c:
                i = 0
                while not stop.is_set():
                    v = order[(i * 5) % len(order)]  # hop around: every request a cold load
                    i += 1
                    t0 = time.perf_counter()
                    c.logprobs(hot_seq, policy_version=v, use_cache=False)
                    cold.append(time.perf_counter() - t0)

        t = threading.Thread(target=cold_loop)
        t.start()
        time.sleep(0.5)
        beside: list[float] = []
        hot_loop(args.pipe_requests, beside)
        stop.set()
        t.join(600)
        metrics: Any = None
        import httpx

        metrics = httpx.get(f"{srv.http_url}/metrics").text
    finally:
        srv.stop()
    loads = [
        float(line.split()[-1])
        for line in metrics.splitlines()
        if line.startswith('oldlogit_weight_loads_total{source="disk"}')
    ]
    ratio = _pct(beside, 0.99) / _pct(alone, 0.99)
    return [
        Figure(
            "L1 hot-version p99 beside cold loads ÷ alone",
            ratio,
            "ratio",
            "<= 1.5",
            {
                "alone_ms": {
                    "p50": 1000 * statistics.median(alone),
                    "p99": 1000 * _pct(alone, 0.99),
                },
                "beside_ms": {
                    "p50": 1000 * statistics.median(beside),
                    "p99": 1000 * _pct(beside, 0.99),
                },
                "cold_ms": {"p50": 1000 * statistics.median(cold), "p99": 1000 * _pct(cold, 0.99)}
                if cold
                else {},
                "cold_requests": len(cold),
                "disk_loads": loads[0] if loads else 0,
                "parameters": model.num_parameters,
                "printed": (
                    f"hot alone p50/p99 {1000 * statistics.median(alone):.0f}/"
                    f"{1000 * _pct(alone, 0.99):.0f} ms; beside {len(cold)} cold requests "
                    f"{1000 * statistics.median(beside):.0f}/{1000 * _pct(beside, 0.99):.0f} ms; "
                    f"cold p50 {1000 * statistics.median(cold) if cold else 0:.0f} ms"
                ),
            },
        )
    ]


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pipe-hidden", type=int, default=512)
    p.add_argument("--pipe-layers", type=int, default=8)
    p.add_argument("--pipe-vocab", type=int, default=16384)
    p.add_argument("--pipe-tokens", type=int, default=128)
    p.add_argument("--pipe-requests", type=int, default=60)


def smoke(args: argparse.Namespace) -> None:
    args.pipe_hidden, args.pipe_layers, args.pipe_vocab = 64, 2, 512
    args.pipe_tokens, args.pipe_requests = 16, 10
