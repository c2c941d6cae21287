"""oldlogit against the roofline, the naive server and itself.

forward-roofline         forward FLOP/s ÷ measured GEMM FLOP/s (fp32), in-process engine,
                         64 × 512; the two interleaved, the median of the rounds' ratios.
concurrent-vs-naive      64 concurrent single-sequence clients: service throughput ÷ naive
                         server; concurrent-vs-big-batch: the same ÷ the in-process big-batch
                         engine call on the same sequences; concurrent-vs-naive-ceiling: that
                         engine call ÷ the naive server, the most any server reaches here.
versions-vs-naive        requests over 16 versions (Zipf-like toward recent) with a device
                         budget of 4 versions: service throughput ÷ naive server (which
                         reloads safetensors on every version switch), the two taking turns
                         over --versions-rounds rounds; eviction and rebuild counts from
                         /metrics; versions-vs-naive-ceiling beside it.
deterministic-vs-fast    deterministic-mode throughput ÷ fast-mode throughput (64 × 512), and
                         the measured fast-mode deviation.
latency-under-load       p50/p99 of single-sequence requests at 10 %, 50 %, 80 % of measured
                         capacity.
"Deterministic" is the default (invariant numerics, packed batches, exact); "fast" is
``--numerics hf --mode fast`` (the plain HF forward, sequences padded together, inexact).
``--device cuda`` runs the in-process engines, both servers and the naive baseline on the GPU.
"""

from __future__ import annotations

import argparse
import random
import re
import statistics
import tempfile
import threading
import time
from pathlib import Path
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
    summary,
    timed,
    versions_server,
    write_versions,
)
from benchmarks.serving import build_model


def _gemm_flops(a: torch.Tensor, b: torch.Tensor, reps: int = 5) -> float:
    """FLOP/s of ``a @ b`` (square), the median of ``reps`` calls after one (each call waits
    for its kernel on a GPU)."""
    n = a.shape[0]
    cuda = a.device.type == "cuda"

    def gemm() -> None:
        torch.mm(a, b)
        if cuda:
            torch.cuda.synchronize()

    ts = timed(gemm, reps=reps)
    return 2 * n**3 / statistics.median(ts)


def _forward_flops(model: Any, tokens_per_seq: int, seqs: int) -> float:
    """Matmul FLOPs of the forward: 2 × non-embedding weights × tokens (+ head and causal
    attention); norms, activations and softmax are left out (they are not GEMMs)."""
    cfg = model.config
    h = int(cfg["hidden_size"])
    layers = int(cfg["num_hidden_layers"])
    vocab = int(cfg["vocab_size"])
    body = sum(
        int(torch.Size(shape).numel())
        for name, (_, shape) in model.param_specs.items()
        if ".layers." in name and len(shape) == 2
    )
    t = tokens_per_seq
    per_seq = 2 * body * t + 2 * h * vocab * t + 2 * layers * t * t * h  # QK^T and AV, causal
    return float(per_seq * seqs)


# What versions-vs-naive reports of the server's work (metric, labels).
_VERSION_METRICS = (
    ("oldlogit_evictions_total", '{tier="device"}'),
    ("oldlogit_weight_loads_total", '{source="disk"}'),
    ("oldlogit_weight_loads_total", '{source="host"}'),
    ("oldlogit_rebuilds_total", ""),
    ("oldlogit_patches_applied_total", ""),
    ("oldlogit_weight_load_seconds_total", ""),
)


def _metric(text: str, name: str, labels: str = "") -> float:
    m = re.search(rf"^{re.escape(name)}{re.escape(labels)} ([0-9.e+-]+)$", text, flags=re.M)
    return float(m.group(1)) if m else 0.0


def run(args: argparse.Namespace) -> list[Figure]:
    from oldlogit import Client, Sequence
    from oldlogit_service.model.checkpoints import load_weights
    from oldlogit_service.model.engine import Engine, Job, measure_fast_mode_deviation
    from oldlogit_service.model.loaded import load_model
    from oldlogit_service.model.numerics import SamplingParams

    root = Path(tempfile.mkdtemp(prefix="oldlogit-bench-g-"))
    model_dir = build_model(args, root)
    device = torch.device(args.device)
    model = load_model(model_dir, dtype=torch.float32, device=device)
    # Fast mode pads only under the plain numerics (under the invariant ones it is an alias of
    # deterministic mode): "fast" is ``--numerics hf --mode fast`` here, in process and served.
    models = {
        "deterministic": model,
        "fast": load_model(model_dir, dtype=torch.float32, device=device, numerics="hf"),
    }
    base = load_weights(model_dir, model)  # on CPU: written, published
    assert base is not None
    on_device = {k: v.to(device) for k, v in base.items()}  # what in-process engines run on
    rng = random.Random(0)
    figures: list[Figure] = []
    conc = args.concurrency
    L = args.single_len
    singles = [[rng.randrange(args.vocab) for _ in range(L)] for _ in range(conc)]
    big = [[rng.randrange(args.vocab) for _ in range(args.seq_len)] for _ in range(args.seqs)]

    only = args.versions_only  # versions-vs-naive and its ceiling, nothing else

    # forward-roofline.
    if not only:
        engine = Engine(model, mode="deterministic")
        jobs = [
            Job(
                token_ids=torch.tensor(s),
                positions=torch.arange(1, len(s)),
                sampling=SamplingParams(),
            )
            for s in big
        ]
        # The forward and the GEMM it is held to, interleaved round by round (this machine's
        # speed drifts between minutes): the figure is the median of the rounds' ratios.
        engine.run(on_device, jobs)
        a = torch.randn(2048, 2048, device=device)
        b = torch.randn(2048, 2048, device=device)
        work = _forward_flops(model, args.seq_len, args.seqs)
        fwd_s: list[float] = []
        gemm_fps: list[float] = []
        ratios: list[float] = []
        for _ in range(args.reps):
            fwd_s += timed(lambda: engine.run(on_device, jobs), reps=1, warmup=0)
            gemm_fps.append(_gemm_flops(a, b))
            ratios.append(work / fwd_s[-1] / gemm_fps[-1])
        figures.append(
            Figure(
                "forward-roofline",
                "forward FLOP/s ÷ GEMM FLOP/s (fp32)",
                statistics.median(ratios),
                "ratio",
                ">= 0.6",
                {
                    "forward_flops_per_s": work / statistics.median(fwd_s),
                    "gemm_flops_per_s": statistics.median(gemm_fps),
                    "round_ratios": ratios,
                    "forward_tokens": engine.forward_tokens,
                    **summary(fwd_s),
                },
            )
        )

    # The versions of versions-vs-naive, written for the naive server too.
    versions = write_versions(base, root / "versions")
    naive = naive_server(model_dir, root / "versions", device=args.device)
    servers = {
        mode: versions_server(
            model_dir,
            root / f"snap-{mode}",
            base,
            mode=mode,
            max_batch_tokens=max(args.seqs * args.seq_len, conc * L),
            device=args.device,
        )
        for mode in ((args.versions_mode,) if only else ("deterministic", "fast"))
    }
    try:
        for srv in servers.values():
            with Client(srv.http_url, timeout_s=600) as c:
                for v, w in enumerate(versions[1:], start=1):
                    c.publish(v, w)
        http_naive = [httpx.Client(base_url=naive.http_url, timeout=600) for _ in range(conc)]

        def naive_one(i: int, v: int = 0) -> None:
            r = http_naive[i].post("/logprobs", json={"token_ids": singles[i], "policy_version": v})
            r.raise_for_status()

        # concurrent-vs-naive: 64 concurrent single-sequence clients, one version.
        rounds = args.concurrent_rounds
        if only:  # the servers warmed up as the full run's concurrent-vs-naive warms them
            concurrent(conc, lambda i: [naive_one(i) for _ in range(rounds)])
        naive_t = statistics.median(
            [
                concurrent(conc, lambda i: [naive_one(i) for _ in range(rounds)])
                for _ in range(1 if only else args.reps)
            ]
        )
        naive_tps = conc * rounds * L / naive_t
        inproc_s: dict[str, float] = {}
        for mode, srv in servers.items():
            clients = [Client(srv.grpc_url, timeout_s=600) for _ in range(conc)]

            def ours(i: int, clients: list[Any] = clients) -> None:
                for _ in range(rounds):
                    clients[i].logprobs(singles[i], policy_version=0, use_cache=False)

            concurrent(conc, ours)  # warm-up
            t = statistics.median([concurrent(conc, ours) for _ in range(1 if only else args.reps)])
            tps = conc * rounds * L / t
            eng = Engine(models[mode], mode=mode)
            sjobs = [
                Job(
                    token_ids=torch.tensor(s),
                    positions=torch.arange(1, L),
                    sampling=SamplingParams(),
                )
                for s in singles
            ]
            inproc = statistics.median(
                timed(lambda eng=eng, sjobs=sjobs: eng.run(on_device, sjobs), reps=args.reps)
            )
            inproc_tps = conc * L / inproc
            inproc_s[mode] = inproc / conc  # seconds per single sequence, no switches
            for c in clients:
                c.close()
            if only:
                continue
            figures.append(
                Figure(
                    "concurrent-vs-naive",
                    f"{mode}: {conc} clients ÷ naive server",
                    tps / naive_tps,
                    "ratio",
                    ">= 4",
                    {"tokens_per_s": tps, "naive_tokens_per_s": naive_tps},
                )
            )
            figures.append(
                Figure(
                    "concurrent-vs-big-batch",
                    f"{mode}: {conc} clients ÷ in-process big batch",
                    tps / inproc_tps,
                    "ratio",
                    ">= 0.8",
                    {"in_process_tokens_per_s": inproc_tps},
                )
            )
            figures.append(
                Figure(
                    "concurrent-vs-naive-ceiling",
                    f"{mode}: in-process big batch ÷ naive server",
                    inproc_tps / naive_tps,
                    "ratio",
                    "",
                    {
                        "why": "the most any server can reach on this machine with this "
                        "engine: concurrent-vs-naive cannot exceed it by more than the transport's "
                        "overlap with compute",
                    },
                )
            )

        # versions-vs-naive: 16 versions, Zipf-like toward recent, device budget 4 versions.
        # The naive server and ours take turns on each round's requests (this machine's speed
        # drifts between minutes); the figure is the ratio of the rounds' sums.
        srv = servers[args.versions_mode]
        clients = [Client(srv.grpc_url, timeout_s=600) for _ in range(conc)]
        naive_rounds: list[float] = []
        ours_rounds: list[float] = []
        moved_by: dict[str, float] = {}
        for _ in range(args.versions_rounds):
            per_client = recent_skewed_requests(rng, args.versions_requests, conc)
            naive_rounds.append(
                concurrent(
                    conc,
                    lambda i, asks=per_client: [naive_one(i, v) for v in asks.get(i, [])],
                )
            )
            before = httpx.get(f"{srv.http_url}/metrics").text
            ours_rounds.append(
                concurrent(
                    conc,
                    lambda i, asks=per_client: [
                        clients[i].logprobs(singles[i], policy_version=v, use_cache=False)
                        for v in asks.get(i, [])
                    ],
                )
            )
            after = httpx.get(f"{srv.http_url}/metrics").text
            for name, labels in _VERSION_METRICS:
                key = name + labels
                moved_by[key] = (
                    moved_by.get(key, 0.0)
                    + _metric(after, name, labels)
                    - _metric(before, name, labels)
                )
        for c in clients:
            c.close()
        naive_versions_s = sum(naive_rounds)
        ours_versions_s = sum(ours_rounds)

        def moved(name: str, labels: str = "") -> float:
            return moved_by[name + labels]

        evictions = moved("oldlogit_evictions_total", '{tier="device"}')

        figures.append(
            Figure(
                "versions-vs-naive",
                f"{VERSIONS} versions, budget {BUDGET_VERSIONS} ({args.versions_mode}) ÷ naive",
                naive_versions_s / ours_versions_s,
                "ratio",
                ">= 2",
                {
                    "requests": args.versions_requests * args.versions_rounds,
                    "rounds": args.versions_rounds,
                    "round_ratios": [n / o for n, o in zip(naive_rounds, ours_rounds, strict=True)],
                    "naive_s": naive_versions_s,
                    "oldlogit_s": ours_versions_s,
                    "device_evictions": evictions,
                    "loads": moved("oldlogit_weight_loads_total", '{source="disk"}')
                    + moved("oldlogit_weight_loads_total", '{source="host"}'),
                    "rebuilds": moved("oldlogit_rebuilds_total"),
                    "patches_applied": moved("oldlogit_patches_applied_total"),
                    "load_seconds": moved("oldlogit_weight_load_seconds_total"),
                    "printed": (
                        f"{evictions:.0f} device evictions, "
                        f"{moved('oldlogit_rebuilds_total'):.0f} rebuilds "
                        f"({moved('oldlogit_patches_applied_total'):.0f} patches applied), "
                        f"{moved('oldlogit_weight_load_seconds_total'):.2f} s loading"
                    ),
                },
            )
        )
        # The same requests in process at one version, no switches at all: versions-vs-naive
        # cannot pass it.
        requests = args.versions_requests * args.versions_rounds
        figures.append(
            Figure(
                "versions-vs-naive-ceiling",
                f"naive ÷ in-process with no version switch ({args.versions_mode})",
                naive_versions_s / (requests * inproc_s[args.versions_mode]),
                "ratio",
                "",
                {"in_process_s": requests * inproc_s[args.versions_mode]},
            )
        )

        if only:
            for h in http_naive:
                h.close()
            return figures

        # deterministic-vs-fast: on 64 × 512 through the service.
        seqs = [Sequence(token_ids=s, policy_version=0) for s in big]
        tps_by_mode = {}
        for mode, srv in servers.items():
            with Client(srv.grpc_url, timeout_s=600) as c:
                res = summary(
                    timed(lambda c=c: c.logprobs_batch(seqs, use_cache=False), reps=args.reps)
                )
            tps_by_mode[mode] = args.seqs * args.seq_len / res["median_s"]
        dev = measure_fast_mode_deviation(
            models["fast"], on_device, num_sequences=8, min_len=2, max_len=args.seq_len
        )
        figures.append(
            Figure(
                "deterministic-vs-fast",
                "deterministic ÷ fast throughput",
                tps_by_mode["deterministic"] / tps_by_mode["fast"],
                "ratio",
                ">= 0.8",
                {"tokens_per_s": tps_by_mode, "fast_max_abs_deviation": dev},
            )
        )

        # latency-under-load: at 10/50/80 % of capacity (single sequences, deterministic server).
        srv = servers["deterministic"]
        clients = [Client(srv.grpc_url, timeout_s=600) for _ in range(conc)]
        cap_t = concurrent(
            conc, lambda i: clients[i].logprobs(singles[i], policy_version=0, use_cache=False)
        )
        capacity = conc / cap_t
        lat_detail: dict[str, Any] = {"capacity_rps": capacity}
        for frac in (0.1, 0.5, 0.8):
            rate = frac * capacity
            n = max(10, int(rate * args.latency_s))
            lats: list[float] = []
            lock = threading.Lock()
            start = time.monotonic() + 0.05

            def one(
                i: int,
                rate: float = rate,
                n: int = n,
                lats: list[float] = lats,
                lock: threading.Lock = lock,
                start: float = start,
            ) -> None:
                k = i
                while k < n:
                    time.sleep(max(0.0, start + k / rate - time.monotonic()))
                    t0 = time.perf_counter()
                    clients[i].logprobs(singles[i], policy_version=0, use_cache=False)
                    with lock:
                        lats.append(time.perf_counter() - t0)
                    k += conc

            concurrent(conc, one)
            lat_detail[f"{int(frac * 100)}%"] = {"rate_rps": rate, **p50_p99_ms(lats)}
        for c in clients:
            c.close()
        figures.append(
            Figure(
                "latency-under-load",
                "p99 at 80 % ÷ at 10 % of capacity",
                lat_detail["80%"]["p99_ms"] / lat_detail["10%"]["p99_ms"],
                "ratio",
                "",
                lat_detail,
            )
        )
        for h in http_naive:
            h.close()
    finally:
        naive.stop()
        for srv in servers.values():
            srv.stop()
    return figures


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--concurrent-rounds",
        type=int,
        default=2,
        help="concurrent-vs-naive, packed-vs-padded: requests per client per round",
    )
    p.add_argument(
        "--versions-requests", type=int, default=256, help="versions-vs-naive: requests in all"
    )
    p.add_argument(
        "--versions-rounds",
        type=int,
        default=2,
        help="versions-vs-naive: rounds, the naive server and oldlogit taking turns",
    )
    p.add_argument(
        "--versions-only",
        action="store_true",
        help="throughput: run only versions-vs-naive and its ceiling (its servers, warmed up as "
        "the full run warms them)",
    )
    p.add_argument(
        "--versions-mode",
        default="deterministic",
        choices=["deterministic", "fast"],
        help="versions-vs-naive: the server measured",
    )
    p.add_argument(
        "--latency-s", type=float, default=8.0, help="latency-under-load: seconds per load level"
    )
