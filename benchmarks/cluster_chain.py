"""Scale-out keeps its deltas: bytes on the shared volume at 1, 2 and 3 replicas, and what a
cold version's first read costs on a replica that never held it.

The RL-like trace of ``delta_trace.py`` (AdamW over float32 masters at lr 1e-6, published in
bf16) is published through each replica in turn into N replicas' stores on one shared
directory, each with its cluster control and a real ``redis-server`` (in process: the very
objects ``server.build_service`` wires, without the transports). Then every replica serves
every version (adopting it with its chain), and:
- cluster-delta-storage: bytes of the weight files under the shared directory (each inode
  once: replicas hold hard links) ÷ one snapshot, at each N;
- cluster-cold-first-read: a random version's first read on a replica that never held one
  (a fresh replica: it adopts the chain, every step hash-checked, and rebuilds it) ÷ the same
  version read cold on the replica that published it (its memory copies dropped first).
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks import delta_trace
from benchmarks.common import Figure


def add_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("cluster (one chain on a shared volume)")
    g.add_argument("--cluster-replicas", default="1,2,3", help="replica counts measured")
    g.add_argument(
        "--cluster-versions",
        type=int,
        default=32,
        help="versions published (the initial weights, then the steps: as bench delta)",
    )
    g.add_argument("--cluster-samples", type=int, default=6, help="cold first reads timed")


def smoke(args: argparse.Namespace) -> None:
    delta_trace.smoke(args)
    args.cluster_versions, args.cluster_samples = 6, 2


class _Redis:
    """A throwaway redis-server on a free loopback port."""

    def __init__(self, workdir: Path) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server is not installed")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = int(s.getsockname()[1])
        workdir.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            [
                exe,
                *("--port", str(self.port), "--bind", "127.0.0.1", "--save", ""),
                *("--appendonly", "no", "--dir", str(workdir)),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        end = time.monotonic() + 10
        while time.monotonic() < end:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=10)


def volume_bytes(root: Path) -> int:
    """Weight files' bytes under ``root``, each inode once (hard links share their bytes)."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for dirpath, _, names in os.walk(root):
        for n in names:
            if not n.endswith((".safetensors", ".patch")):
                continue
            st = os.lstat(os.path.join(dirpath, n))
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_size
    return total


def _replica(shared: Path, url: str, rid: str, specs: Any) -> tuple[Any, Any]:
    from oldlogit_service.cluster.chain import CHAIN_DIR
    from oldlogit_service.cluster.replicas import ClusterControl
    from oldlogit_service.config import Settings
    from oldlogit_service.snapshots import SnapshotStore

    defaults = Settings(demo=True)
    control = ClusterControl(url, "bench", rid, chain_dir=shared / CHAIN_DIR)
    store = SnapshotStore(
        shared / "replicas" / rid,
        param_specs=specs,
        device="cpu",
        device_budget_bytes=1 << 40,  # memory is not what this measures
        host_budget_bytes=0,
        disk_budget_bytes=1 << 50,
        max_versions=1 << 20,
        keyframe_every=defaults.keyframe_every,
        keyframe_chain_fraction=defaults.keyframe_chain_fraction,
        keyframes_follow_access=False,  # placement as published: the figures compare N
        shared=control.shared,
    )
    control.bind(store)
    control.start(http=f"{rid}:0", grpc=f"{rid}:0", queue_depth=lambda: 0)
    return control, store


def _close(replicas: list[tuple[Any, Any]]) -> None:
    for control, store in replicas:
        control.stop()
        store.close()


def _serve(control: Any, store: Any, version: int) -> None:
    control.prepare({version}, tolerant=False)
    with store.acquire(version):
        pass


def run(args: argparse.Namespace) -> list[Figure]:
    from oldlogit_service.model.loaded import load_model

    root = Path(tempfile.mkdtemp(prefix="oldlogit-cluster-"))
    args.trace_versions = args.cluster_versions  # the initial weights, then the steps
    trace = list(delta_trace._train_versions(args, 1e-6, root / "trace"))
    model_dir = trace[0][0]
    versions = [w for _, w in trace]
    specs = load_model(model_dir, dtype=torch.bfloat16, device="cpu").param_specs
    snap = sum(t.numel() * t.element_size() for t in versions[0].values())
    figures: list[Figure] = []
    counts = [int(x) for x in args.cluster_replicas.split(",")]
    for n in counts:
        redis = _Redis(root / f"redis-{n}")
        shared = root / f"shared-{n}"
        reps = [_replica(shared, redis.url, f"r{i}", specs) for i in range(n)]
        try:
            for v, w in enumerate(versions):
                reps[v % n][1].publish(v, w)
            for control, store in reps:
                for v in range(len(versions)):
                    _serve(control, store, v)
            held = volume_bytes(shared)
            kinds = [r.kind for r in reps[0][1].versions()]
            figures.append(
                Figure(
                    "cluster-delta-storage",
                    f"{n} replica(s), {len(versions)} versions: shared volume bytes ÷ one snapshot",
                    held / snap,
                    "ratio",
                    "<= 3.0",
                    {
                        "volume_bytes": held,
                        "snapshot_bytes": snap,
                        "keyframes": kinds.count("keyframe"),
                        "patches": kinds.count("patch"),
                        "whole_versions_would_be": len(versions),
                    },
                )
            )
            if n == max(counts):
                figures.append(_cold_first_read(args, shared, redis.url, specs, reps, versions))
        finally:
            _close(reps)
            redis.stop()
    shutil.rmtree(root, ignore_errors=True)
    return figures


def _cold_first_read(
    args: argparse.Namespace,
    shared: Path,
    url: str,
    specs: Any,
    reps: list[tuple[Any, Any]],
    versions: list[dict[str, torch.Tensor]],
) -> Figure:
    rng = random.Random(0)
    sample = [rng.randrange(1, len(versions)) for _ in range(args.cluster_samples)]
    fresh_s, publisher_s = [], []
    for k, v in enumerate(sample):
        control, store = reps[v % len(reps)]  # the replica that published it
        store.residency.clear()
        t0 = time.perf_counter()
        _serve(control, store, v)
        publisher_s.append(time.perf_counter() - t0)
        fresh = _replica(shared, url, f"fresh{k}", specs)
        try:
            t0 = time.perf_counter()
            _serve(*fresh, v)
            fresh_s.append(time.perf_counter() - t0)
        finally:
            _close([fresh])
    ratios = [f / p for f, p in zip(fresh_s, publisher_s, strict=True)]
    return Figure(
        "cluster-cold-first-read",
        "a cold version's first read on a replica that never held it ÷ on its publisher",
        statistics.median(ratios),
        "ratio",
        "",
        {
            "samples": sample,
            "fresh_replica_s": fresh_s,
            "publishing_replica_s": publisher_s,
        },
    )
