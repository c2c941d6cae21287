"""What one rank holds of a version: its part of every weight, in a snapshot store of its own.

In: the model (its weight specs and tensor-parallel plan) and the degree. Out: the specs of a
rank's part (``shard_specs``), a version split into every rank's part (``split``), and a rank's
store: its own directory, delta encoding against its own previous parts, memory budgets 1/N
of the replica's and no retention of its own (the front's registry decides which versions
stay and tells every rank: ``channel`` command ``retain``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import Tensor

from oldlogit.parity.tensor_parallel import ShardRules, shard_rules, shard_weight
from oldlogit_service.config import Settings
from oldlogit_service.model.loaded import LoadedModel, load_model
from oldlogit_service.snapshots import SnapshotStore

__all__ = [
    "ShardRules",
    "load_rank_model",
    "open_rank_store",
    "rank_device",
    "rank_dir",
    "rules_for",
    "shard_specs",
    "split",
    "threads_per_rank",
]

# A rank store never retires a version by itself: the front's registry applies the retention
# rules to whole versions and tells the ranks (a rank's own count or byte rule could disagree
# with another rank's, and a version must be on every rank or none).
_NO_RETENTION_VERSIONS = 1 << 30


def threads_per_rank(degree: int) -> int:
    """The CPU intra-op threads each rank runs with: the machine's split evenly over ranks."""
    return max(1, (os.cpu_count() or 1) // max(1, degree))


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank ``rank``'s device: its own GPU (``cuda:rank``) on CUDA, the CPU otherwise."""
    return torch.device("cuda", rank) if device.type == "cuda" else device


def load_rank_model(settings: Settings, model_dir: Path, device: torch.device) -> LoadedModel:
    """The skeleton every rank builds from the same directory and settings."""
    from oldlogit_service.model.loaded import dtype_from_name

    return load_model(
        model_dir,
        dtype=dtype_from_name(settings.dtype),
        device=device,
        numerics=settings.numerics,
        tile_rows=settings.tile_rows,
        tp_chunks=settings.tp_chunks,
    )


def rules_for(model: LoadedModel) -> ShardRules:
    return shard_rules(model.module)


def shard_specs(
    model: LoadedModel, rules: ShardRules, degree: int
) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Each weight's (dtype, shape) in one rank's part (every rank's part has the same)."""
    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    for name, (dtype, shape) in model.param_specs.items():
        dims = list(shape)
        dim = rules.dim(name)
        if dim is not None and degree > 1:
            dims[dim] //= degree
        out[name] = (dtype, tuple(dims))
    return out


def split(weights: Mapping[str, Tensor], rules: ShardRules, degree: int) -> list[dict[str, Tensor]]:
    """A whole version → every rank's part, in rank order (contiguous CPU tensors)."""
    parts: list[dict[str, Tensor]] = [{} for _ in range(degree)]
    for name in sorted(weights):
        whole = weights[name].detach()
        if whole.device.type != "cpu":
            whole = whole.cpu()
        for rank in range(degree):
            parts[rank][name] = shard_weight(name, whole, rank, degree, rules).contiguous()
    return parts


def rank_dir(snapshot_dir: Path, rank: int, degree: int) -> Path:
    """Where rank ``rank`` keeps its parts: ``<snapshot_dir>/ranks/tp<degree>/<rank>`` (parts
    of another degree have other shapes; the whole versions beside them serve any degree)."""
    return snapshot_dir / "ranks" / f"tp{degree}" / str(rank)


def open_rank_store(
    settings: Settings,
    model: LoadedModel,
    rules: ShardRules,
    *,
    rank: int,
    degree: int,
    device: torch.device,
) -> SnapshotStore:
    """Rank ``rank``'s store of its parts. Memory budgets are the replica's divided by the
    degree (the CPU's memory is shared by every rank; on CUDA, without --device-budget-gib,
    each rank measures its own GPU's free memory); disk retention is the front's."""
    if settings.device_budget_gib is None and device.type == "cuda":
        device_budget = settings.device_budget_bytes(device)
    else:
        device_budget = settings.device_budget_bytes(device) // degree
    return SnapshotStore(
        rank_dir(settings.snapshot_dir, rank, degree),
        param_specs=shard_specs(model, rules, degree),
        device=device,
        device_budget_bytes=device_budget,
        host_budget_bytes=settings.host_budget_bytes // degree,
        disk_budget_bytes=settings.disk_budget_bytes,
        max_versions=_NO_RETENTION_VERSIONS,
        keyframe_every=settings.keyframe_every,
        keyframe_chain_fraction=settings.keyframe_chain_fraction,
        keyframes_follow_access=settings.keyframes_follow_access,
    )
