"""Rebuilding versions from keyframe + patch chains, the keyframe policy, and chain rewrites.

In: the registry's records (parent links) and the CPU copies and decoded patches memory holds.
Out: a version's weights in a fresh CPU buffer (``materialize``, residency's loader); whether a
new version is stored as a keyframe; patch and keyframe files; new records for versions whose
chain loses a member. A rebuild starts from the nearest CPU copy in memory on its chain, else
from the keyframe file, and is checked against the version's hash the first time this process
builds it. No request handling, no registry writes.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from oldlogit.contract.errors import OldLogitError
from oldlogit_service.snapshots import buffers, codec, persist
from oldlogit_service.snapshots.registry import Registry
from oldlogit_service.snapshots.residency import Residency, Resident

logger = logging.getLogger(__name__)

__all__ = ["Rebuilder"]

# A patch byte costs about this many snapshot bytes of copying to apply (decode + scatter, as
# measured on CPU); used only to rank what to keep in memory.
PATCH_BYTE_COST = 6.0


@dataclass
class _Plan:
    """What a rebuild reads: a base (a CPU copy in memory, or a keyframe file) + patches."""

    base: persist.StoredVersion
    base_res: Resident | None
    patches: list[persist.StoredVersion]  # oldest first


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
    ) -> None:
        self._registry = registry
        self._residency = residency
        self._dir = weights_dir
        self._specs = specs
        self._snapshot_nbytes = snapshot_nbytes
        self.keyframe_every = keyframe_every
        self._chain_fraction = keyframe_chain_fraction
        self._verified: set[str] = set()  # (version, file) keys checked by this process
        self.counters: Counter[str] = Counter()

    # -- trust ------------------------------------------------------------------------------
    @staticmethod
    def _key(sv: persist.StoredVersion) -> str:
        return f"{sv.version}/{sv.file}/{sv.file_sha256 or ''}"

    def is_verified(self, sv: persist.StoredVersion) -> bool:
        return self._key(sv) in self._verified

    def mark_verified(self, sv: persist.StoredVersion) -> None:
        """This process wrote (or checked) these bytes: no hash check on their first load."""
        self._verified.add(self._key(sv))

    # -- costs and policy -------------------------------------------------------------------
    def rebuild_cost(self, version: int) -> float:
        """Snapshot loads needed to bring a version's weights back from disk."""
        try:
            chain = self._registry.chain(version)
        except (persist.CorruptSnapshot, OldLogitError):
            return 1.0
        patch_bytes = sum(sv.file_nbytes for sv in chain if sv.kind == "patch")
        return 1.0 + PATCH_BYTE_COST * patch_bytes / max(1, self._snapshot_nbytes)

    def patch_cost(self, version: int) -> float:
        """Snapshot loads needed to bring a version's decoded patch back from disk."""
        try:
            sv = self._registry.get(version)
        except OldLogitError:
            return 0.0
        return PATCH_BYTE_COST * sv.file_nbytes / max(1, self._snapshot_nbytes)

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
        self._residency.offer(sv.version, patch, patch_key=key)
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
        for attempt in range(3):
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

    # -- rewrites ---------------------------------------------------------------------------
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


def _slice(data: Any, begin: int, end: int) -> list[memoryview]:
    return [memoryview(data[begin:end])]
