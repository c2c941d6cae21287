"""Delta publishing, and storing any new version as a patch or a keyframe.

In: a delta file (the ``oldlogit._delta`` format: changed elements only) and the parent it was
made against, or full weights to diff against the newest version. Out: the new weights, hashed
and checked before anything is written, stored as the keyframe policy says. A parent this store
does not retain, or retains with other weights, is ``ParentMissing``: the client then sends
full weights.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from oldlogit._delta import bits_view
from oldlogit.errors import InvalidRequest, NotFound, VersionEvicted, WeightsMismatch
from oldlogit.weights import DTYPE_ITEMSIZE, read_safetensors_header
from oldlogit_service.snapshots import buffers, codec, persist
from oldlogit_service.snapshots.core import check_sha, check_version
from oldlogit_service.snapshots.publishing import Publishing
from oldlogit_service.snapshots.records import PublishOutcome
from oldlogit_service.snapshots.residency import Resident

logger = logging.getLogger(__name__)

__all__ = ["Deltas"]


class Deltas(Publishing):
    def publish_delta(
        self,
        version: int,
        path: Path | str,
        *,
        parent: int | None = None,
        expected_sha256: str | None = None,
    ) -> PublishOutcome:
        """Publish from a delta file (the ``oldlogit._delta`` format) against a retained parent.

        The parent is ``parent``, else the file's ``parent`` metadata, else the newest retained
        version; a parent not retained here (or whose weight hash differs from the file's
        ``parent_sha256``) is ``ParentMissing``. The rebuilt weights are hashed and checked
        against ``expected_sha256`` and the file's ``sha256`` before anything is written.
        """
        version = check_version(version)
        expected = check_sha(expected_sha256)
        if parent is not None:
            parent = check_version(parent, "parent")
        self._check_open()
        header = read_safetensors_header(Path(path))
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
            self._check_expected(meta_sha, expected)
        expected = expected or meta_sha
        with self._lock:
            existing = self._precheck_locked(version)
            if parent is None and self._entries:
                parent = max(self._entries)
            pe = None if parent is None else self._entries.get(parent)
            if existing is None and (pe is None or parent is None or parent >= version):
                why = (
                    "was never published here"
                    if parent not in self._tombstones
                    else ("is no longer retained")
                )
                raise self._parent_missing(version, -1 if parent is None else parent, why)
        if existing is not None and expected is not None:
            return self._same_or_conflict(version, expected, existing)
        assert parent is not None
        their = meta.get("parent_sha256")
        if pe is not None and their and their != pe.stored.sha256:
            with self._lock:
                raise self._parent_missing(
                    version,
                    parent,
                    f"has weight sha256 {pe.stored.sha256} here, not {their} as the delta "
                    "was made against",
                )
        buf, _ = persist.read_keyframe(Path(path), pin=False, expect_sha256=None)
        patch = codec.parse_patch(header, buf.numpy(), self._specs)
        try:
            with self._cpu_weights(parent) as base:
                assert base.buffer is not None
                n = self._snapshot_nbytes
                out = buffers.alloc_buffer(n, pin=self._pin_host)  # [nbytes]
                codec.rebuild(out.numpy(), base.layout, [patch], base=base.buffer.numpy())
                layout = base.layout
        except (NotFound, VersionEvicted) as exc:
            with self._lock:
                raise self._parent_missing(version, parent, "is no longer retained") from exc
        sha = buffers.hash_buffer(out.numpy(), layout)
        self._check_expected(sha, expected)
        if existing is not None:
            return self._same_or_conflict(version, sha, existing)
        res = Resident(out, layout, persist.tensor_views(out, layout), self._snapshot_nbytes)
        out_ = self._store_version(version, sha, res, parent=parent, patch=patch)
        self._after_op()
        return out_

    @staticmethod
    def _bits(res: Resident) -> dict[str, Any]:
        assert res.buffer is not None
        data = res.buffer.numpy()
        return {
            e.name: bits_view(data[e.begin : e.end], DTYPE_ITEMSIZE[e.dtype]) for e in res.layout
        }

    def _publish_buffered(
        self, version: int, sources: Mapping[str, persist.TensorSource], expected: str | None
    ) -> PublishOutcome:
        """Full weights, read into memory once: hashed, diffed against the newest retained
        version, stored as a patch or a keyframe."""
        retried = self._if_retry(version, sources, expected)
        if retried is not None:
            return retried
        buf, layout, sha = buffers.buffer_from_sources(sources, pin=self._pin_host)
        self._check_expected(sha, expected)
        res = Resident(buf, layout, persist.tensor_views(buf, layout), self._snapshot_nbytes)
        with self._lock:
            parent = max(self._entries) if self._entries else None
        return self._store_version(version, sha, res, parent=parent, patch=None)

    def _store_version(
        self,
        version: int,
        sha: str,
        res: Resident,
        *,
        parent: int | None,
        patch: codec.Patch | None,
    ) -> PublishOutcome:
        due = True
        if parent is not None and self._patches_on():
            if patch is None:
                try:
                    with self._cpu_weights(parent) as base:
                        patch = codec.diff(self._bits(base), self._bits(res))
                except (NotFound, VersionEvicted):  # deleted meanwhile: store it whole
                    patch = None
            if patch is not None:
                with self._lock:
                    pe = self._entries.get(parent)
                    due = pe is None or self._keyframe_due_locked(pe, self._patch_nbytes(patch))
        try:
            if not due:
                assert parent is not None and patch is not None
                stored = self._write_patch(version, parent, patch, sha, self._clock())
            else:
                stored = self._write_buffer_keyframe(version, res, sha)
        except OSError as exc:
            self._raise_if_disk_full(exc)
            raise
        return self._commit_stored(stored, res, patch)

    def _write_buffer_keyframe(
        self, version: int, res: Resident, sha: str
    ) -> persist.StoredVersion:
        assert res.buffer is not None
        data = res.buffer.numpy()
        sources = {
            e.name: persist.TensorSource(
                e.name, e.dtype, e.shape, functools.partial(_slice, data, e.begin, e.end)
            )
            for e in res.layout
        }
        tmp = persist.temp_path(self._weights_dir)
        name = persist.keyframe_name(version)
        try:
            written = persist.write_keyframe(tmp, sources)
            if written != sha:  # the buffer changed under us: never store what was not checked
                raise WeightsMismatch("the weights changed while being stored", parameter="weights")
            persist.durable_rename(tmp, self._weights_dir / name)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return persist.StoredVersion(version, sha, self._snapshot_nbytes, name, self._clock())


def _slice(data: Any, begin: int, end: int) -> list[memoryview]:
    return [memoryview(data[begin:end])]
