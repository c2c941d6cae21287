"""oldlogit against what a user would pick instead, on the same mixed-version workload.

peer-vs-ray-serve   our throughput ÷ Ray Serve model multiplexing's (benchmarks/ray_peer.py:
                    one replica holding at most 4 versions, a version's safetensors file
                    loaded on a miss, one transformers forward per request).
peer-vs-naive       our throughput ÷ the naive server's (benchmarks/naive_server.py: one
                    model, a safetensors reload on every version switch).

The workload is versions-vs-naive's (benchmarks/throughput.py): 16 versions, requests
Zipf-like toward the newest, ``--concurrency`` clients each sending single sequences of
``--single-len`` tokens, one request at a time. The ``-rl`` figures (peer-vs-ray-serve-rl,
peer-vs-naive-rl) run an RL trainer's mix on the same servers: most requests at the newest two
versions, a few very old (``benchmarks/common.py``'s ``rl_skewed_requests``),
``--peer-rl-clients`` clients (16); ``--peer-mix`` picks the mixes. Our server is
`oldlogit serve` in its default mode (deterministic, invariant numerics) with a device budget
of 4 versions and every version published before timing. The three servers run one after
another, never at the same time; each mix runs after the same untimed warm-up (one request
per client at the 4 newest versions); each request's latency is recorded for p50/p99. Ray
Serve is an optional extra (``pip install 'oldlogit[peer]'``); without it the suite says so
and measures ours and naive.
"""

from __future__ import annotations

import argparse
import importlib
import random
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import torch

from benchmarks.common import (
    BUDGET_VERSIONS,
    VERSIONS,
    Figure,
    concurrent,
    naive_server,
    p50_p99_ms,
    recent_skewed_requests,
    rl_skewed_requests,
    versions_server,
    write_versions,
)
from benchmarks.serving import build_model

RAY_MISSING = (
    "ray[serve] is not installed: pip install 'oldlogit[peer]' (or `make peer-venv`); "
    "skipping the Ray Serve peer"
)


def _drive(
    name: str, conc: int, per_client: dict[int, list[int]], tokens: int, call: Callable[..., Any]
) -> dict[str, Any]:
    """The untimed warm-up, then the workload: ``call(i, v)`` sends client i's request at
    version v and returns its logprobs. Throughput and per-request latencies."""
    newest = VERSIONS - 1
    concurrent(conc, lambda i: call(i, newest - i % BUDGET_VERSIONS))
    lats: list[float] = []
    lock = threading.Lock()

    def client(i: int) -> None:
        for v in per_client.get(i, []):
            t0 = time.perf_counter()
            out = call(i, v)
            dt = time.perf_counter() - t0
            if len(out) != tokens - 1:
                raise RuntimeError(f"{name}: {len(out)} logprobs for {tokens} tokens")
            with lock:
                lats.append(dt)

    wall = concurrent(conc, client)
    return {
        "tokens_per_s": len(lats) * tokens / wall,
        **p50_p99_ms(lats),
        "wall_s": wall,
        "requests": len(lats),
    }


def _http_caller(url: str, conc: int, ray: bool) -> tuple[Callable[..., Any], Callable[[], None]]:
    """One HTTP client per client thread: the naive server's POST /logprobs, or the Ray Serve
    peer's POST / with the version in the multiplexed model id header."""
    https = [httpx.Client(base_url=url, timeout=600) for _ in range(conc)]

    def call(i: int, v: int, ids: list[int]) -> list[float]:
        if ray:
            headers = {"serve_multiplexed_model_id": str(v)}
            r = https[i].post("/", json={"token_ids": ids}, headers=headers)
        else:
            r = https[i].post("/logprobs", json={"token_ids": ids, "policy_version": v})
        r.raise_for_status()
        return list(r.json()["logprobs"])

    def close() -> None:
        for h in https:
            h.close()

    return call, close


def run(args: argparse.Namespace) -> list[Figure]:
    from oldlogit import Client
    from oldlogit_service.model.checkpoints import load_weights
    from oldlogit_service.model.loaded import load_model

    ray_peer: ModuleType | None = None
    try:
        ray_peer = importlib.import_module("benchmarks.ray_peer")
    except ImportError as exc:
        print(f"{RAY_MISSING} ({exc})", flush=True)

    root = Path(tempfile.mkdtemp(prefix="oldlogit-bench-peer-"))
    model_dir = build_model(args, root)
    dtype = args.dtype
    base = load_weights(model_dir, load_model(model_dir, dtype=getattr(torch, dtype), device="cpu"))
    assert base is not None
    vdir = root / "versions"
    versions = write_versions(base, vdir)
    rng = random.Random(0)
    conc, L = args.concurrency, args.single_len
    # Each mix: (clients, client -> the versions it asks for, in order).
    mixes: dict[str, tuple[int, dict[int, list[int]]]] = {}
    if args.peer_mix in ("zipf", "both"):
        mixes["zipf"] = (conc, recent_skewed_requests(rng, args.peer_requests, conc))
    if args.peer_mix in ("rl", "both"):
        rl_conc = args.peer_rl_clients
        mixes["rl"] = (rl_conc, rl_skewed_requests(rng, args.peer_requests, rl_conc))
    most = max(n for n, _ in mixes.values())
    singles = [[rng.randrange(args.vocab) for _ in range(L)] for _ in range(most)]
    threads = torch.get_num_threads()  # the servers' too: same machine, same environment
    results: dict[str, dict[str, dict[str, Any]]] = {mix: {} for mix in mixes}  # mix -> server
    first: dict[str, list[float]] = {}  # each server's answer to client 0 at the newest version

    def measure(name: str, call: Callable[[int, int, list[int]], list[float]]) -> None:
        for mix, (n, per_client) in mixes.items():
            results[mix][name] = _drive(name, n, per_client, L, lambda i, v: call(i, v, singles[i]))
        first[name] = call(0, VERSIONS - 1, singles[0])

    # oldlogit: every version published before timing.
    srv = versions_server(
        model_dir, root / "snap", base, dtype=dtype, max_batch_tokens=max(conc * L, 2048)
    )
    try:
        with Client(srv.http_url, timeout_s=600) as c:
            for v, w in enumerate(versions[1:], start=1):
                c.publish(v, w)
        url = srv.grpc_url if args.peer_transport == "grpc" else srv.http_url
        clients = [Client(url, timeout_s=600) for _ in range(most)]
        try:

            def ours(i: int, v: int, ids: list[int]) -> list[float]:
                res = clients[i].logprobs(ids, policy_version=v, use_cache=False)
                return list(res.logprobs[1:])  # position 0 is not scored (NaN)

            measure("oldlogit", ours)
        finally:
            for c in clients:
                c.close()
    finally:
        srv.stop()

    naive = naive_server(model_dir, vdir, dtype)
    try:
        call, close = _http_caller(naive.http_url, most, ray=False)
        try:
            measure("naive", call)
        finally:
            close()
    finally:
        naive.stop()

    if ray_peer is not None:
        try:
            url = ray_peer.start(model_dir, vdir, dtype=dtype, threads=threads)
            call, close = _http_caller(url, most, ray=True)
            try:
                measure("ray-serve", call)
            finally:
                close()
        finally:
            ray_peer.stop()

    ref = torch.tensor(first["naive"])
    diffs = {  # the same sequences scored: the servers agree
        name: float((torch.tensor(out) - ref).abs().max()) for name, out in first.items()
    }
    figures = []
    for mix, (n, per_client) in mixes.items():
        figures += _mix_figures(args, mix, n, per_client, results[mix], diffs, threads)
    return figures


def _mix_figures(
    args: argparse.Namespace,
    mix: str,
    conc: int,
    per_client: dict[int, list[int]],
    results: dict[str, dict[str, Any]],
    diffs: dict[str, float],
    threads: int,
) -> list[Figure]:
    """One mix's figures: ours ÷ Ray Serve's (when it ran) and ÷ naive's."""
    for name, r in results.items():
        r["max_abs_diff_vs_naive"] = diffs[name]
    asked = [v for vs in per_client.values() for v in vs]
    newest = VERSIONS - 1
    share_newest_two = sum(v >= newest - 1 for v in asked) / max(1, len(asked))
    printed = " · ".join(
        f"{name} {r['tokens_per_s']:,.0f} tokens/s, p50 {r['p50_ms']:.0f} ms, "
        f"p99 {r['p99_ms']:.0f} ms"
        for name, r in results.items()
    )
    L = args.single_len
    detail: dict[str, Any] = {
        "servers": results,
        "mix": mix,
        "share_newest_two": share_newest_two,
        "requests_per_version": {v: asked.count(v) for v in range(VERSIONS)},
        "clients": conc,
        "tokens_per_request": L,
        "versions": VERSIONS,
        "budget_versions": BUDGET_VERSIONS,
        "torch_threads": threads,
        "transport": args.peer_transport,
        "printed": f"{100 * share_newest_two:.0f} % at the newest two: {printed}",
    }
    ours = results["oldlogit"]["tokens_per_s"]
    what = "Zipf-like toward recent" if mix == "zipf" else "RL mix, most at the newest two"
    shape = f"{VERSIONS} versions ({what}), budget {BUDGET_VERSIONS}, {conc} clients × {L} tokens"
    suffix = "" if mix == "zipf" else "-rl"
    figures = []
    if "ray-serve" in results:
        figures.append(
            Figure(
                f"peer-vs-ray-serve{suffix}",
                f"{shape}: oldlogit ÷ Ray Serve multiplexing",
                ours / results["ray-serve"]["tokens_per_s"],
                "ratio",
                ">= 2.5" if mix == "zipf" else ">= 3",
                detail,
            )
        )
        detail = {k: v for k, v in detail.items() if k != "printed"}  # printed once
    else:
        detail["ray_serve"] = "not installed"
    figures.append(
        Figure(
            f"peer-vs-naive{suffix}",
            f"{shape}: oldlogit ÷ naive server",
            ours / results["naive"]["tokens_per_s"],
            "ratio",
            "",
            detail,
        )
    )
    return figures


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--peer-requests", type=int, default=512, help="peer-vs-*: requests in all, per server"
    )
    p.add_argument(
        "--peer-transport",
        default="grpc",
        choices=["grpc", "http"],
        help="peer-vs-*: how the clients reach oldlogit (the peers are HTTP only)",
    )
    p.add_argument(
        "--peer-mix",
        default="both",
        choices=["zipf", "rl", "both"],
        help="peer-vs-*: the version mixes: Zipf-like toward recent (peer-vs-ray-serve, "
        "--concurrency clients), an RL trainer's (peer-vs-ray-serve-rl, --peer-rl-clients), "
        "or both on the same servers",
    )
    p.add_argument(
        "--peer-rl-clients", type=int, default=16, help="peer-vs-*-rl: concurrent clients"
    )


def smoke(args: argparse.Namespace) -> None:
    args.peer_requests, args.peer_rl_clients = 16, 4


if __name__ == "__main__":  # pragma: no cover
    sys.exit("run it as: oldlogit bench peer")
