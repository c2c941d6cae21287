"""Delta publishing: a delta upload against a retained parent becomes a version.

In: a delta file (the ``oldlogit._delta`` format: changed elements only) and the parent it was
made against. Out: the rebuilt weights, hashed and checked before anything is written, stored
as the keyframe policy says (``Publishing._store_version``). A parent this store does not
retain, or retains with other weights, is ``ParentMissing``: the client then sends full weights.
"""

from __future__ import annotations

import logging
from pathlib import Path

from oldlogit.errors import InvalidRequest, NotFound, VersionEvicted
from oldlogit.weights import read_safetensors_header
from oldlogit_service.snapshots import codec, persist
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
                out = persist.alloc_buffer(n, pin=self._pin_host)  # [nbytes]
                codec.rebuild(out.numpy(), base.layout, [patch], base=base.buffer.numpy())
                layout = base.layout
        except (NotFound, VersionEvicted) as exc:
            with self._lock:
                raise self._parent_missing(version, parent, "is no longer retained") from exc
        sha = persist.hash_buffer(out.numpy(), layout)
        self._check_expected(sha, expected)
        if existing is not None:
            return self._same_or_conflict(version, sha, existing)
        res = Resident(out, layout, persist.tensor_views(out, layout), self._snapshot_nbytes)
        out_ = self._store_version(version, sha, res, parent=parent, patch=patch)
        self._after_op()
        return out_
