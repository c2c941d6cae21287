"""Rank 0's side of a tensor-parallel replica: every rank, driven as one.

In: the front's own part store and engine, the follower processes (``launch.Ranks``) and the
process groups. Out: ``Front`` — what the scheduler's load stage needs (``hold``/``unhold`` on
every rank, ``acquire`` of rank 0's part, tagged with its version) and what the store needs
(``place`` a version's parts on every rank, ``retain`` only these versions) — and
``ShardedEngine``, the scheduler's engine: each batch goes to every rank (same jobs, same
order), all run it under ``tensor_parallel.use``, the front answers with its own copy.
Every collective runs on a channel's own thread and is waited for only while every rank is
healthy (``launch.Bounded``): a lost rank fails calls with ``Unavailable`` naming it.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator, Mapping, Sequence
from collections.abc import Set as AbstractSet
from typing import Any

import torch
from torch import Tensor

from oldlogit.contract.errors import OldLogitError, Unavailable
from oldlogit.contract.types import RankInfo
from oldlogit.parity.tensor_parallel import ShardRules, TensorParallel, use
from oldlogit.parity.trace import TraceStage
from oldlogit_service.model.engine import Engine, Job, Scored
from oldlogit_service.ranks import shards
from oldlogit_service.ranks.channel import Channel, Reply, reply_error
from oldlogit_service.ranks.follower import rank_stats
from oldlogit_service.ranks.launch import Bounded, Groups, Health, Ranks
from oldlogit_service.snapshots import SnapshotStore

logger = logging.getLogger(__name__)

__all__ = ["Front", "RankWeights", "ShardedEngine"]


class RankWeights(Mapping[str, Tensor]):
    """Rank 0's part of one version, as the engine reads weights, tagged with the version (so
    the engine can tell the other ranks which part to take)."""

    def __init__(self, version: int, tensors: Mapping[str, Tensor]) -> None:
        self.version = version
        self._tensors = tensors

    def __getitem__(self, name: str) -> Tensor:
        return self._tensors[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)


class Front:
    """Every rank of the replica, driven from rank 0."""

    def __init__(
        self,
        *,
        store: SnapshotStore,
        engine: Engine,
        rules: ShardRules,
        ranks: Ranks,
        groups: Groups,
        device: torch.device,
        threads: int,
    ) -> None:
        self.store = store  # rank 0's parts
        self.engine = engine
        self.rules = rules
        self.ranks = ranks
        self.degree = ranks.degree
        self.health: Health = ranks.health
        self.backend = groups.backend
        self.device = device
        self.threads = threads
        self.tp = TensorParallel(groups.tp, 0, self.degree)
        self._control = Channel(groups.control, 0, self.degree)
        self._work = Channel(groups.work, 0, self.degree)
        self._control_thread = Bounded("oldlogit-rank-control", self.health)
        self._work_thread = Bounded("oldlogit-rank-work", self.health)
        self._closed = False

    # -- control commands -------------------------------------------------------------------
    def _command(self, op: str, payload: Any = None, *, local: Any = None) -> list[Reply]:
        """``op`` on every follower and ``local()`` here, at the same time; every rank's reply
        (rank 0's first). A collective failure loses the replica."""

        def remote() -> list[Reply]:
            try:
                self._control.send(op, payload)
                if op == "place":
                    self._control.send_parts(payload_parts)
                return self._control.replies(Reply())
            except Exception as exc:
                self.health.lose(f"a tensor-parallel command ({op}) failed: {exc}")
                raise

        payload_parts: list[Mapping[str, Tensor]] = []
        if op == "place":
            payload, payload_parts = payload
        fut = self._control_thread.submit(remote)  # the followers start at once
        try:
            mine = Reply(value=local()) if local is not None else Reply()
        except Exception as exc:
            mine = reply_error(exc)
        replies = self._control_thread.wait(fut)
        return [mine, *replies[1:]]

    def place(self, version: int, weights: Mapping[str, Tensor]) -> list[str]:
        """Split a whole version (``shard_weight``) and store every rank's part; each rank's part
        hash, in rank order. All or none: if any rank fails, every rank drops the version."""
        parts = shards.split(weights, self.rules, self.degree)
        replies = self._command(
            "place",
            (version, parts),
            local=lambda: self.store.publish(version, parts[0]).sha256,
        )
        if not all(r.ok for r in replies):
            with contextlib.suppress(OldLogitError):
                self.drop(version)
            for rank, r in enumerate(replies):
                if not r.ok:
                    r.raise_for(rank)
        return [str(r.value) for r in replies]

    def drop(self, version: int) -> None:
        """Delete ``version``'s part on every rank that holds it."""
        self.retain(set(self.versions()) - {version})

    def retain(self, keep: AbstractSet[int]) -> None:
        """Every rank keeps only the parts of ``keep`` (the front's registry decides)."""

        def local() -> None:
            for rec in self.store.versions():
                if rec.version not in keep:
                    self.store.delete(rec.version)

        for rank, r in enumerate(self._command("retain", sorted(keep), local=local)):
            r.raise_for(rank)

    def versions(self) -> set[int]:
        """The versions every rank holds its part of."""
        replies = self._command(
            "versions", local=lambda: [r.version for r in self.store.versions()]
        )
        held: set[int] | None = None
        for rank, r in enumerate(replies):
            mine = set(r.raise_for(rank))
            held = mine if held is None else held & mine
        return held or set()

    def problem(self) -> str | None:
        """Why the replica cannot serve (a lost rank, named); None while every rank is up."""
        return self.health.problem()

    def rank_infos(self) -> list[RankInfo]:
        """Each rank's process, device, threads and the bytes of its parts (``/v1/info``)."""
        replies = self._command("stats", local=lambda: rank_stats(self.store))
        pids = {r: p.pid or 0 for r, p in self.health.procs.items()}
        pids[0] = os.getpid()
        out = []
        for rank, r in enumerate(replies):
            stats = dict(r.raise_for(rank))
            out.append(
                RankInfo(
                    rank=rank,
                    pid=pids.get(rank, 0),
                    device=str(shards.rank_device(self.device, rank)),
                    threads=self.threads,
                    **{k: v for k, v in stats.items() if k in RankInfo.model_fields},
                )
            )
        return out

    def rank_stats(self) -> list[dict[str, int]]:
        """Each rank's raw counters, in rank order (tests, benchmarks)."""
        replies = self._command("stats", local=lambda: rank_stats(self.store))
        return [dict(r.raise_for(rank)) for rank, r in enumerate(replies)]

    # -- the scheduler's weights source (``scheduler.WeightsSource``) ------------------------
    def hold(self, version: int, wanted: AbstractSet[int] = frozenset()) -> None:
        """Make ``version`` resident on every rank and keep it so until ``unhold``."""
        replies = self._command(
            "hold", (version, frozenset(wanted)), local=lambda: self.store.hold(version, wanted)
        )
        if all(r.ok for r in replies):
            return
        held = [rank for rank, r in enumerate(replies) if r.ok]
        if held:  # only the ranks that hold it let go
            with contextlib.suppress(OldLogitError):
                self.unhold(version, ranks=held)
        for rank, r in enumerate(replies):
            r.raise_for(rank)

    def unhold(self, version: int, *, ranks: Sequence[int] | None = None) -> None:
        every = list(range(self.degree)) if ranks is None else list(ranks)

        def local() -> None:
            if 0 in every:
                self.store.unhold(version)

        for rank, r in enumerate(self._command("unhold", (version, every), local=local)):
            r.raise_for(rank)

    def resident(self, version: int) -> bool:
        """Never, for the scheduler: each rank's store evicts by its own clock and load times,
        so a version resident here may be gone on another rank, whose acquire would then load
        it while every rank's device budget is pinned by the versions the load stage holds —
        the ranks would wait on each other. The compute stage runs only versions the load
        stage has ``hold``-ed on every rank (a hold of a version resident everywhere is one
        round of commands and loads nothing)."""
        return False

    def pin_resident(self, version: int) -> bool:
        """Never (see ``resident``): the compute stage runs only held versions."""
        return False

    def has_room(self) -> bool:
        return self.store.has_room()

    def cold_room(self) -> tuple[int, frozenset[int]]:
        return self.store.cold_room()

    @contextlib.contextmanager
    def acquire(self, version: int, uses: int = 1) -> Iterator[Mapping[str, Tensor]]:
        self.health.check()
        with self.store.acquire(version, uses=uses) as weights:
            yield RankWeights(version, weights)

    def acquire_lagging(
        self, version: int
    ) -> contextlib.AbstractContextManager[Mapping[str, Tensor]]:
        raise Unavailable("--strategy lagging is not served with --tensor-parallel above 1")

    # -- forwards ---------------------------------------------------------------------------
    def forward(self, op: str, weights: Mapping[str, Tensor], jobs: Sequence[Job]) -> Any:
        """``op`` ("score" or "trace") of ``jobs`` on every rank under ``weights``' version; the
        front's answer (every rank computes the same)."""
        if not isinstance(weights, RankWeights):
            raise TypeError("a tensor-parallel forward takes weights from Front.acquire")
        version = weights.version

        def run() -> Any:
            try:
                self._work.send(op, (version, list(jobs)))
                replies = self._work.agree(Reply())
            except Exception as exc:
                self.health.lose(f"a tensor-parallel forward failed to start: {exc}")
                raise
            for rank, r in enumerate(replies):
                r.raise_for(rank)  # a rank without its part: nobody ran the forward
            try:
                with use(self.tp):
                    if op == "score":
                        return self.engine.score(weights, jobs)
                    return self.engine.trace(weights, jobs[0])
            except OldLogitError:
                raise  # the jobs' own error: every rank raised it the same way
            except Exception as exc:
                why = self.health.problem()
                self.health.lose(why or f"a tensor-parallel forward failed: {exc}")
                raise Unavailable(
                    f"this replica cannot serve: {self.health.problem()}", retry_after_s=5.0
                ) from exc

        return self._work_thread.run(run)

    # -- lifecycle --------------------------------------------------------------------------
    def close(self) -> None:
        """Tell every rank to stop, wait for them, leave the world."""
        if self._closed:
            return
        self._closed = True
        healthy = self.health.problem() is None
        if healthy:
            with contextlib.suppress(Exception):
                self._work_thread.run(lambda: self._work.send("stop"))
            with contextlib.suppress(Exception):
                self._command("stop")
        self.health.stopping = True
        self._control_thread.shutdown()
        self._work_thread.shutdown()
        self.ranks.stop()
        if healthy:
            with contextlib.suppress(Exception):
                torch.distributed.destroy_process_group()
        self.store.close()


class ShardedEngine:
    """The scheduler's engine over every rank (``scheduler.Forward``): the local engine's
    numbers, computed together by all ranks."""

    def __init__(self, front: Front) -> None:
        self.front = front
        self.model = front.engine.model
        self.lm_head_fp32 = front.engine.lm_head_fp32
        self.max_batch_tokens = front.engine.max_batch_tokens

    def run(self, weights: Mapping[str, Tensor], jobs: Sequence[Job]) -> list[Tensor]:
        return [s.logprobs for s in self.score(weights, jobs)]

    def score(self, weights: Mapping[str, Tensor], jobs: Sequence[Job]) -> list[Scored]:
        if not jobs:
            return []
        out: list[Scored] = self.front.forward("score", weights, jobs)
        return out

    def trace(self, weights: Mapping[str, Tensor], job: Job) -> list[TraceStage]:
        out: list[TraceStage] = self.front.forward("trace", weights, [job])
        return out
