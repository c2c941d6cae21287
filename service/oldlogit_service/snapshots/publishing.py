"""Publishing: full weights or a delta becomes a durable, visible version.

In: weights (checked against ``param_specs`` before any data is read) or a delta file against
a retained parent, and an optional expected sha256. Out: a ``PublishOutcome`` once file and
registry record are durable (temp → fsync → rename → fsync dir → registry), or a typed error
with nothing left behind. With patches on, new weights are diffed against their parent and
stored as a patch or a keyframe as the keyframe policy says.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
from collections.abc import Mapping
from pathlib import Path

import torch

from oldlogit.errors import (
    InvalidRequest,
    OutOfMemory,
    ParentMissing,
    VersionConflict,
    VersionEvicted,
    VersionNotIncreasing,
    WeightsMismatch,
)
from oldlogit_service.snapshots import codec, ingest, persist
from oldlogit_service.snapshots.chains import Chains
from oldlogit_service.snapshots.core import check_sha, check_version
from oldlogit_service.snapshots.records import PublishOutcome
from oldlogit_service.snapshots.residency import Resident, VersionEntry

logger = logging.getLogger(__name__)

__all__ = ["Publishing"]


class Publishing(Chains):
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
        if self._patches_on():
            return self._publish_buffered(version, sources, expected)
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
        if self._patches_on():
            out = self._publish_buffered(version, sources, expected)
            self._after_op()
            return out
        # A moved file is served as laid out; one with a tensor at an offset its dtype view
        # cannot use (e.g. name-ordered mixed dtypes) is rewritten in the aligned layout.
        if move and path.is_file() and persist.aligned(headers[0]):
            return self._publish_moved(version, path, sources, expected)
        out = self._publish_sources(version, sources, expected)
        self._after_op()
        return out

    def _precheck_locked(self, version: int, adopt: bool = False) -> str | None:
        """The retained version's hash (for the idempotency check), or None if it is new.
        ``adopt``: the shared registry already ordered this version (scale-out), so the local
        order checks do not apply."""
        e = self._entries.get(version)
        if e is not None:
            return e.stored.sha256
        if adopt:
            return None
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

    def _if_retry(
        self, version: int, sources: Mapping[str, persist.TensorSource], expected: str | None
    ) -> PublishOutcome | None:
        """The outcome for a version this store already holds (a retry: hash only, write
        nothing; the same weights or a conflict), or None if the version is new. Raises the
        order checks' errors."""
        with self._lock:
            existing = self._precheck_locked(version)
        if existing is None:
            return None
        sha = ingest.hash_sources(sources)
        self._check_expected(sha, expected)
        return self._same_or_conflict(version, sha, existing)

    def _publish_sources(
        self, version: int, sources: Mapping[str, persist.TensorSource], expected: str | None
    ) -> PublishOutcome:
        retried = self._if_retry(version, sources, expected)
        if retried is not None:
            return retried
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

    def has(self, version: int) -> bool:
        """Whether this store retains ``version`` (no error for unknown ones)."""
        with self._lock:
            return version in self._entries

    def adopt(self, version: int, path: Path, expected_sha256: str) -> PublishOutcome:
        """Take in a version another replica published to the shared volume (scale-out).

        The file is hard-linked (same volume: no copy; it survives the other replica's
        deletion) or copied, its sha256 verified, and it is recorded without the local order
        checks — the shared registry ordered it. Keyframes only: a patch needs its chain.
        """
        version = check_version(version)
        self._check_open()
        name = persist.keyframe_name(version)
        tmp = persist.temp_path(self._weights_dir)
        try:
            try:
                os.link(path, tmp)
            except OSError:
                shutil.copyfile(path, tmp)
            sources, _ = ingest.file_sources(tmp, self._specs)
            sha = ingest.hash_sources(sources)
            self._check_expected(sha, expected_sha256)
            persist.durable_rename(tmp, self._weights_dir / name)
        except FileNotFoundError as exc:
            raise VersionEvicted(
                f"policy_version {version} is registered but its file is gone from the "
                "shared volume",
                parameter="policy_version",
            ) from exc
        finally:
            tmp.unlink(missing_ok=True)
        return self._commit_stored(
            persist.StoredVersion(version, sha, self._snapshot_nbytes, name, self._clock()),
            adopt=True,
        )

    @staticmethod
    def _raise_if_disk_full(exc: OSError) -> None:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise OutOfMemory(
                "no room on the snapshot disk for these weights: lower --disk-budget-gib, "
                "raise the watermark, or free space",
                parameter="weights",
            ) from exc

    def _commit(self, version: int, sha: str, name: str) -> PublishOutcome:
        return self._commit_stored(
            persist.StoredVersion(version, sha, self._snapshot_nbytes, name, self._clock())
        )

    def _commit_stored(
        self,
        stored: persist.StoredVersion,
        res: Resident | None = None,
        patch: codec.Patch | None = None,
        *,
        adopt: bool = False,
    ) -> PublishOutcome:
        """Record a durable file; the version becomes visible only after the registry write.
        ``res`` (its weights in CPU memory) and ``patch`` (decoded) are kept resident if they
        fit: the newest version is the next one's parent and the likeliest to be asked for."""
        version, sha = stored.version, stored.sha256
        final = self._weights_dir / stored.file
        existing: str | None = None
        created = True
        try:
            with self._persist_lock:
                with self._lock:
                    self._sweep_locked()
                    # a racing publish may have won
                    existing = self._precheck_locked(version, adopt)
                    if existing is None:
                        if stored.parent is not None and stored.parent not in self._entries:
                            raise self._parent_missing(version, stored.parent, "was deleted")
                        doc = self._doc_locked(add=stored)
                if existing is None and self.commit_hook is not None and not adopt:
                    # The shared registry's claim: durable here, not yet visible anywhere.
                    # A conflict or an unreachable registry raises and the file is removed.
                    created = self.commit_hook(
                        version,
                        sha,
                        final,
                        {"kind": stored.kind, "parent": stored.parent, "nbytes": stored.nbytes},
                    )
                if existing is None:
                    persist.write_registry(self._root, doc)
                    with self._lock:
                        e = VersionEntry(
                            stored, stored.created_at, next(self._ticks), verified=True
                        )
                        self._entries[version] = e
                        self._newest = doc.newest
                        self._disk.add(stored.disk_nbytes)
                        self._publishes += 1
                        if res is not None:
                            self._offer_locked(e, res, rebuild_cost=self._rebuild_cost_locked(e))
                        if patch is not None and stored.kind == "patch":
                            self._offer_locked(e, patch, rebuild_cost=self._patch_cost_locked(e))
        except BaseException:
            final.unlink(missing_ok=True)
            raise
        if existing is not None:
            final.unlink(missing_ok=True)
            return self._same_or_conflict(version, sha, existing)
        logger.info(
            "published version %d as a %s (sha256 %s, %d bytes on disk)",
            version,
            stored.kind,
            sha,
            stored.disk_nbytes,
        )
        self._retain()
        return PublishOutcome(version, sha, created, stored.nbytes, stored.kind)

    # -- patches ----------------------------------------------------------------------------
    def _patches_on(self) -> bool:
        return self._keyframe_every > 1

    def _parent_missing(self, version: int, parent: int, why: str) -> ParentMissing:
        rng = self._retained_locked()
        return ParentMissing(
            f"the delta for policy_version {version} is against parent {parent}, which {why}; "
            "publish the full weights instead (Client.publish(..., fallback_full=True) does)",
            parameter="parent",
            details={"parent": parent, "retained": list(rng) if rng else None},
        )

    def _publish_buffered(
        self, version: int, sources: Mapping[str, persist.TensorSource], expected: str | None
    ) -> PublishOutcome:  # pragma: no cover - the deltas layer provides it
        """Full weights read into memory, diffed against the newest version (``deltas``)."""
        raise NotImplementedError

    @property
    def staging_dir(self) -> Path:
        """Where uploads are streamed before ``publish_file(..., move=True)`` (same
        filesystem, so the move is a rename; leftovers are cleared when the store opens)."""
        d = self._root / persist.INCOMING
        d.mkdir(exist_ok=True)
        return d
