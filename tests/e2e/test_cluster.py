"""Scale-out with real processes: three replicas on 127.0.0.1, one registry redis-server, one
cache redis-server, one shared snapshot directory (docs/operations.md, "Scale-out").

The default run starts three ``oldlogit serve`` processes and two Redis servers once for the
module (~20 s on 2 cores): a publish read bitwise on every replica, the shared result cache,
leases and the watermark across replicas, deltas through each replica in turn sharing one
chain on the volume. ``slow``: the SIGKILL and registry-outage tests,
each with a cluster of its own (~25 and ~30 s)."""

from __future__ import annotations

import random
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from oldlogit import Client
from oldlogit.contract import errors
from oldlogit_service.demo.tiny import make_tiny_model_dir
from oldlogit_service.model.checkpoints import load_weights
from oldlogit_service.model.loaded import load_model
from oldlogit_service.model.numerics import SamplingParams
from oldlogit_service.model.reference import reference_logprobs
from tests.redis_server import RedisServer

from .cluster_chain import inodes, volume_bytes
from .conftest import CliServer, start_clis

pytestmark = [pytest.mark.e2e, pytest.mark.redis]

TOKEN = "cluster-token"


@dataclass
class Cluster:
    replicas: list[CliServer]
    registry: RedisServer
    cache: RedisServer
    args: list[list[str]]
    model: object
    base: dict[str, torch.Tensor]

    def grpc(self, i: int) -> str:
        return f"grpc://{self.replicas[i].grpc}"

    def http(self, i: int) -> str:
        return f"http://{self.replicas[i].http}"


def _weights(base: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        k: (t.float() + 0.05 * torch.randn(t.shape, generator=g)).to(t.dtype)
        for k, t in base.items()
    }


def _start(tmp: Path, n: int = 3) -> Cluster:
    registry = RedisServer(tmp / "registry", durable=True).start()
    cache = RedisServer(tmp / "cache", policy="allkeys-lru", maxmemory="64mb").start()
    model_dir = make_tiny_model_dir(tmp / "model", vocab_size=384, hidden_size=64, num_layers=2)
    model = load_model(model_dir, dtype=torch.float32, device=torch.device("cpu"))
    base = load_weights(model_dir, model)
    assert base is not None
    args = [
        [
            "--model",
            str(model_dir),
            "--snapshot-dir",
            str(tmp / "shared"),
            "--dtype",
            "float32",
            "--redis-url",
            registry.url,
            "--cache-redis-url",
            cache.url,
            "--replica-id",
            f"r{i}",
            "--write-token",
            TOKEN,
            "--http-port",
            "0",
            "--grpc-port",
            "0",
            "--log-level",
            "WARNING",
        ]
        for i in range(n)
    ]
    replicas = start_clis(args)
    return Cluster(replicas, registry, cache, args, model, base)


def _stop(c: Cluster) -> None:
    # SIGTERM to every replica first, then wait for each: they drain side by side.
    for r in c.replicas:
        if r.proc.poll() is None:
            r.proc.send_signal(signal.SIGTERM)
    for r in c.replicas:
        r.proc.wait(timeout=30)
    c.registry.stop()
    c.cache.stop()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = _start(tmp_path_factory.mktemp("cluster"))
    yield c
    _stop(c)


def test_publish_on_one_read_bitwise_on_the_others(cluster: Cluster) -> None:
    w = _weights(cluster.base, 1)
    with Client(cluster.http(0), token=TOKEN) as c:
        res = c.publish(1, w)
    assert res.created
    ids = list(range(3, 90))
    ref = reference_logprobs(cluster.model, w, ids, SamplingParams())  # type: ignore[arg-type]
    for i, url in ((1, cluster.grpc(1)), (2, cluster.http(2))):
        with Client(url, token=TOKEN) as c:
            r = c.logprobs(ids, policy_version=1, use_cache=False)
            assert np.array_equal(r.logprobs, ref, equal_nan=True), f"replica {i}"
            assert r.weight_sha256[1] == res.weight_sha256
            assert 1 in [v.policy_version for v in c.versions()]
    # Idempotent on another replica; a different weight under the same version is refused.
    with Client(cluster.grpc(2), token=TOKEN, retries=0) as c:
        assert c.publish(1, w).created is False
        with pytest.raises(errors.VersionConflict):
            c.publish(1, _weights(cluster.base, 99))
    import httpx

    def members() -> set[str]:
        r = httpx.get(
            f"{cluster.http(1)}/v1/replicas", headers={"authorization": f"Bearer {TOKEN}"}
        )
        return {m["replica_id"] for m in r.json()["replicas"]}

    # Membership is a heartbeat with a TTL: on a loaded CI machine a beat can come late, so
    # give it a few beats before judging.
    seen, end = members(), time.monotonic() + 5
    while seen != {"r0", "r1", "r2"} and time.monotonic() < end:
        time.sleep(0.2)
        seen = members()
    assert seen == {"r0", "r1", "r2"}
    # A heartbeat after the reads above: replica 1 reports version 1 resident.
    resident: list[int] = []
    end = time.monotonic() + 5
    while 1 not in resident and time.monotonic() < end:
        time.sleep(0.2)
        r = httpx.get(
            f"{cluster.http(1)}/v1/replicas", headers={"authorization": f"Bearer {TOKEN}"}
        )
        resident = {m["replica_id"]: m for m in r.json()["replicas"]}["r1"]["resident"]
    assert 1 in resident
    # The client discovers the live replicas (gRPC here) from any one of them.
    with Client(cluster.grpc(2), token=TOKEN) as c:
        urls = c.discover()
        assert sorted(urls) == sorted(cluster.grpc(i) for i in range(3))
        # gRPC answers what HTTP answers, resident versions included.
        assert 1 in {m["replica_id"]: m for m in c.replicas()}["r1"]["resident"]
        assert c.logprobs(ids, policy_version=1).versions == [1]


def test_shared_result_cache_never_crosses_a_weight_change(cluster: Cluster) -> None:
    ids = list(range(10, 70))
    with Client(cluster.grpc(0), token=TOKEN) as c:
        c.publish(2, _weights(cluster.base, 2))
        first = c.logprobs(ids, policy_version=2)
    assert first.cached is False
    with Client(cluster.grpc(1), token=TOKEN) as c:
        second = c.logprobs(ids, policy_version=2)
    assert second.cached is True
    assert np.array_equal(first.logprobs, second.logprobs, equal_nan=True)
    with Client(cluster.grpc(2), token=TOKEN) as c:
        c.publish(3, _weights(cluster.base, 3))
        third = c.logprobs(ids, policy_version=3)
    assert third.cached is False
    assert not np.array_equal(third.logprobs, first.logprobs, equal_nan=True)


def test_leases_expire_across_replicas_and_watermark_applies_on_all(cluster: Cluster) -> None:
    with Client(cluster.grpc(0), token=TOKEN) as c:
        c.publish(4, _weights(cluster.base, 4))
        c.publish(5, _weights(cluster.base, 5))
        c.create_lease(4, ttl_s=1.0, holder="rollout-7")
    with Client(cluster.grpc(1), token=TOKEN, retries=0) as c:
        with pytest.raises(errors.Conflict):
            c.delete_version(4)  # leased on replica 0: pinned everywhere
    time.sleep(1.5)
    with Client(cluster.grpc(2), token=TOKEN, retries=0) as c:
        c.delete_version(4)  # the lease expired by TTL
    with Client(cluster.grpc(0), token=TOKEN, retries=0) as c:
        with pytest.raises(errors.VersionEvicted):
            c.logprobs([1, 2, 3], policy_version=4)
    with Client(cluster.http(1), token=TOKEN) as c:
        assert c.set_watermark(3) == 3
    for i in range(3):
        with Client(cluster.grpc(i), token=TOKEN, retries=0) as c:
            vs = [v.policy_version for v in c.versions()]
            assert min(vs) >= 3, (i, vs)
            with pytest.raises(errors.VersionEvicted):
                c.logprobs([1, 2, 3], policy_version=1)


@pytest.mark.slow
def test_sigkill_one_replica_under_load_zero_failures(tmp_path: Path) -> None:
    c3 = _start(tmp_path, 3)
    try:
        urls = [c3.grpc(i) for i in range(3)]
        with Client(urls[0], token=TOKEN) as c:
            for v in (1, 2, 3):
                c.publish(v, _weights(c3.base, v))
        failures: list[BaseException] = []
        done = 0
        stop = threading.Event()
        lock = threading.Lock()

        def load(k: int) -> None:
            nonlocal done
            rng = random.Random(k)
            with Client(urls, token=TOKEN, retries=6, timeout_s=60) as c:
                while not stop.is_set():
                    try:
                        c.logprobs(
                            [rng.randrange(384) for _ in range(40)],
                            policy_version=rng.choice([0, 1, 2, 3]),
                            use_cache=False,
                        )
                        with lock:
                            done += 1
                    except BaseException as exc:
                        failures.append(exc)

        threads = [threading.Thread(target=load, args=(k,)) for k in range(8)]
        for t in threads:
            t.start()
        time.sleep(2.0)
        c3.replicas[1].stop(signal.SIGKILL)
        time.sleep(3.0)
        stop.set()
        for t in threads:
            t.join(timeout=60)
            assert not t.is_alive(), "a worker thread did not finish in time"
        assert not failures, failures[:3]
        assert done > 50
    finally:
        _stop(c3)


@pytest.mark.slow
def test_registry_outage_reads_continue_publish_refused_then_reconverge(tmp_path: Path) -> None:
    c2 = _start(tmp_path, 2)
    try:
        with Client(c2.grpc(0), token=TOKEN) as c:
            c.publish(1, _weights(c2.base, 1))
        for i in range(2):  # make version 1 resident (adopted) on both replicas
            with Client(c2.grpc(i), token=TOKEN) as c:
                c.logprobs([1, 2, 3], policy_version=1)
        c2.registry.stop()
        reads, refused = 0, 0
        end = time.monotonic() + 10.0
        while time.monotonic() < end:
            for i in range(2):
                with Client(c2.grpc(i), token=TOKEN, retries=0) as c:
                    r = c.logprobs([5, 6, 7, 8], policy_version=1, use_cache=False)
                    assert np.isfinite(r.logprobs[1:]).all()
                    reads += 1
            if refused < 2:
                with Client(c2.http(refused % 2), token=TOKEN, retries=0) as c:
                    with pytest.raises(errors.Unavailable):
                        c.publish(2, _weights(c2.base, 2))
                    refused += 1
            time.sleep(0.2)
        assert reads > 10 and refused == 2
        c2.registry.start()  # same port, same append-only file
        time.sleep(1.0)
        with Client(c2.grpc(0), token=TOKEN, retries=8) as c:
            assert c.publish(2, _weights(c2.base, 2)).created
        with Client(c2.grpc(1), token=TOKEN) as c:
            assert 2 in [v.policy_version for v in c.versions()]
            assert c.logprobs([1, 2, 3], policy_version=2).versions == [2]
    finally:
        _stop(c2)


def test_deltas_through_each_replica_share_one_chain(cluster: Cluster) -> None:
    """Versions published as deltas through each replica in turn are one chain on the shared
    volume (a keyframe, then patches), every replica answers each bitwise, and the volume
    holds each file once: the replicas hold hard links (docs/delta-snapshots.md)."""
    shared = Path(cluster.args[0][cluster.args[0].index("--snapshot-dir") + 1])
    before = volume_bytes(shared)
    g = torch.Generator().manual_seed(11)
    w = _weights(cluster.base, 10)
    last = None
    made: dict[int, tuple[np.ndarray, str]] = {}
    ids = list(range(20, 80))
    for k, v in enumerate(range(10, 15)):
        if k:  # an RL-like step: 2 % of the elements change
            w = {
                n: torch.where(torch.rand(t.shape, generator=g) < 0.02, t + 0.01, t)
                for n, t in w.items()
            }
        with Client(cluster.grpc(k % 3), token=TOKEN) as c:
            pub = c._aio._publisher  # one trainer's delta state, through each replica in turn
            pub._last_published = last
            res = c.publish(v, w, delta=True)
            last = pub._last_published
        ref = reference_logprobs(cluster.model, w, ids, SamplingParams())  # type: ignore[arg-type]
        made[v] = (ref, res.weight_sha256)
    for i in range(3):
        with Client(cluster.grpc(i), token=TOKEN) as c:
            for v, (ref, sha) in made.items():
                r = c.logprobs(ids, policy_version=v, use_cache=False)
                assert np.array_equal(r.logprobs, ref, equal_nan=True), (i, v)
                assert r.weight_sha256[v] == sha
            kinds = {x.policy_version: x.kind for x in c.versions()}
            assert [kinds[v] for v in range(11, 15)] == ["patch"] * 4, kinds
    snap = sum(t.numel() * t.element_size() for t in cluster.base.values())
    # Version 10 is a keyframe, 11-14 patches of ~2 %: about 1.1 snapshots on the volume for
    # five versions on three replicas (stored whole on each, 15).
    end = time.monotonic() + 20
    while True:  # links of versions deleted earlier go as the sweepers follow and collect
        added = volume_bytes(shared) - before
        linked_only = inodes(shared / "replicas") <= inodes(shared / "chain")
        if (linked_only and added < 1.5 * snap) or time.monotonic() > end:
            break
        time.sleep(0.3)
    assert linked_only
    assert added < 1.5 * snap, (added / snap, added, snap)
