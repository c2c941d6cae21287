"""Publishing: a state dict or safetensors file becomes a durable, visible version.

In: weights (checked against ``param_specs`` before any data is read) and an optional
expected sha256. Out: a ``PublishOutcome`` once file and registry record are durable
(temp → fsync → rename → fsync dir → registry), or a typed error with nothing left behind.
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Mapping
from pathlib import Path

import torch

from oldlogit.errors import (
    InvalidRequest,
    OutOfMemory,
    VersionConflict,
    VersionNotIncreasing,
    WeightsMismatch,
)
from oldlogit_service.snapshots import ingest, persist
from oldlogit_service.snapshots.core import StoreCore, check_sha, check_version
from oldlogit_service.snapshots.records import PublishOutcome
from oldlogit_service.snapshots.residency import VersionEntry

logger = logging.getLogger(__name__)

__all__ = ["Publishing"]


class Publishing(StoreCore):
    def publish(
        self,
        version: int,
        weights: Mapping[str, torch.Tensor] | Path | str,
        *,
        expected_sha256: str | None = None,
        cast: bool = False,
    ) -> PublishOutcome:
        """Publish a version from a state dict or a safetensors file/shard directory.

        Names, dtypes and shapes are checked before any data is read; the version is visible
        only once its file and registry record are durable. ``cast`` (state dicts only) casts
        floating tensors to the serving dtype instead of refusing them.
        """
        version = check_version(version)
        expected = check_sha(expected_sha256)
        self._check_open()
        if isinstance(weights, (str, os.PathLike)):
            if cast:
                raise InvalidRequest("cast applies to state dicts only", parameter="cast")
            return self.publish_file(version, Path(weights), expected_sha256=expected)
        sources = ingest.state_dict_sources(weights, self._specs, cast=cast)
        return self._publish_sources(version, sources, expected)

    def publish_file(
        self,
        version: int,
        path: Path | str,
        *,
        expected_sha256: str | None = None,
        move: bool = False,
    ) -> PublishOutcome:
        """Publish from a safetensors file or shard directory. With ``move`` (an upload the
        HTTP layer streamed to ``staging_dir``) a single file is renamed into the store
        instead of copied; if the publish fails before that, the file is left where it was."""
        version = check_version(version)
        expected = check_sha(expected_sha256)
        self._check_open()
        path = Path(path)
        sources, headers = ingest.file_sources(path, self._specs)
        # A moved file is served as laid out; one with a tensor at an offset its dtype view
        # cannot use (e.g. name-ordered mixed dtypes) is rewritten in the aligned layout.
        if move and path.is_file() and persist.aligned(headers[0]):
            return self._publish_moved(version, path, sources, expected)
        out = self._publish_sources(version, sources, expected)
        self._after_op()
        return out

    def _precheck_locked(self, version: int) -> str | None:
        """The retained version's hash (for the idempotency check), or None if it is new."""
        e = self._entries.get(version)
        if e is not None:
            return e.stored.sha256
        if version in self._tombstones:
            raise VersionNotIncreasing(
                f"policy_version {version} was published before and has since been deleted; "
                f"publish a version above {self._newest}",
                parameter="policy_version",
            )
        if self._newest is not None and version <= self._newest:
            raise VersionNotIncreasing(
                f"policy_version {version} is not above the newest acknowledged version "
                f"{self._newest}",
                parameter="policy_version",
            )
        if self._watermark is not None and version < self._watermark:
            raise InvalidRequest(
                f"policy_version {version} is below the watermark {self._watermark}",
                parameter="policy_version",
            )
        return None

    @staticmethod
    def _check_expected(sha: str, expected: str | None) -> None:
        if expected is not None and sha != expected:
            raise WeightsMismatch(
                f"the weights' sha256 is {sha}, not the expected sha256 {expected}",
                parameter="sha256",
                details={"expected": expected, "actual": sha},
            )

    def _same_or_conflict(self, version: int, sha: str, existing: str) -> PublishOutcome:
        if sha == existing:
            return PublishOutcome(version, sha, False, self._snapshot_nbytes)
        raise VersionConflict(
            f"policy_version {version} is already published with weight sha256 {existing}; "
            f"these weights hash to {sha}",
            parameter="policy_version",
            details={"existing_sha256": existing, "sha256": sha},
        )

    def _publish_sources(
        self, version: int, sources: Mapping[str, persist.TensorSource], expected: str | None
    ) -> PublishOutcome:
        with self._lock:
            existing = self._precheck_locked(version)
        if existing is not None:  # a retry: hash only, write nothing
            sha = ingest.hash_sources(sources)
            self._check_expected(sha, expected)
            return self._same_or_conflict(version, sha, existing)
        tmp = persist.temp_path(self._weights_dir)
        name = persist.keyframe_name(version)
        try:
            try:
                sha = persist.write_keyframe(tmp, sources)
            except OSError as exc:
                self._raise_if_disk_full(exc)
                raise
            self._check_expected(sha, expected)
            persist.durable_rename(tmp, self._weights_dir / name)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return self._commit(version, sha, name)

    def _publish_moved(
        self,
        version: int,
        path: Path,
        sources: Mapping[str, persist.TensorSource],
        expected: str | None,
    ) -> PublishOutcome:
        with self._lock:
            existing = self._precheck_locked(version)
        sha = ingest.hash_sources(sources)
        self._check_expected(sha, expected)
        if existing is not None:
            return self._same_or_conflict(version, sha, existing)
        persist.fsync_file(path)  # the uploader may not have
        name = persist.keyframe_name(version)
        try:
            persist.durable_rename(path, self._weights_dir / name)
        except OSError as exc:
            if exc.errno != errno.EXDEV:
                raise
            return self._publish_sources(version, sources, expected)  # another filesystem
        return self._commit(version, sha, name)

    @staticmethod
    def _raise_if_disk_full(exc: OSError) -> None:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise OutOfMemory(
                "no room on the snapshot disk for these weights: lower --disk-budget-gib, "
                "raise the watermark, or free space",
                parameter="weights",
            ) from exc

    def _commit(self, version: int, sha: str, name: str) -> PublishOutcome:
        """Record a durable file; the version becomes visible only after the registry write."""
        final = self._weights_dir / name
        existing: str | None = None
        try:
            with self._persist_lock:
                with self._lock:
                    self._sweep_locked()
                    existing = self._precheck_locked(version)  # a racing publish may have won
                    if existing is None:
                        stored = persist.StoredVersion(
                            version, sha, self._snapshot_nbytes, name, self._clock()
                        )
                        doc = self._doc_locked(add=stored)
                if existing is None:
                    persist.write_registry(self._root, doc)
                    with self._lock:
                        e = VersionEntry(
                            stored, stored.created_at, next(self._ticks), verified=True
                        )
                        self._entries[version] = e
                        self._newest = doc.newest
                        self._disk.add(stored.nbytes)
                        self._publishes += 1
        except BaseException:
            final.unlink(missing_ok=True)
            raise
        if existing is not None:
            final.unlink(missing_ok=True)
            return self._same_or_conflict(version, sha, existing)
        logger.info("published version %d (sha256 %s, %d bytes)", version, sha, stored.nbytes)
        self._retain()
        return PublishOutcome(version, sha, True, stored.nbytes)

    @property
    def staging_dir(self) -> Path:
        """Where uploads are streamed before ``publish_file(..., move=True)`` (same
        filesystem, so the move is a rename; leftovers are cleared when the store opens)."""
        d = self._root / persist.INCOMING
        d.mkdir(exist_ok=True)
        return d
