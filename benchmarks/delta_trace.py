"""Delta snapshots on an RL-like trace: bytes stored, and the cost of serving a version cold.

A tiny Qwen2-style model (HF init, std 0.02) is trained with AdamW on fp32 master weights with a
policy-gradient-style loss (-advantage x logprob of sampled-like sequences); after every step
its weights are published in bf16 to the service's snapshot store (in process, the service's
keyframe policy). Per learning rate:
- delta-storage: bytes stored for all versions ÷ bytes of one full snapshot (goal <= 3.0 at
  lr 1e-6);
- cold-version-load: time to serve a random retained version cold (its weights not in memory,
  its keyframe and patches resident: ``acquire`` rebuilds it) ÷ time to load one full snapshot
  from RAM (a copy into a fresh buffer) (goal <= 2.0). Also measured, in the details:
  everything from disk. Between the (untimed) rounds the store is swept as the service's
  sweeper does every second: keyframes follow the rebuilds asked for (``SnapshotStore.sweep``),
  which the details show (keyframes moved, bytes stored after).
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.common import Figure


def add_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("delta (the RL-like trace)")
    g.add_argument("--trace-hidden", type=int, default=512)
    g.add_argument("--trace-layers", type=int, default=4)
    g.add_argument("--trace-vocab", type=int, default=8192)
    g.add_argument("--trace-versions", type=int, default=32, help="versions published")
    g.add_argument("--trace-batch", type=int, default=4, help="sequences per step")
    g.add_argument("--trace-seq-len", type=int, default=64)
    g.add_argument("--trace-lrs", default="1e-6,1e-5")
    g.add_argument("--trace-samples", type=int, default=24, help="cold serves timed per lr")
    g.add_argument("--keyframe-every", type=int, default=None, help="default: the service's")
    g.add_argument("--keyframe-chain-fraction", type=float, default=None)


def smoke(args: argparse.Namespace) -> None:
    args.trace_hidden, args.trace_layers, args.trace_vocab = 64, 2, 512
    args.trace_versions, args.trace_batch, args.trace_seq_len, args.trace_samples = 8, 2, 16, 4


def _train_versions(args: argparse.Namespace, lr: float, root: Path) -> Any:
    """Yield ``{name: bf16 tensor}`` per version: the initial weights, then one per step."""
    from transformers import AutoModelForCausalLM

    from oldlogit_service.demo.tiny import make_tiny_model_dir

    h = args.trace_hidden
    model_dir = make_tiny_model_dir(
        root / "model",
        arch="qwen2",
        seed=0,
        vocab_size=args.trace_vocab,
        hidden_size=h,
        num_layers=args.trace_layers,
        num_heads=max(1, h // 64) * 2,
        num_kv_heads=max(1, h // 64),
        intermediate_size=h * 3,
        max_positions=max(256, args.trace_seq_len * 2),
        initializer_range=0.02,  # as real checkpoints: the bf16 spacing vs the step matters
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=lr)
        gen = torch.Generator().manual_seed(1)
        vocab = args.trace_vocab

        def snapshot() -> dict[str, torch.Tensor]:
            return {k: p.detach().to(torch.bfloat16).clone() for k, p in model.named_parameters()}

        yield model_dir, snapshot()
        for _ in range(args.trace_versions - 1):
            ids = torch.randint(0, vocab, (args.trace_batch, args.trace_seq_len), generator=gen)
            logits = model(input_ids=ids).logits[:, :-1].float()  # [B, T-1, V]
            logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]
            reward = (ids[:, 1:] < vocab // 2).float().mean(1)  # a fixed preference to learn
            advantage = (reward - reward.mean())[:, None]  # [B, 1]
            loss = -(advantage * logp).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            yield model_dir, snapshot()


def _median_s(fn: Any, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _one_lr(args: argparse.Namespace, lr: float) -> list[Figure]:
    from oldlogit_service.config import Settings
    from oldlogit_service.snapshots import SnapshotStore

    defaults = Settings(demo=True)
    every = args.keyframe_every or defaults.keyframe_every
    fraction = args.keyframe_chain_fraction or defaults.keyframe_chain_fraction
    root = Path(tempfile.mkdtemp(prefix="oldlogit-trace-"))
    store: SnapshotStore | None = None
    changed: list[float] = []
    prev: dict[str, torch.Tensor] | None = None
    t_train = time.perf_counter()
    for v, (model_dir, weights) in enumerate(_train_versions(args, lr, root)):
        if store is None:
            from oldlogit_service.model.loaded import load_model

            specs = load_model(model_dir, dtype=torch.bfloat16, device="cpu").param_specs
            store = SnapshotStore(
                root / "snap",
                param_specs=specs,
                device="cpu",
                device_budget_bytes=1 << 40,  # memory is not what this measures
                host_budget_bytes=0,
                disk_budget_bytes=1 << 50,
                max_versions=1 << 20,
                keyframe_every=every,
                keyframe_chain_fraction=fraction,
            )
        if prev is not None:
            n = sum(t.numel() for t in weights.values())
            diff = sum(
                int((weights[k].view(torch.int16) != prev[k].view(torch.int16)).sum())
                for k in weights
            )
            changed.append(diff / n)
        store.publish(v, weights)
        prev = weights
    assert store is not None
    train_s = time.perf_counter() - t_train
    try:
        snap = store.snapshot_nbytes
        recs = store.versions()
        stored = sum(r.stored_nbytes for r in recs)
        kinds = [r.kind for r in recs]
        storage = Figure(
            "delta-storage",
            f"lr={lr:g}: bytes stored for {len(recs)} versions ÷ one snapshot",
            stored / snap,
            "ratio",
            "<= 3.0" if lr <= 1e-6 else "",
            {
                "stored_bytes": stored,
                "snapshot_bytes": snap,
                "keyframes": kinds.count("keyframe"),
                "patches": kinds.count("patch"),
                "changed_per_step_pct": [round(100 * c, 2) for c in changed],
                "keyframe_every": every,
                "keyframe_chain_fraction": fraction,
                "train_s": round(train_s, 1),
            },
        )
        # The baseline: one full snapshot copied from RAM into a fresh buffer (numpy's
        # allocator: huge pages, the fastest fresh buffer here; the store allocates the same).
        kf = next(r.version for r in recs if r.kind == "keyframe")
        with store.acquire(kf) as w:
            src = np.concatenate([t.reshape(-1).view(torch.uint8).numpy() for t in w.values()])

        def load_full() -> None:
            np.copyto(np.empty(snap, dtype=np.uint8), src)

        full_s = _median_s(load_full, max(5, args.trace_samples))
        rng = random.Random(0)
        sample = [rng.choice(recs).version for _ in range(args.trace_samples)]

        def warm() -> None:
            for r in recs:  # keyframes and decoded patches resident, as a running service has
                with store.acquire(r.version):
                    pass

        def cold(v: int) -> float:
            warm()
            for r in store.versions():  # nothing of it (a keyframe: read from disk), nor of its
                if r.kind == "patch" or r.version == v:  # chain
                    store.evict(r.version)
            t0 = time.perf_counter()
            with store.acquire(v):
                pass
            took = time.perf_counter() - t0
            store.sweep()  # untimed: the service's sweeper, every second
            return took

        cold(sample[0])
        cold(sample[1])
        times = [cold(v) for v in sample]
        st0 = store.stats()
        after = store.versions()
        kf = next(r.version for r in after if r.kind == "keyframe")
        kf_reads = []  # the pre-delta store's load: a keyframe file (in the page cache) read
        for _ in range(max(3, len(sample) // 4)):
            store.evict(kf)
            t0 = time.perf_counter()
            with store.acquire(kf):
                pass
            kf_reads.append(time.perf_counter() - t0)
        disk = []
        for v in sample[: max(2, len(sample) // 4)]:
            store.residency.clear()  # forget every memory copy, decoded patches too
            t0 = time.perf_counter()
            with store.acquire(v):
                pass
            disk.append(time.perf_counter() - t0)
        serve = Figure(
            "cold-version-load",
            f"lr={lr:g}: serve a random version cold ÷ load a full snapshot from RAM",
            statistics.median(times) / full_s,
            "ratio",
            "<= 2.0" if lr <= 1e-6 else "",
            {
                "cold_median_s": statistics.median(times),
                "cold_max_s": max(times),
                "full_load_from_ram_s": full_s,
                "keyframe_file_read_s": statistics.median(kf_reads),
                "cold_vs_keyframe_file_read": statistics.median(times)
                / statistics.median(kf_reads),
                "everything_from_disk_median_s": statistics.median(disk),
                "everything_from_disk_ratio": statistics.median(disk) / full_s,
                "samples": sample,
                "rebuilds": st0.rebuilds,
                "patches_applied": st0.patches_applied,
                "keyframes_moved": store.rebuilder.counters["keyframe_moves"],
                "keyframes_after": [r.version for r in after if r.kind == "keyframe"],
                "stored_bytes_after": sum(r.stored_nbytes for r in after),
                "stored_after_vs_snapshot": sum(r.stored_nbytes for r in after) / snap,
            },
        )
        return [storage, serve]
    finally:
        store.close()


def run(args: argparse.Namespace) -> list[Figure]:
    figures: list[Figure] = []
    for lr in (float(x) for x in args.trace_lrs.split(",")):
        figures.extend(_one_lr(args, lr))
    return figures
