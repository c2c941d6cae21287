"""A follower rank (1..N-1): its part of every version, and the forwards the front starts.

In: commands from the front (``channel.Channel``) on two groups, each served by its own thread
in the order sent: **control** (place a version's part, hold/unhold for the load stage,
retain, versions, stats, stop) and **work** (score or trace jobs under a version: the rank's
weights, ``tensor_parallel.use``, the same engine call as every other rank). Out: one ``Reply``
per control command; a forward's answer stays with the front (every rank computes it).
The process is started by ``launch.Ranks.start`` and exits when told to stop or when the
front is gone.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

from oldlogit.contract.weights import torch_dtype
from oldlogit.parity.tensor_parallel import TensorParallel, use
from oldlogit_service.config import Settings
from oldlogit_service.model.allocator import tune_allocator
from oldlogit_service.model.engine import Engine
from oldlogit_service.model.loaded import resolve_device
from oldlogit_service.ranks import shards
from oldlogit_service.ranks.channel import Channel, Reply, reply_error
from oldlogit_service.ranks.launch import Groups, heartbeat, join
from oldlogit_service.snapshots import SnapshotStore

logger = logging.getLogger(__name__)

__all__ = ["main"]


def main(
    rank: int,
    degree: int,
    addr: str,
    port: int,
    beats: Any,
    conn: Connection,
    settings: Settings,
    model_dir: Path,
    threads: int,
) -> None:
    """A follower process: build the model and this rank's store, join, serve until stopped."""
    logging.basicConfig(
        level=settings.log_level.upper(),
        format=f"%(asctime)s %(levelname)s rank{rank} %(name)s: %(message)s",
    )
    stop = threading.Event()
    threading.Thread(
        target=heartbeat, args=(beats, rank, stop), name="oldlogit-heartbeat", daemon=True
    ).start()
    try:
        tune_allocator()  # this rank's forwards allocate as the front's do (model/allocator.py)
        torch.set_num_threads(threads)
        device = shards.rank_device(resolve_device(settings.device), rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        model = shards.load_rank_model(settings, model_dir, device)
        rules = shards.rules_for(model)
        store = shards.open_rank_store(
            settings, model, rules, rank=rank, degree=degree, device=device
        )
        engine = Engine(
            model,
            mode=settings.mode,
            lm_head_fp32=settings.lm_head_fp32,
            max_batch_tokens=settings.max_batch_tokens,
        )
        groups = join(rank, degree, addr, port, device=device, timeout_s=settings.rank_timeout_s)
        conn.send(("joined", None))
    except BaseException as exc:  # reported to the front, which names this rank
        with contextlib.suppress(Exception):
            conn.send(("error", f"{type(exc).__name__}: {exc}"))
        stop.set()
        sys.exit(1)
    follower = Follower(rank, degree, store, engine, groups, model)
    try:
        follower.serve(settings.sweep_interval_s)
    finally:
        stop.set()
        store.close()
        with contextlib.suppress(Exception):
            torch.distributed.destroy_process_group()
    os._exit(0)  # the daemonic process's leftovers (NCCL, gloo threads) must not hold it


class Follower:
    def __init__(
        self,
        rank: int,
        degree: int,
        store: SnapshotStore,
        engine: Engine,
        groups: Groups,
        model: Any,
    ) -> None:
        self.rank = rank
        self.store = store
        self.engine = engine
        self.control = Channel(groups.control, rank, degree)
        self.work = Channel(groups.work, rank, degree)
        self.tp = TensorParallel(groups.tp, rank, degree)
        self.specs = {
            name: (torch_dtype(dtype), shape)
            for name, (dtype, shape) in shards.shard_specs(
                model, shards.rules_for(model), degree
            ).items()
        }
        self._done = threading.Event()

    def serve(self, sweep_interval_s: float) -> None:
        """Both command loops and this rank's sweeper, until the front says stop (or goes)."""
        work = threading.Thread(target=self._guard(self._work_loop), name="oldlogit-work")
        work.start()
        sweeper = threading.Thread(
            target=self._sweep_loop, args=(sweep_interval_s,), name="oldlogit-sweeper", daemon=True
        )
        sweeper.start()
        self._guard(self._control_loop)()
        self._done.set()
        work.join(timeout=10)

    def _guard(self, loop: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                loop()
            except Exception:
                # A broken collective (the front or a peer is gone): nothing can be resumed.
                logger.exception("tensor-parallel rank %d: its command loop failed", self.rank)
                self._done.set()
                os._exit(1)

        return run

    def _sweep_loop(self, interval_s: float) -> None:
        # Keyframe moves only: a rank store never retires a version on its own (shards.py).
        while not self._done.wait(interval_s):
            try:
                self.store.sweep()
            except Exception:
                logger.exception("the periodic sweep failed; the next one retries")

    # -- control ----------------------------------------------------------------------------
    def _control_loop(self) -> None:
        while True:
            op, payload = self.control.receive()
            parts = self.control.receive_parts(self.specs) if op == "place" else None
            try:
                reply = Reply(value=self._do(op, payload, parts))
            except Exception as exc:
                logger.warning("rank %d: %s failed: %s", self.rank, op, exc)
                reply = reply_error(exc)
            self.control.replies(reply)
            if op == "stop":
                return

    def _do(self, op: str, payload: Any, parts: dict[str, torch.Tensor] | None) -> Any:
        store = self.store
        if op == "place":
            version = int(payload)
            assert parts is not None
            return store.publish(version, parts).sha256
        if op == "hold":
            version, wanted = payload
            store.hold(version, wanted)
            return None
        if op == "unhold":
            version, ranks = payload
            if self.rank in ranks:
                store.unhold(int(version))
            return None
        if op == "retain":
            keep = set(payload)
            for rec in store.versions():
                if rec.version not in keep:
                    store.delete(rec.version)
            return None
        if op == "versions":
            return [rec.version for rec in store.versions()]
        if op == "stats":
            return rank_stats(store)
        if op == "evict":
            return store.evict(int(payload))
        if op == "stop":
            return None
        raise ValueError(f"unknown command {op!r}")

    # -- work -------------------------------------------------------------------------------
    def _work_loop(self) -> None:
        while True:
            op, payload = self.work.receive()
            if op == "stop":
                return
            version, jobs = payload
            with contextlib.ExitStack() as stack:
                try:
                    weights = stack.enter_context(self.store.acquire(version, uses=len(jobs)))
                    mine = Reply()
                except Exception as exc:
                    mine = reply_error(exc)
                if not all(r.ok for r in self.work.agree(mine)):
                    continue  # some rank lacks its weights: nobody runs the forward
                try:
                    with use(self.tp):
                        if op == "score":
                            self.engine.score(weights, jobs)
                        else:
                            for job in jobs:
                                self.engine.trace(weights, job)
                except Exception as exc:
                    # The same jobs fail the same way on the front, which answers them.
                    logger.warning("rank %d: %s failed: %s", self.rank, op, exc)


def rank_stats(store: SnapshotStore) -> dict[str, int]:
    """A rank's memory and disk, for ``/v1/info`` and the metrics."""
    st = store.stats()
    return {
        "device_bytes": st.tiers["device"].bytes,
        "device_budget_bytes": st.tiers["device"].budget,
        "host_bytes": st.tiers["host"].bytes,
        "disk_bytes": st.tiers["disk"].bytes,
        "device_versions": st.tiers["device"].versions,
        "device_evictions": st.tiers["device"].evictions,
        "versions": st.versions,
    }
