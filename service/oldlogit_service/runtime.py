"""The data plane both transports call: logprobs and traces, and plain delegation.

In: contract types. Out: contract types, or errors of the tree. This is the one sync/async
boundary of a request: every method that may block is async and runs its blocking work (disk,
Redis) in a thread, so the transports are one-line translators and the event loop never waits.
Flow of a logprobs call: validate/plan → make the versions servable here (``Control.prepare``)
→ each version's weights by reference and their hash (the store's; an adapter version's are
its base's, its adapter riding on its jobs; a proxy's only when the request asks for one or
allows it) → result cache (keys hold a sequence's MoE routing record;
an answer that returns its routing is computed) → scheduler (version-aware batches) → stitch
per sequence. Versions, leases and the watermark are the deployment's (``Control``, one
interface whether local or through Redis), and ``info`` reads them from there too.

Not here: who may call (``api/auth.py``), how a version comes in (``publishing/``), how the
parts are built and started (``server.py``). Nothing here knows HTTP or gRPC.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import numpy as np
import numpy.typing as npt
import torch

from oldlogit.contract.errors import DeadlineExceeded, InvalidRequest, Unavailable
from oldlogit.contract.types import (
    Info,
    LeaseInfo,
    LogprobsRequest,
    LogprobsResponse,
    RankInfo,
    RoutedExperts,
    SequenceResult,
    Trace,
    TraceRequest,
    TraceStageInfo,
    VersionInfo,
)
from oldlogit.parity import BUFFER_CONVENTION
from oldlogit.parity.kernels.cuda.gemm_choice import decided as gemm_choices
from oldlogit.parity.trace import MAX_TRACE_TOKENS
from oldlogit_service import __version__
from oldlogit_service.cache import ResultCacheBackend
from oldlogit_service.cluster.control import Control
from oldlogit_service.config import Settings
from oldlogit_service.history import History
from oldlogit_service.metrics import Metrics, ServiceState
from oldlogit_service.model.engine import Job, LoraWeights, SamplingParams
from oldlogit_service.model.ewma import EwmaProxy, resolve_hashes
from oldlogit_service.model.loaded import LoadedModel, weight_layout_info
from oldlogit_service.scheduler import Result, Routed, Scheduler, Stages, WeightsRef
from oldlogit_service.snapshots import SnapshotStore, check_version
from oldlogit_service.validate import Limits, SequencePlan, check_trace, plan_request

logger = logging.getLogger(__name__)

T = TypeVar("T")


class RanksView(Protocol):
    """A tensor-parallel replica's ranks, as the data plane sees them."""

    @property
    def degree(self) -> int: ...

    def problem(self) -> str | None:
        """Why the replica cannot serve (names the lost rank); None while every rank is up."""
        ...

    def rank_infos(self) -> list[RankInfo]:
        """Each rank's process, device, threads and bytes (asks every rank)."""
        ...


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
    weights: WeightsRef
    positions: npt.NDArray[np.int64]
    key: bytes | None
    value: npt.NDArray[np.float32] | None = None
    future: Future[Result] | None = None
    routing: npt.NDArray[np.int32] | None = None  # what the forward used (return_routing)


class Runtime:
    """Logprobs and traces of one replica; its parts are built and handed in by
    ``server.build_service``."""

    def __init__(
        self,
        settings: Settings,
        model: LoadedModel,
        store: SnapshotStore,
        scheduler: Scheduler,
        cache: ResultCacheBackend,
        control: Control,
        *,
        limits: Limits,
        metrics: Metrics,
        history: History,
        ewma: EwmaProxy | None = None,
        fast_deviation: float | None = None,
        ranks: RanksView | None = None,
    ) -> None:
        self.settings = settings
        # Fast mode under the plain numerics: max |fast − exact| measured at start-up.
        self.fast_deviation = fast_deviation
        self.control = control  # local, or scale-out through Redis: chosen at start-up
        self.ewma = ewma  # the approximate proxy policy; None unless --ewma-beta
        self.model = model
        self.store = store
        self.scheduler = scheduler
        self.cache = cache
        self.limits = limits
        self.metrics = metrics
        self.history = history  # the status page's charts; `serve` runs its sampler
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
        # A tensor-parallel replica's ranks: why they cannot serve (a lost rank), each rank's
        # memory (``/v1/info``); None on one device.
        self.ranks = ranks
        self._ready = True
        self._draining = False
        self.metrics.attach_state(self.state)

    # -- lifecycle -----------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        return self._ready and not self._draining and self.not_ready_reason is None

    @property
    def not_ready_reason(self) -> str | None:
        """Why this replica cannot serve, when a part of it is lost (a tensor-parallel rank)."""
        return self.ranks.problem() if self.ranks is not None else None

    def _check_serving(self) -> None:
        if self._draining:
            raise Unavailable("the service is draining for shutdown", retry_after_s=1.0)
        why = self.not_ready_reason
        if why is not None:
            raise Unavailable(f"this replica cannot serve: {why}", retry_after_s=5.0)

    def start_draining(self) -> None:
        """Not-ready first (load balancers stop sending), then the caller drains and stops."""
        self._draining = True

    async def drain(self, timeout_s: float) -> bool:
        return await asyncio.to_thread(self.scheduler.drain, timeout_s)

    def close(self) -> None:
        """Not ready, and every queued job failed as unavailable (``Scheduler.close``)."""
        self._ready = False
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

    # -- logprobs ------------------------------------------------------------------------
    async def logprobs(self, req: LogprobsRequest) -> LogprobsResponse:
        self._check_serving()
        if req.proxy is not None and self.ewma is None:
            raise InvalidRequest(
                f"proxy={req.proxy!r} is not enabled on this deployment: start the service "
                "with --ewma-beta",
                parameter="proxy",
            )
        plans = plan_request(req, self.limits)
        timeout = req.timeout_s or self.settings.request_timeout_s
        deadline = time.monotonic() + timeout
        wanted = {v for p in plans for v in p.jobs}
        tolerant = req.allow_inexact or req.proxy is not None
        if any(not self.store.has(v) for v in wanted):  # published elsewhere: adopt it
            await self._blocking(lambda: self.control.prepare(wanted, tolerant=tolerant))
        bases = {v: b for v in wanted if self.store.has(v) for b in [self.store.adapter_base(v)]}
        weights, hashes = self._weights(wanted, req, bases)
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
                        routing=plan.routing,
                    )
                pending.append(_Pending(plan, v, weights[v], pos, key))
        # An answer with its routing is computed: the cache holds logprobs only.
        keyed = [p for p in pending if p.key is not None and not req.return_routing]
        if keyed:
            found = await self._cache(self.cache.get_many, [p.key for p in keyed])
            for p, value in zip(keyed, found, strict=True):
                p.value = value
        # The adapters of the jobs still to compute, pinned in the store's tiers until their
        # forwards are done (a cached answer loads none).
        over = {p.version for p in pending if p.value is None and bases.get(p.version) is not None}
        loras: dict[int, LoraWeights] = {}
        try:
            if over:
                loras = await self._pinned_loras(over)
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
                        routing=None
                        if p.plan.routing is None
                        else torch.from_numpy(p.plan.routing),
                        record_routing=req.return_routing,
                        adapter=loras.get(p.version),
                    )
                    p.future = self.scheduler.submit(p.weights, job, deadline=deadline)
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
                        got = next(it)
                        if isinstance(got, Routed):
                            p.value, p.routing = got.logprobs, got.routing
                        else:
                            p.value = got
                        if p.key is not None:
                            fresh.append((p.key, p.value))
                if fresh:
                    await self._cache(self.cache.put_many, fresh)
        finally:
            for p in pending:  # cancelled or failed requests leave nothing queued behind
                if p.future is not None and not p.future.done():
                    p.future.cancel()
            self._unpin_loras(loras, [p.future for p in pending if p.future is not None])
        return LogprobsResponse(
            results=self._stitch(plans, pending, hashes, routing=req.return_routing)
        )

    def _pin_loras(self, versions: set[int]) -> dict[int, LoraWeights]:
        """The adapters of adapter versions, each pinned in the store's memory tiers
        (``SnapshotStore.pin_adapter``): all of them, or none (an error releases those
        taken)."""
        out: dict[int, LoraWeights] = {}
        try:
            for v in sorted(versions):
                a = self.store.pin_adapter(v)
                out[v] = LoraWeights(a.sha256, a.config.as_dict(), a.tensors)
        except BaseException:
            self._unpin_loras(out, [])
            raise
        return out

    async def _pinned_loras(self, versions: set[int]) -> dict[int, LoraWeights]:
        """``_pin_loras`` in a thread; a request cancelled meanwhile releases the pins when
        the thread is done taking them."""
        task = asyncio.ensure_future(asyncio.to_thread(self._pin_loras, versions))
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:

            def release(t: asyncio.Future[dict[int, LoraWeights]]) -> None:
                if not t.cancelled() and t.exception() is None:
                    self._unpin_loras(t.result(), [])

            task.add_done_callback(release)
            raise

    def _unpin_loras(self, loras: Mapping[int, LoraWeights], futures: list[Future[Any]]) -> None:
        """Release the adapters' pins once none of the jobs' ``futures`` is still pending."""
        if not loras:
            return
        live = [f for f in futures if not f.done()]
        if not live:
            for v in loras:
                self.store.residency.unpin(v)
            return
        left = [len(live)]

        def done(_f: object) -> None:
            left[0] -= 1
            if left[0] == 0:
                for v in loras:
                    self.store.residency.unpin(v)

        for f in live:
            f.add_done_callback(done)

    def _weights(
        self, wanted: set[int], req: LogprobsRequest, bases: Mapping[int, int | None]
    ) -> tuple[dict[int, WeightsRef], dict[int, str]]:
        """Each version's weights by reference, and the hash of the weights that answer it.

        An exact request (no ``proxy``, no ``allow_inexact``) is the store's version or the
        store's error (``UnknownVersion`` / ``VersionEvicted``). Otherwise ``resolve_hashes``
        decides which versions the EWMA proxy answers, under one snapshot of it per request.
        An adapter version (``bases``: its base) runs under its base's weights, always exactly:
        its jobs share the base's queue and batches.
        """

        def ref(v: int) -> WeightsRef:
            base = bases.get(v)
            return WeightsRef.stored(v if base is None else base)

        if req.proxy is None and not req.allow_inexact:
            return ({v: ref(v) for v in wanted}, {v: self.store.sha256(v) for v in wanted})
        adapters = {v for v, b in bases.items() if b is not None}
        snap = self.ewma.snapshot() if self.ewma is not None else None
        hashes, proxied = resolve_hashes(
            wanted - adapters,
            self.store.sha256,
            snap,
            proxy=req.proxy,
            allow_inexact=req.allow_inexact,
        )
        hashes.update((v, self.store.sha256(v)) for v in adapters)
        refs = {v: ref(v) for v in wanted - proxied}
        if proxied:
            assert snap is not None  # resolve_hashes proxies only under a snapshot
            proxy = WeightsRef.proxy(snap.sha256, snap.weights)
            refs.update((v, proxy) for v in proxied)
        return refs, hashes

    def _stitch(
        self,
        plans: list[SequencePlan],
        pending: list[_Pending],
        hashes: Mapping[int, str],
        *,
        routing: bool = False,
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
            proxied = any(not p.weights.loads for p in parts)
            records = None
            if routing:  # one record per version's forward, rows 0 … n − 2
                used = {p.version: p.routing for p in parts}
                records = [RoutedExperts(ids=used[v], start=0) for v in versions]
            out.append(
                SequenceResult(
                    logprobs=lp,
                    versions=versions,
                    weight_sha256={v: hashes[v] for v in versions},
                    # A padded (fast-mode) forward is not the reference's; a proxy is not
                    # the version's weights.
                    exact=self.mode != "fast" and not proxied,
                    cached=bool(parts) and all(p.future is None for p in parts),
                    routed_experts=records,
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
        self._check_serving()
        check_trace(req, self.limits, MAX_TRACE_TOKENS)
        version = req.policy_version
        if not self.store.has(version):  # published elsewhere: adopt it
            await self._blocking(lambda: self.control.prepare({version}, tolerant=False))
        sha = self.store.sha256(version)  # UnknownVersion / VersionEvicted
        base = self.store.adapter_base(version)
        n = len(req.token_ids)
        timeout = self.settings.request_timeout_s
        loras = {} if base is None else await self._pinned_loras({version})
        future: Future[Stages] | None = None
        try:
            job = Job(
                token_ids=torch.from_numpy(req.token_ids),
                positions=torch.arange(1, n, dtype=torch.int64),
                sampling=SamplingParams(
                    temperature=float(req.temperature),
                    top_k=int(req.top_k),
                    top_p=float(req.top_p),
                ),
                trace=True,
                adapter=loras.get(version),
            )
            future = self.scheduler.submit_trace(
                WeightsRef.stored(version if base is None else base),
                job,
                deadline=time.monotonic() + timeout,
            )
            stages = await asyncio.wait_for(asyncio.wrap_future(future), timeout=timeout)
        except TimeoutError as exc:
            raise DeadlineExceeded(
                f"no trace within the service's request timeout ({timeout:g} s)"
            ) from exc
        finally:
            if future is not None and not future.done():  # cancelled or failed: nothing
                future.cancel()  # stays queued behind
            self._unpin_loras(loras, [] if future is None else [future])
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

    def _info(self, versions: tuple[list[VersionInfo], int | None] | None = None) -> Info:
        """``versions``: the deployment's versions and watermark, read once by the caller
        (``Control.versions``, the source ``/v1/versions`` reads too)."""
        listed, watermark = versions if versions is not None else self.control.versions()
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
            versions=[v.policy_version for v in listed],
            watermark=watermark,
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
            numerics_config=dict(spec.config),
            attention_windows=dict(spec.windows),
            hardware=spec.hardware,
            kernels=spec.kernels,
            gemm_choices=gemm_choices(),
            tp_chunks=spec.tp_chunks,
            tensor_parallel=self.ranks.degree if self.ranks is not None else 1,
            ranks=self._rank_infos(),
            **weight_layout_info(m.layout),
            moe=self.limits.moe,
        )

    def _rank_infos(self) -> list[RankInfo]:
        """Each rank's part (empty on one device, and once a rank is lost: nobody to ask)."""
        if self.ranks is None or self.ranks.problem() is not None:
            return []
        try:
            return self.ranks.rank_infos()
        except Unavailable:
            return []

    async def metrics_text(self) -> bytes:
        """``/metrics``: the collector reads the store's and the cache's state (locks, maybe
        Redis), so it renders in a thread."""
        return await self._blocking(self.metrics.render)

    async def status_page(self, render: Callable[[StatusView], str]) -> str:
        """The status page, rendered from one read of the live state (in a thread)."""

        def build() -> str:
            versions = self.control.versions()
            view = StatusView(self._info(versions), self.state(), versions[0], self.history)
            return render(view)

        return await self._blocking(build)
