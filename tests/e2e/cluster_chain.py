"""Helpers of the shared-chain cluster tests: replicas as real ``oldlogit serve`` processes on one
shared snapshot directory and a real redis-server, RL-like bf16 versions, bytes on the volume."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import redis
import torch

from oldlogit import Client
from oldlogit_service.demo.tiny import make_tiny_model_dir
from oldlogit_service.model.checkpoints import load_weights
from oldlogit_service.model.loaded import load_model
from oldlogit_service.model.numerics import SamplingParams
from oldlogit_service.model.reference import reference_logprobs
from oldlogit_service.snapshots import ingest
from tests.redis_server import RedisServer

from .conftest import CliServer, start_cli, start_clis

TOKEN = "chain-token"
IDS = list(range(3, 70))


def volume_bytes(root: Path, suffixes: tuple[str, ...] = (".safetensors", ".patch")) -> int:
    """Bytes of the weight files under ``root``, each inode once (hard links share bytes)."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for dirpath, _, names in os.walk(root):
        for n in names:
            p = os.path.join(dirpath, n)
            st = os.lstat(p)
            if not n.endswith(suffixes) or (st.st_dev, st.st_ino) in seen:
                continue
            seen.add((st.st_dev, st.st_ino))
            total += st.st_size
    return total


def inodes(root: Path) -> set[tuple[int, int]]:
    out: set[tuple[int, int]] = set()
    for dirpath, _, names in os.walk(root):
        for n in names:
            if n.endswith((".safetensors", ".patch")):
                st = os.lstat(os.path.join(dirpath, n))
                out.add((st.st_dev, st.st_ino))
    return out


@dataclass
class ChainCluster:
    tmp: Path
    registry: RedisServer
    model_dir: Path
    model: Any
    dtype: str
    replicas: dict[str, CliServer] = field(default_factory=dict)
    refs: dict[int, np.ndarray] = field(default_factory=dict)
    shas: dict[int, str] = field(default_factory=dict)

    @property
    def shared(self) -> Path:
        return self.tmp / "shared"

    def args(self, rid: str) -> list[str]:
        return [
            "--model",
            str(self.model_dir),
            "--snapshot-dir",
            str(self.shared),
            "--dtype",
            self.dtype,
            "--redis-url",
            self.registry.url,
            "--replica-id",
            rid,
            "--write-token",
            TOKEN,
            "--http-port",
            "0",
            "--grpc-port",
            "0",
            "--sweep-interval-s",
            "0.3",
            "--log-level",
            "WARNING",
        ]

    def start(self, *rids: str, env: dict[str, str] | None = None) -> None:
        if env is None:
            for rid, srv in zip(rids, start_clis([self.args(r) for r in rids]), strict=True):
                self.replicas[rid] = srv
        else:
            for rid in rids:
                self.replicas[rid] = start_cli(self.args(rid), env=env)

    def kill(self, rid: str) -> None:
        self.replicas.pop(rid).stop(signal.SIGKILL)

    def stop(self) -> None:
        for r in self.replicas.values():
            if r.proc.poll() is None:
                r.proc.send_signal(signal.SIGTERM)
        for r in self.replicas.values():
            r.proc.wait(timeout=30)
        self.replicas.clear()
        self.registry.stop()

    def client(self, rid: str, **kw: Any) -> Client:
        return Client(f"grpc://{self.replicas[rid].grpc}", token=TOKEN, **kw)

    def snapshot_nbytes(self) -> int:
        return ingest.specs_nbytes(ingest.normalize_specs(self.model.param_specs))

    def record(self, version: int, weights: dict[str, torch.Tensor], sha: str) -> None:
        self.refs[version] = reference_logprobs(self.model, weights, IDS, SamplingParams())
        self.shas[version] = sha

    def check_bitwise(self, rids: list[str] | None = None) -> None:
        """Every acknowledged version on every live replica: bitwise the one-replica answer."""
        for rid in rids or list(self.replicas):
            with self.client(rid, retries=2) as c:
                for v, ref in sorted(self.refs.items()):
                    r = c.logprobs(IDS, policy_version=v, use_cache=False)
                    assert np.array_equal(r.logprobs, ref, equal_nan=True), (rid, v)
                    assert r.weight_sha256[v] == self.shas[v], (rid, v)

    def chain_files(self) -> set[str]:
        r = redis.Redis.from_url(self.registry.url)
        return {json.loads(x)["file"] for x in r.hgetall("oldlogit:default:versions").values()}

    def no_orphans(self, timeout_s: float = 30.0) -> None:
        """The chain directory holds exactly the records' files, and every replica's links
        are links to them (collection and following are the sweepers': waited for)."""
        end = time.monotonic() + timeout_s
        while True:
            files = set(os.listdir(self.shared / "chain"))
            want = self.chain_files()
            linked = inodes(self.shared / "replicas")
            ok = files == want and linked <= inodes(self.shared / "chain")
            if ok or time.monotonic() > end:
                break
            time.sleep(0.3)
        assert files == want, (sorted(files - want), sorted(want - files))
        assert linked <= inodes(self.shared / "chain")


def start_cluster(
    tmp: Path, rids: list[str], *, dtype: str = "bfloat16", model_dir: Path | None = None
) -> ChainCluster:
    """Replicas ``rids`` of a tiny model (or ``model_dir``'s), version 0 its weights."""
    registry = RedisServer(tmp / "registry", durable=True).start()
    if model_dir is None:
        model_dir = make_tiny_model_dir(tmp / "model", vocab_size=384, hidden_size=64, num_layers=2)
    model = load_model(model_dir, dtype=getattr(torch, dtype), device=torch.device("cpu"))
    c = ChainCluster(tmp, registry, model_dir, model, dtype)
    base = load_weights(model_dir, model)
    assert base is not None
    c.start(*rids)
    with c.client(rids[0]) as cl:
        c.shas[0] = cl.version(0).weight_sha256
    c.refs[0] = reference_logprobs(model, base, IDS, SamplingParams())
    return c


def rl_like(
    base: dict[str, torch.Tensor], n: int, seed: int, lr: float = 1e-5
) -> Iterator[dict[str, torch.Tensor]]:
    """``n`` versions, each an Adam-like step (``lr`` x a random sign per element) on float32
    masters, served in the base's dtype: at this model's weight scale about 2 % of the bf16
    elements change per step, as an RL step at a small learning rate does."""
    g = torch.Generator().manual_seed(seed)
    master = {k: t.float().clone() for k, t in base.items()}
    for _ in range(n):
        for t in master.values():
            t.add_(lr * torch.randn(t.shape, generator=g).sign())
        yield {k: t.to(base[k].dtype) for k, t in master.items()}


def publish_in_turn(
    c: ChainCluster,
    rids: list[str],
    versions: Iterator[dict[str, torch.Tensor]],
    first: int = 1,
    after: Callable[[int], None] | None = None,
) -> int:
    """Each version through the next replica, as a delta against the one before (one trainer
    whose publishes land on a different replica each time). Returns the next version."""
    last = None
    v = first
    for w in versions:
        rid = rids[(v - first) % len(rids)]
        with c.client(rid) as cl:
            pub = cl._aio._publisher  # the trainer's delta state travels with it
            pub._last_published = last
            res = cl.publish(v, w, delta=True, fallback_full=True)
            last = pub._last_published
        assert res.created
        c.record(v, w, res.weight_sha256)
        if after is not None:
            after(v)
        v += 1
    return v
