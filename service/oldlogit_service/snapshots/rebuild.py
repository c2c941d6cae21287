"""Rebuilding versions from keyframe + patch chains, the keyframe policy, and chain rewrites.

In: the registry's records (parent links) and the CPU copies and decoded patches memory holds.
Out: a version's weights in a fresh CPU buffer (``materialize``, residency's loader); whether a
new version is stored as a keyframe; patch and keyframe files; new records for versions whose
chain loses a member, and for a keyframe moved to where rebuilds are asked for. A rebuild
starts from the nearest CPU copy in memory on its chain, else from the keyframe file, and is
checked against the version's hash the first time this process builds it. No request handling,
no registry writes (the store swaps the records this writes).

Keyframes follow access: each keyframe and the versions rebuilt from it form a tree (parent
links). ``keyframe_move`` finds the tree's version that minimises the rebuild work of the
rebuilds observed lately (the demand-weighted centroid: no branch holds more than half of the
demand); ``rewrites_for_move`` makes it the keyframe and each version on the way from the old
keyframe a patch against its child (the same positions as the child's patch, its own values:
the same bytes on disk), checked bit for bit before any record changes. More keyframes would
cut rebuilds too, at a snapshot of disk each; a moved keyframe costs none.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Concatenate, ParamSpec, TypeVar

import numpy as np

from oldlogit.contract.errors import OldLogitError
from oldlogit_service.snapshots import buffers, codec, persist
from oldlogit_service.snapshots.registry import Registry
from oldlogit_service.snapshots.residency import Residency, Resident

logger = logging.getLogger(__name__)
P = ParamSpec("P")
R = TypeVar("R")

__all__ = ["KeyframeMove", "Rebuilder", "centroid"]

# What a patch file's byte costs, in snapshot bytes copied (the unit of memory's rebuild costs:
# 1.0 = one snapshot loaded), measured on CPU with 3 % (float32) and 1-3 % (bf16) patches:
# applying it decoded (the scatter) 12-25, bringing its decoded form back (file read, hash,
# decode) 32-44. Used only to rank what memory keeps.
PATCH_APPLY_COST = 16.0
PATCH_READ_COST = 40.0

# Keyframes that follow access (module docstring). Rebuilds count for this long (half-life):
# the demand a keyframe placement is judged on.
DEMAND_HALF_LIFE_S = 300.0
# A keyframe moves only once its tree has seen this many rebuilds (decayed) since it was placed
MOVE_MIN_DEMAND = 8.0
# and the move cuts the patch bytes those rebuilds apply by at least this fraction (a move
# writes a keyframe and every patch on its way: it must pay for itself).
MOVE_MIN_GAIN = 0.3


def centroid(parents: Mapping[int, int | None], weight: Mapping[int, float], root: int) -> int:
    """The version of a tree (``parents``: version -> parent, ``root``'s None) that minimises
    the weighted sum of its path lengths to every version, whatever the (positive) edge
    lengths: the weighted centroid, where no branch holds more than half of the weight. From
    ``root``, it steps into the one child holding more than half while there is one."""
    children: dict[int, list[int]] = {}
    for v, p in parents.items():
        if p is not None and v != root:
            children.setdefault(p, []).append(v)
    order = [root]
    for v in order:  # breadth first: parents before children
        order.extend(sorted(children.get(v, ())))
    below = {v: float(weight.get(v, 0.0)) for v in order}  # the weight of v's subtree
    for v in reversed(order[1:]):
        below[parents[v]] += below[v]  # type: ignore[index]
    half = below[root] / 2
    at = root
    while True:
        heavy = [c for c in children.get(at, ()) if below[c] > half]
        if not heavy:
            return at
        at = heavy[0]


@dataclass(frozen=True)
class KeyframeMove:
    """A keyframe to move down its chain: ``path`` is [the keyframe, ..., the new one]."""

    path: tuple[persist.StoredVersion, ...]
    gain: float  # the fraction of the demand's patch bytes it saves


@dataclass(frozen=True)
class MovedKeyframe:
    """The records (files written, checked) of a keyframe moved along ``path``, and the reverse
    patches decoded (for memory to keep)."""

    path: tuple[persist.StoredVersion, ...]
    records: dict[int, persist.StoredVersion]
    patches: dict[int, codec.Patch]


@dataclass
class _Plan:
    """What a rebuild reads: a base (a CPU copy in memory, or a keyframe file) + patches."""

    base: persist.StoredVersion
    base_res: Resident | None
    patches: list[persist.StoredVersion]  # oldest first


def _background(
    fn: Callable[Concatenate[Rebuilder, P], R],
) -> Callable[Concatenate[Rebuilder, P], R]:
    """A rewrite (re-keying, a sweep's rewrites) runs as background work: it yields to forwards
    between chunks (``yielding.py``; loads do already, in ``residency``)."""

    @functools.wraps(fn)
    def run(self: Rebuilder, /, *args: P.args, **kwargs: P.kwargs) -> R:
        with self._residency.foreground.background():
            return fn(self, *args, **kwargs)

    return run


class Rebuilder:
    def __init__(
        self,
        *,
        registry: Registry,
        residency: Residency,
        weights_dir: Path,
        specs: Mapping[str, tuple[str, tuple[int, ...]]],
        snapshot_nbytes: int,
        keyframe_every: int,
        keyframe_chain_fraction: float,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._registry = registry
        self._clock = clock
        self._residency = residency
        self._dir = weights_dir
        self._specs = specs
        self._snapshot_nbytes = snapshot_nbytes
        self.keyframe_every = keyframe_every
        self._chain_fraction = keyframe_chain_fraction
        self._verified: set[str] = set()  # (version, file) keys checked by this process
        self.counters: Counter[str] = Counter()
        self._demand: dict[int, tuple[float, float]] = {}  # version -> (rebuilds, at), decayed
        # Files no record owns any more are deleted once no rebuild that may have planned with
        # the old records still runs (``reading``).
        self._readers = 0
        self._stale: list[str] = []
        self._read_lock = threading.Lock()

    # -- trust ------------------------------------------------------------------------------
    @staticmethod
    def _key(sv: persist.StoredVersion) -> str:
        return f"{sv.version}/{sv.file}/{sv.file_sha256 or ''}"

    def is_verified(self, sv: persist.StoredVersion) -> bool:
        return self._key(sv) in self._verified

    def mark_verified(self, sv: persist.StoredVersion) -> None:
        """This process wrote (or checked) these bytes: no hash check on their first load."""
        self._verified.add(self._key(sv))

    # -- readers and retired files ---------------------------------------------------------
    @contextlib.contextmanager
    def reading(self) -> Iterator[None]:
        """While a chain planned from the registry is read: files retired meanwhile wait."""
        with self._read_lock:
            self._readers += 1
        try:
            yield
        finally:
            with self._read_lock:
                self._readers -= 1
                stale = self._stale if self._readers == 0 else []
                if stale:
                    self._stale = []
            persist.remove_files(self._dir, stale)

    def retire_files(self, names: Iterable[str]) -> None:
        """Delete files no record owns any more, once no rebuild may still read them."""
        with self._read_lock:
            if self._readers:
                self._stale.extend(names)
                return
        persist.remove_files(self._dir, names)

    # -- costs and policy -------------------------------------------------------------------
    def rebuild_cost(self, version: int) -> float:
        """Snapshot loads needed to bring a version's weights back from disk."""
        try:
            chain = self._registry.chain(version)
        except (persist.CorruptSnapshot, OldLogitError):
            return 1.0
        patch_bytes = sum(sv.file_nbytes for sv in chain if sv.kind == "patch")
        return 1.0 + PATCH_APPLY_COST * patch_bytes / max(1, self._snapshot_nbytes)

    def patch_cost(self, version: int) -> float:
        """Snapshot loads needed to bring a version's decoded patch back from disk."""
        try:
            sv = self._registry.get(version)
        except OldLogitError:
            return 0.0
        return PATCH_READ_COST * sv.file_nbytes / max(1, self._snapshot_nbytes)

    @property
    def patches_on(self) -> bool:
        return self.keyframe_every > 1

    def keyframe_due(self, parent: int | None, patch_nbytes: int) -> bool:
        """A new version whose patch against ``parent`` would be ``patch_nbytes`` is stored whole
        when its chain would reach ``keyframe_every`` versions or its chain's patches would
        exceed ``keyframe_chain_fraction`` of one keyframe (both bound a rebuild's work)."""
        if not self.patches_on or parent is None:
            return True
        try:
            chain = self._registry.chain(parent)
        except (persist.CorruptSnapshot, OldLogitError):
            return True
        if len(chain) >= self.keyframe_every:  # the new version's patches to its keyframe
            return True
        chain_bytes = patch_nbytes + sum(sv.file_nbytes for sv in chain if sv.kind == "patch")
        return chain_bytes > self._chain_fraction * self._snapshot_nbytes

    # -- patches ----------------------------------------------------------------------------
    def load_patch(self, sv: persist.StoredVersion) -> codec.Patch:
        """A version's decoded patch, from memory or from its (checked) file."""
        key = sv.file_sha256 or sv.file
        cached = self._residency.cached_patch(sv.version, key)
        if cached is not None:
            return cached
        patch = self.read_patch(sv)
        self._residency.offer(sv.version, patch, patch_key=key)
        return patch

    def read_patch(self, sv: persist.StoredVersion) -> codec.Patch:
        """A patch file read, its hash checked, decoded."""
        buf, header = persist.read_keyframe(
            self._dir / sv.file, pin=False, expect_sha256=sv.file_sha256, version=sv.version
        )
        try:
            patch = codec.parse_patch(
                header, buf.numpy(), self._specs, what=f"patch of {sv.version}"
            )
        except OldLogitError as exc:
            raise persist.CorruptSnapshot(f"{sv.file}: {exc}", sv.version) from exc
        self.counters["bytes_read"] += header.nbytes
        self.counters["patch_reads"] += 1
        return patch

    def write_patch(
        self, version: int, parent: int, patch: codec.Patch, sha: str, created_at: float
    ) -> persist.StoredVersion:
        """Write a patch file durably; its record (not yet in the registry)."""
        sources: dict[str, buffers.TensorSource] = {}
        for key, (role, arr) in codec.file_tensors(patch).items():
            name = key.rsplit("::", 1)[0]
            dtype = self._specs[name][0] if role == "val" else "U8"
            raw = np.ascontiguousarray(arr).view(np.uint8)
            sources[key] = buffers.TensorSource(
                key, dtype, (int(arr.shape[0]),), functools.partial(lambda r: [r.data], raw)
            )
        meta = {"format": codec.FORMAT, "parent": str(parent), "sha256": sha}
        tmp = persist.temp_path(self._dir)
        name = persist.patch_name(version)
        try:
            file_sha = persist.write_keyframe(tmp, sources, meta)
            size = tmp.stat().st_size
            persist.durable_rename(tmp, self._dir / name)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        sv = persist.StoredVersion(
            version,
            sha,
            self._snapshot_nbytes,
            name,
            created_at,
            kind="patch",
            parent=parent,
            file_nbytes=size,
            file_sha256=file_sha,
        )
        self.mark_verified(sv)
        return sv

    def write_keyframe(
        self, version: int, res: Resident, sha: str, created_at: float
    ) -> persist.StoredVersion:
        """Write a version held in a CPU buffer as a keyframe file, durably; refuses bytes that
        do not hash to ``sha`` (never stores what was not checked)."""
        assert res.buffer is not None
        data = res.buffer.numpy()
        sources = {
            e.name: buffers.TensorSource(
                e.name, e.dtype, e.shape, functools.partial(_slice, data, e.begin, e.end)
            )
            for e in res.layout
        }
        tmp = persist.temp_path(self._dir)
        name = persist.keyframe_name(version)
        try:
            written = persist.write_keyframe(tmp, sources)
            if written != sha:
                raise persist.CorruptSnapshot(
                    f"version {version}: the bytes to store hash to {written}, not {sha}", version
                )
            persist.durable_rename(tmp, self._dir / name)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        sv = persist.StoredVersion(version, sha, self._snapshot_nbytes, name, created_at)
        self.mark_verified(sv)
        return sv

    def apply_checked(
        self, data: Any, layout: Sequence[Any], sv: persist.StoredVersion, source: str
    ) -> None:
        """``sv``'s patch file (its hash checked) applied in place to ``data``, the bytes of
        the version it is a patch against; the result must hash to ``sv.sha256`` (``source``
        says where the chain came from, for the error)."""
        codec.rebuild(data, layout, [self.read_patch(sv)])
        got = buffers.hash_buffer(data, layout)
        if got != sv.sha256:
            raise persist.CorruptSnapshot(
                f"version {sv.version} rebuilt from {source} hashes to {got}, its record "
                f"says {sv.sha256}",
                sv.version,
            )

    @staticmethod
    def patch_nbytes(patch: codec.Patch) -> int:
        """About what the patch file holds (values + coded positions)."""
        return sum(arr.nbytes for _, arr in codec.file_tensors(patch).values())

    # -- rebuild ----------------------------------------------------------------------------
    def _plan(self, version: int) -> _Plan:
        patches: list[persist.StoredVersion] = []
        for sv in self._registry.chain(version):  # [version, parent, ..., keyframe]
            res = self._residency.cpu_copy(sv.version)
            if res is not None or sv.kind != "patch":
                patches.reverse()
                return _Plan(sv, res, patches)
            patches.append(sv)
        raise AssertionError("a chain ends at a keyframe")  # pragma: no cover

    def materialize(self, version: int) -> Resident:
        """A version's weights in a fresh CPU buffer (page-locked in front of a GPU): its
        keyframe read from disk, or its nearest base on the chain plus the patches above it."""
        self._note_demand(version)
        return self._materialize(version)

    def _materialize(self, version: int) -> Resident:
        for attempt in range(3):
            with self.reading():
                plan = self._plan(version)
                try:
                    return self._rebuild(version, plan)
                except persist.CorruptSnapshot:
                    # A removal may have rewritten the chain under this rebuild: plan again.
                    records = self._registry.records()
                    steps = [plan.base, *plan.patches]
                    moved = any(records.get(sv.version) is not sv for sv in steps)
                    if not moved or attempt == 2:
                        raise
        raise AssertionError("unreachable")  # pragma: no cover

    def _rebuild(self, version: int, plan: _Plan) -> Resident:
        target = plan.patches[-1] if plan.patches else plan.base
        n = target.nbytes
        pin = self._residency.pin_host
        patches = [self.load_patch(sv) for sv in plan.patches]
        read = verified = 0
        if plan.base_res is not None:
            assert plan.base_res.buffer is not None
            layout = plan.base_res.layout
            out = buffers.alloc_buffer(n, pin=pin)  # [nbytes]
            codec.rebuild(out.numpy(), layout, patches, base=plan.base_res.buffer.numpy())
        else:
            kf = plan.base
            verify = None if self.is_verified(kf) else kf.sha256
            out, header = persist.read_keyframe(
                self._dir / kf.file, pin=pin, expect_sha256=verify, version=kf.version
            )
            layout = tuple(header.tensors.values())
            read, verified = header.nbytes, int(verify is not None)
            self.counters["keyframe_reads"] += 1
            self.mark_verified(kf)
            if patches:
                # Keep the keyframe read as the base of its chain's next rebuilds, if it fits.
                base = Resident(out, layout, persist.tensor_views(out, layout), read)
                if self._residency.offer(kf.version, base):
                    out = buffers.alloc_buffer(n, pin=pin)
                    assert base.buffer is not None
                    codec.rebuild(out.numpy(), layout, patches, base=base.buffer.numpy())
                else:
                    codec.rebuild(out.numpy(), layout, patches)
        if patches and not self.is_verified(target):
            verified += 1
            got = buffers.hash_buffer(out.numpy(), layout)
            if got != target.sha256:
                raise persist.CorruptSnapshot(
                    f"version {version} rebuilt from its chain hashes to {got}, the registry "
                    f"says {target.sha256}",
                    version,
                )
            self.mark_verified(target)
        self.counters["bytes_read"] += read
        self.counters["verified_loads"] += verified
        self.counters["rebuilds"] += bool(patches)
        self.counters["patches_applied"] += len(patches)
        return Resident(out, layout, persist.tensor_views(out, layout), n)

    @contextlib.contextmanager
    def cpu_weights(self, version: int) -> Iterator[Resident]:
        """A retained version's weights in a CPU buffer while the block runs (for diffs and
        rewrites); the version is pinned meanwhile."""
        sv = self._registry.get(version)
        res = self._residency.pin(version, sv.nbytes)
        try:
            if res.buffer is not None and res.buffer.device.type == "cpu":
                yield res
            else:
                host = self._residency.cpu_copy(version)
                yield host if host is not None else self.materialize(version)
        finally:
            self._residency.unpin(version)

    # -- keyframes that follow access -------------------------------------------------------
    def _note_demand(self, version: int) -> None:
        now = self._clock()
        with self._read_lock:
            n, at = self._demand.get(version, (0.0, now))
            self._demand[version] = (_decayed(n, now - at) + 1.0, now)

    def demand(self) -> dict[int, float]:
        """Rebuilds asked for per version lately (decayed with ``DEMAND_HALF_LIFE_S``)."""
        now = self._clock()
        with self._read_lock:
            return {v: _decayed(n, now - at) for v, (n, at) in self._demand.items()}

    def keyframe_move(self) -> KeyframeMove | None:
        """The keyframe whose move down its chain would save the most of the rebuild work
        asked for lately, if a move pays (``MOVE_MIN_DEMAND``, ``MOVE_MIN_GAIN``)."""
        records = self._registry.records()
        demand = self.demand()
        root_of: dict[int, int] = {}
        for v in records:  # each version's keyframe, following parent links
            path: list[int] = []
            at: int | None = v
            while at is not None and at not in root_of and at in records:
                if len(path) > len(records):  # a cycle
                    break
                path.append(at)
                at = records[at].parent if records[at].kind == "patch" else None
            if at is None:
                root = path[-1]
            elif at in root_of:
                root = root_of[at]
            else:
                continue  # a broken chain: rebuilds fail on it, nothing to move
            for x in path:
                root_of[x] = root
        best: KeyframeMove | None = None
        for root in {r for r in root_of.values()}:
            tree = {v: records[v].parent if v != root else None for v, r in root_of.items()}
            tree = {v: p for v, p in tree.items() if root_of[v] == root}
            weight = {v: demand.get(v, 0.0) for v in tree}
            if sum(weight.values()) < MOVE_MIN_DEMAND or len(tree) < 2:
                continue
            to = centroid(tree, weight, root)
            if to == root:
                continue
            edge = {v: float(records[v].file_nbytes) for v in tree if v != root}
            now, then = _work(tree, weight, edge, root), _work(tree, weight, edge, to)
            gain = 1.0 - then / now if now > 0 else 0.0
            if gain >= MOVE_MIN_GAIN and (best is None or gain > best.gain):
                chain = self._registry.chain(to)  # [to, ..., root]
                best = KeyframeMove(tuple(reversed(chain)), gain)
        return best

    @_background
    def rewrites_for_move(self, move: KeyframeMove) -> MovedKeyframe:
        """Write the files of ``move``: its last version as a keyframe, each one before it as
        a patch against the next (``codec.undo``), every version on the path rebuilt from the
        new files and checked against its hash before this returns (nothing else is touched;
        the caller swaps the records, or removes the files)."""
        path = move.path
        written: list[str] = []
        try:
            with self.reading():
                res = self._materialize(path[0].version)  # [nbytes]: the old keyframe's bytes
                assert res.buffer is not None
                buf, layout = res.buffer.numpy(), res.layout
                reverse: dict[int, codec.Patch] = {}
                for x, y in itertools.pairwise(path):
                    forward = self.load_patch(y)
                    reverse[x.version] = codec.undo(buf, layout, forward)
                    codec.rebuild(buf, layout, [forward])  # buf: x -> y
            top = path[-1]
            # Refuses bytes that do not hash to the version's (the whole chain, checked).
            kf = self.write_keyframe(top.version, res, top.sha256, top.created_at)
            written.append(kf.file)
            records: dict[int, persist.StoredVersion] = {top.version: kf}
            for x, y in reversed(list(itertools.pairwise(path))):
                sv = self.write_patch(
                    x.version, y.version, reverse[x.version], x.sha256, x.created_at
                )
                written.append(sv.file)
                records[x.version] = sv
                # What a rebuild will read: the file, applied to the version after it.
                self.apply_checked(buf, layout, sv, f"its moved keyframe {top.version}")
        except BaseException:
            persist.remove_files(self._dir, written)
            raise
        self.counters["keyframe_moves"] += 1
        return MovedKeyframe(path, records, reverse)

    # -- rewrites ---------------------------------------------------------------------------
    @_background
    def rewrites_for_removal(self, remove: set[int]) -> dict[int, persist.StoredVersion]:
        """New records (files written durably) for each retained version whose parent goes:
        its patch composed with the removed ones down to the nearest kept ancestor or, when
        its keyframe goes, the version rewritten as a keyframe (re-keyframing)."""
        out: dict[int, persist.StoredVersion] = {}
        try:
            for v in self._registry.dependents(remove):
                out[v] = self._rewrite_one(v, remove)
        except BaseException:
            persist.remove_files(self._dir, [sv.file for sv in out.values()])
            raise
        return out

    def _rewrite_one(self, version: int, remove: set[int]) -> persist.StoredVersion:
        chain = self._registry.chain(version)
        path = [chain[0]]  # the version, then its removed ancestors upward
        for sv in chain[1:]:
            if path[-1].kind != "patch" or path[-1].parent not in remove:
                break
            path.append(sv)
        top = path[-1]
        anchor = top.parent if top.kind == "patch" else None
        e = chain[0]
        if anchor is not None:
            merged = functools.reduce(codec.compose, [self.load_patch(sv) for sv in reversed(path)])
            if not self.keyframe_due(anchor, self.patch_nbytes(merged)):
                logger.info("version %d rebased onto version %d", version, anchor)
                return self.write_patch(version, anchor, merged, e.sha256, e.created_at)
        logger.info("version %d rewritten as a keyframe (its chain's keyframe goes)", version)
        with self.cpu_weights(version) as res:
            return self.write_keyframe(version, res, e.sha256, e.created_at)


def _decayed(n: float, seconds: float) -> float:
    return float(n * 2.0 ** (-max(0.0, seconds) / DEMAND_HALF_LIFE_S))


def _work(
    tree: Mapping[int, int | None],
    weight: Mapping[int, float],
    edge: Mapping[int, float],
    at: int,
) -> float:
    """Patch bytes the demand ``weight`` applies with the keyframe at ``at``: each version's
    path to ``at`` (``edge[v]``: the patch between v and its parent, either way)."""
    near: dict[int, list[tuple[int, float]]] = {}
    for v, p in tree.items():
        if p is not None:
            near.setdefault(v, []).append((p, edge[v]))
            near.setdefault(p, []).append((v, edge[v]))
    dist = {at: 0.0}
    todo = [at]
    while todo:
        v = todo.pop()
        for u, w in near.get(v, ()):
            if u not in dist:
                dist[u] = dist[v] + w
                todo.append(u)
    return sum(weight.get(v, 0.0) * dist.get(v, 0.0) for v in tree)


def _slice(data: Any, begin: int, end: int) -> list[memoryview]:
    return [memoryview(data[begin:end])]
