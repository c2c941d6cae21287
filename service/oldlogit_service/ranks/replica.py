"""Opening a tensor-parallel replica: the checks, the ranks, the front's parts.

In: the settings (``tensor_parallel`` > 1) and the model directory. Out: ``Replica`` — the
front's model, the store the runtime and intake use (``FrontStore``), the scheduler's weights
source and engine (``Front``, ``ShardedEngine``) — or a start-up error naming the setting or
the rank. Bad setups are refused before any rank starts: the degree against the heads, the KV
heads and the chunk count (``check_degree``), MoE models, a decoder layer whose plan style
needs more than a plain column or row shard (``check_rank_shards``). A head tied to the
embeddings is held whole with the replicated embedding; each rank takes its vocabulary rows at
the forward.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch

from oldlogit.parity.tensor_parallel import check_degree, check_rank_shards
from oldlogit_service.config import Settings
from oldlogit_service.model.engine import Engine, self_check
from oldlogit_service.model.loaded import LoadedModel
from oldlogit_service.ranks import follower, shards
from oldlogit_service.ranks.front import Front, ShardedEngine
from oldlogit_service.ranks.launch import Ranks
from oldlogit_service.ranks.store import FrontStore

logger = logging.getLogger(__name__)

__all__ = ["Replica", "check_setup", "open_replica"]


@dataclass
class Replica:
    model: LoadedModel
    store: FrontStore
    front: Front
    engine: ShardedEngine

    def self_check(self) -> None:
        """Packed batches bitwise equal to single sequences, on every rank together, at the
        newest version (none yet: the first request's batch is the first forward)."""
        newest = self.store.newest
        if newest is None or not self.store.has(newest):
            logger.info("numerics self-check skipped: no version placed yet")
            return
        start = time.perf_counter()
        with self.front.acquire(newest) as weights:
            compared = self_check(cast(Engine, self.engine), weights)
        logger.info(
            "numerics self-check over %d ranks: %d logprobs packed == alone, bitwise (%.2f s)",
            self.front.degree,
            compared,
            time.perf_counter() - start,
        )

    def close(self) -> None:
        self.front.close()


def check_setup(settings: Settings, model: LoadedModel) -> None:
    """Refuse, naming the setting, what a tensor-parallel replica cannot serve."""
    degree = settings.tensor_parallel
    check_degree(model.module.config, degree, settings.tp_chunks)
    if degree > 1:
        check_rank_shards(model.module)


def open_replica(settings: Settings, model_dir: Path, device: torch.device) -> Replica:
    """Start ranks 1..N-1, build rank 0 here, join them, and place every retained version."""
    degree = settings.tensor_parallel
    threads = shards.threads_per_rank(degree)
    torch.set_num_threads(threads)
    front_device = shards.rank_device(device, 0)
    if front_device.type == "cuda":
        torch.cuda.set_device(front_device)
    model = shards.load_rank_model(settings, model_dir, front_device)
    check_setup(settings, model)
    rules = shards.rules_for(model)
    ranks = Ranks.start(follower.main, degree, (settings, model_dir, threads))
    part_store = None
    try:
        part_store = shards.open_rank_store(
            settings, model, rules, rank=0, degree=degree, device=front_device
        )
        engine = Engine(
            model,
            mode=settings.mode,
            lm_head_fp32=settings.lm_head_fp32,
            max_batch_tokens=settings.max_batch_tokens,
        )
        groups = ranks.join(device=front_device, timeout_s=settings.rank_timeout_s)
    except BaseException:
        ranks.stop(0.0)
        if part_store is not None:
            part_store.close()
        raise
    front = Front(
        store=part_store,
        engine=engine,
        rules=rules,
        ranks=ranks,
        groups=groups,
        device=front_device,
        threads=threads,
    )
    try:
        # The registry of record keeps whole versions on disk; in memory only the one being
        # placed or verified (the next delta's parent, likeliest reused), on the CPU.
        store = FrontStore(
            settings.snapshot_dir,
            front=front,
            param_specs=model.param_specs,
            device=torch.device("cpu"),
            device_budget_bytes=model.nbytes,
            host_budget_bytes=0,
            disk_budget_bytes=settings.disk_budget_bytes,
            max_versions=settings.max_versions,
            keyframe_every=settings.keyframe_every,
            keyframe_chain_fraction=settings.keyframe_chain_fraction,
            keyframes_follow_access=settings.keyframes_follow_access,
        )
        try:
            store.place_all()
        except BaseException:
            store.close()
            raise
    except BaseException:
        with contextlib.suppress(Exception):
            front.close()
        raise
    logger.info(
        "tensor parallel %d (%s): %d CPU threads per rank, rank devices %s",
        degree,
        groups.backend,
        threads,
        [str(shards.rank_device(device, r)) for r in range(degree)],
    )
    return Replica(model, store, front, ShardedEngine(front))
