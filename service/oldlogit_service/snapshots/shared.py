"""One chain of keyframes and patches on a shared volume, mirrored by every replica's store.

In: the deployment's records of a version's chain (``persist.StoredVersion``, as the shared
registry holds them) and the shared chain directory, where each chain file has one link under
its name. Out: those versions in this store — each file hard-linked into the store's
``weights/`` (same volume: no copy; a link keeps the bytes alive while this replica reads them,
whatever the others remove), every step of the chain rebuilt and checked against its hash
before any record is written — and this store's records switched to the deployment's after
another replica rewrote a chain (a removal re-keyed it, a keyframe moved). Nothing here
decides what the chain is; the cluster control (``cluster/replicas.py``) does, one replica at a
time, and this only follows. No Redis.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from oldlogit_service.snapshots import buffers, crashpoints, persist
from oldlogit_service.snapshots.publish import Claim
from oldlogit_service.snapshots.rebuild import Rebuilder
from oldlogit_service.snapshots.registry import Registry
from oldlogit_service.snapshots.residency import Residency, Resident

logger = logging.getLogger(__name__)

__all__ = [
    "ChainMoved",
    "SharedChain",
    "Swap",
    "adopt_chain",
    "check_record",
    "follow_records",
    "link_shared",
    "shared_files",
]


# The deployment's compare-and-swap of chain records, under its re-key lease: (versions to
# remove, records to put in, the records both must replace there) — ``ChainMoved`` when the
# deployment's records are not those any more, or this replica lost the lease.
Swap = Callable[
    [tuple[int, ...], Mapping[int, persist.StoredVersion], Mapping[int, persist.StoredVersion]],
    None,
]


@dataclass(frozen=True)
class SharedChain:
    """What a store on a shared volume is given by the deployment (scale-out).

    ``directory``: where every chain file has its one shared link. ``claim``: the shared
    registry's claim, between "durable here" and "visible anywhere" (its record carries the
    kind, parent, file and hashes). ``fetch(version)``: make a version the deployment has
    (None: its newest) servable here, adopting its chain — a publish diffs against it.
    ``pinned_elsewhere``: versions leased on any replica. ``quarantined``: versions this
    store found damaged and dropped (the deployment drops them too). ``swap``: a rewrite of
    chains (a removal's re-keyed dependents, a keyframe moved) made the deployment's, before
    this store's records change; called only while this replica holds the re-key lease.
    """

    directory: Path
    claim: Claim
    fetch: Callable[[int | None], None]
    pinned_elsewhere: Callable[[], set[int]]
    quarantined: Callable[[tuple[int, ...]], None]
    swap: Swap


class ChainMoved(Exception):
    """A shared file named by the records is gone: another replica rewrote the chain since
    they were read. Read them again and retry."""


def link_shared(src: Path, directory: Path, name: str, *, durable: bool = True) -> Path:
    """A link of ``src`` as ``directory/name`` (kept if it is there already); ``durable``:
    the directory synced (else the caller syncs it once for several links)."""
    dst = directory / name
    tmp = persist.temp_path(directory)
    try:
        os.link(src, tmp)
        os.replace(tmp, dst)
    finally:
        tmp.unlink(missing_ok=True)
    if durable:
        persist.fsync_dir(directory)
    return dst


def _link_in(shared: Path, weights: Path, sv: persist.StoredVersion) -> bool:
    """Link a shared chain file into this store (the caller syncs the directory); True if
    it was linked now (False: there)."""
    if (weights / sv.file).exists():
        return False
    try:
        link_shared(shared / sv.file, weights, sv.file, durable=False)
    except FileNotFoundError as exc:
        raise ChainMoved(
            f"{sv.file} (version {sv.version}) is gone from the shared volume"
        ) from exc
    return True


def adopt_chain(
    chain: Sequence[persist.StoredVersion],
    *,
    shared: Path,
    registry: Registry,
    residency: Residency,
    rebuilder: Rebuilder,
) -> None:
    """Take in ``chain`` ([version, its parent, ..., its keyframe], the deployment's records):
    each member this store lacks is linked in, rebuilt from the one below it and checked
    against its hash (a patch's file against its own hash too), then recorded, keyframe first.
    Raises ``ChainMoved`` (retry with fresh records) or ``persist.CorruptSnapshot``."""
    weights = registry.root / persist.WEIGHTS
    todo: list[persist.StoredVersion] = []
    for sv in chain:
        if registry.has(sv.version):
            if registry.get(sv.version).sha256 != sv.sha256:
                raise persist.CorruptSnapshot(
                    f"version {sv.version} is held here with other weights than the "
                    "deployment's record",
                    sv.version,
                )
            break
        todo.append(sv)
    if not todo:
        return
    todo.reverse()  # from the lowest one missing here up to the version
    linked: list[str] = []
    try:
        for sv in todo:
            if _link_in(shared, weights, sv):
                linked.append(sv.file)
        persist.fsync_dir(weights)  # the links durable before any record names them
        res = _verify_steps(todo, registry, rebuilder, weights)
        crashpoints.reached("adopt", todo[-1].version)
        with registry.persist_lock:
            registry.commit_adopted(todo)  # one registry write for the whole chain
            for sv in todo:
                rebuilder.mark_verified(sv)
        linked = []
    finally:
        persist.remove_files(weights, linked)
    residency.offer(todo[-1].version, res)
    logger.info("adopted version %d with %d step(s) of its chain", todo[-1].version, len(todo))


def _verify_steps(
    todo: Sequence[persist.StoredVersion],
    registry: Registry,
    rebuilder: Rebuilder,
    weights: Path,
) -> Resident:
    """Rebuild ``todo`` in order, each step hashed against its version's sha256."""
    first = todo[0]
    if first.kind == "keyframe":
        buf, header = persist.read_keyframe(
            weights / first.file, pin=False, expect_sha256=first.sha256, version=first.version
        )
        layout = tuple(header.tensors.values())
        steps = todo[1:]
    else:
        assert first.parent is not None
        with rebuilder.cpu_weights(first.parent) as base:
            assert base.buffer is not None
            layout = base.layout
            buf = buffers.alloc_buffer(base.nbytes, pin=False)  # [nbytes]
            np.copyto(buf.numpy(), base.buffer.numpy())
        steps = todo
    data = buf.numpy()
    for sv in steps:
        if sv.kind != "patch":
            raise persist.CorruptSnapshot(
                f"version {sv.version}: a keyframe inside a chain's records", sv.version
            )
        rebuilder.apply_checked(data, layout, sv, "the shared chain")
    return Resident(buf, layout, persist.tensor_views(buf, layout), buf.numel())


def follow_records(
    records: Mapping[int, persist.StoredVersion],
    removed: set[int],
    *,
    shared: Path,
    registry: Registry,
    residency: Residency,
    rebuilder: Rebuilder,
    in_use: Callable[[], set[int]],
) -> tuple[list[int], list[int]]:
    """Switch this store's records to the deployment's (``records``: every version retained
    there; ``removed``: the held ones deleted there): deleted versions go here (in-use ones
    when their requests end: retired), and versions whose record changed there (a re-keyed
    chain) get its file and record here. A version held here that the deployment neither
    retains nor deleted (a registry that lost data) is left alone. A new record's parent must
    be held here (the caller adopts it first). Returns (removed, switched)."""
    weights = registry.root / persist.WEIGHTS
    linked: list[str] = []
    with registry.persist_lock:
        local = registry.records()
        gone = tuple(
            sorted(
                v
                for v, sv in local.items()
                if sv.kind != "adapter" and v not in records and v in removed
            )
        )
        switch = {
            v: records[v]
            for v, sv in local.items()
            if v in records and sv.kind != "adapter" and records[v].file != sv.file
        }
        if not gone and not switch:
            return [], []
        kept = {v: sv for v, sv in local.items() if v not in gone}
        kept.update(switch)
        for v, sv in switch.items():
            if records[v].sha256 != local[v].sha256:
                raise persist.CorruptSnapshot(
                    f"version {v}: the deployment's record has other weights", v
                )
            if sv.kind == "patch" and sv.parent not in kept:
                raise ChainMoved(f"version {v}'s new parent {sv.parent} is not held here")
        for v, sv in kept.items():
            needs = sv.parent if sv.kind == "patch" else sv.base
            if sv.kind in ("patch", "adapter") and needs not in kept:
                raise ChainMoved(f"version {v} would lose {needs}, which its chain needs")
        try:
            for sv in switch.values():
                if _link_in(shared, weights, sv):
                    linked.append(sv.file)
            if linked:
                persist.fsync_dir(weights)
            old = registry.remove(gone, replace=switch, evicted=True)
            linked = []
        finally:
            persist.remove_files(weights, linked)
    for v in gone:
        residency.retire(v)
    for v in switch:
        residency.forget_patch(v)  # the old file's patch, against its old parent
    rebuilder.retire_files(old)
    if gone or switch:
        logger.info(
            "followed the deployment's chain: %d version(s) gone, %d switched (in use now: %s)",
            len(gone),
            len(switch),
            sorted(set(gone) & in_use()) or "none",
        )
    return list(gone), sorted(switch)


def shared_files(directory: Path) -> dict[str, os.stat_result]:
    """The chain files in the shared directory (no temp files), with their stat."""
    out: dict[str, os.stat_result] = {}
    with contextlib.suppress(FileNotFoundError):
        for p in directory.iterdir():
            if p.name.startswith(persist.TMP_PREFIX):
                continue
            with contextlib.suppress(FileNotFoundError):
                out[p.name] = p.stat()
    return out


def check_record(sv: persist.StoredVersion) -> persist.StoredVersion:
    """A record read from the deployment, checked for what a chain step needs."""
    if sv.kind == "patch" and (sv.parent is None or not sv.file_sha256):
        raise persist.CorruptSnapshot("a patch record without its parent or hash", sv.version)
    if "/" in sv.file or sv.file.startswith(".") or not sv.file:
        raise persist.CorruptSnapshot(f"a record with a bad file name {sv.file!r}", sv.version)
    return sv
