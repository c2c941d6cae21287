"""The Python client: ``AsyncClient`` and its sync twin ``Client``, over HTTP or gRPC.

In: token ids (lists, numpy or torch, duck-typed), versions and weights; out: contract types with
numpy arrays (``SequenceResult.logprobs`` float32, full length, NaN where not scored). The
methods parse their arguments into contract types and call through: every call runs on the
client's ``TransportPool`` (``oldlogit.transport``: replicas, retries, failover), publishing on
its ``Publisher`` (``oldlogit.publishing``). One code path: ``Client`` runs ``AsyncClient`` on
a private event-loop thread. Never imports torch (tensors are duck-typed).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import socket
import weakref
from collections.abc import Callable, Coroutine, Iterator, Mapping
from collections.abc import Sequence as Seq
from types import TracebackType
from typing import TYPE_CHECKING, Any, Concatenate, Literal, ParamSpec, TypeVar

from pydantic import ValidationError

from oldlogit.contract import wire
from oldlogit.contract.adapters import AdapterConfig
from oldlogit.contract.errors import InvalidRequest, UnknownLease
from oldlogit.contract.types import (
    Info,
    LeaseInfo,
    LogprobsRequest,
    PublishResult,
    RoutedExperts,
    Sampling,
    Sequence,
    SequenceResult,
    SessionInfo,
    Trace,
    TraceRequest,
    VersionInfo,
)
from oldlogit.publishing.adapters import AdapterUpload
from oldlogit.publishing.publisher import Publisher
from oldlogit.transport.base import TLS_SCHEMES, Transport, check_url, open_transport
from oldlogit.transport.loop_thread import LoopThread
from oldlogit.transport.pool import TransportPool
from oldlogit.transport.retry import RetryPolicy
from oldlogit.transport.tls import ClientTls

if TYPE_CHECKING:
    from oldlogit.contract.layout import WeightLayout
    from oldlogit.contract.safetensors import SafetensorsStream
    from oldlogit.integrations.padded import PaddedLogprobs
    from oldlogit.publishing.streams import WeightsCopy

__all__ = ["AsyncClient", "AsyncLease", "Client", "Lease"]

logger = logging.getLogger(__name__)

P = ParamSpec("P")
T = TypeVar("T")

DEFAULT_LEASE_TTL_S = 600.0


def _default_holder() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def _routing_key(req: LogprobsRequest) -> int | None:
    """The version a request is routed by (replicas are ranked per version: docs/operations.md)."""
    for seq in req.sequences:
        if seq.policy_version is not None:
            return seq.policy_version
        if seq.versions is not None and seq.versions.size:
            return int(seq.versions.max())
    return None


class AsyncClient:
    """Talks to one oldlogit deployment (a URL, or a list of replica URLs).

    ``timeout_s`` bounds each call, retries included, and is sent to the server as the request's
    deadline. Only ``Overloaded``/``Unavailable`` and connection failures are retried
    (``retries`` extra rounds over the replicas, exponential backoff with jitter, at least the
    server's ``retry_after_s``). ``publish_timeout_s`` bounds ``publish`` (default: none).
    ``http_encoding`` picks the logprobs body on HTTP (msgpack: compact binary arrays).
    ``https://`` and ``grpcs://`` URLs use TLS, verified against the system's CAs or
    ``ca_file`` (PEM); ``cert_file`` + ``key_file`` present a client certificate (mutual TLS).
    A failed handshake raises ``TlsError`` naming the reason, never retried.
    Connections open on first use and belong to that event loop; close with ``aclose()`` or
    ``async with``.
    """

    def __init__(
        self,
        url_or_urls: str | Seq[str],
        *,
        token: str | None = None,
        timeout_s: float | None = 60.0,
        retries: int = 3,
        backoff_s: float = 0.1,
        http_encoding: Literal["msgpack", "json"] = "msgpack",
        publish_timeout_s: float | None = None,
        ca_file: str | os.PathLike[str] | None = None,
        cert_file: str | os.PathLike[str] | None = None,
        key_file: str | os.PathLike[str] | None = None,
    ) -> None:
        urls = [url_or_urls] if isinstance(url_or_urls, str) else list(url_or_urls)
        if not urls:
            raise InvalidRequest("at least one URL is needed", parameter="url")
        tls = ClientTls.load(
            *(None if f is None else os.fspath(f) for f in (ca_file, cert_file, key_file))
        )
        for url in urls:
            if check_url(url) not in TLS_SCHEMES and tls is not None:
                raise InvalidRequest(
                    f"ca_file/cert_file/key_file need https:// or grpcs:// URLs, not {url!r}",
                    parameter="url",
                )
        if retries < 0:
            raise InvalidRequest("retries must be >= 0", parameter="retries")
        encoding = wire.MSGPACK_TYPE if http_encoding == "msgpack" else wire.JSON_TYPE

        def open_one(url: str) -> Transport:
            return open_transport(url, token=token, http_encoding=encoding, tls=tls)

        policy = RetryPolicy(retries=retries, backoff_s=backoff_s)
        self._pool = TransportPool(urls, open_one, policy, timeout_s=timeout_s)
        # Publishing's own state (the last delta's weights, the layout) lives there.
        self._publisher = Publisher(self._pool, self.info, timeout_s=publish_timeout_s)

    @property
    def urls(self) -> list[str]:
        return self._pool.urls

    # ------------------------------------------------------------------ logprobs

    async def logprobs(
        self,
        token_ids: Any,
        *,
        policy_version: int | None = None,
        score_from: int | None = None,
        versions: Any = None,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        proxy: Literal["ewma"] | None = None,
        allow_inexact: bool = False,
        use_cache: bool = True,
        timeout_s: float | None = None,
        routed_experts: RoutedExperts | Any = None,
        return_routing: bool = False,
    ) -> SequenceResult:
        """Logprobs of one sequence: ``policy_version`` (+ ``score_from``) or ``versions``.

        ``token_ids``: a list, numpy array or torch tensor. The result's ``logprobs`` has
        ``len(token_ids)`` float32 values, NaN where not scored (always position 0).
        MoE models: ``routed_experts`` replays a routing record (a ``RoutedExperts``, or its
        ids [n − 1, MoE layers, top_k] from position 0; ``oldlogit.contract.routing.from_vllm``
        / ``from_sglang`` map the engines' layouts), and ``return_routing`` returns the routing
        each version's forward used (``SequenceResult.routed_experts``); docs/exactness.md.
        """
        try:
            record = routed_experts
            if record is not None and not isinstance(record, RoutedExperts):
                record = RoutedExperts(ids=record)
            seq = Sequence(
                token_ids=token_ids,
                policy_version=policy_version,
                score_from=score_from,
                versions=versions,
                routed_experts=record,
            )
        except ValidationError as exc:
            raise _invalid(exc) from exc
        results = await self.logprobs_batch(
            [seq],
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            proxy=proxy,
            allow_inexact=allow_inexact,
            use_cache=use_cache,
            timeout_s=timeout_s,
            return_routing=return_routing,
        )
        return results[0]

    async def logprobs_batch(
        self,
        sequences: Seq[Sequence],
        *,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        proxy: Literal["ewma"] | None = None,
        allow_inexact: bool = False,
        use_cache: bool = True,
        timeout_s: float | None = None,
        return_routing: bool = False,
    ) -> list[SequenceResult]:
        """Logprobs of many sequences in one request; results in the same order.

        The sampling arguments apply to every sequence without its own ``Sequence.sampling``.
        ``timeout_s`` overrides the client's for this call (None: the client's).
        ``return_routing`` (MoE models): each result's ``routed_experts`` holds the routing of
        each of its versions' forwards.
        """
        try:
            req = LogprobsRequest(
                sequences=list(sequences),
                sampling=Sampling(temperature=temperature, top_k=top_k, top_p=top_p),
                proxy=proxy,
                allow_inexact=allow_inexact,
                use_cache=use_cache,
                return_routing=return_routing,
            )
        except ValidationError as exc:
            raise _invalid(exc) from exc

        async def op(t: Transport, remaining: float | None) -> list[SequenceResult]:
            # The server gets what is left of the deadline on this attempt.
            resp = await t.logprobs(req.model_copy(update={"timeout_s": remaining}), remaining)
            return resp.results

        return await self._pool.call(
            op, timeout_s="client" if timeout_s is None else timeout_s, key=_routing_key(req)
        )

    async def logprobs_padded(
        self,
        input_ids: Any,
        attention_mask: Any = None,
        *,
        response_mask: Any = None,
        score_from: Any = None,
        policy_version: int | None = None,
        versions: Any = None,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        use_cache: bool = True,
        timeout_s: float | None = None,
        sequences_per_request: int = 256,
        routed_experts: Any = None,
    ) -> PaddedLogprobs:
        """Logprobs of a padded ``[B, T]`` batch, aligned with it (TRL's and verl's layout).

        ``attention_mask`` marks each row's one run of real tokens (left or right padding);
        ``response_mask`` [B, T] or ``score_from`` (a column, or one per row) says which tokens
        to score; ``policy_version`` (one for all) or ``versions`` ([B] per row, [B, T] per
        token, −1 = not scored) says at which version. Returns ``PaddedLogprobs(logprobs, mask)``:
        [B, T] float32 and its mask, 0 where unscored (padding, prompts, a sequence's first
        token), so masked losses stay finite; torch tensors (on the input's device) when
        ``input_ids`` is one, else numpy. Requests of ``sequences_per_request`` sequences run
        concurrently. ``routed_experts`` (MoE models): [B, T, MoE layers, top_k] expert ids
        aligned with ``input_ids`` (row t: the routing of the forward that processed token t;
        padding rows and each sequence's last row are not sent), replayed by the service.
        """
        from oldlogit.integrations.padded import padded_requests, place_results

        seqs, placed, shape = padded_requests(
            input_ids,
            attention_mask,
            response_mask=response_mask,
            score_from=score_from,
            policy_version=policy_version,
            versions=versions,
            routed_experts=routed_experts,
        )
        if sequences_per_request < 1:
            raise InvalidRequest(
                "sequences_per_request must be >= 1", parameter="sequences_per_request"
            )
        chunks = [
            seqs[i : i + sequences_per_request] for i in range(0, len(seqs), sequences_per_request)
        ]
        answers = await asyncio.gather(
            *(
                self.logprobs_batch(
                    chunk,
                    temperature=temperature,
                    top_k=top_k,
                    top_p=top_p,
                    use_cache=use_cache,
                    timeout_s=timeout_s,
                )
                for chunk in chunks
            )
        )
        results = [r for answer in answers for r in answer]
        return place_results(results, placed, shape, input_ids)

    async def trace(
        self,
        token_ids: Any,
        policy_version: int,
        *,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
    ) -> Trace:
        """The digests of every stage of one forward of ``token_ids`` alone at
        ``policy_version`` on the service: ``oldlogit.parity.trace.forward_trace``, the function
        a trainer runs on its own model, so ``first_divergence`` of the two names the first
        stage where they part ways. 2 to min(``MAX_TRACE_TOKENS``, max_seq_len) tokens; the
        sampling arguments apply to the last stage (the processed logprobs). Never cached.
        """
        try:
            req = TraceRequest(
                token_ids=token_ids,
                policy_version=policy_version,
                temperature=temperature,
                top_k=top_k,
                top_p=top_p,
            )
        except ValidationError as exc:
            raise _invalid(exc) from exc
        return await self._pool.call(lambda t, rem: t.trace(req, rem), key=policy_version)

    # ------------------------------------------------------------------ versions

    async def versions(self) -> list[VersionInfo]:
        """The retained versions, ascending."""
        infos, _ = await self._pool.call(lambda t, rem: t.list_versions(rem))
        return infos

    async def version(self, policy_version: int) -> VersionInfo:
        return await self._pool.call(
            lambda t, rem: t.get_version(policy_version, rem), key=policy_version
        )

    async def delete_version(self, policy_version: int) -> None:
        await self._pool.call(
            lambda t, rem: t.delete_version(policy_version, rem), key=policy_version
        )

    async def set_watermark(self, policy_version: int) -> int:
        """Promise never to ask below ``policy_version``; returns the watermark in force."""
        return await self._pool.call(lambda t, rem: t.set_watermark(policy_version, rem))

    async def info(self) -> Info:
        return await self._pool.call(lambda t, rem: t.info(rem))

    async def replicas(self) -> list[dict[str, Any]]:
        """The deployment's live replicas (id, http, grpc, queue depth), from its registry."""
        return await self._pool.call(lambda t, rem: t.list_replicas(rem))

    async def discover(self) -> list[str]:
        """Replace the replica list with the deployment's live replicas (same scheme as the
        configured URLs), so routing and failover follow scale-ups and removals. Returns the
        URLs now in use; without a registry (one replica) nothing changes."""
        scheme = self.urls[0].split("://", 1)[0]
        field = "grpc" if scheme in ("grpc", "grpcs") else "http"
        found = [f"{scheme}://{m[field]}" for m in await self.replicas() if m.get(field)]
        self._pool.update(found)
        return self.urls

    async def publish(
        self,
        policy_version: int,
        weights: Mapping[str, Any] | str | os.PathLike[str],
        *,
        delta: bool = False,
        sha256: str | None = None,
        by_path: bool = False,
        progress: bool = False,
        fallback_full: bool = False,
        cast: bool = False,
    ) -> PublishResult:
        """Publish a version's weights: a ``{name: tensor}`` state dict, or a safetensors file
        or shard directory (uploaded; with ``by_path=True`` the service reads the path itself).

        A trainer's own ``model.state_dict()`` is accepted as it is: names are mapped onto the
        model's canonical weights with the service's weight layout (``Info.weight_layout``,
        fetched once): tied duplicates dropped by the model's tie table, wrapper prefixes
        (``_orig_mod.``, ``module.``, FSDP's) stripped, per-expert checkpoint tensors joined
        into the fused ones; the weight hash is over the canonical names. ``cast=True`` casts
        floating tensors (fp32 masters, say) to the serving dtype, one tensor at a time;
        without it another dtype is refused, naming the tensor. DTensors of a one-rank mesh
        are gathered; sharded ones need ``oldlogit.integrations.publish_sharded``.

        ``sha256`` defaults to the weight hash computed here (``oldlogit.contract.weights``) for
        uploads; the service verifies it. By path, the client never reads the files: without
        ``sha256`` the service computes the hash and returns it in the result (``delta=True``
        there means the path holds a delta file). The call's deadline is the client's
        ``publish_timeout_s`` (default: none, uploads take what they take).

        ``delta=True`` sends only the elements that changed since the last version this client
        published with ``delta=True`` (it keeps a CPU copy of those weights, in the serving
        dtype); the service rebuilds the version from its copy of that parent and checks the
        sha256 before the version becomes visible. The first such publish sends everything.
        If the service no longer has the parent it raises ``ParentMissing``; with
        ``fallback_full=True`` the client then uploads the full weights instead.
        """
        return await self._publisher.publish(
            policy_version,
            weights,
            delta=delta,
            sha256=sha256,
            by_path=by_path,
            progress=progress,
            fallback_full=fallback_full,
            cast=cast,
        )

    async def publish_adapter(
        self,
        policy_version: int,
        adapter: Any,
        *,
        base_version: int,
        sha256: str | None = None,
        progress: bool = False,
    ) -> PublishResult:
        """Publish an adapter version: LoRA tensors and config over the retained full-weights
        version ``base_version`` (docs/trainers.md, "Adapter versions").

        ``adapter``: a PEFT model, a PEFT ``save_pretrained`` directory, a
        ``(state_dict, config_dict)`` pair of PEFT's, or an ``oldlogit.parity.lora.Adapter``.
        A PEFT model is converted with ``oldlogit.parity.lora.adapter_from_peft`` (torch and
        peft); a directory or pair is read without torch when those are not installed.
        ``sha256`` defaults to the adapter hash computed here
        (``oldlogit.contract.weights.adapter_sha256``, over the base's weight hash); the
        service verifies it. The same version and hash again is a no-op; other tensors are a
        ``VersionConflict``.
        """
        upload = await asyncio.to_thread(_adapter_upload, adapter)
        return await self._publisher.publish_adapter(
            policy_version, upload, base_version=base_version, sha256=sha256, progress=progress
        )

    async def weight_layout(self) -> WeightLayout:
        """The model's weight layout (``Info.weight_layout``), fetched once per client."""
        return await self._publisher.weight_layout()

    async def _upload(
        self,
        policy_version: int,
        stream: SafetensorsStream,
        sha256: str,
        progress: bool,
        *,
        parent: int | None = None,
    ) -> PublishResult:
        """Stream one safetensors body (full weights, or a delta against ``parent``)."""
        return await self._publisher.upload(policy_version, stream, sha256, progress, parent=parent)

    # ------------------------------------------------------------------ publish sessions

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
        """Open a publish session (idempotent for the same id and parameters)."""
        return await self._publisher.sessions.open(
            session_id,
            policy_version,
            members,
            delta=delta,
            parent=parent,
            sha256=sha256,
            ttl_s=ttl_s,
        )

    async def upload_part(
        self,
        session_id: str,
        rank: int,
        chunks: Iterator[bytes],
        total_bytes: int,
        *,
        policy_version: int,
    ) -> SessionInfo:
        """Stage rank's part, read from ``chunks`` (a blocking iterator, pulled on a worker
        thread) of ``total_bytes`` bytes. Not retried: the iterator cannot be replayed."""
        return await self._publisher.sessions.upload_part(
            session_id, rank, chunks, total_bytes, policy_version=policy_version
        )

    async def commit_part(
        self, session_id: str, rank: int, sha256: str, *, policy_version: int
    ) -> SessionInfo:
        """Commit rank's staged part with the rank's hash; the last commit publishes."""
        return await self._publisher.sessions.commit_part(
            session_id, rank, sha256, policy_version=policy_version
        )

    async def session(self, session_id: str, *, policy_version: int) -> SessionInfo:
        """A session's state (``published`` carries the version's ``PublishResult``)."""
        return await self._publisher.sessions.get(session_id, policy_version=policy_version)

    async def abort_session(self, session_id: str, *, policy_version: int) -> SessionInfo:
        """Abort a session: its parts are dropped, nothing is published."""
        return await self._publisher.sessions.abort(session_id, policy_version=policy_version)

    async def publish_part(
        self,
        session_id: str,
        rank: int,
        weights: Mapping[str, Any],
        *,
        policy_version: int,
        parent_copy: WeightsCopy | None = None,
        cast: bool = False,
    ) -> tuple[SessionInfo, WeightsCopy | None]:
        """Upload and commit rank's share of the weights (a ``{name: tensor}``, any names the
        model's layout maps, a subset of the model).

        With ``parent_copy`` (this rank's share as it sent it last, from the previous call) the
        part is a delta against it; the session must be a delta session. Returns the session's
        state and this share's copy for the next delta (None for a full part).
        """
        return await self._publisher.sessions.publish_part(
            session_id,
            rank,
            weights,
            policy_version=policy_version,
            parent_copy=parent_copy,
            cast=cast,
        )

    # ------------------------------------------------------------------ leases

    async def create_lease(
        self, policy_version: int, *, ttl_s: float = DEFAULT_LEASE_TTL_S, holder: str | None = None
    ) -> LeaseInfo:
        """Pin ``policy_version`` for ``ttl_s`` seconds (or until ``release_lease``)."""
        return await self._pool.call(
            lambda t, rem: t.create_lease(policy_version, holder or _default_holder(), ttl_s, rem),
            key=policy_version,
        )

    async def release_lease(self, lease_id: str) -> None:
        await self._pool.call(lambda t, rem: t.delete_lease(lease_id, rem))

    def lease(
        self, policy_version: int, *, ttl_s: float = DEFAULT_LEASE_TTL_S, holder: str | None = None
    ) -> AsyncLease:
        """``async with client.lease(7, ttl_s=120) as info:`` pins version 7 inside the block."""
        return AsyncLease(self, policy_version, ttl_s=ttl_s, holder=holder)

    # ------------------------------------------------------------------ lifecycle

    async def aclose(self) -> None:
        await self._pool.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()


class AsyncLease:
    """A lease held for the duration of an ``async with`` block; released on exit."""

    def __init__(
        self, client: AsyncClient, policy_version: int, *, ttl_s: float, holder: str | None
    ) -> None:
        self._client = client
        self.policy_version = policy_version
        self.ttl_s = ttl_s
        self.holder = holder
        self.info: LeaseInfo | None = None

    async def __aenter__(self) -> LeaseInfo:
        self.info = await self._client.create_lease(
            self.policy_version, ttl_s=self.ttl_s, holder=self.holder
        )
        return self.info

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self.info is None:
            return
        lease_id, self.info = self.info.lease_id, None
        try:
            await self._client.release_lease(lease_id)
        except UnknownLease:
            logger.info("lease %s had already expired", lease_id)


# ---------------------------------------------------------------------- sync twin


def _sync(
    method: Callable[Concatenate[AsyncClient, P], Coroutine[Any, Any, T]],
) -> Callable[Concatenate[Client, P], T]:
    """The blocking twin of an ``AsyncClient`` method (same name, signature and docs)."""

    def wrapper(self: Client, /, *args: P.args, **kwargs: P.kwargs) -> T:
        return self._loop.run(method(self._aio, *args, **kwargs))

    functools.update_wrapper(wrapper, method)
    return wrapper


class Client:
    """The blocking client: the same methods as ``AsyncClient``, same arguments, same results.

    ``with Client("grpc://localhost:50051") as c: r = c.logprobs(ids, policy_version=7)``

    Thread-safe: every call runs on the client's own event loop thread, so one ``Client`` may
    serve all the threads of a process at once (their calls share its connections).
    """

    def __init__(
        self,
        url_or_urls: str | Seq[str],
        *,
        token: str | None = None,
        timeout_s: float | None = 60.0,
        retries: int = 3,
        backoff_s: float = 0.1,
        http_encoding: Literal["msgpack", "json"] = "msgpack",
        publish_timeout_s: float | None = None,
        ca_file: str | os.PathLike[str] | None = None,
        cert_file: str | os.PathLike[str] | None = None,
        key_file: str | os.PathLike[str] | None = None,
    ) -> None:
        self._aio = AsyncClient(
            url_or_urls,
            token=token,
            timeout_s=timeout_s,
            retries=retries,
            backoff_s=backoff_s,
            http_encoding=http_encoding,
            publish_timeout_s=publish_timeout_s,
            ca_file=ca_file,
            cert_file=cert_file,
            key_file=key_file,
        )
        self._loop = LoopThread()
        # A client dropped without close() must not leave its thread running.
        self._finalizer = weakref.finalize(self, self._loop.stop)

    @property
    def urls(self) -> list[str]:
        return self._aio.urls

    logprobs = _sync(AsyncClient.logprobs)
    logprobs_batch = _sync(AsyncClient.logprobs_batch)
    logprobs_padded = _sync(AsyncClient.logprobs_padded)
    trace = _sync(AsyncClient.trace)
    versions = _sync(AsyncClient.versions)
    version = _sync(AsyncClient.version)
    delete_version = _sync(AsyncClient.delete_version)
    set_watermark = _sync(AsyncClient.set_watermark)
    info = _sync(AsyncClient.info)
    replicas = _sync(AsyncClient.replicas)
    discover = _sync(AsyncClient.discover)
    publish = _sync(AsyncClient.publish)
    publish_adapter = _sync(AsyncClient.publish_adapter)
    weight_layout = _sync(AsyncClient.weight_layout)
    open_session = _sync(AsyncClient.open_session)
    upload_part = _sync(AsyncClient.upload_part)
    commit_part = _sync(AsyncClient.commit_part)
    session = _sync(AsyncClient.session)
    abort_session = _sync(AsyncClient.abort_session)
    publish_part = _sync(AsyncClient.publish_part)
    create_lease = _sync(AsyncClient.create_lease)
    release_lease = _sync(AsyncClient.release_lease)

    def lease(
        self, policy_version: int, *, ttl_s: float = DEFAULT_LEASE_TTL_S, holder: str | None = None
    ) -> Lease:
        """``with client.lease(7, ttl_s=120) as info:`` pins version 7 inside the block."""
        return Lease(self, self._aio.lease(policy_version, ttl_s=ttl_s, holder=holder))

    def close(self) -> None:
        if not self._finalizer.alive:
            return
        try:
            self._loop.run(self._aio.aclose())
        finally:
            self._finalizer()

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class Lease:
    """The blocking twin of ``AsyncLease``."""

    def __init__(self, client: Client, inner: AsyncLease) -> None:
        self._client = client
        self._inner = inner

    @property
    def info(self) -> LeaseInfo | None:
        return self._inner.info

    def __enter__(self) -> LeaseInfo:
        return self._client._loop.run(self._inner.__aenter__())

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._client._loop.run(self._inner.__aexit__(exc_type, exc, tb))


# ---------------------------------------------------------------------- helpers


def _adapter_upload(adapter: Any) -> AdapterUpload:
    """What ``publish_adapter`` sends for any of the adapters it takes (see there)."""
    if hasattr(adapter, "spec") and hasattr(adapter, "tensors"):  # oldlogit.parity.lora.Adapter
        config = AdapterConfig.from_dict(adapter.spec.as_dict())
        return AdapterUpload.from_tensors(config, adapter.tensors)
    is_path = isinstance(adapter, (str, os.PathLike))
    is_pair = isinstance(adapter, tuple) and len(adapter) == 2
    try:
        from oldlogit.parity.lora import adapter_from_peft
    except ImportError:  # no torch or peft here: PEFT's files read as they are
        if is_path:
            return AdapterUpload.from_directory(adapter)
        if is_pair:
            return AdapterUpload.from_peft_state_dict(adapter[0], adapter[1])
        raise InvalidRequest(
            "a PEFT model is converted with oldlogit.parity.lora (pip install 'oldlogit[trainer]' "
            "peft), or pass its save_pretrained directory",
            parameter="adapter",
        ) from None
    if not (is_path or is_pair or hasattr(adapter, "peft_config")):
        raise InvalidRequest(
            "adapter must be a PEFT model, a save_pretrained directory, a (state_dict, config) "
            f"pair or an oldlogit.parity.lora.Adapter, not {type(adapter).__name__}",
            parameter="adapter",
        )
    return _adapter_upload(adapter_from_peft(os.fspath(adapter) if is_path else adapter))


def _invalid(exc: ValidationError) -> InvalidRequest:
    first = exc.errors()[0]
    parameter = wire.parameter_path(first["loc"])
    return InvalidRequest(f"{parameter}: {first['msg']}", parameter=parameter)
