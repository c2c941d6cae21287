"""Crash safety: a child process publishes in a loop and is SIGKILLed at random moments.

After each kill the store reopens: every publish the child saw acknowledged is served with
its hash and bytes, nothing half-written is visible, and no stray file survives recovery.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time
from pathlib import Path

import torch

from oldlogit.contract.weights import weight_sha256
from oldlogit_service.snapshots import SnapshotStore

SHAPE = (256, 1024)  # 4 tensors x 1 MiB: a publish takes long enough to be caught mid-way
NAMES = [f"layer{i}.weight" for i in range(4)]
SPECS = {n: ("F32", SHAPE) for n in NAMES}

CHILD = f"""
import sys, torch
from pathlib import Path
from oldlogit_service.snapshots import SnapshotStore
specs = {SPECS!r}
def sd(v):
    g = torch.Generator().manual_seed(v)
    return {{n: torch.randn(specs[n][1], generator=g) for n in sorted(specs)}}
s = SnapshotStore(Path(sys.argv[1]), param_specs=specs, device="cpu", device_budget_bytes=0,
                  host_budget_bytes=0, disk_budget_bytes=1 << 40, max_versions=100000)
v = 0 if s.newest is None else s.newest + 1
print("READY", v, flush=True)
while True:
    out = s.publish(v, sd(v))
    print("ACK", v, out.sha256, flush=True)
    v += 1
"""


def make_sd(v: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(v)
    return {n: torch.randn(SPECS[n][1], generator=g) for n in sorted(SPECS)}


def open_store(root: Path) -> SnapshotStore:
    return SnapshotStore(
        root,
        param_specs=SPECS,
        device="cpu",
        device_budget_bytes=0,
        host_budget_bytes=0,
        disk_budget_bytes=1 << 40,
        max_versions=100000,
    )


def test_sigkill_never_exposes_half_written_publishes(tmp_path: Path) -> None:
    root = tmp_path / "snap"
    rng = random.Random(1234)
    acked: dict[int, str] = {}
    attempted: set[int] = set()
    for _ in range(4):
        proc = subprocess.Popen(
            [sys.executable, "-c", CHILD, str(root)],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert proc.stdout is not None
        ready = proc.stdout.readline().split()
        assert ready and ready[0] == "READY", ready
        first = int(ready[1])
        # Let a few publishes complete, then kill at a random moment of the next ones.
        lines = [proc.stdout.readline() for _ in range(rng.randint(0, 3))]
        time.sleep(rng.uniform(0.0, 0.15))
        proc.kill()  # SIGKILL: no cleanup, no atexit, no flush beyond what was written
        proc.wait()
        n_acked = 0
        for line in lines + proc.stdout.read().splitlines():
            tag, v, sha = line.split()
            assert tag == "ACK"
            acked[int(v)] = sha
            n_acked += 1
        proc.stdout.close()
        attempted.add(first + n_acked)  # the publish in flight when the kill landed

        with open_store(root) as s:
            visible = {r.version: r.sha256 for r in s.versions()}
            for v, sha in acked.items():
                assert visible.get(v) == sha, f"acknowledged version {v} lost"
            extra = set(visible) - set(acked)
            # A publish can be durable a moment before the child prints its ACK; nothing else.
            assert extra <= attempted, extra
            for v in visible:
                with s.acquire(v) as w:
                    assert weight_sha256(dict(w)) == visible[v] == weight_sha256(make_sd(v))
            weights = os.listdir(root / "weights")
            assert len(weights) == len(visible), weights  # no orphans, no temp files
            assert not [p for p in os.listdir(root) if p.startswith(".tmp-")]
        acked.update({v: visible[v] for v in extra})
    assert len(acked) >= 3  # the kills did land after some publishes
