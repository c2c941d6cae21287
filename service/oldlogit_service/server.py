"""Build every part of a replica from ``Settings`` and run HTTP (uvicorn) and gRPC in one loop.

``build_service`` is the one place the parts are made and wired: the model, the snapshot
store, the control (local or Redis), the engine and scheduler, the result cache, the EWMA
proxy, the runtime (data plane), the intake (publishes, sessions) and the auth check; the
returned ``Service`` also owns the periodic sweeper (lease expiry, retention, idle sessions).
Shutdown on SIGTERM/SIGINT: not-ready first (``/readyz`` and gRPC health flip), drain the
queue, then stop both servers. With TLS on, both ports serve ``ServerTls``'s certificates,
re-read on SIGHUP and every ``tls_reload_interval_s``; ``--health-port`` adds a plain-HTTP port
with the probes only. ``ServerThread`` runs the same thing on a background thread for tests and
benchmarks (real servers on 127.0.0.1, port 0).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import ssl
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import uvicorn
from torch import Tensor

from oldlogit_service.api.auth import Auth
from oldlogit_service.api.grpc import start_grpc_server
from oldlogit_service.api.http import create_app, create_health_app
from oldlogit_service.api.tls import ServerTls
from oldlogit_service.cache import ResultCache
from oldlogit_service.cluster.chain import CHAIN_DIR
from oldlogit_service.cluster.control import Control, LocalControl
from oldlogit_service.cluster.redis_adapters import RedisResultCache, check_eviction_policy, connect
from oldlogit_service.cluster.replicas import ClusterControl, advertised_address, default_replica_id
from oldlogit_service.config import Settings
from oldlogit_service.demo.deployment import DEMO_MODEL_KWARGS, publish_demo_versions
from oldlogit_service.demo.tiny import make_tiny_model_dir
from oldlogit_service.history import History, sample_forever
from oldlogit_service.metrics import Metrics
from oldlogit_service.model.checkpoints import load_weights
from oldlogit_service.model.engine import Engine, measure_fast_mode_deviation, self_check
from oldlogit_service.model.ewma import EwmaProxy
from oldlogit_service.model.loaded import (
    LoadedModel,
    dtype_from_name,
    load_model,
    resolve_device,
)
from oldlogit_service.publishing.intake import Intake
from oldlogit_service.ranks.replica import Replica, open_replica
from oldlogit_service.runtime import Runtime
from oldlogit_service.scheduler import BatchPolicy, Scheduler
from oldlogit_service.snapshots import SnapshotStore
from oldlogit_service.validate import Limits

logger = logging.getLogger(__name__)


@dataclass
class Service:
    """One replica's parts, built by ``build_service``; ``start`` joins the deployment and
    starts the sweeper, ``close`` stops them and fails whatever is still queued."""

    settings: Settings
    runtime: Runtime
    intake: Intake
    auth: Auth
    control: Control
    replica: Replica | None = None  # --tensor-parallel N: the other ranks, closed last
    _stop: threading.Event = field(default_factory=threading.Event)
    _sweeper: threading.Thread | None = None

    def start(self, *, http: str, grpc: str) -> None:
        """Join the deployment (membership lists these addresses) and start the sweeper."""
        self.control.start(http=http, grpc=grpc, queue_depth=lambda: self.runtime.scheduler.depth)
        self._sweeper = threading.Thread(
            target=self._sweep_loop, name="oldlogit-sweeper", daemon=True
        )
        self._sweeper.start()

    def _sweep_loop(self) -> None:
        while not self._stop.wait(self.settings.sweep_interval_s):
            try:
                self.control.sweep()
                self.intake.sessions.sweep()
            except Exception:
                logger.exception("the periodic sweep failed; the next one retries")

    def close(self) -> None:
        self._stop.set()
        if self._sweeper is not None:
            self._sweeper.join(timeout=10)
            if self._sweeper.is_alive():
                logger.warning("the sweeper did not stop within 10 s")
        self.runtime.close()
        self.control.stop()
        if self.replica is not None:
            self.replica.close()


def build_service(settings: Settings) -> Service:
    """Load the architecture, open the snapshot store, seed version 0 / the demo versions, and
    build the parts that serve them."""
    device = resolve_device(settings.device)
    dtype = dtype_from_name(settings.dtype)
    if settings.demo:
        # The demo model is seeded, so a restart on the same snapshot dir rebuilds the very
        # same architecture; it lives outside the snapshot dir, which holds only versions.
        model_dir = make_tiny_model_dir(
            Path(tempfile.mkdtemp(prefix="oldlogit-demo-model-")), **DEMO_MODEL_KWARGS
        )
    else:
        assert settings.model is not None
        model_dir = settings.model
    # --tensor-parallel N: ranks 1..N-1 start here and join; the store is the front's, whose
    # versions land on every rank (ranks/).
    replica = open_replica(settings, model_dir, device) if settings.tensor_parallel > 1 else None
    model = (
        replica.model
        if replica is not None
        else load_model(
            model_dir,
            dtype=dtype,
            device=device,
            numerics=settings.numerics,
            tile_rows=settings.tile_rows,
            tp_chunks=settings.tp_chunks,
        )
    )
    settings.snapshot_dir.mkdir(parents=True, exist_ok=True)
    clustered = settings.redis_url is not None
    replica_id = settings.replica_id or default_replica_id()
    # Scale-out: each replica keeps its own store directory on the shared volume (its own
    # registry file and lock); the versions are one chain of keyframes and patches for the
    # deployment, in <snapshot-dir>/chain, adopted with their chain by hard link.
    root = settings.snapshot_dir / "replicas" / replica_id if clustered else settings.snapshot_dir
    root.mkdir(parents=True, exist_ok=True)
    cluster = (
        ClusterControl(
            settings.redis_url,
            settings.namespace,
            replica_id,
            chain_dir=settings.snapshot_dir / CHAIN_DIR,
        )
        if settings.redis_url is not None
        else None
    )
    store = (
        replica.store
        if replica is not None
        else SnapshotStore(
            root,
            param_specs=model.param_specs,
            device=device,
            device_budget_bytes=settings.device_budget_bytes(device),
            host_budget_bytes=settings.host_budget_bytes,
            disk_budget_bytes=settings.disk_budget_bytes,
            max_versions=settings.max_versions,
            keyframe_every=settings.keyframe_every,
            keyframe_chain_fraction=settings.keyframe_chain_fraction,
            keyframes_follow_access=settings.keyframes_follow_access,
            shared=cluster.shared if cluster is not None else None,
        )
    )
    control: Control = cluster.bind(store) if cluster is not None else LocalControl(store)
    # A replica joining a deployment that has versions takes them from it (a restarted or
    # new one): its model directory's weights are the deployment's version 0 at most.
    if (
        not store.versions()
        and store.newest is None
        and (cluster is None or cluster.registry.newest() is None)
    ):
        if settings.demo:
            publish_demo_versions(store, model_dir, model)
        else:
            weights = load_weights(model_dir, model)
            if weights is not None:
                logger.info("publishing the weights in %s as version 0", model_dir)
                store.publish(0, weights)
    engine = Engine(
        model,
        mode=settings.mode,
        lm_head_fp32=settings.lm_head_fp32,
        max_batch_tokens=settings.max_batch_tokens,
    )
    fast_deviation = None
    if replica is not None:
        replica.self_check()
    elif model.profile == "invariant":
        _check_numerics(engine, store, model)
    elif settings.mode == "fast":
        fast_deviation = _measure_fast_mode(engine, store, model)
    cache: Any = ResultCache(settings.cache_budget_bytes)
    if settings.cache_redis_url is not None:
        # Shared across replicas; its keys hold the weight hash, so no hit crosses a change.
        cache = RedisResultCache(connect(settings.cache_redis_url), settings.namespace)
        check_eviction_policy(cache.r, want="allkeys-lru", role="result-cache")
    ewma = None
    if settings.ewma_beta is not None:
        ewma = EwmaProxy(model, beta=settings.ewma_beta, state_dir=settings.snapshot_dir / "ewma")
        ewma.catch_up(store)  # versions published before (or while it was off)
    metrics = Metrics()
    scheduler = Scheduler(
        replica.engine if replica is not None else engine,
        replica.front if replica is not None else store,
        policy=BatchPolicy(
            max_batch_tokens=settings.max_batch_tokens,
            max_wait_s=settings.max_wait_ms / 1000.0,
        ),
        max_queue=settings.max_queue,
        observer=metrics,
        strategy=settings.strategy,
    )
    limits = Limits(
        vocab_size=model.vocab_size,
        max_seq_len=min(settings.max_seq_len or model.max_positions, model.max_positions),
        max_tokens_per_request=settings.max_tokens_per_request,
        max_sequences_per_request=settings.max_sequences_per_request,
        moe=model.moe_info(),
        replay=model.profile == "invariant",
    )
    runtime = Runtime(
        settings,
        model,
        store,
        scheduler,
        cache,
        control,
        limits=limits,
        metrics=metrics,
        history=History(),
        ewma=ewma,
        fast_deviation=fast_deviation,
        ranks=replica.front if replica is not None else None,
    )
    intake = Intake(settings, model, store, metrics, ewma=ewma)
    return Service(settings, runtime, intake, Auth(settings), control, replica)


def build_runtime(settings: Settings) -> Runtime:
    """The data plane alone, in process (tests, notebooks): ``build_service``'s runtime, with
    no transport and no sweeper; close with ``close()``. A publish through its ``store`` skips
    the intake (no publish metrics, no EWMA fold): ``build_service(...).intake`` has them."""
    return build_service(settings).runtime


@contextlib.contextmanager
def _check_weights(store: SnapshotStore, model: LoadedModel) -> Iterator[Mapping[str, Tensor]]:
    """The weights start-up checks run on: the newest retained version (the one most likely to
    be asked for), or random weights in the serving dtype when the store holds none yet."""
    newest = store.newest
    if newest is not None:
        with store.acquire(newest) as weights:
            yield weights
        return
    gen = torch.Generator().manual_seed(0)
    yield {  # every weight in its serving dtype (model.param_specs)
        name: (torch.randn(shape, generator=gen) * 0.05).to(model.device, model.weight_dtype(name))
        for name, (_, shape) in model.param_specs.items()
    }


def _check_numerics(engine: Engine, store: SnapshotStore, model: LoadedModel) -> None:
    """Refuse to start when packed batches are not bitwise equal to single sequences here."""
    start = time.perf_counter()
    with _check_weights(store, model) as weights:
        compared = self_check(engine, weights)
    logger.info(
        "numerics self-check: %d logprobs packed == alone, bitwise (%s, %.2f s)",
        compared,
        model.numerics_spec(engine.lm_head_fp32).key,
        time.perf_counter() - start,
    )


def _measure_fast_mode(engine: Engine, store: SnapshotStore, model: LoadedModel) -> float:
    """Fast mode under the plain numerics pads: its max |fast − reference| over random
    sequences, measured here at start-up (``/v1/info`` reports it)."""
    start = time.perf_counter()
    with _check_weights(store, model) as weights:
        worst = measure_fast_mode_deviation(
            model,
            weights,
            lm_head_fp32=engine.lm_head_fp32,
            max_batch_tokens=engine.max_batch_tokens,
        )
    logger.info(
        "fast mode pads sequences: max |fast - exact| %.3g over random sequences (%.2f s); "
        "its answers say exact=false",
        worst,
        time.perf_counter() - start,
    )
    return worst


async def _watch_ready(rt: Runtime, health: Any) -> None:
    """gRPC health follows ``/readyz`` when a part of the replica can be lost (a rank)."""
    while rt.not_ready_reason is None:
        await asyncio.sleep(0.5)
    await health.set_not_serving()


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP named, not 0: asyncio switches Nagle's algorithm off (TCP_NODELAY) only on
    # connections whose socket says TCP, and uvicorn writes a response's head and body in two
    # sends: with Nagle on, the body waits for the client's delayed ACK of the head (40 ms on
    # Linux) on every keep-alive request. Set on the listener too (accepted sockets inherit it).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind((host, port))
    sock.listen(1024)
    sock.setblocking(False)
    return sock


class _Uvicorn(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # Signals are ours: SIGTERM must flip readiness and drain before uvicorn stops.
        yield


@dataclass
class Bound:
    http: str  # host:port
    grpc: str  # host:port
    health: str | None = None  # host:port of --health-port (plain HTTP, probes only)


def server_tls(settings: Settings) -> ServerTls | None:
    """The TLS files of the settings, loaded (``TlsConfigError`` names a bad one)."""
    if settings.tls_cert_file is None or settings.tls_key_file is None:
        return None
    return ServerTls(settings.tls_cert_file, settings.tls_key_file, settings.tls_client_ca_file)


def _fixed_context(ctx: ssl.SSLContext) -> Callable[..., ssl.SSLContext]:
    def factory(_config: uvicorn.Config, _default: Callable[[], ssl.SSLContext]) -> ssl.SSLContext:
        return ctx

    return factory


async def _reload_tls(tls: ServerTls, interval_s: float, wake: asyncio.Event) -> None:
    """Re-read the TLS files every ``interval_s`` or when woken (SIGHUP)."""
    while True:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(wake.wait(), interval_s)
        wake.clear()
        # On the loop's own thread: uvicorn's handshakes use the live SSLContext from this
        # thread, and OpenSSL does not promise a context may change under a concurrent
        # handshake. The files are small: a reload takes about a millisecond.
        tls.reload()


async def serve(
    settings: Settings,
    *,
    service: Service | None = None,
    on_ready: Callable[[Bound, Service], None] | None = None,
    stop: asyncio.Event | None = None,
    install_signals: bool = True,
    tls: ServerTls | None = None,
) -> None:
    """Run both transports until ``stop`` is set or SIGTERM/SIGINT arrives.

    ``tls``: the certificates already loaded (the CLI loads them before the model, so a bad
    file fails at once); None loads them from ``settings`` when TLS is configured.
    """
    tls = tls or server_tls(settings)  # before the model: a bad file fails at once
    svc = service if service is not None else await asyncio.to_thread(build_service, settings)
    rt = svc.runtime
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    reload_now = asyncio.Event()
    if install_signals:
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, stop.set)
        if tls is not None:
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(signal.SIGHUP, reload_now.set)
    servers: list[tuple[_Uvicorn, asyncio.Task[None]]] = []
    ports: dict[str, int] = {}
    apps = [("http", settings.http_port, create_app(rt, svc.intake, svc.auth), tls)]
    if settings.health_port is not None:
        apps.append(("health", settings.health_port, create_health_app(rt), None))
    for name, port, app, app_tls in apps:
        sock = _bind(settings.host, port)
        ports[name] = sock.getsockname()[1]
        config = uvicorn.Config(
            app,
            log_config=None,
            access_log=False,
            lifespan="off",
            timeout_keep_alive=30,
            timeout_graceful_shutdown=max(1, int(settings.drain_timeout_s)),
            # The one live context of ServerTls: its reloads reach new handshakes.
            ssl_context_factory=_fixed_context(app_tls.ssl_context) if app_tls else None,
        )
        server = _Uvicorn(config)
        servers.append((server, asyncio.create_task(server.serve(sockets=[sock]))))
    grpc_server, grpc_port, health = await start_grpc_server(
        rt, svc.intake, svc.auth, settings.host, settings.grpc_port, tls
    )
    sampler = asyncio.create_task(sample_forever(rt.history, rt.metrics.registry))
    watcher = asyncio.create_task(_watch_ready(rt, health)) if rt.ranks is not None else None
    reloader = (
        asyncio.create_task(_reload_tls(tls, settings.tls_reload_interval_s, reload_now))
        if tls is not None
        else None
    )
    for server, task in servers:
        while not server.started and not task.done():
            await asyncio.sleep(0.01)
        if task.done():
            await task  # raises the start-up error
    host = f"[{settings.host}]" if ":" in settings.host else settings.host
    bound = Bound(
        http=f"{host}:{ports['http']}",
        grpc=f"{host}:{grpc_port}",
        health=f"{host}:{ports['health']}" if "health" in ports else None,
    )
    # The membership lists where others reach us, not where we bound (0.0.0.0 is no address).
    svc.start(
        http=advertised_address(settings.host, ports["http"], settings.advertise_host),
        grpc=advertised_address(settings.host, grpc_port, settings.advertise_host),
    )
    if on_ready is not None:
        on_ready(bound, svc)
    try:
        await stop.wait()
    finally:
        logger.info("shutting down: not ready, draining up to %.0fs", settings.drain_timeout_s)
        rt.start_draining()
        await health.set_not_serving()
        drained = await rt.drain(settings.drain_timeout_s)
        if not drained:
            logger.warning("drain timed out; remaining requests are failed as unavailable")
        await grpc_server.stop(grace=min(5.0, settings.drain_timeout_s))
        for server, _ in servers:
            server.should_exit = True
        for _, task in servers:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(task, timeout=settings.drain_timeout_s + 5)
        sampler.cancel()
        if watcher is not None:
            watcher.cancel()
        if reloader is not None:
            reloader.cancel()
        svc.close()


class ServerThread:
    """Runs ``serve`` on a background thread; for tests, benchmarks and notebooks."""

    def __init__(self, settings: Settings, service: Service | None = None) -> None:
        self.settings = settings
        self._service = service
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self.bound: Bound | None = None
        self.service: Service | None = None
        self._tls: ServerTls | None = None
        self._thread = threading.Thread(target=self._main, name="oldlogit-server", daemon=True)

    def _main(self) -> None:
        async def run() -> None:
            self._loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()

            def ready(b: Bound, svc: Service) -> None:
                self.bound, self.service = b, svc
                self._ready.set()

            self._tls = server_tls(self.settings)
            await serve(
                self.settings,
                service=self._service,
                on_ready=ready,
                stop=self._stop,
                install_signals=False,
                tls=self._tls,
            )

        try:
            asyncio.run(run())
        except BaseException as exc:  # surfaced by start()
            self._error = exc
            self._ready.set()

    def start(self, timeout_s: float = 120.0) -> ServerThread:
        self._thread.start()
        if not self._ready.wait(timeout_s):
            raise TimeoutError("the server did not start in time")
        if self._error is not None:
            raise self._error
        return self

    @property
    def runtime(self) -> Runtime:
        assert self.service is not None, "not started"
        return self.service.runtime

    @property
    def http_url(self) -> str:
        assert self.bound is not None
        return f"{'https' if self.settings.tls_enabled else 'http'}://{self.bound.http}"

    @property
    def grpc_url(self) -> str:
        assert self.bound is not None
        return f"{'grpcs' if self.settings.tls_enabled else 'grpc'}://{self.bound.grpc}"

    @property
    def tls(self) -> ServerTls | None:
        """The live certificates (tests call ``reload()`` on it instead of sending SIGHUP)."""
        return self._tls

    def reload_tls(self) -> bool:
        """Re-read the TLS files now, as SIGHUP does (on the server's loop); True if changed."""
        tls, loop = self._tls, self._loop
        assert tls is not None and loop is not None

        async def reload() -> bool:
            return tls.reload()

        return asyncio.run_coroutine_threadsafe(reload(), loop).result(timeout=30)

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None and not self._loop.is_closed():
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout=60)

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
