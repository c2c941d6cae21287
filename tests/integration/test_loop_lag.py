"""The event loop is never blocked: cold loads, Redis calls and publishes run off it.

A probe on the server's own event loop asks to be woken every 5 ms and records how late each
wake-up is, while the service loads cold versions (a device budget of one and a half versions,
requests cycling through six), answers from a result cache in Redis, lists versions through the
Redis registry and takes a 30 MB upload. Any of those done on the loop would stall it for tens to
hundreds of milliseconds (a cold load here takes ~50–150 ms, an upload's hash and fsync more);
scheduling noise on two busy cores stays far below the 100 ms bound.
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from oldlogit import Client
from oldlogit_service.config import Settings
from oldlogit_service.demo.deployment import demo_versions
from oldlogit_service.demo.tiny import make_tiny_model_dir
from oldlogit_service.model.checkpoints import load_weights
from oldlogit_service.model.loaded import load_model
from oldlogit_service.server import ServerThread
from tests.integration.conftest import WRITE_TOKEN
from tests.redis_server import RedisServer

BOUND_S = 0.100


async def _probe(stop: asyncio.Event, lags: list[float], period: float = 0.005) -> None:
    loop = asyncio.get_running_loop()
    while not stop.is_set():
        t0 = loop.time()
        await asyncio.sleep(period)
        lags.append(loop.time() - t0 - period)


def test_event_loop_never_waits_on_loads_redis_or_publishes(tmp_path: Path) -> None:
    registry = RedisServer(tmp_path / "registry").start()
    cache = RedisServer(tmp_path / "cache", policy="allkeys-lru", maxmemory="64mb").start()
    try:
        model_dir = make_tiny_model_dir(
            tmp_path / "model",
            hidden_size=256,
            num_layers=4,
            intermediate_size=768,
            vocab_size=8192,
            num_heads=8,
            num_kv_heads=4,
        )
        model = load_model(model_dir, dtype="float32", device="cpu")
        base = load_weights(model_dir, model)
        assert base is not None
        settings = Settings(
            model=model_dir,
            snapshot_dir=tmp_path / "snap",
            http_port=0,
            grpc_port=0,
            dtype="float32",
            device_budget_gib=1.5 * model.nbytes / 1024**3,
            write_token=WRITE_TOKEN,
            redis_url=registry.url,
            cache_redis_url=cache.url,
            max_wait_ms=1.0,
        )
        server = ServerThread(settings).start()
        try:
            versions = demo_versions(base, 8)
            with Client(server.http_url, token=WRITE_TOKEN, timeout_s=120) as c:
                for v in range(1, 6):
                    c.publish(v, versions[v])
            # Two attempts at most: code that blocks the loop stalls it every time, while a
            # scheduling hiccup of the machine (other processes on two cores) does not repeat.
            worst: list[float] = []
            for publish in (6, 7):
                lags = _workload(server, versions, publish)
                worst.append(max(lags))
                if worst[-1] < BOUND_S:
                    break
            assert min(worst) < BOUND_S, worst
            assert server.runtime is not None
            assert server.runtime.store.stats().loads_disk >= 6  # the loads were real
        finally:
            server.stop()
    finally:
        cache.stop()
        registry.stop()


def _workload(server: ServerThread, versions: list[Any], publish: int) -> list[float]:
    """Readers over both transports cycling through cold versions (with the Redis cache and
    registry) and one publish, while the probe runs on the server's loop; the probe's lags."""
    loop = server._loop
    assert loop is not None
    stop = asyncio.Event()
    lags: list[float] = []
    probe = asyncio.run_coroutine_threadsafe(_probe(stop, lags), loop)
    errors: list[BaseException] = []
    rng = np.random.default_rng(publish)
    seqs = [rng.integers(0, 8192, 48).tolist() for _ in range(12)]

    def readers(url: str) -> None:
        try:
            with Client(url, timeout_s=120) as c:
                for i in range(18):  # cycles through six versions: cold loads
                    c.logprobs(seqs[i % 12], policy_version=i % 6, use_cache=i % 2 == 0)
                    if i % 6 == 0:
                        c.versions()  # the Redis registry
        except BaseException as exc:
            errors.append(exc)

    def publisher() -> None:
        try:
            with Client(server.grpc_url, token=WRITE_TOKEN, timeout_s=120) as c:
                c.publish(publish, versions[publish])  # ~30 MB upload: hash, fsync, claim
        except BaseException as exc:
            errors.append(exc)

    threads = [
        threading.Thread(target=readers, args=(server.http_url,)),
        threading.Thread(target=readers, args=(server.grpc_url,)),
        threading.Thread(target=publisher),
    ]
    time.sleep(0.2)
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    busy_s = time.perf_counter() - t0
    loop.call_soon_threadsafe(stop.set)
    probe.result(10)
    assert not errors, errors
    assert len(lags) > busy_s / 0.05, len(lags)  # the probe ran the whole time
    return lags


@pytest.mark.parametrize("blocking", [True])
def test_the_probe_sees_a_blocked_loop(blocking: bool) -> None:
    """The probe is not blind: a 150 ms blocking call on the loop shows as a lag above the
    bound."""

    async def main() -> float:
        stop = asyncio.Event()
        lags: list[float] = []
        task = asyncio.create_task(_probe(stop, lags))
        await asyncio.sleep(0.05)
        if blocking:
            time.sleep(0.15)  # what a disk read or a Redis call on the loop would do
        await asyncio.sleep(0.05)
        stop.set()
        await task
        return max(lags)

    assert asyncio.run(main()) > BOUND_S
    assert torch.get_num_threads() >= 1
