"""`oldlogit bench`: run the figures, print a table, write JSON to the output directory."""

from __future__ import annotations

import argparse
import platform
import shutil
import tempfile
from pathlib import Path

import torch

from benchmarks import (
    adapters,
    cluster_chain,
    delta_trace,
    invariant,
    models,
    parity,
    peer,
    pipeline,
    routing,
    serving,
    shapes,
    soak,
    tensor_parallel,
    throughput,
    tls,
)
from benchmarks.common import Figure, print_table, write_results

SUITES = {  # each runs some figures (docs/performance.md)
    "serving": serving,
    "throughput": throughput,
    "delta": delta_trace,
    "parity": parity,
    "pipeline": pipeline,
    "soak": soak,
    "tls": tls,
    "models": models,
    "peer": peer,
    "routing": routing,
    "invariant": invariant,  # also part of parity; its args and smoke come with parity's
    "tp": tensor_parallel,  # invariant's models, args and smoke; TP N vs 1 servers
    "adapters": adapters,  # LoRA adapter versions: publish, mixed batches, 1,000 retained
    "cluster": cluster_chain,  # one chain on a shared volume: bytes at 1-3 replicas, cold reads
}
# Suites that time a trainer-side path in this process (the patched forward against the plain
# one, transformers' forward as a baseline): they run with the process's own C allocator.
TRAINER_SIDE = frozenset({"invariant", "parity", "models"})
DEFAULT = [
    "serving",
    "throughput",
    "delta",
    "parity",
    "pipeline",
    "tls",
]  # the soak and the real-size models run for minutes, peer starts Ray, routing is for MoE
# replay, tp for tensor parallelism, adapters builds a Qwen2.5-0.5B-shaped model, cluster
# starts redis-server: ask for them by name


def plot(figures: list[Figure], out: Path) -> None:
    """One PNG of every ratio against its goal; latency vs load when measured."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # plots are optional: the table and JSON carry the numbers
        print("matplotlib is not installed: no plots")
        return
    ratios = [f for f in figures if f.unit == "ratio" and f.value == f.value]
    if ratios:
        fig, ax = plt.subplots(figsize=(9, 0.45 * len(ratios) + 1.2))
        labels = [f"{f.figure}: {f.name}" for f in ratios]
        ax.barh(labels, [f.value for f in ratios], color="#4a7bd0")
        for i, f in enumerate(ratios):
            goal = f.goal.replace(">=", "").replace("<=", "").strip()
            try:
                ax.plot([float(goal)] * 2, [i - 0.4, i + 0.4], color="#c03030", lw=2)
            except ValueError:
                pass
        ax.invert_yaxis()
        ax.set_xlabel("ratio (red: goal)")
        fig.tight_layout()
        fig.savefig(out / "ratios.png", dpi=110)
        plt.close(fig)
    lat = next((f for f in figures if f.figure == "latency-under-load"), None)
    if lat is not None:
        loads = [k for k in ("10%", "50%", "80%") if k in lat.detail]
        fig, ax = plt.subplots(figsize=(5, 3.5))
        ax.plot(loads, [lat.detail[k]["p50_ms"] for k in loads], "o-", label="p50")
        ax.plot(loads, [lat.detail[k]["p99_ms"] for k in loads], "o-", label="p99")
        ax.set_xlabel("load (fraction of capacity)")
        ax.set_ylabel("latency (ms)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "latency.png", dpi=110)
        plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="oldlogit bench")
    p.add_argument(
        "figures",
        nargs="*",
        metavar="suite",
        help=f"which suites (default all but soak, models, peer, routing): {sorted(SUITES)}",
    )
    p.add_argument("--out", type=Path, default=Path("bench-out"))
    p.add_argument("--smoke", action="store_true", help="tiny sizes: seconds, for CI")
    p.add_argument(
        "--default-allocator",
        action="store_true",
        help="leave the C allocator as the process starts for every suite (default: the "
        "suites that time the service's engine in process run with the settings `oldlogit "
        "serve` sets, after the trainer-side suites)",
    )
    serving.add_args(p)
    soak.add_args(p)
    delta_trace.add_args(p)
    throughput.add_args(p)
    parity.add_args(p)
    pipeline.add_args(p)
    tls.add_args(p)
    models.add_args(p)
    peer.add_args(p)
    routing.add_args(p)
    tensor_parallel.add_args(p)
    adapters.add_args(p)
    cluster_chain.add_args(p)
    shapes.add_args(p)
    args = p.parse_args(argv)
    args.figures = args.figures or list(DEFAULT)
    unknown = sorted(set(args.figures) - set(SUITES))
    if unknown:
        p.error(f"unknown suites {unknown}; choose from {sorted(SUITES)}")
    if args.smoke:
        args.hidden, args.layers, args.vocab = 64, 2, 512
        args.seqs, args.seq_len, args.concurrency, args.single_len, args.reps = 4, 64, 4, 16, 1
        args.duration_s, args.capacity_s, args.publish_every_s = 4.0, 1.5, 0.5
        args.warmup_s = 1.0
        delta_trace.smoke(args)
        parity.smoke(args)
        pipeline.smoke(args)
        tls.smoke(args)
        models.smoke(args)
        peer.smoke(args)
        routing.smoke(args)
        tensor_parallel.smoke(args)
        adapters.smoke(args)
        cluster_chain.smoke(args)
        args.concurrent_rounds, args.versions_requests, args.latency_s = 1, 16, 1.0
        args.versions_rounds = 1
    asked = list(dict.fromkeys(args.figures))
    figures = []
    by_suite: dict[str, list[Figure]] = {}
    allocator: dict[str, str] = {}
    # Every suite's models, snapshots and versions go under one directory, removed at the end
    # (a real-size run writes GBs; repeated runs must not fill the disk).
    scratch = tempfile.mkdtemp(prefix="oldlogit-bench-")
    previous, tempfile.tempdir = tempfile.tempdir, scratch
    try:
        # The suites that time a trainer's process (TRAINER_SIDE) run first, with the C
        # allocator as a process starts; then the in-process service engines and their
        # baselines run with the settings `oldlogit serve` sets (tune_allocator: the change
        # cannot be undone within a process, hence the order). Otherwise an in-process engine
        # call page-faults its activations in again layer after layer, and a figure held
        # against the service would measure glibc's trim threshold, not the engine.
        order = sorted(asked, key=lambda n: n not in TRAINER_SIDE)  # stable: trainer side first
        setting = "default"
        for name in order:
            if name not in TRAINER_SIDE and setting == "default" and not args.default_allocator:
                from oldlogit_service.model.allocator import tune_allocator

                setting = "oldlogit serve's" if tune_allocator() else "default (not glibc)"
            allocator[name] = setting
            by_suite[name] = SUITES[name].run(args)
    finally:
        tempfile.tempdir = previous
        shutil.rmtree(scratch, ignore_errors=True)
    for name in asked:  # printed and written in the order asked for
        figures.extend(by_suite[name])
    print_table(figures)
    meta = {
        "machine": platform.machine(),
        "processor": platform.processor(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "allocator": allocator,
        **(
            {"cuda_device": torch.cuda.get_device_name(0), "cuda": torch.version.cuda}
            if args.device == "cuda" and torch.cuda.is_available()
            else {}
        ),
        "args": {k: str(v) for k, v in vars(args).items()},
    }
    path = write_results(args.out, figures, meta)
    plot(figures, args.out)
    print(f"results: {path}")
    return 0
