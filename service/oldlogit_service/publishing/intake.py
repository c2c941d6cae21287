"""Every way a version comes in, behind one async object both transports call.

In: an upload stream (full or delta), a path under a publish root, a state dict (in process),
or a multi-rank session's calls (open, stage a part, commit, get, abort). Out: a
``PublishResult`` or ``SessionInfo`` once the snapshot store has verified, persisted and
registered the version — the store's public publish calls are the only way in, so a version is
checked the same way however it arrived. Blocking work (disk, hashing) runs in threads. Each
publish is counted in the metrics, then the EWMA proxy (when on) folds the new version in.
Knows nothing of HTTP, gRPC or the scheduler.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any, TypeVar

import torch

from oldlogit.contract.convert import PublishHeader
from oldlogit.contract.errors import InvalidRequest, OldLogitError
from oldlogit.contract.types import OpenSession, PublishResult, SessionInfo
from oldlogit_service.config import Settings
from oldlogit_service.metrics import Metrics
from oldlogit_service.model.checkpoints import canonical_file
from oldlogit_service.model.ewma import EwmaProxy
from oldlogit_service.model.loaded import LoadedModel
from oldlogit_service.publishing.sessions import Sessions
from oldlogit_service.publishing.uploads import receive_upload, resolve_publish_path
from oldlogit_service.snapshots import SnapshotStore, check_version

logger = logging.getLogger(__name__)

__all__ = ["Intake"]

T = TypeVar("T")


class Intake:
    """Uploads, publishes by path and multi-rank sessions of one replica."""

    def __init__(
        self,
        settings: Settings,
        model: LoadedModel,
        store: SnapshotStore,
        metrics: Metrics,
        ewma: EwmaProxy | None = None,
    ) -> None:
        self.settings = settings
        self.model = model
        self.store = store
        self.metrics = metrics
        self.ewma = ewma
        # Multi-rank publishes: parts staged here, the last commit publishes like any upload.
        self.sessions = Sessions(store, model.param_specs, publish=self.publish_now)

    @property
    def upload_limit_bytes(self) -> int:
        return int(self.settings.max_upload_gib * 1024**3)

    # -- one version from one source ------------------------------------------------------
    async def publish_stream(
        self, header: PublishHeader, chunks: AsyncIterator[bytes], *, parameter: str = "body"
    ) -> PublishResult:
        """The one upload path of both transports: a safetensors body (``header.delta``: the
        changed elements against ``header.parent``; ``header.base_version``: an adapter's
        tensors over that base) streamed to the staging directory (same
        filesystem as the store, so a full publish is a rename), within the upload limit, then
        published."""
        version, sha256, parent = header.policy_version, header.sha256, header.parent
        tmp = self.store.staging_dir / f"upload-{version}-{uuid.uuid4().hex}.safetensors.part"
        try:
            await receive_upload(
                chunks, tmp, limit_bytes=self.upload_limit_bytes, parameter=parameter
            )
            base = header.base_version
            if base is not None:  # an adapter's LoRA tensors over ``base``
                return await self._publish(
                    lambda: self.store.publish_adapter(
                        version, tmp, base_version=base, expected_sha256=sha256
                    )
                )
            if header.delta:
                return await self._publish(
                    lambda: self.store.publish_delta(
                        version, tmp, parent=parent, expected_sha256=sha256
                    )
                )
            return await self._publish(
                lambda: self.store.publish_file(version, tmp, expected_sha256=sha256, move=True)
            )
        finally:
            if tmp.exists():
                await asyncio.to_thread(os.unlink, tmp)

    async def publish_weights(
        self, version: int, weights: Mapping[str, torch.Tensor], *, sha256: str | None
    ) -> PublishResult:
        """In-process publish of a state dict (tests, embedding)."""
        check_version(version)
        return await self._publish(
            lambda: self.store.publish(version, weights, expected_sha256=sha256)
        )

    async def publish_path(self, header: PublishHeader, path: str) -> PublishResult:
        """Publish from storage the service can read, only under the configured roots
        (``header.delta``: the path holds a delta file against ``header.parent``)."""
        version, sha256, parent = header.policy_version, header.sha256, header.parent
        target = await asyncio.to_thread(resolve_publish_path, path, self.settings.publish_roots)
        if header.base_version is not None:
            raise InvalidRequest(
                "an adapter is published by upload (Client.publish_adapter), not by path",
                parameter="base_version",
            )
        if header.delta:
            if not target.is_file():
                raise InvalidRequest(
                    f"path {path!r}: a delta is one safetensors file", parameter="path"
                )
            return await self._publish(
                lambda: self.store.publish_delta(
                    version, target, parent=parent, expected_sha256=sha256
                )
            )
        # A hub checkpoint's layout (per-expert tensors, tied duplicates) → canonical names.
        staged = await asyncio.to_thread(
            canonical_file, target, self.model.layout, self.store.staging_dir
        )
        if staged is not None:
            try:
                return await self._publish(
                    lambda: self.store.publish_file(
                        version, staged, expected_sha256=sha256, move=True
                    )
                )
            finally:
                staged.unlink(missing_ok=True)
        return await self._publish(
            lambda: self.store.publish(version, target, expected_sha256=sha256)
        )

    async def _publish(self, do: Callable[[], Any]) -> PublishResult:
        return await asyncio.to_thread(self.publish_now, do)

    def publish_now(self, do: Callable[[], Any]) -> PublishResult:
        """Run one store publish (blocking): metrics, then the proxy policy folds it in."""
        start = time.perf_counter()
        code = "ok"
        try:
            out = do()
        except OldLogitError as exc:
            code = exc.code
            raise
        except Exception:
            code = "internal"
            raise
        finally:
            self.metrics.publishes.labels(code).inc()
            self.metrics.publish_seconds.labels(code).observe(time.perf_counter() - start)
        if self.ewma is not None:
            try:  # the version is visible already; a failed fold is retried on the next publish
                self.ewma.catch_up(self.store)
            except Exception:
                logger.exception("ewma: folding in version %s failed", out.version)
        return PublishResult(
            policy_version=int(out.version),
            weight_sha256=str(out.sha256),
            created=bool(out.created),
            nbytes=int(out.nbytes),
            kind=str(out.kind),
        )

    # -- multi-rank publish sessions ------------------------------------------------------
    async def open_session(self, request: OpenSession) -> SessionInfo:
        return await asyncio.to_thread(self.sessions.open, request)

    async def stage_part(
        self, session_id: str, rank: int, chunks: AsyncIterator[bytes], *, parameter: str = "body"
    ) -> SessionInfo:
        """One rank's part, streamed like an upload into the session's directory, then checked
        against the model (names, dtypes, shapes) and hashed."""
        path = await asyncio.to_thread(self.sessions.part_path, session_id, rank)
        try:
            await receive_upload(
                chunks, path, limit_bytes=self.upload_limit_bytes, parameter=parameter
            )
            return await asyncio.to_thread(self.sessions.stage, session_id, rank, path)
        finally:
            await asyncio.to_thread(path.unlink, True)

    async def commit_part(self, session_id: str, rank: int, sha256: str) -> SessionInfo:
        """Commit a staged part; the last commit publishes the version (in this call)."""
        return await asyncio.to_thread(self.sessions.commit, session_id, rank, sha256)

    async def get_session(self, session_id: str) -> SessionInfo:
        return await asyncio.to_thread(self.sessions.get, session_id)

    async def abort_session(self, session_id: str) -> SessionInfo:
        return await asyncio.to_thread(self.sessions.abort, session_id)
