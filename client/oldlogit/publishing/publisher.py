"""What ``Client.publish`` does: pick the stream a version travels as, hash it, upload it.

In: a version's weights (a state dict, a safetensors file or shard directory, or a path the
service reads itself) and ``AsyncClient.publish``'s options; out: the service's
``PublishResult``. Owns what publishing remembers between calls: the weights last published
with ``delta=True`` (a ``WeightsCopy``, the next delta's parent) and the model's weight layout
(fetched once through ``info``). Calls go through the client's ``TransportPool``, routed by the
version, under the client's ``publish_timeout_s``; the session calls are ``sessions``. Reads
weights on worker threads; never imports torch.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from oldlogit.contract import safetensors
from oldlogit.contract.convert import PublishHeader
from oldlogit.contract.errors import (
    Forbidden,
    InvalidRequest,
    OldLogitError,
    ParentMissing,
    TlsError,
    Unauthorized,
    UnknownVersion,
    VersionEvicted,
    WeightsMismatch,
)
from oldlogit.contract.layout import WeightLayout
from oldlogit.contract.types import Info, PublishResult
from oldlogit.publishing.adapters import AdapterUpload
from oldlogit.publishing.sessions import Sessions
from oldlogit.publishing.streams import (
    SafetensorsStream,
    WeightsCopy,
    aiter_in_thread,
    progress_bar,
)

if TYPE_CHECKING:
    from oldlogit.transport.base import Transport
    from oldlogit.transport.pool import TransportPool

__all__ = ["Publisher"]

logger = logging.getLogger(__name__)

Weights = Mapping[str, Any] | str | os.PathLike[str]


class Publisher:
    """One client's publishing: ``publish``, ``upload``, the weight layout and ``sessions``.

    ``info``: the client's ``info()`` (the layout comes from it); ``timeout_s``: the deadline
    of every upload and commit (None: none, uploads take what they take).
    """

    def __init__(
        self,
        pool: TransportPool,
        info: Callable[[], Awaitable[Info]],
        *,
        timeout_s: float | None,
    ) -> None:
        self._pool = pool
        self._info = info
        self._timeout_s = timeout_s
        self._layout: WeightLayout | None = None
        # The weights of the last publish(..., delta=True): the next delta's parent.
        self._last_published: WeightsCopy | None = None
        self.sessions = Sessions(pool, self.weight_layout, timeout_s=timeout_s)

    async def weight_layout(self) -> WeightLayout:
        """The model's weight layout, fetched once."""
        if self._layout is None:
            self._layout = (await self._info()).weight_layout()
        return self._layout

    async def publish(
        self,
        policy_version: int,
        weights: Weights,
        *,
        delta: bool,
        sha256: str | None,
        by_path: bool,
        progress: bool,
        fallback_full: bool,
        cast: bool,
    ) -> PublishResult:
        """See ``AsyncClient.publish``: by path, as a delta, or the full weights."""
        if by_path:
            return await self._by_path(policy_version, weights, sha256, delta=delta)
        layout = await self._layout_or_none()
        if delta:
            return await self._delta(
                policy_version,
                weights,
                layout,
                sha256,
                progress=progress,
                fallback_full=fallback_full,
                cast=cast,
            )
        return await self._full(policy_version, weights, layout, sha256, progress, cast=cast)

    async def upload(
        self,
        policy_version: int,
        stream: safetensors.SafetensorsStream,
        sha256: str,
        progress: bool,
        *,
        parent: int | None = None,
        base_version: int | None = None,
    ) -> PublishResult:
        """Stream one safetensors body (full weights, a delta against ``parent``, or an
        adapter over ``base_version``); a retry uploads it again from its first byte."""
        header = PublishHeader(
            policy_version,
            sha256,
            delta=parent is not None,
            parent=parent,
            total_bytes=stream.total_bytes,
            base_version=base_version,
        )
        bar = progress_bar(progress, stream.total_bytes, f"publish v{policy_version}")

        async def op(t: Transport, remaining: float | None) -> PublishResult:
            if bar is not None:
                bar.reset(total=stream.total_bytes)  # a retry starts the upload again
            return await t.publish(header, aiter_in_thread(stream.chunks(), bar), remaining)

        try:
            return await self._pool.call(op, timeout_s=self._timeout_s, key=policy_version)
        finally:
            if bar is not None:
                bar.close()

    async def publish_adapter(
        self,
        policy_version: int,
        adapter: AdapterUpload,
        *,
        base_version: int,
        sha256: str | None,
        progress: bool,
    ) -> PublishResult:
        """See ``AsyncClient.publish_adapter``: hashed over the base's weight hash (asked of
        the service), then uploaded; the service checks and hashes it again."""
        try:
            base = await self._pool.call(
                lambda t, rem: t.get_version(base_version, rem), key=base_version
            )
        except (UnknownVersion, VersionEvicted) as exc:
            raise type(exc)(
                f"base_version {base_version}: {exc.message}",
                parameter="base_version",
                details=exc.details,
            ) from exc
        if base.adapter_of is not None:
            raise InvalidRequest(
                f"base_version {base_version} is itself an adapter version (over "
                f"{base.adapter_of}); an adapter applies to full weights",
                parameter="base_version",
            )
        ours = await asyncio.to_thread(adapter.sha256, base.weight_sha256)
        if sha256 is not None and sha256.lower() != ours:
            raise WeightsMismatch(
                f"the adapter hashes to {ours}, not the given sha256 {sha256}", parameter="sha256"
            )
        return await self.upload(
            policy_version, adapter.stream, ours, progress, base_version=base_version
        )

    # -- the three ways a version travels ----------------------------------------------------

    async def _by_path(
        self, policy_version: int, weights: Weights, sha256: str | None, *, delta: bool
    ) -> PublishResult:
        """The service reads the path itself; the client never opens the files."""
        if isinstance(weights, Mapping):
            raise InvalidRequest("by_path=True needs a path, not a state dict", parameter="weights")
        path = os.fspath(weights)
        header = PublishHeader(policy_version, sha256, delta=delta)
        return await self._pool.call(
            lambda t, rem: t.publish_by_path(header, path, rem),
            timeout_s=self._timeout_s,
            key=policy_version,
        )

    async def _delta(
        self,
        policy_version: int,
        weights: Weights,
        layout: WeightLayout | None,
        sha256: str | None,
        *,
        progress: bool,
        fallback_full: bool,
        cast: bool,
    ) -> PublishResult:
        """Only what changed since the last delta publish (everything the first time, or when
        the tensors differ from the parent's); the copy becomes the next delta's parent."""
        new = await asyncio.to_thread(WeightsCopy.read, weights, layout, cast=cast)
        parent = self._last_published
        if sha256 is not None and sha256.lower() != new.sha256:
            raise WeightsMismatch(
                f"the weights hash to {new.sha256}, not the given sha256 {sha256}",
                parameter="sha256",
            )
        if parent is None or not parent.matches(new):
            logger.info("publish v%d: no earlier weights to diff against", policy_version)
            res = await self.upload(policy_version, new.full_stream(), new.sha256, progress)
        else:
            stream = await asyncio.to_thread(new.delta_stream, parent)
            try:
                res = await self.upload(
                    policy_version, stream, new.sha256, progress, parent=parent.policy_version
                )
            except ParentMissing:
                if not fallback_full:
                    raise
                logger.info("publish v%d: parent missing, sending full", policy_version)
                res = await self.upload(policy_version, new.full_stream(), new.sha256, progress)
        self._last_published = new.published(policy_version)
        return res

    async def _full(
        self,
        policy_version: int,
        weights: Weights,
        layout: WeightLayout | None,
        sha256: str | None,
        progress: bool,
        *,
        cast: bool,
    ) -> PublishResult:
        """The whole weights, streamed tensor by tensor; hashed first unless ``sha256`` is
        given (the service verifies it either way)."""
        if isinstance(weights, Mapping):
            stream = SafetensorsStream.from_state_dict(weights, layout, cast=cast)
        else:
            stream = await asyncio.to_thread(
                SafetensorsStream.from_path, Path(weights), layout, cast=cast
            )
        if sha256 is None:
            bar = progress_bar(progress, stream.data_bytes, f"hash v{policy_version}")
            try:
                sha256 = await asyncio.to_thread(stream.sha256, bar)
            finally:
                if bar is not None:
                    bar.close()
        return await self.upload(policy_version, stream, sha256, progress)

    async def _layout_or_none(self) -> WeightLayout | None:
        """The layout for a publish; None when ``info`` fails for any reason but auth or TLS
        (the upload then goes under the names given, and the service checks them)."""
        try:
            return await self.weight_layout()
        except (Unauthorized, Forbidden, TlsError):
            raise
        except OldLogitError as exc:
            logger.warning("publish: no weight layout from the service (%s); names as given", exc)
            return None
