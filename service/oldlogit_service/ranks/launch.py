"""Starting the ranks of one replica and watching them.

In: the settings and the degree. Out: ``Ranks`` processes 1..N-1 started by the front (one
command starts them all), joined to one ``torch.distributed`` world (gloo for commands; the
forward's group gloo on CPU, NCCL on CUDA), and ``Health``: why the replica cannot serve, if it
cannot — a rank that exited or stopped beating, or a collective that failed — naming the rank.
A rank that cannot join is refused at start-up, naming the rank and the address, within
``rank_timeout_s``.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import multiprocessing as mp
import os
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from oldlogit.contract.errors import Unavailable

logger = logging.getLogger(__name__)

__all__ = ["Groups", "Health", "RankJoinError", "Ranks", "heartbeat", "join", "master_address"]

T = TypeVar("T")

HEARTBEAT_S = 0.5  # how often a follower says it is alive
HUNG_AFTER_S = 15.0  # a rank silent this long is taken as hung
COMMAND_TIMEOUT_S = 1800.0  # the longest a command's collective waits for a live rank


class RankJoinError(RuntimeError):
    """A rank could not join the replica at start-up (the message names it and the address)."""


@dataclass(frozen=True)
class Groups:
    """A rank's process groups: ``control`` (gloo, the front's commands), ``work`` (gloo, the
    compute stage's commands) and ``tp`` (the forward's collectives: gloo or NCCL)."""

    control: Any
    work: Any
    tp: Any
    backend: str


def master_address() -> tuple[str, int]:
    """``MASTER_ADDR``/``MASTER_PORT`` when given, else 127.0.0.1 and a free port."""
    addr = os.environ.get("MASTER_ADDR") or "127.0.0.1"
    port = os.environ.get("MASTER_PORT")
    if port:
        return addr, int(port)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((addr, 0))
        return addr, int(s.getsockname()[1])


def join(
    rank: int, degree: int, addr: str, port: int, *, device: torch.device, timeout_s: float
) -> Groups:
    """Join the replica's world (blocks until every rank has) and make the groups, in the same
    order on every rank."""
    timeout = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{addr}:{port}",
        rank=rank,
        world_size=degree,
        timeout=timeout,
    )
    backend = "nccl" if device.type == "cuda" else "gloo"
    # A command waits for the slowest rank's part of it (a load may queue behind admission);
    # a lost rank fails the wait at once through ``Health``, not through this timeout.
    commands = datetime.timedelta(seconds=max(timeout_s, COMMAND_TIMEOUT_S))
    control = dist.new_group(backend="gloo", timeout=commands)
    work = dist.new_group(backend="gloo", timeout=commands)
    # Inside a forward every rank computes the same thing: a collective waits only for skew.
    tp = dist.new_group(backend=backend, timeout=timeout)
    return Groups(control, work, tp, backend)


def heartbeat(beats: Any, rank: int, stop: threading.Event) -> None:
    """A follower's beat (``beats[rank]`` = monotonic seconds) until ``stop``; exits the process
    when the front is gone (a rank never outlives its replica)."""
    parent = os.getppid()
    while not stop.wait(HEARTBEAT_S):
        beats[rank] = time.monotonic()
        if os.getppid() != parent:
            logger.error(
                "tensor-parallel rank %d: the front (pid %d) is gone; exiting", rank, parent
            )
            os._exit(1)


@dataclass
class Health:
    """Why the replica cannot serve (None: it can). Sticky: once a rank is lost, the replica
    stays unready until it is restarted (its collectives cannot be resumed)."""

    procs: dict[int, BaseProcess] = field(default_factory=dict)
    beats: Any = None
    stopping: bool = False  # the front told the ranks to stop: their exits are no loss
    _lost: str | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def lose(self, why: str) -> None:
        with self._lock:
            if self._lost is None:
                logger.error("tensor-parallel replica lost: %s", why)
                self._lost = why

    def problem(self) -> str | None:
        if self._lost is not None or self.stopping:
            return self._lost
        now = time.monotonic()
        for rank, proc in self.procs.items():
            if not proc.is_alive():
                self.lose(
                    f"tensor-parallel rank {rank} (pid {proc.pid}) exited with code {proc.exitcode}"
                )
            elif self.beats is not None and now - self.beats[rank] > HUNG_AFTER_S:
                self.lose(
                    f"tensor-parallel rank {rank} (pid {proc.pid}) has not answered for "
                    f"{now - self.beats[rank]:.0f} s"
                )
        return self._lost

    def check(self) -> None:
        """Raise ``Unavailable`` naming the lost rank, if one is."""
        why = self.problem()
        if why is not None:
            raise Unavailable(f"this replica cannot serve: {why}", retry_after_s=5.0)


class Bounded:
    """One thread that runs a channel's collectives, in order; a caller waits for its call only
    while every rank is healthy: a lost rank fails the wait at once (``Unavailable`` naming the
    rank), never a hang. A collective that fails marks the replica lost."""

    def __init__(self, name: str, health: Health) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._health = health
        self._name = name

    def run(self, fn: Callable[[], T]) -> T:
        return self.wait(self.submit(fn))

    def submit(self, fn: Callable[[], T]) -> Future[T]:
        self._health.check()
        return self._pool.submit(fn)

    def wait(self, fut: Future[T]) -> T:
        while True:
            with contextlib.suppress(TimeoutError):
                return fut.result(timeout=0.1)
            self._health.check()

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


@dataclass
class Ranks:
    """The follower processes of one replica (ranks 1..N-1), started by the front."""

    degree: int
    addr: str
    port: int
    health: Health
    conns: dict[int, Connection]

    @classmethod
    def start(cls, target: Callable[..., None], degree: int, args: tuple[Any, ...]) -> Ranks:
        """Spawn ranks 1..N-1 running ``target(rank, degree, addr, port, beats, conn, *args)``."""
        addr, port = master_address()
        ctx = mp.get_context("spawn")
        beats = ctx.Array("d", degree, lock=False)
        now = time.monotonic()
        for r in range(degree):
            beats[r] = now
        procs: dict[int, BaseProcess] = {}
        conns: dict[int, Connection] = {}
        for rank in range(1, degree):
            recv, send = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=target,
                args=(rank, degree, addr, port, beats, send, *args),
                name=f"oldlogit-rank-{rank}",
                daemon=True,
            )
            proc.start()
            send.close()
            procs[rank], conns[rank] = proc, recv
        logger.info(
            "tensor parallel: started ranks 1..%d (pids %s), rendezvous at %s:%d",
            degree - 1,
            [p.pid for p in procs.values()],
            addr,
            port,
        )
        return cls(degree, addr, port, Health(procs, beats), conns)

    def join(self, *, device: torch.device, timeout_s: float) -> Groups:
        """Rank 0 joins; every other rank must join within ``timeout_s`` or the start fails
        (``RankJoinError`` naming the rank, why, and the address)."""
        box: dict[str, Any] = {}

        def run() -> None:
            try:
                box["groups"] = join(
                    0, self.degree, self.addr, self.port, device=device, timeout_s=timeout_s
                )
            except BaseException as exc:
                box["error"] = exc

        t = threading.Thread(target=run, name="oldlogit-rank-join", daemon=True)
        t.start()
        deadline = time.monotonic() + timeout_s
        joined: set[int] = set()
        where = f"{self.addr}:{self.port}"
        while t.is_alive():
            t.join(0.1)
            for rank, conn in self.conns.items():
                while rank not in joined and conn.poll():
                    try:
                        kind, text = conn.recv()
                    except (EOFError, OSError):
                        break
                    if kind == "joined":
                        joined.add(rank)
                    else:
                        self.stop(0.0)
                        raise RankJoinError(
                            f"tensor-parallel rank {rank} could not join the replica at {where}: "
                            f"{text}"
                        )
                proc = self.health.procs[rank]
                if rank not in joined and not proc.is_alive():
                    self.stop(0.0)
                    raise RankJoinError(
                        f"tensor-parallel rank {rank} (pid {proc.pid}) exited with code "
                        f"{proc.exitcode} before joining the replica at {where}"
                    )
            if t.is_alive() and time.monotonic() > deadline:
                missing = sorted(set(self.conns) - joined)
                self.stop(0.0)
                raise RankJoinError(
                    f"tensor-parallel rank(s) {missing} did not join the replica at {where} "
                    f"within {timeout_s:.0f} s (--rank-timeout-s)"
                )
        if "error" in box:
            self.stop(0.0)
            raise RankJoinError(f"rank 0 could not open the replica at {where}: {box['error']}")
        groups: Groups = box["groups"]
        return groups

    def stop(self, timeout_s: float = 10.0) -> None:
        """Wait for the followers to exit (they were told to stop), then end those left."""
        end = time.monotonic() + timeout_s
        for proc in self.health.procs.values():
            proc.join(max(0.0, end - time.monotonic()))
        for proc in self.health.procs.values():
            if proc.is_alive():
                proc.terminate()
                proc.join(5)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
