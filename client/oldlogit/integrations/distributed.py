"""Publishing from several ranks: FSDP2/DTensor or per-rank state dicts, one version.

In: on *every* rank of a ``torch.distributed`` group, the same call with that rank's state
dict — an FSDP2 ``model.state_dict()`` (DTensor values: every rank holds every name) or the
tensors the rank owns (plain values: disjoint names across ranks). Out: the version's
``PublishResult`` on every rank, or the same failure raised on every rank. The protocol is a
publish session (docs/multi-rank-publishing.md):

- rank 0 opens the session and broadcasts its id;
- DTensor state: canonical tensors are owned round-robin by sorted name; every rank takes part
  in gathering each one (``full_tensor()``, one at a time, in the same order everywhere) and only
  its owner keeps it — streamed straight into its part (full publish: a few tensors in memory)
  or into the rank's copy of its share (delta: one copy of the weights across all ranks);
- plain state: each rank sends what it holds;
- the ranks agree (all-reduce) that every part is staged before any commits; a failure on any
  rank aborts the session and raises everywhere. The last commit publishes the version.
Imports torch (this module only).
"""

from __future__ import annotations

import json
import math
import queue
import threading
import uuid
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from oldlogit.contract.delta import FORMAT, bits_view
from oldlogit.contract.errors import Conflict, InvalidRequest, OldLogitError, Unavailable
from oldlogit.contract.layout import WeightLayout, check_tied
from oldlogit.contract.safetensors import TensorSource, check_dtype, coalesce
from oldlogit.contract.types import PublishResult
from oldlogit.contract.weights import (
    DTYPE_ITEMSIZE,
    WeightHasher,
    dtype_name,
    tensor_raw_bytes,
    torch_dtype,
)
from oldlogit.publishing.sources import is_dtensor, same_state_tensors
from oldlogit.publishing.streams import SafetensorsStream, WeightsCopy

__all__ = ["ShardedPublisher", "publish_sharded"]

_QUEUE_TENSORS = 2  # gathered tensors waiting for the upload: the memory bound of a full part


class ShardedPublisher:
    """Publishes versions from every rank of ``group``.

    ``client``: this rank's ``oldlogit.Client`` (each rank uploads its own part). ``deltas``:
    keep each rank's share of the last published weights on its CPU (one copy of the weights
    across the ranks) so ``publish(..., delta=True)`` sends only changes; without it a full
    publish of DTensors streams its part with a few tensors in memory. ``cast``: cast floating
    tensors to the serving dtype. ``ttl_s``: the session's idle limit.
    """

    def __init__(
        self,
        client: Any,
        *,
        group: Any = None,
        deltas: bool = True,
        cast: bool = False,
        ttl_s: float | None = None,
    ) -> None:
        self.client = client
        self.group = group
        self.deltas = deltas
        self.cast = cast
        self.ttl_s = ttl_s
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self._share: WeightsCopy | None = None  # this rank's tensors as last published

    def publish(
        self, policy_version: int, state_dict: Mapping[str, Any], *, delta: bool = False
    ) -> PublishResult:
        """Publish ``state_dict`` (this rank's) as ``policy_version``; call on every rank.

        ``delta=True`` sends only what changed since this publisher's last publish, against
        that version (the first publish sends everything).
        """
        if delta and not self.deltas:
            raise InvalidRequest("this publisher keeps no share: deltas=False", parameter="delta")
        parent = self._share if delta else None
        layout: WeightLayout | None = None
        try:
            layout = self.client.weight_layout()
            error = None
        except OldLogitError as exc:
            error = exc
        self._agree(None, policy_version, error)  # every rank reaches the service, or none goes on
        assert layout is not None
        sid = self._open(policy_version, parent)
        sha, share = "", None
        try:
            if any(is_dtensor(v) for v in state_dict.values()):
                sha, share = self._gathered(sid, policy_version, state_dict, layout, parent)
            else:
                sha, share = self._own(sid, policy_version, state_dict, layout, parent)
        except OldLogitError as exc:
            error = exc
        except Exception as exc:  # a local failure must not leave the other ranks waiting
            error = Unavailable(f"rank {self.rank}: {type(exc).__name__}: {exc}")
        self._agree(sid, policy_version, error)  # every part is staged before any commit
        try:
            self.client.commit_part(sid, self.rank, sha, policy_version=policy_version)
        except OldLogitError as exc:
            error = exc
        self._agree(sid, policy_version, error)
        info = self.client.session(sid, policy_version=policy_version)
        if info.state != "published" or info.result is None:
            raise Conflict(
                f"the publish session for policy_version {policy_version} ended "
                f"{info.state}: {info.error}",
                parameter="policy_version",
            )
        self._share = share.published(policy_version) if share is not None else None
        result: PublishResult = info.result
        return result

    # -- steps -----------------------------------------------------------------------------
    def _open(self, version: int, parent: WeightsCopy | None) -> str:
        """Rank 0 opens the session; every rank learns its id (or rank 0's error)."""
        box: list[Any] = [None]
        if self.rank == 0:
            sid = uuid.uuid4().hex
            try:
                self.client.open_session(
                    sid,
                    version,
                    self.world,
                    delta=parent is not None,
                    parent=None if parent is None else parent.policy_version,
                    ttl_s=self.ttl_s,
                )
                box[0] = sid
            except OldLogitError as exc:
                box[0] = exc
        src = 0 if self.group is None else dist.get_global_rank(self.group, 0)
        dist.broadcast_object_list(box, src=src, group=self.group)
        if isinstance(box[0], OldLogitError):
            raise box[0]
        return str(box[0])

    def _agree(self, sid: str | None, version: int, error: OldLogitError | None) -> None:
        """Every rank succeeded so far, or the session (if any) is aborted and every rank
        raises: its own error, or a ``Conflict`` naming the rank that failed."""
        errors: list[Any] = [None] * self.world
        mine = None if error is None else (self.rank, error.code, error.message)
        dist.all_gather_object(errors, mine, group=self.group)
        failed = [e for e in errors if e is not None]
        if not failed:
            return
        if self.rank == 0 and sid is not None:
            try:
                self.client.abort_session(sid, policy_version=version)
            except OldLogitError:
                pass  # the session may be gone with its replica: nothing was published
        if error is not None:
            raise error
        rank, code, message = failed[0]
        raise Conflict(
            f"the publish of policy_version {version} was aborted: rank {rank} failed "
            f"({code}: {message})",
            parameter="policy_version",
        )

    def _own(
        self,
        sid: str,
        version: int,
        state: Mapping[str, Any],
        layout: WeightLayout,
        parent: WeightsCopy | None,
    ) -> tuple[str, WeightsCopy | None]:
        """Plain tensors: this rank's share as it holds it."""
        if not self.deltas:
            stream = SafetensorsStream.from_state_dict(state, layout, cast=self.cast, partial=True)
            sha = stream.sha256()
            self._upload(sid, version, stream)
            return sha, None
        share = WeightsCopy.read(state, layout, cast=self.cast, partial=True)
        self._upload(sid, version, self._part(share, parent))
        return share.sha256, share

    def _part(self, share: WeightsCopy, parent: WeightsCopy | None) -> SafetensorsStream:
        if parent is None:
            return share.full_stream()
        if not share.matches(parent):
            raise InvalidRequest(
                f"rank {self.rank} holds other tensors than at its last publish: publish full",
                parameter="delta",
            )
        meta = {"format": FORMAT, "owned": json.dumps(sorted(share.tensors))}
        return share.delta_stream(parent, meta)

    def _upload(self, sid: str, version: int, stream: SafetensorsStream) -> None:
        self.client.upload_part(
            sid, self.rank, stream.chunks(), stream.total_bytes, policy_version=version
        )

    def _gathered(
        self,
        sid: str,
        version: int,
        state: Mapping[str, Any],
        layout: WeightLayout,
        parent: WeightsCopy | None,
    ) -> tuple[str, WeightsCopy | None]:
        """DTensor state: every rank gathers every tensor in order; its owner keeps it."""
        assembly = layout.assemble(state)
        # Whole tensors compared on every rank alike (the same collectives, the same answer).
        check_tied(assembly, lambda a, b: same_state_tensors(state[a], state[b], gather=True))
        names = sorted(assembly.parts)
        owned = {n: layout.specs[n] for i, n in enumerate(names) if i % self.world == self.rank}
        target = {
            n: check_dtype(layout, n, dtype_name(state[assembly.parts[n][0]]), self.cast, "weights")
            or spec[0]
            for n, spec in owned.items()
        }

        def gather(name: str) -> torch.Tensor | None:
            pieces = []
            for part in assembly.parts[name]:
                t = state[part]
                full = t.full_tensor() if is_dtensor(t) else t  # a collective for a DTensor
                pieces.append(full.detach().reshape(-1))
            if name not in owned:
                return None
            whole = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
            return whole.to(torch_dtype(target[name])).cpu()

        if not self.deltas:
            return self._streamed(sid, version, names, owned, target, gather), None
        bits: dict[str, tuple[str, tuple[int, ...], Any]] = {}
        for name in names:
            t = gather(name)
            if t is not None:
                raw = np.frombuffer(tensor_raw_bytes(t), np.uint8).copy()
                bits[name] = (target[name], owned[name][1], bits_view(raw, t.element_size()))
        share = _copy_of(bits)
        self._upload(sid, version, self._part(share, parent))
        return share.sha256, share

    def _streamed(
        self,
        sid: str,
        version: int,
        names: list[str],
        owned: Mapping[str, tuple[str, tuple[int, ...]]],
        target: Mapping[str, str],
        gather: Any,
    ) -> str:
        """A full part streamed while the tensors are gathered: a few tensors in memory."""

        def nothing(_: Any) -> list[bytes]:
            return []

        sources = [
            TensorSource(
                n, target[n], spec[1], math.prod(spec[1]) * DTYPE_ITEMSIZE[target[n]], nothing
            )
            for n, spec in owned.items()
        ]
        layout_only = SafetensorsStream(sources)  # its header and size; the bytes come below
        q: queue.Queue[Any] = queue.Queue(maxsize=_QUEUE_TENSORS)
        done = threading.Event()
        hasher = WeightHasher()
        failure: list[BaseException] = []

        def put(item: Any) -> None:
            while not done.is_set():
                try:
                    q.put(item, timeout=0.1)
                    return
                except queue.Full:
                    continue

        def produce() -> None:
            try:
                for name in names:  # every rank, every tensor, the same order: collectives
                    t = gather(name)
                    if t is None:
                        continue
                    data = tensor_raw_bytes(t)
                    hasher.begin(name, target[name], owned[name][1])
                    hasher.update(data)
                    put(data)
            except BaseException as exc:
                failure.append(exc)
            finally:
                put(None)

        def chunks() -> Iterator[bytes]:
            def pieces() -> Iterator[bytes | memoryview]:
                yield layout_only.header
                while (item := q.get()) is not None:
                    yield item

            yield from coalesce(pieces(), 4 * 1024 * 1024)

        producer = threading.Thread(target=produce, name="oldlogit-gather", daemon=True)
        producer.start()
        try:
            self.client.upload_part(
                sid, self.rank, chunks(), layout_only.total_bytes, policy_version=version
            )
        finally:
            done.set()  # the upload is over (or failed): the gathers go on, unsent
            producer.join()
        if failure:
            raise failure[0]
        return hasher.hexdigest()


def _copy_of(bits: Mapping[str, tuple[str, tuple[int, ...], Any]]) -> WeightsCopy:
    hasher = WeightHasher()
    for name in sorted(bits):
        dt, shape, b = bits[name]
        hasher.begin(name, dt, shape)
        hasher.update(np.ascontiguousarray(b).view(np.uint8).data)
    return WeightsCopy(-1, hasher.hexdigest(), dict(bits))


def publish_sharded(
    client: Any,
    policy_version: int,
    state_dict: Mapping[str, Any],
    *,
    group: Any = None,
    cast: bool = False,
) -> PublishResult:
    """One full publish from every rank of ``group``, streamed with a few tensors in memory
    (``ShardedPublisher`` keeps shares for deltas)."""
    publisher = ShardedPublisher(client, group=group, deltas=False, cast=cast)
    return publisher.publish(policy_version, state_dict)
