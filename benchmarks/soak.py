"""Soak: ~80 % of measured capacity with publishes and evictions, bounded in time and count.

A publisher adds a version every ``--publish-every-s`` and moves the watermark (so versions are
evicted and deleted) from the first second to the last, with a device budget of a few versions
(so requests reload from disk). Capacity is measured first under it (closed loop, 8 clients,
single-sequence requests), then an open-loop load at ``--load`` × capacity runs for the
warm-up and ``--duration-s``. Reports the error count, p50/
p99 per window and their drift, and the server's RSS growth. Loopback only; stops by itself.

The load phase starts with a warm-up (``--warmup-s``, the same load): the store starts it
holding one version and fills to its retention (watermark, ``--max-versions``) and the result
cache to its budget, which takes a few minutes here. The ``--duration-s`` measured after it is
what the figures describe: latency windows, and RSS growth as the peak RSS of its last minute
over the peak of its first (single samples wobble by ~5 % as versions are built and dropped).
RSS is sampled every few seconds through both; the sample-to-sample growth, the growth from the
very start of the load, the second half's slope and the whole series are reported beside it.
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

import torch

from benchmarks.common import Figure, ServerProcess

TOKEN = "soak-token"


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def _pctl(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def run(args: argparse.Namespace) -> list[Figure]:
    from oldlogit import Client, OldLogitError
    from oldlogit_service.demo.tiny import make_tiny_model_dir
    from oldlogit_service.model.checkpoints import load_weights
    from oldlogit_service.model.loaded import load_model

    root = Path(tempfile.mkdtemp(prefix="oldlogit-soak-"))
    model_dir = make_tiny_model_dir(
        root / "model", vocab_size=args.soak_vocab, hidden_size=args.soak_hidden, num_layers=2
    )
    model = load_model(model_dir, dtype=torch.bfloat16, device=torch.device("cpu"))
    base = load_weights(model_dir, model)
    assert base is not None
    one_gib = sum(t.numel() * t.element_size() for t in base.values()) / 1024**3
    server = ServerProcess(
        [
            "--model",
            str(model_dir),
            "--snapshot-dir",
            str(root / "snap"),
            "--write-token",
            TOKEN,
            "--device-budget-gib",
            f"{4 * one_gib:.9f}",
            "--max-versions",
            "12",
            "--cache-budget-mib",
            "8",
        ]
    )
    rng = random.Random(0)
    lock = threading.Lock()
    versions = [0]
    errors: list[str] = []
    races = 0  # requests for a version the watermark retired while they were in flight
    sent = 0

    def make_seq() -> tuple[list[int], int]:
        with lock:
            pool = list(versions)
        v = pool[-1 - min(len(pool) - 1, int(rng.expovariate(0.7)))]  # Zipf-ish: recent
        return [rng.randrange(args.soak_vocab) for _ in range(args.soak_tokens)], v

    stop = threading.Event()

    def publisher() -> None:
        with Client(server.http_url, token=TOKEN, timeout_s=120) as c:
            v = 0
            while not stop.wait(args.publish_every_s):
                v += 1
                g = torch.Generator().manual_seed(v)
                w = {
                    k: (t.float() + 0.01 * torch.randn(t.shape, generator=g)).to(t.dtype)
                    for k, t in base.items()
                }
                try:
                    c.publish(v, w)
                    with lock:
                        versions.append(v)
                        if len(versions) > 8:
                            wm = versions[-8]
                            del versions[:-8]
                        else:
                            wm = None
                    if wm is not None:
                        time.sleep(0.5)  # let in-flight requests for old versions finish
                        c.set_watermark(wm)
                except OldLogitError as exc:
                    errors.append(f"publish {v}: {exc.code}: {exc}")

    try:
        # 1. Capacity: closed loop, with the publisher already running, so that "80 % of
        # capacity" means 80 % of what the service does while versions come and go.
        pub = threading.Thread(target=publisher)
        pub.start()
        done = 0
        stop_at = time.monotonic() + args.capacity_s

        def closed(c: Any) -> None:
            nonlocal done, races
            while time.monotonic() < stop_at:
                ids, v = make_seq()
                try:
                    c.logprobs(ids, policy_version=v, use_cache=False)
                except OldLogitError as exc:
                    if exc.code != "version_evicted":
                        errors.append(f"capacity logprobs v{v}: {exc.code}: {exc}")
                        continue
                    with lock:
                        races += 1
                    continue
                with lock:
                    done += 1

        clients = [Client(server.grpc_url, token=TOKEN, timeout_s=60) for _ in range(8)]
        ts = [threading.Thread(target=closed, args=(c,)) for c in clients]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        capacity = done / args.capacity_s
        rate = args.load * capacity

        # 2. Open loop at `rate` with a publisher.
        rss0 = _rss_bytes(server.proc.pid)
        lat: list[tuple[float, float]] = []  # (t since start, latency s)
        start = time.monotonic()
        warm = args.warmup_s
        end = start + warm + args.duration_s
        rss_series: list[tuple[float, int]] = [(0.0, rss0)]

        def sample_rss() -> None:
            every = max(0.5, min(5.0, (warm + args.duration_s) / 100))
            while not stop.wait(every):
                rss_series.append((time.monotonic() - start, _rss_bytes(server.proc.pid)))

        def worker(c: Any, k: int, n_workers: int) -> None:
            nonlocal sent, races
            i = 0
            while True:
                due = start + (i * n_workers + k) / rate
                if due > end or sent >= args.max_requests:
                    return
                time.sleep(max(0.0, due - time.monotonic()))
                ids, v = make_seq()
                t0 = time.monotonic()
                try:
                    c.logprobs(ids, policy_version=v, use_cache=False)
                except OldLogitError as exc:
                    # A version retired by the watermark mid-flight is the client's race, not
                    # a server fault: count it apart.
                    if exc.code != "version_evicted":
                        errors.append(f"logprobs v{v}: {exc.code}: {exc}")
                    else:
                        with lock:
                            races += 1
                with lock:
                    lat.append((t0 - start, time.monotonic() - t0))
                    sent += 1
                i += 1

        sampler = threading.Thread(target=sample_rss, daemon=True)
        sampler.start()
        n_workers = 16
        wclients = [Client(server.grpc_url, token=TOKEN, timeout_s=60) for _ in range(n_workers)]
        ws = [
            threading.Thread(target=worker, args=(wclients[k], k, n_workers))
            for k in range(n_workers)
        ]
        for t in ws:
            t.start()
        for t in ws:
            t.join()
        rss1 = _rss_bytes(server.proc.pid)
        rss_series.append((time.monotonic() - start, rss1))
        stop.set()
        pub.join(timeout=120)
        for c in clients + wclients:
            c.close()
    finally:
        stop.set()  # the publisher ends with the run, whatever ended it
        server.stop()

    lat = [(t - warm, d) for t, d in lat if t >= warm]  # the measured period only
    windows = max(2, min(10, int(args.duration_s // 30) or 2))
    width = args.duration_s / windows
    p99s = []
    for w in range(windows):
        xs = [d for t, d in lat if w * width <= t < (w + 1) * width]
        p99s.append(_pctl(xs, 0.99))
    all_lat = [d for _, d in lat]
    rss_warm = next((r for t, r in rss_series if t >= warm), rss0)
    # The judged growth: peak RSS in the last minute of the measured period ÷ peak RSS in its
    # first minute. Single samples wobble by ~5 % here as versions are built and dropped, so a
    # first-sample-to-last-sample ratio measures the wobble; peaks over a minute do not.
    edge = min(60.0, args.duration_s / 4)
    head = [r for t, r in rss_series if warm <= t < warm + edge] or [rss_warm]
    tail = [r for t, r in rss_series if t >= warm + args.duration_s - edge] or [rss1]
    peak_growth = max(tail) / max(head) - 1
    half = [(t, r) for t, r in rss_series if t >= warm + args.duration_s / 2]
    # MiB per minute over the second half, least squares (the series wobbles by tens of MiB as
    # versions are loaded and dropped): ~0 once RSS has levelled off, > 0 for a leak.
    slope = float("nan")
    if len(half) >= 3:
        mt = statistics.fmean(t for t, _ in half)
        mr = statistics.fmean(r for _, r in half)
        var = sum((t - mt) ** 2 for t, _ in half)
        if var > 0:
            slope = sum((t - mt) * (r - mr) for t, r in half) / var * 60 / 2**20
    drift = p99s[-1] / p99s[0] if p99s and p99s[0] == p99s[0] and p99s[0] > 0 else float("nan")
    detail = {
        "capacity_rps": capacity,
        "target_rps": rate,
        "requests": len(lat),
        "duration_s": args.duration_s,
        "errors": errors[:20],
        "error_count": len(errors),
        "evicted_races": races,
        "p50_s": _pctl(all_lat, 0.5),
        "p99_s": _pctl(all_lat, 0.99),
        "p99_per_window_s": p99s,
        "rss_start": rss0,
        "rss_end": rss1,
        "rss_after_warmup": rss_warm,
        "rss_peak_first_minute": max(head),
        "rss_peak_last_minute": max(tail),
        "rss_growth_sample_to_sample": (rss1 - rss_warm) / rss_warm if rss_warm else float("nan"),
        "warmup_s": warm,
        "rss_growth_from_start": (rss1 - rss0) / rss0 if rss0 else float("nan"),
        "rss_slope_second_half_mib_per_min": slope,
        "rss_series_mib": [(round(t, 1), round(r / 2**20, 1)) for t, r in rss_series],
        "published_versions": versions[-1],
        "median_s": statistics.median(all_lat) if all_lat else float("nan"),
    }
    return [
        Figure("soak-errors", "errors under load", float(len(errors)), "count", "0", detail),
        Figure("soak-p99-drift", "p99, last ÷ first window", drift, "ratio", "~1", {}),
        Figure(
            "soak-rss-growth",
            "RSS growth (peak, last ÷ first minute after the warm-up)",
            peak_growth,
            "fraction",
            "<= 0.05",
            {
                "from_start": detail["rss_growth_from_start"],
                "sample_to_sample": detail["rss_growth_sample_to_sample"],
                "slope_second_half_mib_per_min": slope,
            },
        ),
    ]


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--duration-s", type=float, default=600.0)
    p.add_argument("--capacity-s", type=float, default=10.0)
    p.add_argument("--load", type=float, default=0.8)
    p.add_argument("--publish-every-s", type=float, default=5.0)
    p.add_argument("--max-requests", type=int, default=1_000_000)
    p.add_argument(
        "--warmup-s",
        type=float,
        default=180.0,
        help="load before the measured period (the store and the result cache fill first)",
    )
    p.add_argument("--soak-hidden", type=int, default=128)
    p.add_argument("--soak-vocab", type=int, default=2048)
    p.add_argument("--soak-tokens", type=int, default=128)
