"""The one runtime both transports call: logprobs, traces, publish, versions, leases, info, metrics.

In: contract types (``oldlogit.types``) and upload streams. Out: contract types, or errors of
the tree. This is the one sync/async boundary: every method that may block is async and runs
its blocking work (disk, Redis, hashing) in a thread, so the transports are one-line
translators and the event loop never waits. Flow of a logprobs call: validate/plan → make the
versions servable here (``Control.prepare``) → each version's weight hash → result cache →
scheduler (version-aware batches) → stitch per sequence. Nothing here knows HTTP or gRPC.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from collections.abc import Set as AbstractSet
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt
import torch

from oldlogit.errors import (
    DeadlineExceeded,
    Forbidden,
    InvalidRequest,
    LimitExceeded,
    OldLogitError,
    Unauthorized,
    Unavailable,
)
from oldlogit.parity import BUFFER_CONVENTION
from oldlogit.parity.trace import MAX_TRACE_TOKENS
from oldlogit.types import (
    Info,
    LeaseInfo,
    LogprobsRequest,
    LogprobsResponse,
    PublishResult,
    SequenceResult,
    SessionInfo,
    Trace,
    TraceRequest,
    TraceStageInfo,
    VersionInfo,
)
from oldlogit_service import __version__
from oldlogit_service.cache import ResultCacheBackend
from oldlogit_service.cluster.control import Control
from oldlogit_service.config import Settings
from oldlogit_service.history import History
from oldlogit_service.metrics import Metrics, ServiceState
from oldlogit_service.model.checkpoints import canonical_file
from oldlogit_service.model.engine import Engine, Job, SamplingParams
from oldlogit_service.model.ewma import EwmaProxy, resolve_hashes
from oldlogit_service.model.loaded import LoadedModel, weight_layout_info
from oldlogit_service.publishing.sessions import Sessions
from oldlogit_service.scheduler import BatchPolicy, Scheduler
from oldlogit_service.snapshots import SnapshotStore, check_version
from oldlogit_service.validate import Limits, SequencePlan, check_trace, plan_request

logger = logging.getLogger(__name__)

T = TypeVar("T")

_LOOPBACK = ("127.", "::1", "localhost", "unix:")
# Upload bytes gathered before one write in a worker thread (the event loop never writes).
_UPLOAD_FLUSH_BYTES = 8 * 1024 * 1024


@dataclass(frozen=True)
class StatusView:
    """What the status page shows, read in one go (``Runtime.status_page``)."""

    info: Info
    state: ServiceState
    versions: list[VersionInfo]
    history: History


@dataclass
class _Pending:
    plan: SequencePlan
    version: int
    positions: npt.NDArray[np.int64]
    key: bytes | None
    value: npt.NDArray[np.float32] | None = None
    future: Future[npt.NDArray[np.float32]] | None = None


class Runtime:
    def __init__(
        self,
        settings: Settings,
        model: LoadedModel,
        store: SnapshotStore,
        engine: Engine,
        cache: ResultCacheBackend,
        control: Control,
        metrics: Metrics | None = None,
        ewma: EwmaProxy | None = None,
        fast_deviation: float | None = None,
    ) -> None:
        self.settings = settings
        # Fast mode under the plain numerics: max |fast − exact| measured at start-up.
        self.fast_deviation = fast_deviation
        self.control = control  # local, or scale-out through Redis: chosen at start-up
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
        # Under the invariant numerics a padded batch would give the very bits a packed one
        # does, at the cost of the padding: fast mode is deterministic mode there.
        self.mode = "deterministic" if model.profile == "invariant" else settings.mode
        if settings.mode == "fast" and self.mode != "fast":
            logger.warning(
                "--mode fast is an alias of deterministic under the invariant numerics: packed "
                "batches are exact and batched (--numerics hf --mode fast pads, inexactly)"
            )
        # Multi-rank publishes: parts staged here, the last commit publishes like any upload.
        self.sessions = Sessions(store, model.param_specs, publish=self._publish_now)
        self._ready = True
        self._draining = False
        self._stop = threading.Event()
        self._sweeper: threading.Thread | None = None
        self.metrics.attach_state(self.state)
        self.history = History()  # the status page's charts; `serve` runs its sampler

    # -- lifecycle -----------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        return self._ready and not self._draining

    def start(self, *, http: str, grpc: str) -> None:
        """Join the deployment and start the periodic sweeper (lease expiry, retention)."""
        self.control.start(http=http, grpc=grpc, queue_depth=lambda: self.scheduler.depth)
        self._sweeper = threading.Thread(
            target=self._sweep_loop, name="oldlogit-sweeper", daemon=True
        )
        self._sweeper.start()

    def _sweep_loop(self) -> None:
        while not self._stop.wait(self.settings.sweep_interval_s):
            try:
                self.control.sweep()
                self.sessions.sweep()
            except Exception:
                logger.exception("the periodic sweep failed; the next one retries")

    def start_draining(self) -> None:
        """Not-ready first (load balancers stop sending), then the caller drains and stops."""
        self._draining = True

    async def drain(self, timeout_s: float) -> bool:
        return await asyncio.to_thread(self.scheduler.drain, timeout_s)

    def close(self) -> None:
        self._ready = False
        self._stop.set()
        if self._sweeper is not None:
            self._sweeper.join(timeout=10)
        self.control.stop()
        self.scheduler.close()

    def state(self) -> ServiceState:
        records = self.store.versions()
        newest = {
            t: max((r.version for r in records if t in r.tiers), default=-1)
            for t in ("device", "host")
        }
        return ServiceState(
            store=self.store.stats(),
            cache=self.cache.stats(),
            queue_depth=self.scheduler.depth,
            queue_tokens=self.scheduler.queued_tokens,
            load_queue=self.scheduler.load_waiting(),
            ready=self.ready,
            newest_resident=newest,
        )

    async def _blocking(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.to_thread(fn, *args)

    async def _cache(self, fn: Callable[..., T], *args: Any) -> T:
        """A result-cache call: in a thread when the cache waits on the network."""
        return await asyncio.to_thread(fn, *args) if self.cache.blocking else fn(*args)

    # -- auth ----------------------------------------------------------------------------
    def authorize(self, *, write: bool, token: str | None, peer: str | None) -> None:
        """Check the bearer token; both transports call this before anything else."""
        s = self.settings
        write_token = s.write_token.get_secret_value() if s.write_token else None
        read_token = s.read_token.get_secret_value() if s.read_token else None
        expected = write_token if write else read_token
        if write and expected is None:
            # No write token configured: writes are bound to loopback only, and to nobody with
            # TLS on (a TLS-terminating proxy beside the server would make every peer loopback).
            if s.tls_enabled or (peer is not None and not peer.startswith(_LOOPBACK)):
                raise Forbidden(
                    "writes are only accepted from loopback when no --write-token is set"
                    + (", and not at all with TLS on" if s.tls_enabled else ""),
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
        tolerant = req.allow_inexact or req.proxy is not None
        if any(not self.store.has(v) for v in wanted):  # published elsewhere: adopt it
            await self._blocking(lambda: self.control.prepare(wanted, tolerant=tolerant))
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
                pending.append(_Pending(plan, v, pos, key))
        keyed = [p for p in pending if p.key is not None]
        if keyed:
            found = await self._cache(self.cache.get_many, [p.key for p in keyed])
            for p, value in zip(keyed, found, strict=True):
                p.value = value
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
                    source = None
                    if p.version in proxied:
                        assert snap is not None  # resolve_hashes
                        source = (snap.source, snap.weights)
                    p.future = self.scheduler.submit(
                        p.version, job, deadline=deadline, weights=source
                    )
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
                fresh: list[tuple[bytes, npt.NDArray[np.float32]]] = []
                for p in pending:
                    if p.future is not None:
                        p.value = next(it)
                        if p.key is not None:
                            fresh.append((p.key, p.value))
                if fresh:
                    await self._cache(self.cache.put_many, fresh)
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
                    # A padded (fast-mode) forward is not the reference's; a proxy is not
                    # the version's weights.
                    exact=self.mode != "fast" and not any(v in proxied for v in versions),
                    cached=bool(parts) and all(p.future is None for p in parts),
                )
            )
        if cached_n:
            self.metrics.scored.labels("cache").inc(cached_n)
        if computed_n:
            self.metrics.scored.labels("forward").inc(computed_n)
        return out

    # -- trace ---------------------------------------------------------------------------
    async def trace(self, req: TraceRequest) -> Trace:
        """The digests of every stage of one forward of ``req.token_ids`` alone at a version:
        ``oldlogit.parity.trace.forward_trace``, the function a trainer runs on its own model,
        here on the skeleton with the version's weights, so the first stage whose digests
        differ is where the two forwards part ways. A job of the version's queue like any
        other (scheduler → ``Engine.trace``); never cached."""
        if self._draining:
            raise Unavailable("the service is draining for shutdown", retry_after_s=1.0)
        check_trace(req, self.limits, MAX_TRACE_TOKENS)
        version = req.policy_version
        if not self.store.has(version):  # published elsewhere: adopt it
            await self._blocking(lambda: self.control.prepare({version}, tolerant=False))
        sha = self.store.sha256(version)  # UnknownVersion / VersionEvicted
        n = len(req.token_ids)
        job = Job(
            token_ids=torch.from_numpy(req.token_ids),
            positions=torch.arange(1, n, dtype=torch.int64),
            sampling=SamplingParams(
                temperature=float(req.temperature), top_k=int(req.top_k), top_p=float(req.top_p)
            ),
            trace=True,
        )
        timeout = self.settings.request_timeout_s
        future = self.scheduler.submit_trace(version, job, deadline=time.monotonic() + timeout)
        try:
            stages = await asyncio.wait_for(asyncio.wrap_future(future), timeout=timeout)
        except TimeoutError as exc:
            raise DeadlineExceeded(
                f"no trace within the service's request timeout ({timeout:g} s)"
            ) from exc
        finally:
            if not future.done():  # cancelled or failed: nothing stays queued behind
                future.cancel()
        return Trace(
            policy_version=version,
            weight_sha256=sha,
            numerics=self.numerics_spec.key,
            stages=[
                TraceStageInfo(
                    name=s.name,
                    dtype=s.dtype,
                    shape=list(s.shape),
                    sha256=s.sha256,
                    total=s.total,
                    absmax=s.absmax,
                )
                for s in stages
            ],
        )

    # -- publish -------------------------------------------------------------------------
    async def publish_stream(
        self,
        version: int,
        chunks: AsyncIterator[bytes],
        *,
        sha256: str | None,
        delta: bool = False,
        parent: int | None = None,
        parameter: str = "body",
    ) -> PublishResult:
        """The one upload path of both transports: a safetensors body (``delta``: the changed
        elements against ``parent``) streamed to the staging directory (same filesystem as the
        store, so a full publish is a rename), within the upload limit, then published."""
        check_version(version)
        if parent is not None and not delta:
            raise InvalidRequest("parent applies to delta uploads only", parameter="parent")
        tmp = self.store.staging_dir / f"upload-{version}-{uuid.uuid4().hex}.safetensors.part"
        try:
            await self._receive(chunks, tmp, parameter=parameter)
            if delta:
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
                await self._blocking(os.unlink, tmp)

    async def _receive(self, chunks: AsyncIterator[bytes], path: Path, *, parameter: str) -> None:
        """Stream an upload to ``path`` within the upload limit (writes batched, in threads);
        an empty upload is refused."""
        limit = int(self.settings.max_upload_gib * 1024**3)
        size = 0
        with open(path, "wb") as f:
            batch: list[bytes] = []
            held = 0
            async for chunk in chunks:
                size += len(chunk)
                if size > limit:
                    raise LimitExceeded(
                        f"the upload exceeds the limit of {limit} bytes", parameter=parameter
                    )
                batch.append(chunk)
                held += len(chunk)
                if held >= _UPLOAD_FLUSH_BYTES:
                    await self._blocking(f.writelines, batch)
                    batch, held = [], 0
            if batch:
                await self._blocking(f.writelines, batch)
        if size == 0:
            raise InvalidRequest(
                "the upload is empty: send a safetensors file", parameter=parameter
            )

    async def publish_weights(
        self, version: int, weights: Mapping[str, torch.Tensor], *, sha256: str | None
    ) -> PublishResult:
        """In-process publish of a state dict (tests, embedding)."""
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
        if parent is not None and not delta:
            raise InvalidRequest("parent applies to delta publishes only", parameter="parent")
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
            return await self._publish(
                lambda: self.store.publish_delta(
                    version, target, parent=parent, expected_sha256=sha256
                )
            )
        # A hub checkpoint's layout (per-expert tensors, tied duplicates) → canonical names.
        staged = await self._blocking(
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
        return await self._blocking(self._publish_now, do)

    def _publish_now(self, do: Callable[[], Any]) -> PublishResult:
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

    # -- multi-rank publish sessions -----------------------------------------------------
    async def open_session(
        self,
        session_id: str,
        policy_version: int,
        members: int,
        *,
        delta: bool = False,
        parent: int | None = None,
        sha256: str | None = None,
        ttl_s: float | None = None,
    ) -> SessionInfo:
        check_version(policy_version)
        return await self._blocking(
            lambda: self.sessions.open(
                session_id,
                policy_version,
                members,
                delta=delta,
                parent=parent,
                sha256=sha256,
                ttl_s=ttl_s,
            )
        )

    async def stage_part(
        self, session_id: str, rank: int, chunks: AsyncIterator[bytes], *, parameter: str = "body"
    ) -> SessionInfo:
        """One rank's part, streamed like an upload into the session's directory, then checked
        against the model (names, dtypes, shapes) and hashed."""
        path = await self._blocking(self.sessions.part_path, session_id, rank)
        try:
            await self._receive(chunks, path, parameter=parameter)
            return await self._blocking(self.sessions.stage, session_id, rank, path)
        finally:
            await self._blocking(path.unlink, True)

    async def commit_part(self, session_id: str, rank: int, sha256: str) -> SessionInfo:
        """Commit a staged part; the last commit publishes the version (in this call)."""
        return await self._blocking(self.sessions.commit, session_id, rank, sha256)

    async def get_session(self, session_id: str) -> SessionInfo:
        return await self._blocking(self.sessions.get, session_id)

    async def abort_session(self, session_id: str) -> SessionInfo:
        return await self._blocking(self.sessions.abort, session_id)

    # -- versions, leases, watermark -----------------------------------------------------
    async def versions(self) -> tuple[list[VersionInfo], int | None]:
        return await self._blocking(self.control.versions)

    async def version(self, version: int) -> VersionInfo:
        return await self._blocking(self.control.version, check_version(version))

    async def delete_version(self, version: int) -> None:
        await self._blocking(self.control.delete, check_version(version))

    async def set_watermark(self, version: int) -> int:
        return await self._blocking(self.control.set_watermark, check_version(version))

    async def create_lease(self, version: int, holder: str, ttl_s: float) -> LeaseInfo:
        return await self._blocking(
            self.control.create_lease, check_version(version), holder, float(ttl_s)
        )

    async def release_lease(self, lease_id: str) -> None:
        await self._blocking(self.control.release_lease, lease_id)

    async def replicas(self) -> list[dict[str, Any]]:
        return await self._blocking(self.control.replicas)

    # -- introspection -------------------------------------------------------------------
    async def info(self) -> Info:
        return await self._blocking(self._info)

    def _info(self) -> Info:
        s = self.settings
        m = self.model
        spec = self.numerics_spec
        return Info(
            model_type=m.model_type,
            architecture=m.architecture,
            vocab_size=m.vocab_size,
            max_positions=m.max_positions,
            num_parameters=m.num_parameters,
            dtype=s.dtype,
            head_dtype="float32" if s.lm_head_fp32 else s.dtype,
            device=str(m.device),
            mode=self.mode,
            fast_mode_max_abs_deviation=self.fast_deviation,  # None unless hf fast mode
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
            versions=[r.version for r in self.store.versions()],
            watermark=self.store.watermark,
            server_version=__version__,
            numerics=spec.profile,
            tile_rows=spec.tile_rows,
            threads=spec.threads,
            lm_head_fp32=spec.lm_head_fp32,
            attention=spec.attention,
            numerics_revision=spec.revision,
            torch_version=spec.torch_version,
            buffers=dict(spec.buffers),
            buffer_convention=BUFFER_CONVENTION,
            transformers_version=spec.transformers_version,
            **weight_layout_info(m.layout),
        )

    async def metrics_text(self) -> bytes:
        """``/metrics``: the collector reads the store's and the cache's state (locks, maybe
        Redis), so it renders in a thread."""
        return await self._blocking(self.metrics.render)

    async def status_page(self, render: Callable[[StatusView], str]) -> str:
        """The status page, rendered from one read of the live state (in a thread)."""

        def build() -> str:
            view = StatusView(self._info(), self.state(), self.control.versions()[0], self.history)
            return render(view)

        return await self._blocking(build)
