"""Publishing: weights (full or a delta against a parent) become a durable, visible version.

In: a state dict, a safetensors file/shard directory, or a delta file (``oldlogit.contract.delta``
format) against a retained parent; an optional expected sha256. Out: a ``PublishOutcome`` once
file and registry record are durable (temp → fsync → rename → fsync dir → claim → registry),
or a typed error with nothing left behind. Names, dtypes and shapes are checked before any
data is read; with patches on, new weights are diffed against their parent and stored as a
patch or a keyframe as the keyframe policy says.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from oldlogit.contract.delta import bits_view
from oldlogit.contract.errors import (
    InvalidRequest,
    NotFound,
    OutOfMemory,
    ParentMissing,
    VersionConflict,
    VersionEvicted,
    WeightsMismatch,
)
from oldlogit.contract.weights import DTYPE_ITEMSIZE, read_safetensors_header
from oldlogit_service.snapshots import buffers, codec, ingest, persist
from oldlogit_service.snapshots.buffers import TensorSource
from oldlogit_service.snapshots.rebuild import Rebuilder
from oldlogit_service.snapshots.records import PublishOutcome
from oldlogit_service.snapshots.registry import Registry
from oldlogit_service.snapshots.residency import Residency, Resident

logger = logging.getLogger(__name__)

__all__ = ["Claim", "Publisher", "check_sha"]

# The shared registry's claim (scale-out), between "durable here" and "visible anywhere":
# (version, sha256, file, record) → True if created, False if the same weights were there.
Claim = Callable[[int, str, Path, dict[str, Any]], bool]


def check_sha(sha: str | None) -> str | None:
    if sha is None:
        return None
    if (
        not isinstance(sha, str)
        or len(sha) != 64
        or any(c not in "0123456789abcdef" for c in sha.lower())
    ):
        raise InvalidRequest("sha256 must be 64 hex digits", parameter="sha256")
    return sha.lower()


class Publisher:
    def __init__(
        self,
        *,
        registry: Registry,
        residency: Residency,
        rebuilder: Rebuilder,
        specs: Mapping[str, tuple[str, tuple[int, ...]]],
        snapshot_nbytes: int,
        clock: Callable[[], float],
        claim: Claim | None,
        fetch: Callable[[int | None], None] | None = None,
    ) -> None:
        self._registry = registry
        self._residency = residency
        self._rebuilder = rebuilder
        self._specs = specs
        self._snapshot_nbytes = snapshot_nbytes
        self._clock = clock
        self._claim = claim
        self._fetch = fetch
        self._dir = registry.root / persist.WEIGHTS

    # -- entry points -----------------------------------------------------------------------
    def publish_weights(
        self, version: int, weights: Mapping[str, torch.Tensor], expected: str | None, cast: bool
    ) -> PublishOutcome:
        sources = ingest.state_dict_sources(weights, self._specs, cast=cast)
        if self._rebuilder.patches_on:
            return self._publish_buffered(version, sources, expected)
        return self._publish_sources(version, sources, expected)

    def publish_file(
        self, version: int, path: Path, expected: str | None, *, move: bool
    ) -> PublishOutcome:
        """From a safetensors file or shard directory. With ``move`` (an upload streamed to the
        staging directory) a single file is renamed into the store instead of copied; if the
        publish fails before that, the file is left where it was."""
        sources, headers = ingest.file_sources(path, self._specs)
        if self._rebuilder.patches_on:
            return self._publish_buffered(version, sources, expected)
        # A moved file is served as laid out; one with a tensor at an offset its dtype view
        # cannot use (e.g. name-ordered mixed dtypes) is rewritten in the aligned layout.
        if move and path.is_file() and persist.aligned(headers[0]):
            return self._publish_moved(version, path, sources, expected)
        return self._publish_sources(version, sources, expected)

    def publish_delta(
        self, version: int, path: Path, parent: int | None, expected: str | None
    ) -> PublishOutcome:
        """From a delta file against a retained parent: ``parent``, else the file's ``parent``
        metadata, else the newest retained version. A parent not retained here (or retained
        with other weights than the file's ``parent_sha256``) is ``ParentMissing``. The rebuilt
        weights are checked against ``expected`` and the file's ``sha256`` before any write."""
        header = read_safetensors_header(path)
        meta = header.metadata
        codec.check_format(meta, "the upload")
        meta_parent = meta.get("parent")
        if meta_parent is not None:
            if not meta_parent.isdigit():
                raise InvalidRequest(
                    f"the delta's parent metadata {meta_parent!r} is not a version",
                    parameter="parent",
                )
            if parent is not None and int(meta_parent) != parent:
                raise InvalidRequest(
                    f"parent={parent} disagrees with the delta's own parent {meta_parent}",
                    parameter="parent",
                )
            parent = int(meta_parent)
        meta_sha = check_sha(meta.get("sha256"))
        if expected is not None and meta_sha is not None:
            _check_expected(meta_sha, expected)
        expected = expected or meta_sha
        existing = self._registry.precheck(version)
        if existing is None and (parent is None or not self._registry.has(parent)):
            self._fetch_parent(parent)
        if parent is None:
            parent = self._registry.newest_retained()
        if existing is None and (
            parent is None or parent >= version or not self._registry.has(parent)
        ):
            why = (
                "is no longer retained"
                if parent is not None and self._registry.was_deleted(parent)
                else "was never published here"
            )
            raise self._registry.parent_missing(version, -1 if parent is None else parent, why)
        if existing is not None and expected is not None:
            return self._same_or_conflict(version, expected, existing)
        assert parent is not None
        their = meta.get("parent_sha256")
        try:
            parent_sha = self._registry.get(parent).sha256
        except (NotFound, VersionEvicted):
            parent_sha = None
        if parent_sha is not None and their and their != parent_sha:
            raise self._registry.parent_missing(
                version,
                parent,
                f"has weight sha256 {parent_sha} here, not {their} as the delta was made against",
            )
        buf, _ = persist.read_keyframe(path, pin=False, expect_sha256=None)
        patch = codec.parse_patch(header, buf.numpy(), self._specs)
        try:
            with self._rebuilder.cpu_weights(parent) as base:
                assert base.buffer is not None
                out = buffers.alloc_buffer(self._snapshot_nbytes, pin=self._residency.pin_host)
                codec.rebuild(out.numpy(), base.layout, [patch], base=base.buffer.numpy())
                layout = base.layout
        except (NotFound, VersionEvicted) as exc:
            raise self._registry.parent_missing(version, parent, "is no longer retained") from exc
        sha = buffers.hash_buffer(out.numpy(), layout)
        _check_expected(sha, expected)
        if existing is not None:
            return self._same_or_conflict(version, sha, existing)
        res = Resident(out, layout, persist.tensor_views(out, layout), self._snapshot_nbytes)
        return self._store(version, sha, res, parent=parent, patch=patch)

    def adopt(self, version: int, path: Path, expected: str) -> PublishOutcome:
        """Take in a version another replica published to the shared volume: hard-linked (same
        volume: no copy; it survives the other replica's deletion) or copied, its sha256
        verified, recorded without the local order checks — the shared registry ordered it.
        Keyframes only: a patch needs its chain."""
        name = persist.keyframe_name(version)
        tmp = persist.temp_path(self._dir)
        try:
            try:
                os.link(path, tmp)
            except OSError:
                shutil.copyfile(path, tmp)
            sources, _ = ingest.file_sources(tmp, self._specs)
            sha = ingest.hash_sources(sources)
            _check_expected(sha, expected)
            persist.durable_rename(tmp, self._dir / name)
        except FileNotFoundError as exc:
            raise VersionEvicted(
                f"policy_version {version} is registered but its file is gone from the shared "
                "volume",
                parameter="policy_version",
            ) from exc
        finally:
            tmp.unlink(missing_ok=True)
        stored = persist.StoredVersion(version, sha, self._snapshot_nbytes, name, self._clock())
        return self._commit(stored, adopt=True)

    def _fetch_parent(self, version: int | None) -> None:
        """On a shared chain: adopt the parent a new version is diffed against (None: the
        deployment's newest) if another replica published it; without it the version is
        diffed against what this replica holds, or stored whole."""
        if self._fetch is None:
            return
        try:
            self._fetch(version)
        except Exception as exc:
            logger.info("no parent %s from the deployment for a diff: %s", version, exc)

    # -- full weights -----------------------------------------------------------------------
    def _if_retry(
        self, version: int, sources: Mapping[str, TensorSource], expected: str | None
    ) -> PublishOutcome | None:
        """The outcome for a version already held (a retry: hash only, write nothing; the same
        weights or a conflict), or None if it is new. Raises the order checks' errors."""
        existing = self._registry.precheck(version)
        if existing is None:
            return None
        sha = ingest.hash_sources(sources)
        _check_expected(sha, expected)
        return self._same_or_conflict(version, sha, existing)

    def _publish_sources(
        self, version: int, sources: Mapping[str, TensorSource], expected: str | None
    ) -> PublishOutcome:
        retried = self._if_retry(version, sources, expected)
        if retried is not None:
            return retried
        tmp = persist.temp_path(self._dir)
        name = persist.keyframe_name(version)
        try:
            try:
                sha = persist.write_keyframe(tmp, sources)
            except OSError as exc:
                _raise_if_disk_full(exc)
                raise
            _check_expected(sha, expected)
            persist.durable_rename(tmp, self._dir / name)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        stored = persist.StoredVersion(version, sha, self._snapshot_nbytes, name, self._clock())
        self._rebuilder.mark_verified(stored)
        return self._commit(stored)

    def _publish_moved(
        self, version: int, path: Path, sources: Mapping[str, TensorSource], expected: str | None
    ) -> PublishOutcome:
        existing = self._registry.precheck(version)
        sha = ingest.hash_sources(sources)
        _check_expected(sha, expected)
        if existing is not None:
            return self._same_or_conflict(version, sha, existing)
        persist.fsync_file(path)  # the uploader may not have
        name = persist.keyframe_name(version)
        try:
            persist.durable_rename(path, self._dir / name)
        except OSError as exc:
            if exc.errno != errno.EXDEV:
                raise
            return self._publish_sources(version, sources, expected)  # another filesystem
        stored = persist.StoredVersion(version, sha, self._snapshot_nbytes, name, self._clock())
        self._rebuilder.mark_verified(stored)
        return self._commit(stored)

    def _publish_buffered(
        self, version: int, sources: Mapping[str, TensorSource], expected: str | None
    ) -> PublishOutcome:
        """Full weights read into memory once: hashed, diffed against the newest retained
        version, stored as a patch or a keyframe."""
        retried = self._if_retry(version, sources, expected)
        if retried is not None:
            return retried
        buf, layout, sha = buffers.buffer_from_sources(sources, pin=self._residency.pin_host)
        _check_expected(sha, expected)
        res = Resident(buf, layout, persist.tensor_views(buf, layout), self._snapshot_nbytes)
        self._fetch_parent(None)
        return self._store(version, sha, res, parent=self._registry.newest_retained(), patch=None)

    def _store(
        self,
        version: int,
        sha: str,
        res: Resident,
        *,
        parent: int | None,
        patch: codec.Patch | None,
    ) -> PublishOutcome:
        """Write new weights held in memory as a patch against ``parent`` or a keyframe."""
        due = True
        if parent is not None and self._rebuilder.patches_on:
            if patch is None:
                try:
                    with self._rebuilder.cpu_weights(parent) as base:
                        patch = codec.diff(_bits(base), _bits(res))
                except (NotFound, VersionEvicted):  # deleted meanwhile: store it whole
                    patch = None
            if patch is not None:
                due = self._rebuilder.keyframe_due(parent, self._rebuilder.patch_nbytes(patch))
        try:
            if not due:
                assert parent is not None and patch is not None
                stored = self._rebuilder.write_patch(version, parent, patch, sha, self._clock())
            else:
                stored = self._rebuilder.write_keyframe(version, res, sha, self._clock())
        except persist.CorruptSnapshot as exc:
            raise WeightsMismatch(
                "the weights changed while being stored", parameter="weights"
            ) from exc
        except OSError as exc:
            _raise_if_disk_full(exc)
            raise
        if stored.kind != "patch":
            return self._commit(stored, res=res)
        try:
            return self._commit(stored, res=res, patch=patch)
        except ParentMissing:
            # Its parent went meanwhile (a removal here, or on the shared chain another
            # replica's): the weights are in hand and checked, so store them whole instead.
            logger.info("version %d: its parent %s went meanwhile; stored whole", version, parent)
            whole = self._rebuilder.write_keyframe(version, res, sha, self._clock())
            return self._commit(whole, res=res)

    # -- visibility -------------------------------------------------------------------------
    def _commit(
        self,
        stored: persist.StoredVersion,
        *,
        res: Resident | None = None,
        patch: codec.Patch | None = None,
        adopt: bool = False,
    ) -> PublishOutcome:
        """Make a durable file visible: the shared claim (scale-out), then the registry. The
        weights (``res``) and a decoded ``patch`` made anyway are kept resident if they fit:
        the newest version is the next one's parent and the likeliest to be asked for."""
        version, sha = stored.version, stored.sha256
        final = self._dir / stored.file
        created = True
        try:
            with self._registry.persist_lock:
                existing = self._registry.precheck(version, adopt=adopt)  # a racer may have won
                if existing is None:
                    if self._claim is not None and not adopt:
                        created = self._claim(version, sha, final, stored.to_json())
                    if created:
                        self._registry.commit(stored, adopt=adopt)
        except BaseException:
            final.unlink(missing_ok=True)
            raise
        if not created:  # the deployment has these weights already (another replica's file)
            final.unlink(missing_ok=True)
            return PublishOutcome(version, sha, False, stored.nbytes)
        if existing is not None:
            final.unlink(missing_ok=True)
            return self._same_or_conflict(version, sha, existing)
        if res is not None:
            self._residency.offer(version, res)
        if patch is not None:
            self._residency.offer(version, patch, patch_key=stored.file_sha256 or stored.file)
        logger.info(
            "published version %d as a %s (sha256 %s, %d bytes on disk)",
            version,
            stored.kind,
            sha,
            stored.disk_nbytes,
        )
        return PublishOutcome(version, sha, created, stored.nbytes, stored.kind)

    def _same_or_conflict(self, version: int, sha: str, existing: str) -> PublishOutcome:
        if sha == existing:
            return PublishOutcome(version, sha, False, self._snapshot_nbytes)
        raise VersionConflict(
            f"policy_version {version} is already published with weight sha256 {existing}; "
            f"these weights hash to {sha}",
            parameter="policy_version",
            details={"existing_sha256": existing, "sha256": sha},
        )


def _check_expected(sha: str, expected: str | None) -> None:
    if expected is not None and sha != expected:
        raise WeightsMismatch(
            f"the weights' sha256 is {sha}, not the expected sha256 {expected}",
            parameter="sha256",
            details={"expected": expected, "actual": sha},
        )


def _raise_if_disk_full(exc: OSError) -> None:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        raise OutOfMemory(
            "no room on the snapshot disk for these weights: lower --disk-budget-gib, raise the "
            "watermark, or free space",
            parameter="weights",
        ) from exc


def _bits(res: Resident) -> dict[str, Any]:
    assert res.buffer is not None
    data = res.buffer.numpy()
    return {e.name: bits_view(data[e.begin : e.end], DTYPE_ITEMSIZE[e.dtype]) for e in res.layout}
