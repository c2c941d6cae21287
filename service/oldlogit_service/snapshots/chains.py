"""Patch chains: rebuilding a version from its nearest base, the keyframe policy, rewrites.

In: a version entry and the registry's parent links; decoded patches cached in memory or read
(and checked against their file hash) from disk. Out: the version's weights in a fresh CPU
buffer; whether a new version is stored as a keyframe; new records for versions whose chain
loses a member. A rebuild starts from the nearest CPU copy in memory on its chain, else from
the keyframe file. No request handling here.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from oldlogit.errors import OldLogitError, error_from_payload
from oldlogit_service.snapshots import buffers, codec, persist
from oldlogit_service.snapshots.core import StoreCore
from oldlogit_service.snapshots.residency import Resident, VersionEntry

logger = logging.getLogger(__name__)

__all__ = ["Chains"]

# A patch byte costs about this many snapshot bytes of copying to apply (decode + scatter, as
# measured on CPU); used only to rank what to keep in memory.
PATCH_BYTE_COST = 6.0


@dataclass
class _Plan:
    """What a rebuild reads: a base (a CPU copy in memory, or a keyframe file) + patches."""

    base: VersionEntry
    base_stored: persist.StoredVersion
    base_res: Resident | None
    patches: list[tuple[VersionEntry, persist.StoredVersion]]  # oldest first


class Chains(StoreCore):
    # -- chain facts (call with _lock) ------------------------------------------------------
    def _parent_locked(self, e: VersionEntry) -> VersionEntry:
        p = e.stored.parent
        parent = None if p is None else self._entries.get(p)
        if parent is None:
            v = e.stored.version
            raise persist.CorruptSnapshot(f"version {v}: its parent {p} is not retained", v)
        return parent

    def _chain_locked(self, entry: VersionEntry) -> list[VersionEntry]:
        """``[entry, its parent, ..., its keyframe]``."""
        out = [entry]
        while out[-1].stored.kind == "patch":
            out.append(self._parent_locked(out[-1]))
        return out

    def _rebuild_cost_locked(self, entry: VersionEntry) -> float:
        if entry.stored.kind != "patch":
            return 1.0
        try:
            chain = self._chain_locked(entry)
        except persist.CorruptSnapshot:
            return 1.0
        patch_bytes = sum(e.stored.file_nbytes for e in chain if e.stored.kind == "patch")
        return 1.0 + PATCH_BYTE_COST * patch_bytes / max(1, self._snapshot_nbytes)

    def _patch_cost_locked(self, entry: VersionEntry) -> float:
        return PATCH_BYTE_COST * entry.stored.file_nbytes / max(1, self._snapshot_nbytes)

    def _keyframe_due_locked(self, parent: VersionEntry | None, patch_nbytes: int) -> bool:
        """The keyframe policy for a new version whose patch against ``parent`` would be
        ``patch_nbytes``: see ``StoreCore.__init__``."""
        if self._keyframe_every <= 1 or parent is None:
            return True
        try:
            chain = self._chain_locked(parent)
        except persist.CorruptSnapshot:
            return True
        if len(chain) >= self._keyframe_every:  # the new version's patches to its keyframe
            return True
        chain_bytes = patch_nbytes + sum(
            e.stored.file_nbytes for e in chain if e.stored.kind == "patch"
        )
        return chain_bytes > self._keyframe_chain_fraction * self._snapshot_nbytes

    def _cpu_res_locked(self, e: VersionEntry) -> Resident | None:
        res = e.host if self._host_enabled else e.device if self._direct else None
        return res if res is not None and res.buffer is not None else None

    # -- patches ----------------------------------------------------------------------------
    def _load_patch(self, entry: VersionEntry, stored: persist.StoredVersion) -> codec.Patch:
        """A version's decoded patch, from memory or from its (checked) file."""
        with self._lock:
            if entry.patch is not None and entry.stored is stored:
                entry.patch_used, entry.patch_tick = self._clock(), next(self._ticks)
                return entry.patch
        v = stored.version
        buf, header = persist.read_keyframe(
            self._weights_dir / stored.file,
            pin=False,
            expect_sha256=stored.file_sha256,
            version=v,
        )
        try:
            patch = codec.parse_patch(header, buf.numpy(), self._specs, what=f"patch of {v}")
        except OldLogitError as exc:
            raise persist.CorruptSnapshot(f"{stored.file}: {exc}", v) from exc
        with self._lock:
            self._counters["bytes_read"] += header.nbytes
            if entry.stored is stored:
                self._offer_locked(entry, patch, rebuild_cost=self._patch_cost_locked(entry))
        return patch

    def _write_patch(
        self, version: int, parent: int, patch: codec.Patch, sha: str, created_at: float
    ) -> persist.StoredVersion:
        """Write a patch file durably; its record (not yet in the registry)."""
        sources: dict[str, persist.TensorSource] = {}
        for key, (role, arr) in codec.file_tensors(patch).items():
            name = key.rsplit("::", 1)[0]
            dtype = self._specs[name][0] if role == "val" else "U8"
            raw = np.ascontiguousarray(arr).view(np.uint8)
            sources[key] = persist.TensorSource(
                key, dtype, (int(arr.shape[0]),), functools.partial(lambda r: [r.data], raw)
            )
        meta = {"format": codec.FORMAT, "parent": str(parent), "sha256": sha}
        tmp = persist.temp_path(self._weights_dir)
        name = persist.patch_name(version)
        try:
            file_sha = persist.write_keyframe(tmp, sources, meta)
            size = tmp.stat().st_size
            persist.durable_rename(tmp, self._weights_dir / name)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return persist.StoredVersion(
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

    @staticmethod
    def _patch_nbytes(patch: codec.Patch) -> int:
        """About what the patch file holds (values + coded positions)."""
        return sum(arr.nbytes for _, arr in codec.file_tensors(patch).values())

    # -- rebuild ----------------------------------------------------------------------------
    def _plan_locked(self, entry: VersionEntry) -> _Plan:
        patches: list[tuple[VersionEntry, persist.StoredVersion]] = []
        e = entry
        while True:
            res = self._cpu_res_locked(e)
            if res is not None or e.stored.kind != "patch":
                break
            patches.append((e, e.stored))
            e = self._parent_locked(e)
        patches.reverse()
        return _Plan(e, e.stored, res, patches)

    def _materialize(self, entry: VersionEntry) -> Resident:
        """A version's weights in a fresh CPU buffer (page-locked for a GPU): its keyframe read
        from disk, or its nearest base on the chain plus the patches above it."""
        for attempt in range(3):
            with self._lock:
                plan = self._plan_locked(entry)
            try:
                return self._rebuild(entry, plan)
            except persist.CorruptSnapshot:
                # A removal may have rewritten the chain under this rebuild: plan again.
                with self._lock:
                    steps = [(plan.base, plan.base_stored), *plan.patches]
                    moved = any(e.retired or e.stored is not sv for e, sv in steps)
                if not moved or attempt == 2:
                    raise
        raise AssertionError("unreachable")  # pragma: no cover

    def _rebuild(self, entry: VersionEntry, plan: _Plan) -> Resident:
        n = entry.stored.nbytes
        patches = [self._load_patch(e, sv) for e, sv in plan.patches]
        read = verified = 0
        if plan.base_res is not None:
            assert plan.base_res.buffer is not None
            layout = plan.base_res.layout
            out = buffers.alloc_buffer(n, pin=self._pin_host)  # [nbytes]
            codec.rebuild(out.numpy(), layout, patches, base=plan.base_res.buffer.numpy())
        else:
            kf = plan.base
            verify = None if kf.verified else plan.base_stored.sha256
            out, header = persist.read_keyframe(
                self._weights_dir / plan.base_stored.file,
                pin=self._pin_host,
                expect_sha256=verify,
                version=plan.base_stored.version,
            )
            layout = tuple(header.tensors.values())
            read, verified = header.nbytes, int(verify is not None)
            if patches:
                # Keep the keyframe read as the base of its chain's next rebuilds, if it fits.
                base = Resident(out, layout, persist.tensor_views(out, layout), read)
                with self._lock:
                    if kf.stored is plan.base_stored:
                        kf.verified = True
                    kept = self._offer_locked(kf, base, rebuild_cost=1.0)
                if kept:
                    out = buffers.alloc_buffer(n, pin=self._pin_host)
                    codec.rebuild(out.numpy(), layout, patches, base=base.buffer.numpy())  # type: ignore[union-attr]
                else:
                    codec.rebuild(out.numpy(), layout, patches)
        if patches and not entry.verified:
            verified += 1
            got = buffers.hash_buffer(out.numpy(), layout)
            if got != entry.stored.sha256:
                v = entry.stored.version
                raise persist.CorruptSnapshot(
                    f"version {v} rebuilt from its chain hashes to {got}, the registry says "
                    f"{entry.stored.sha256}",
                    v,
                )
        with self._lock:
            self._counters["bytes_read"] += read
            self._counters["verified_loads"] += verified
            self._counters["rebuilds"] += bool(patches)
            self._counters["patches_applied"] += len(patches)
        return Resident(out, layout, persist.tensor_views(out, layout), n)

    # -- pinning ----------------------------------------------------------------------------
    def _pin(self, version: int) -> tuple[VersionEntry, Resident]:
        with self._lock:
            self._sweep_locked()
            entry = self._live_locked(version)
            entry.pins += 1
            self._touch_locked(entry)
            if entry.device is not None:
                self._counters["device_hits"] += 1
                return entry, entry.device
        try:
            return entry, self._load_shared(entry)
        except persist.CorruptSnapshot as exc:
            self._unpin(entry)
            raise self._corrupt(version, exc) from exc
        except OldLogitError as exc:
            self._unpin(entry)
            # A follower re-raises a copy, so threads do not share one traceback.
            raise error_from_payload(exc.to_payload()) from exc
        except BaseException:
            self._unpin(entry)
            raise

    def _corrupt(self, version: int, exc: persist.CorruptSnapshot) -> OldLogitError:
        """Quarantine the bad file's version (and what is rebuilt through it); the error for
        the request that found it."""
        logger.error("version %d failed verification: %s", version, exc)
        with self._lock:
            bad = self._entries.get(exc.version if exc.version is not None else version)
        if bad is not None:
            self._lose(bad)
        with self._lock:
            return self._missing_error(
                version,
                "its file (or one of the files it is rebuilt from) failed verification and "
                "was quarantined",
            )

    @contextlib.contextmanager
    def _cpu_weights(self, version: int) -> Iterator[Resident]:
        """A pinned version's weights in CPU memory (a buffer), for diffs and rewrites."""
        entry, res = self._pin(version)
        try:
            if res.buffer is not None and res.buffer.device.type == "cpu":
                yield res
            else:
                with self._lock:
                    host = self._cpu_res_locked(entry)
                yield host if host is not None else self._materialize(entry)
        finally:
            self._unpin(entry)

    def _evicted_while_loading(self, entry: VersionEntry) -> Exception:
        return self._missing_error(entry.stored.version)

    def _lose(self, entry: VersionEntry) -> None:
        """A version whose file is corrupt goes, and with it every version rebuilt through it."""
        version = entry.stored.version
        with self._persist_lock:
            with self._lock:
                if self._entries.get(version) is not entry:
                    return
                gone = (version, *sorted(self._descendants_locked({version})))
                files = [self._entries[v].stored.file for v in gone[1:]]
                doc = self._doc_locked(remove=gone)
            persist.write_registry(self._root, doc)
            with self._lock:
                for v in gone:
                    self._retire_locked(v)
            persist.quarantine(self._root, entry.stored.file)
            persist.remove_files(self._weights_dir, files)
        if len(gone) > 1:
            logger.error("versions %s were rebuilt through version %d: gone too", gone[1:], version)

    # -- removals ---------------------------------------------------------------------------
    def _rewrites_for_removal(self, remove: set[int]) -> dict[int, persist.StoredVersion]:
        """Each retained version whose parent goes is rewritten: its patch composed with the
        removed ones down from the nearest kept ancestor, or, when its keyframe goes, as a
        keyframe itself (re-keyframing)."""
        with self._lock:
            deps = [
                v
                for v in sorted(self._entries)
                if v not in remove and self._entries[v].stored.parent in remove
            ]
        out: dict[int, persist.StoredVersion] = {}
        try:
            for v in deps:
                out[v] = self._rewrite_one(v, remove)
        except BaseException:
            persist.remove_files(self._weights_dir, [sv.file for sv in out.values()])
            raise
        return out

    def _rewrite_one(self, version: int, remove: set[int]) -> persist.StoredVersion:
        with self._lock:
            e = self._entries[version]
            path = [e]  # e, then its removed ancestors upward
            while path[-1].stored.kind == "patch" and path[-1].stored.parent in remove:
                path.append(self._parent_locked(path[-1]))
            top = path[-1]
            anchor = self._parent_locked(top) if top.stored.kind == "patch" else None
        if anchor is not None:
            steps = [self._load_patch(x, x.stored) for x in reversed(path)]
            merged = functools.reduce(codec.compose, steps)
            with self._lock:
                due = self._keyframe_due_locked(anchor, self._patch_nbytes(merged))
            if not due:
                logger.info("version %d rebased onto version %d", version, anchor.stored.version)
                return self._write_patch(
                    version, anchor.stored.version, merged, e.stored.sha256, e.stored.created_at
                )
        logger.info("version %d rewritten as a keyframe (its chain's keyframe goes)", version)
        with self._cpu_weights(version) as res:
            sources = {
                t.name: persist.TensorSource(
                    t.name, t.dtype, t.shape, functools.partial(_raw_chunks, res, t.name)
                )
                for t in res.layout
            }
            tmp = persist.temp_path(self._weights_dir)
            name = persist.keyframe_name(version)
            try:
                sha = persist.write_keyframe(tmp, sources)
                if sha != e.stored.sha256:
                    raise persist.CorruptSnapshot(f"version {version} rebuilt wrong", version)
                persist.durable_rename(tmp, self._weights_dir / name)
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise
        return persist.StoredVersion(version, sha, self._snapshot_nbytes, name, e.stored.created_at)


def _raw_chunks(res: Resident, name: str) -> list[memoryview]:
    return [res.tensors[name].reshape(-1).view(torch.uint8).numpy().data]
