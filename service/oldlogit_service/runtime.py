"""The one runtime object both transports call: logprobs, publish, versions, leases, info.

In: contract types (``oldlogit.types``). Out: contract types, or errors of the tree. Flow of a
logprobs call: validate/plan → resolve each version's weight hash → result cache → scheduler
(version-aware batches) → stitch per sequence. Nothing here knows HTTP or gRPC.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import math
import time
from collections.abc import Mapping
from collections.abc import Set as AbstractSet
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from oldlogit.errors import (
    DeadlineExceeded,
    Forbidden,
    InvalidRequest,
    OldLogitError,
    Unauthorized,
    Unavailable,
)
from oldlogit.types import (
    Info,
    LeaseInfo,
    LogprobsRequest,
    LogprobsResponse,
    PublishResult,
    SequenceResult,
    VersionInfo,
)
from oldlogit_service import __version__
from oldlogit_service.cache import ResultCache
from oldlogit_service.checkpoints import canonical_file
from oldlogit_service.cluster import Cluster
from oldlogit_service.config import Settings
from oldlogit_service.engine import Engine, Job, SamplingParams
from oldlogit_service.ewma import EwmaProxy, resolve_hashes
from oldlogit_service.history import History
from oldlogit_service.metrics import Metrics
from oldlogit_service.model import LoadedModel, weight_layout_info
from oldlogit_service.scheduler import BatchPolicy, Scheduler
from oldlogit_service.snapshots import SnapshotStore
from oldlogit_service.snapshots.core import check_version
from oldlogit_service.validate import Limits, SequencePlan, plan_request

logger = logging.getLogger(__name__)

_LOOPBACK = ("127.", "::1", "localhost", "unix:")


@dataclass
class _Pending:
    plan: SequencePlan
    version: int
    positions: npt.NDArray[np.int64]
    key: bytes | None
    value: npt.NDArray[np.float32] | None = None
    future: Future[npt.NDArray[np.float32]] | None = None


def _record_to_info(rec: Any) -> VersionInfo:
    return VersionInfo(
        policy_version=int(rec.version),
        weight_sha256=str(rec.sha256),
        nbytes=int(rec.nbytes),
        tiers=sorted(str(t) for t in rec.tiers),
        kind=str(getattr(rec, "kind", "keyframe")),
        parent=getattr(rec, "parent", None),
        leases=int(getattr(rec, "leases", 0)),
        created_at=float(getattr(rec, "created_at", 0.0)),
    )


class Runtime:
    def __init__(
        self,
        settings: Settings,
        model: LoadedModel,
        store: SnapshotStore,
        engine: Engine,
        cache: ResultCache,
        metrics: Metrics | None = None,
        ewma: EwmaProxy | None = None,
        cluster: Cluster | None = None,
    ) -> None:
        self.settings = settings
        self.cluster = cluster  # scale-out through Redis; None on the embedded default
        self.ewma = ewma  # the approximate proxy policy; None unless --ewma-beta
        self.model = model
        self.store = store
        self.engine = engine
        self.cache = cache
        self.metrics = metrics or Metrics()
        self.limits = Limits(
            vocab_size=model.vocab_size,
            max_seq_len=min(settings.max_seq_len or model.max_positions, model.max_positions),
            max_tokens_per_request=settings.max_tokens_per_request,
            max_sequences_per_request=settings.max_sequences_per_request,
        )
        self.scheduler = Scheduler(
            engine,
            store,
            policy=BatchPolicy(
                max_batch_tokens=settings.max_batch_tokens,
                max_wait_s=settings.max_wait_ms / 1000.0,
            ),
            max_queue=settings.max_queue,
            observer=self.metrics,
            strategy=settings.strategy,
        )
        self.numerics_spec = model.numerics_spec(settings.lm_head_fp32)
        # Everything besides weights and request that changes the numbers goes in cache keys.
        # The invariant profile packs in every mode; hf's fast mode pads (other bits).
        mode = "packed" if model.profile == "invariant" else settings.mode
        self.numerics = f"{self.numerics_spec.key}/{mode}"
        self._ready = True
        self._draining = False
        self.metrics.attach_state(self.state)
        self.history = History()  # the status page's charts; `serve` runs its sampler

    # -- lifecycle -----------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        return self._ready and not self._draining

    def start_draining(self) -> None:
        """Not-ready first (load balancers stop sending), then the caller drains and stops."""
        self._draining = True

    async def drain(self, timeout_s: float) -> bool:
        return await asyncio.to_thread(self.scheduler.drain, timeout_s)

    def close(self) -> None:
        self._ready = False
        self.scheduler.close()
        if self.ewma is not None:
            self.ewma.close()

    def state(self) -> dict[str, Any]:
        st: dict[str, Any] = dict(self.store.stats())
        st["queue_depth"] = self.scheduler.depth
        st["queue_tokens"] = self.scheduler.queued_tokens
        st["cache"] = self.cache.stats()
        st["ready"] = 1 if self.ready else 0
        # Newest version held in each memory tier (-1: none), against "newest" (published).
        records = self.store.versions()
        st["newest_resident"] = {
            t: max((int(r.version) for r in records if t in r.tiers), default=-1)
            for t in ("device", "host")
        }
        return st

    # -- auth ----------------------------------------------------------------------------
    def authorize(self, *, write: bool, token: str | None, peer: str | None) -> None:
        """Check the bearer token; called by both transports before any operation."""
        s = self.settings
        write_token = s.write_token.get_secret_value() if s.write_token else None
        read_token = s.read_token.get_secret_value() if s.read_token else None
        expected = write_token if write else read_token
        if write and expected is None:
            # No write token configured: writes are bound to loopback only.
            if peer is not None and not peer.startswith(_LOOPBACK):
                raise Forbidden(
                    "writes are only accepted from loopback when no --write-token is set",
                    parameter="authorization",
                )
            return
        if not write and expected is None:
            return
        ok = token is not None and hmac.compare_digest(token.encode(), (expected or "").encode())
        if not ok and not write and write_token is not None and token is not None:
            ok = hmac.compare_digest(token.encode(), write_token.encode())
        if not ok:
            raise Unauthorized(
                "missing or wrong bearer token" + (" for writes" if write else ""),
                parameter="authorization",
            )

    # -- logprobs ------------------------------------------------------------------------
    async def logprobs(self, req: LogprobsRequest) -> LogprobsResponse:
        if self._draining:
            raise Unavailable("the service is draining for shutdown", retry_after_s=1.0)
        if req.proxy is not None and self.ewma is None:
            raise InvalidRequest(
                f"proxy={req.proxy!r} is not enabled on this deployment: start the service "
                "with --ewma-beta",
                parameter="proxy",
            )
        plans = plan_request(req, self.limits)
        timeout = req.timeout_s or self.settings.request_timeout_s
        deadline = time.monotonic() + timeout
        snap = self.ewma.snapshot() if self.ewma is not None else None  # one view per request
        wanted = {v for p in plans for v in p.jobs}
        if self.cluster is not None:
            for v in wanted:
                if not self.store.has(v):  # published on another replica: adopt it
                    await asyncio.to_thread(
                        self._adopt_or_none, v, req.allow_inexact or req.proxy is not None
                    )
        hashes, proxied = resolve_hashes(
            wanted,
            self.store.sha256,  # UnknownVersion / VersionEvicted
            snap,
            proxy=req.proxy,
            allow_inexact=req.allow_inexact,
        )
        pending: list[_Pending] = []
        for plan in plans:
            sp = plan.sampling
            for v, pos in plan.jobs.items():
                key = None
                if req.use_cache:
                    key = self.cache.make_key(
                        weight_sha256=hashes[v],
                        numerics=self.numerics,
                        sampling=(float(sp.temperature), int(sp.top_k), float(sp.top_p)),
                        token_ids=plan.token_ids,
                        positions=pos,
                    )
                pending.append(_Pending(plan, v, pos, key, self.cache.get(key) if key else None))
        try:
            for p in pending:
                if p.value is None:
                    job = Job(
                        token_ids=torch.from_numpy(p.plan.token_ids),
                        positions=torch.from_numpy(p.positions),
                        sampling=SamplingParams(
                            temperature=float(p.plan.sampling.temperature),
                            top_k=int(p.plan.sampling.top_k),
                            top_p=float(p.plan.sampling.top_p),
                        ),
                    )
                    if p.version in proxied:
                        assert self.ewma is not None and snap is not None  # resolve_hashes
                        p.future = self.ewma.submit(snap, job)
                    else:
                        p.future = self.scheduler.submit(p.version, job, deadline=deadline)
            waits = [asyncio.wrap_future(p.future) for p in pending if p.future is not None]
            if waits:
                try:
                    results = await asyncio.wait_for(
                        asyncio.gather(*waits), timeout=max(0.0, deadline - time.monotonic())
                    )
                except TimeoutError as exc:
                    raise DeadlineExceeded(
                        f"no answer within timeout_s={timeout:g}", parameter="timeout_s"
                    ) from exc
                it = iter(results)
                for p in pending:
                    if p.future is not None:
                        p.value = next(it)
                        if p.key is not None:
                            self.cache.put(p.key, p.value)
        finally:
            for p in pending:  # cancelled or failed requests leave nothing queued behind
                if p.future is not None and not p.future.done():
                    p.future.cancel()
        return LogprobsResponse(results=self._stitch(plans, pending, hashes, proxied))

    def _stitch(
        self,
        plans: list[SequencePlan],
        pending: list[_Pending],
        hashes: Mapping[int, str],
        proxied: AbstractSet[int] = frozenset(),
    ) -> list[SequenceResult]:
        by_plan: dict[int, list[_Pending]] = {}
        for p in pending:
            by_plan.setdefault(p.plan.index, []).append(p)
        out: list[SequenceResult] = []
        cached_n = computed_n = 0
        for plan in plans:
            lp = np.full(len(plan.token_ids), np.nan, dtype=np.float32)
            parts = by_plan.get(plan.index, [])
            for p in parts:
                assert p.value is not None
                lp[p.positions] = p.value
                if p.future is None:
                    cached_n += len(p.positions)
                else:
                    computed_n += len(p.positions)
            versions = sorted(plan.jobs)
            out.append(
                SequenceResult(
                    logprobs=lp,
                    versions=versions,
                    weight_sha256={v: hashes[v] for v in versions},
                    exact=not any(v in proxied for v in versions),
                    cached=bool(parts) and all(p.future is None for p in parts),
                )
            )
        if cached_n:
            self.metrics.scored.labels("cache").inc(cached_n)
        if computed_n:
            self.metrics.scored.labels("forward").inc(computed_n)
        return out

    # -- versions ------------------------------------------------------------------------
    async def publish_file(
        self, version: int, path: Path, *, sha256: str | None, move: bool
    ) -> PublishResult:
        check_version(version)
        return await self._publish(
            lambda: self.store.publish_file(version, path, expected_sha256=sha256, move=move)
        )

    async def publish_delta_file(
        self, version: int, path: Path, *, sha256: str | None, parent: int | None
    ) -> PublishResult:
        """A delta upload (changed elements only) against ``parent`` (None: the file's, else
        the newest retained); ``ParentMissing`` when the store lacks it."""
        check_version(version)
        return await self._publish(
            lambda: self.store.publish_delta(version, path, parent=parent, expected_sha256=sha256)
        )

    async def publish_weights(
        self, version: int, weights: Mapping[str, torch.Tensor], *, sha256: str | None
    ) -> PublishResult:
        check_version(version)
        return await self._publish(
            lambda: self.store.publish(version, weights, expected_sha256=sha256)
        )

    async def publish_path(
        self,
        version: int,
        path: str,
        *,
        sha256: str | None,
        delta: bool = False,
        parent: int | None = None,
    ) -> PublishResult:
        """Publish from storage the service can read, only under the configured roots
        (``delta``: the path holds a delta file against ``parent``)."""
        check_version(version)
        roots = [r.resolve() for r in self.settings.publish_roots]
        if not roots:
            raise Forbidden(
                "publish by path is disabled: start the service with --publish-root DIR",
                parameter="path",
            )
        if not path or "\x00" in path or len(path) > 4096:
            raise InvalidRequest(
                "path must be a non-empty file system path (no NUL bytes, at most 4096 chars)",
                parameter="path",
            )
        try:
            target = Path(path).resolve()  # symlinks resolved: no escaping a root via a link
        except (OSError, ValueError, RuntimeError) as exc:
            raise InvalidRequest(
                f"path {path!r} cannot be resolved: {exc}", parameter="path"
            ) from exc
        if not any(target == r or target.is_relative_to(r) for r in roots):
            raise Forbidden(
                f"path {path!r} is not under a configured publish root", parameter="path"
            )
        if not target.exists():
            raise InvalidRequest(f"path {path!r} does not exist", parameter="path")
        if delta:
            if not target.is_file():
                raise InvalidRequest(
                    f"path {path!r}: a delta is one safetensors file", parameter="path"
                )
            return await self.publish_delta_file(version, target, sha256=sha256, parent=parent)
        if parent is not None:
            raise InvalidRequest("parent applies to delta publishes only", parameter="parent")
        # A hub checkpoint's layout (per-expert tensors, tied duplicates) → canonical names.
        staged = await asyncio.to_thread(
            canonical_file, target, self.model.layout, self.store.staging_dir
        )
        if staged is not None:
            try:
                return await self.publish_file(version, staged, sha256=sha256, move=True)
            finally:
                staged.unlink(missing_ok=True)
        return await self._publish(
            lambda: self.store.publish(version, target, expected_sha256=sha256)
        )

    async def _publish(self, do: Any) -> PublishResult:
        start = time.perf_counter()
        code = "ok"
        try:
            out = await asyncio.to_thread(do)
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
                await asyncio.to_thread(self.ewma.catch_up, self.store)
            except Exception:
                logger.exception("ewma: folding in version %s failed", out.version)
        return PublishResult(
            policy_version=int(out.version),
            weight_sha256=str(out.sha256),
            created=bool(out.created),
            nbytes=int(out.nbytes),
            kind=str(getattr(out, "kind", "keyframe")),
        )

    def _adopt_or_none(self, version: int, tolerant: bool) -> None:
        assert self.cluster is not None
        try:
            self.cluster.ensure_local(version)
        except OldLogitError:
            if not tolerant:  # with a proxy/fallback allowed, resolve_hashes decides
                raise

    def versions(self) -> tuple[list[VersionInfo], int | None]:
        local = {r.version: _record_to_info(r) for r in self.store.versions()}
        if self.cluster is None:
            return list(local.values()), self.store.watermark
        try:  # every replica's view: the registry, with this replica's tiers where local
            shared = self.cluster.registry.all()
            watermark = self.cluster.registry.watermark()
        except Unavailable:
            return list(local.values()), self.store.watermark
        local_wm = self.store.watermark
        if watermark is not None and (local_wm is None or local_wm < watermark):
            # raised on another replica and its event not here yet: apply it before answering,
            # so a listing right after set_watermark agrees on every replica
            self.cluster.apply_watermark(watermark)
            local = {r.version: _record_to_info(r) for r in self.store.versions()}
        for v, rec in shared.items():
            if watermark is not None and v < watermark:
                continue
            local.setdefault(
                v,
                VersionInfo(
                    policy_version=v,
                    weight_sha256=str(rec["sha256"]),
                    nbytes=int(rec.get("nbytes", 0)),
                    tiers=["shared"],
                    kind=str(rec.get("kind", "keyframe")),
                ),
            )
        return [local[v] for v in sorted(local)], watermark

    def version(self, version: int) -> VersionInfo:
        if self.cluster is not None and not self.store.has(version):
            self.cluster.ensure_local(version)
        return _record_to_info(self.store.info(version))

    async def delete_version(self, version: int) -> None:
        if self.cluster is not None:
            await asyncio.to_thread(self.cluster.delete, version)
            return
        await asyncio.to_thread(self.store.delete, version)

    async def set_watermark(self, version: int) -> int:
        check_version(version)
        if self.cluster is not None:
            return await asyncio.to_thread(self.cluster.set_watermark, version)
        await asyncio.to_thread(self.store.set_watermark, version)
        wm = self.store.watermark
        return int(wm if wm is not None else version)

    def replicas(self) -> list[dict[str, Any]]:
        if self.cluster is None:
            return []
        return self.cluster.members()

    def create_lease(self, version: int, holder: str, ttl_s: float) -> LeaseInfo:
        if not (math.isfinite(ttl_s) and 0 < ttl_s <= 7 * 24 * 3600):
            raise InvalidRequest(
                f"ttl_s must be in (0, 604800] seconds, got {ttl_s!r}", parameter="ttl_s"
            )
        if self.cluster is not None:  # a lease pins the version on every replica
            if self.cluster.registry.get(version) is None:
                self.cluster.ensure_local(version)  # raises UnknownVersion / VersionEvicted
            rec: Any = self.cluster.leases.create(version, holder, ttl_s)
        else:
            rec = self.store.lease(version, holder, ttl_s)
        return LeaseInfo(
            lease_id=str(rec.lease_id),
            policy_version=int(rec.version),
            holder=str(rec.holder),
            ttl_s=float(rec.ttl_s),
            expires_at=float(rec.expires_at),
        )

    def release_lease(self, lease_id: str) -> None:
        if self.cluster is not None:
            self.cluster.leases.release(lease_id)
            return
        self.store.release(lease_id)

    def info(self) -> Info:
        s = self.settings
        m = self.model
        return Info(
            model_type=m.model_type,
            architecture=m.architecture,
            vocab_size=m.vocab_size,
            max_positions=m.max_positions,
            num_parameters=m.num_parameters,
            dtype=s.dtype,
            head_dtype="float32" if s.lm_head_fp32 else s.dtype,
            device=str(m.device),
            mode=s.mode,
            fast_mode_max_abs_deviation=None,
            limits={
                "max_seq_len": self.limits.max_seq_len,
                "max_tokens_per_request": self.limits.max_tokens_per_request,
                "max_sequences_per_request": self.limits.max_sequences_per_request,
                "max_batch_tokens": s.max_batch_tokens,
                "max_queue": s.max_queue,
                "max_request_mib": s.max_request_mib,
                "max_upload_gib": s.max_upload_gib,
                "request_timeout_s": s.request_timeout_s,
            },
            versions=[int(r.version) for r in self.store.versions()],
            watermark=self.store.watermark,
            server_version=__version__,
            numerics=self.numerics_spec.profile,
            tile_rows=self.numerics_spec.tile_rows,
            threads=self.numerics_spec.threads,
            lm_head_fp32=self.numerics_spec.lm_head_fp32,
            attention=self.numerics_spec.attention,
            **weight_layout_info(m.layout),
        )
