"""The client without a real service: the retry/failover policy with fakes, the clients over fake
transports, publish payloads, the HTTP transport over httpx.MockTransport, the gRPC transport
against an in-process fake servicer, and the torch-free import."""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import httpx
import numpy as np
import pytest

import oldlogit.client as client_mod
from oldlogit._proto.oldlogit.v1 import oldlogit_pb2 as pb
from oldlogit._proto.oldlogit.v1 import oldlogit_pb2_grpc as pb_grpc
from oldlogit.client import AsyncClient, Client
from oldlogit.contract import convert, errors, wire
from oldlogit.contract.convert import PublishHeader
from oldlogit.contract.safetensors import coalesce
from oldlogit.contract.types import (
    Info,
    LeaseInfo,
    LogprobsRequest,
    LogprobsResponse,
    PublishResult,
    Sequence,
    SequenceResult,
    Trace,
    TraceRequest,
    TraceStageInfo,
    VersionInfo,
)
from oldlogit.contract.weights import safetensors_sha256, weight_sha256
from oldlogit.publishing.streams import SafetensorsStream
from oldlogit.transport.http import HttpTransport
from oldlogit.transport.retry import ReplicaSet, RetryPolicy, call_with_retries

# ---------------------------------------------------------------- retry policy (pure logic)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def _scripted(
    script: dict[str, list[Any]], log: list[tuple[str, float | None]]
) -> Callable[..., Any]:
    """op(replica, remaining): pops the replica's next outcome (an exception or a value)."""

    async def op(replica: str, remaining: float | None) -> Any:
        log.append((replica, remaining))
        outcome = script[replica].pop(0)
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    return op


def _log() -> list[tuple[str, float | None]]:
    return []


def _run(op: Callable[..., Any], replicas: ReplicaSet[str], clock: Clock, **kw: Any) -> Any:
    kw.setdefault("timeout_s", None)
    return asyncio.run(
        call_with_retries(
            op,
            replicas,
            kw.pop("policy", RetryPolicy(retries=3, backoff_s=0.1)),
            sleep=clock.sleep,
            clock=clock,
            rng=random.Random(0),
            **kw,
        )
    )


def test_unavailable_fails_over_at_once_and_remembers_the_dead_replica() -> None:
    clock, log = Clock(), _log()
    replicas = ReplicaSet(["a", "b"], cooldown_s=5.0, clock=clock)
    script: dict[str, list[Any]] = {
        "a": [errors.Unavailable("down", retry_after_s=0.0)],
        "b": ["ok", "ok2"],
    }
    assert _run(_scripted(script, log), replicas, clock) == "ok"
    assert [r for r, _ in log] == ["a", "b"] and clock.sleeps == []
    assert replicas.order() == ["b", "a"]  # a is cooling down
    assert _run(_scripted(script, log), replicas, clock) == "ok2"
    assert log[-1][0] == "b"
    clock.now += 6.0
    assert replicas.order() == ["a", "b"]  # cooled down: configured order again


def test_overloaded_backs_off_at_least_retry_after() -> None:
    clock, log = Clock(), _log()
    replicas = ReplicaSet(["a", "b"], clock=clock)
    script: dict[str, list[Any]] = {
        "a": [errors.Overloaded("busy", retry_after_s=2.0), "ok"],
        "b": [],
    }
    assert _run(_scripted(script, log), replicas, clock) == "ok"
    assert [r for r, _ in log] == ["a", "a"]  # Overloaded ends the round; b is not tried
    assert clock.sleeps == [pytest.approx(2.0)]


@pytest.mark.parametrize(
    "err",
    [
        errors.InvalidRequest("bad", parameter="token_ids"),
        errors.UnknownVersion("no"),
        errors.DeadlineExceeded("late"),
        errors.InternalError("boom"),
        # A failed TLS handshake: every replica shares the certificates, none is "down".
        errors.TlsError("untrusted", parameter="ca_file", details={"reason": "untrusted"}),
    ],
)
def test_other_errors_are_not_retried(err: errors.OldLogitError) -> None:
    clock, log = Clock(), _log()
    script: dict[str, list[Any]] = {"a": [err], "b": ["never"]}
    with pytest.raises(type(err)):
        _run(_scripted(script, log), ReplicaSet(["a", "b"], clock=clock), clock)
    assert len(log) == 1 and clock.sleeps == []


def test_gives_up_after_the_retries_with_growing_jittered_backoff() -> None:
    clock, log = Clock(), _log()
    down = [errors.Unavailable("down", retry_after_s=0.0) for _ in range(10)]
    script: dict[str, list[Any]] = {"a": list(down), "b": list(down)}
    policy = RetryPolicy(retries=3, backoff_s=0.1, max_backoff_s=0.3)
    with pytest.raises(errors.Unavailable):
        _run(_scripted(script, log), ReplicaSet(["a", "b"], clock=clock), clock, policy=policy)
    assert len(log) == 2 * 4  # every replica, 1 + 3 rounds
    assert len(clock.sleeps) == 3
    for k, wait in enumerate(clock.sleeps):
        base = min(0.3, 0.1 * 2**k)
        assert base / 2 <= wait <= base


def test_the_deadline_bounds_retries_and_is_passed_down() -> None:
    clock, log = Clock(), _log()
    script: dict[str, list[Any]] = {"a": [errors.Overloaded("busy", retry_after_s=1.0)] * 5}
    with pytest.raises(errors.Overloaded):
        _run(_scripted(script, log), ReplicaSet(["a"], clock=clock), clock, timeout_s=2.5)
    assert [rem for _, rem in log] == [pytest.approx(2.5), pytest.approx(1.5), pytest.approx(0.5)]
    assert clock.sleeps == [pytest.approx(1.0)] * 2  # a third 1 s wait would pass the deadline


def test_zero_timeout_is_a_deadline_error() -> None:
    clock = Clock()
    with pytest.raises(errors.DeadlineExceeded):
        _run(_scripted({"a": ["ok"]}, []), ReplicaSet(["a"], clock=clock), clock, timeout_s=0.0)


# ---------------------------------------------------------------- clients over fake transports


class FakeTransport:
    """Implements oldlogit.transport.base.Transport in memory; ``fail``: errors to raise first."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.fail: list[errors.OldLogitError] = []
        self.calls: list[tuple[str, Any]] = []
        self.uploads: list[bytes] = []
        self.leases: dict[str, LeaseInfo] = {}
        self.closed = False
        self.fail_upload_after: int | None = None  # chunks read before a connection drop

    def _enter(self, name: str, arg: Any) -> None:
        self.calls.append((name, arg))
        if self.fail:
            raise self.fail.pop(0)

    async def logprobs(self, req: LogprobsRequest, timeout_s: float | None) -> LogprobsResponse:
        self._enter("logprobs", (req, timeout_s))
        return LogprobsResponse(
            results=[
                SequenceResult(
                    logprobs=np.where(s.scored_mask(), -np.arange(len(s.token_ids)), np.nan).astype(
                        np.float32
                    ),
                    versions=sorted({int(v) for v in s.per_token_versions() if v >= 0}),
                    weight_sha256={int(v): "h" for v in s.per_token_versions() if v >= 0},
                )
                for s in req.sequences
            ]
        )

    async def trace(self, req: TraceRequest, timeout_s: float | None) -> Trace:
        self._enter("trace", (req, timeout_s))
        stage = TraceStageInfo(name="logprobs", dtype="float32", sha256="s", total=0, absmax=0)
        return Trace(
            policy_version=req.policy_version, weight_sha256="h", numerics="n", stages=[stage]
        )

    async def list_versions(self, timeout_s: float | None) -> tuple[list[VersionInfo], int | None]:
        self._enter("list_versions", timeout_s)
        return [VersionInfo(policy_version=1, weight_sha256="h", nbytes=1, tiers=["disk"])], 0

    async def get_version(self, policy_version: int, timeout_s: float | None) -> VersionInfo:
        self._enter("get_version", policy_version)
        return VersionInfo(policy_version=policy_version, weight_sha256="h", nbytes=1, tiers=[])

    async def delete_version(self, policy_version: int, timeout_s: float | None) -> None:
        self._enter("delete_version", policy_version)

    async def publish(
        self, header: PublishHeader, chunks: AsyncIterator[bytes], timeout_s: float | None
    ) -> PublishResult:
        self._enter("publish", (header, timeout_s))
        got = []
        async for chunk in chunks:
            got.append(chunk)
            if self.fail_upload_after is not None and len(got) >= self.fail_upload_after:
                self.fail_upload_after = None
                raise errors.Unavailable("connection reset", retry_after_s=0.0)
        self.uploads.append(b"".join(got))
        return PublishResult(
            policy_version=header.policy_version, weight_sha256=header.sha256, created=True
        )

    async def publish_by_path(
        self, header: PublishHeader, path: str, timeout_s: float | None
    ) -> PublishResult:
        self._enter("publish_by_path", (header, path))
        return PublishResult(
            policy_version=header.policy_version,
            weight_sha256=header.sha256 or "computed",
            created=True,
        )

    async def set_watermark(self, policy_version: int, timeout_s: float | None) -> int:
        self._enter("set_watermark", policy_version)
        return policy_version

    async def create_lease(
        self, policy_version: int, holder: str, ttl_s: float, timeout_s: float | None
    ) -> LeaseInfo:
        self._enter("create_lease", (policy_version, holder, ttl_s))
        info = LeaseInfo(
            lease_id=f"L{len(self.leases)}",
            policy_version=policy_version,
            holder=holder,
            ttl_s=ttl_s,
            expires_at=0.0,
        )
        self.leases[info.lease_id] = info
        return info

    async def delete_lease(self, lease_id: str, timeout_s: float | None) -> None:
        self._enter("delete_lease", lease_id)
        if self.leases.pop(lease_id, None) is None:
            raise errors.UnknownLease(f"no lease {lease_id}", parameter="lease_id")

    async def info(self, timeout_s: float | None) -> Info:
        self._enter("info", timeout_s)
        return Info(
            model_type="qwen2",
            architecture="Qwen2ForCausalLM",
            vocab_size=512,
            max_positions=64,
            num_parameters=1,
            dtype="float32",
            head_dtype="float32",
            device="cpu",
            mode="deterministic",
        )

    async def aclose(self) -> None:
        self.closed = True


@pytest.fixture
def fakes(monkeypatch: pytest.MonkeyPatch) -> dict[str, FakeTransport]:
    made: dict[str, FakeTransport] = {}

    def open_fake(url: str, *, token: str | None, http_encoding: str, tls: Any) -> FakeTransport:
        return made.setdefault(url, FakeTransport(url))

    monkeypatch.setattr(client_mod, "open_transport", open_fake)
    return made


class DuckTensor:
    """Quacks like a torch tensor (detach/cpu/numpy) without importing torch."""

    def __init__(self, values: list[int]) -> None:
        self._a = np.array(values)

    def detach(self) -> DuckTensor:
        return self

    def cpu(self) -> DuckTensor:
        return self

    def numpy(self) -> np.ndarray:
        return self._a


def test_sync_client_logprobs_shape_and_deadline(fakes: dict[str, FakeTransport]) -> None:
    with Client("http://a:1", timeout_s=30.0) as c:
        r = c.logprobs(DuckTensor([5, 6, 7, 8]), policy_version=3, score_from=2, temperature=0.5)
        assert r.logprobs.dtype == np.float32 and r.logprobs.shape == (4,)
        np.testing.assert_array_equal(r.logprobs, [np.nan, np.nan, -2.0, -3.0])
        assert r.versions == [3] and r.weight_sha256 == {3: "h"} and r.exact and not r.cached
        req, timeout = fakes["http://a:1"].calls[-1][1]
        assert req.sampling.temperature == 0.5
        assert 0 < req.timeout_s <= 30.0 and timeout == req.timeout_s  # server told the deadline
        rs = c.logprobs_batch(
            [Sequence(token_ids=[1, 2, 3], versions=[-1, 4, 5]), Sequence(token_ids=[1])],
            top_k=5,
            timeout_s=5.0,
        )
        assert [r.versions for r in rs] == [[4, 5], []]
        assert fakes["http://a:1"].calls[-1][1][1] <= 5.0
    assert fakes["http://a:1"].closed


def test_sync_client_invalid_inputs_name_the_parameter(fakes: dict[str, FakeTransport]) -> None:
    with Client("grpc://a:1") as c:
        with pytest.raises(errors.InvalidRequest) as info:
            c.logprobs("not tokens", policy_version=1)
        assert info.value.parameter == "token_ids"
        with pytest.raises(errors.InvalidRequest) as info:
            c.logprobs([1, 2], policy_version=1, proxy="magic")  # type: ignore[arg-type]
        assert info.value.parameter == "proxy"
    for url in ("ftp://x:1", "grpc://x:1/path", "localhost:8000"):
        with pytest.raises(errors.InvalidRequest) as info:
            Client(url)
        assert info.value.parameter == "url"


def test_sync_client_trace_parses_once_retries_and_routes_by_version(
    fakes: dict[str, FakeTransport],
) -> None:
    with Client(["http://a:1", "http://b:2"], backoff_s=0.001) as c:
        first = c.trace(DuckTensor([5, 6, 7]), 3, temperature=0.5, top_k=2)
        assert first.policy_version == 3 and first.stages[0].name == "logprobs"
        (url,) = [u for u, f in fakes.items() if f.calls]
        req, _ = fakes[url].calls[-1][1]
        assert req.token_ids.tolist() == [5, 6, 7] and (req.temperature, req.top_k) == (0.5, 2)
        fakes[url].fail = [errors.Overloaded("busy", retry_after_s=0.001)]
        assert c.trace([1, 2], 3).policy_version == 3  # retried, on the version's replica
        assert [n for n, _ in fakes[url].calls] == ["trace"] * 3
        with pytest.raises(errors.InvalidRequest) as info:
            c.trace("not tokens", 3)
        assert info.value.parameter == "token_ids"


def test_sync_client_fails_over_and_retries(fakes: dict[str, FakeTransport]) -> None:
    with Client(["http://a:1", "grpc://b:2"], backoff_s=0.001) as c:
        c.info()
        assert "grpc://b:2" not in fakes  # a replica's transport is opened on first use
        fakes["http://a:1"].fail = [errors.Unavailable("down", retry_after_s=0.0)]
        assert c.version(9).policy_version == 9
        assert fakes["grpc://b:2"].calls == [("get_version", 9)]
        # a is cooling down, so b goes first; Overloaded backs off and retries b.
        fakes["grpc://b:2"].fail = [errors.Overloaded("busy", retry_after_s=0.01)]
        assert c.versions()[0].policy_version == 1
        assert [n for n, _ in fakes["grpc://b:2"].calls][-2:] == ["list_versions"] * 2
        assert [n for n, _ in fakes["http://a:1"].calls] == ["info", "get_version"]


def test_sync_client_other_methods(fakes: dict[str, FakeTransport]) -> None:
    with Client("http://a:1") as c:
        assert c.set_watermark(4) == 4
        c.delete_version(2)
        assert c.info().vocab_size == 512
        fake = fakes["http://a:1"]
        assert ("delete_version", 2) in fake.calls and ("set_watermark", 4) in fake.calls


def test_lease_context_creates_and_releases(fakes: dict[str, FakeTransport]) -> None:
    with Client("http://a:1") as c:
        with c.lease(7, ttl_s=30.0, holder="me") as info:
            assert info.policy_version == 7 and info.holder == "me"
            assert info.lease_id in fakes["http://a:1"].leases
        assert not fakes["http://a:1"].leases
        with pytest.raises(RuntimeError), c.lease(7):
            raise RuntimeError("the block failed")
        assert not fakes["http://a:1"].leases  # released anyway
        with c.lease(8) as info:  # already expired on the server: exit stays quiet
            fakes["http://a:1"].leases.clear()
        lease = c.create_lease(9, ttl_s=5.0)
        c.release_lease(lease.lease_id)
        with pytest.raises(errors.UnknownLease):
            c.release_lease(lease.lease_id)


async def test_async_client_twin(fakes: dict[str, FakeTransport]) -> None:
    async with AsyncClient("grpc://a:1") as c:
        r = await c.logprobs([1, 2, 3], versions=[-1, 2, -1])
        np.testing.assert_array_equal(r.logprobs, [np.nan, -1.0, np.nan])
        async with c.lease(2) as info:
            assert info.lease_id in fakes["grpc://a:1"].leases
        assert not fakes["grpc://a:1"].leases
    assert fakes["grpc://a:1"].closed


def test_closed_client_refuses_calls(fakes: dict[str, FakeTransport]) -> None:
    c = Client("http://a:1")
    c.close()
    c.close()  # idempotent
    with pytest.raises(RuntimeError):
        c.info()


def test_sync_and_async_twins_have_the_same_methods() -> None:
    def public(cls: type) -> set[str]:
        return {n for n in dir(cls) if not n.startswith("_")}

    assert public(AsyncClient) - {"aclose"} == public(Client) - {"close"}


# ---------------------------------------------------------------- publish


def _state_dict() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "model.layers.0.mlp.weight": rng.standard_normal((33, 7)).astype(np.float32),
        "lm_head.weight": rng.standard_normal((5, 3)).astype(np.float16),
        "model.norm.bias": np.arange(3, dtype=np.int64),
        "scalar": np.array(2.5, dtype=np.float64),
        "empty": np.zeros((0, 4), dtype=np.float32),
    }


def _load(data: bytes) -> dict[str, np.ndarray]:
    from safetensors.numpy import load

    return load(data)


def test_coalesce_recuts_exactly() -> None:
    rng = np.random.default_rng(1)
    pieces = [rng.bytes(int(n)) for n in rng.integers(0, 40, 50)]
    chunks = list(coalesce(pieces, 16))
    assert b"".join(chunks) == b"".join(pieces)
    assert all(len(c) == 16 for c in chunks[:-1]) and 0 < len(chunks[-1]) <= 16


def test_state_dict_stream_is_a_valid_safetensors_file() -> None:
    sd = _state_dict()
    stream = SafetensorsStream.from_state_dict(sd)
    data = b"".join(stream.chunks(chunk_bytes=64))
    assert len(data) == stream.total_bytes
    assert (8 + int.from_bytes(data[:8], "little")) % 8 == 0  # data region 8-aligned
    loaded = _load(data)
    assert set(loaded) == set(sd)
    for name, arr in sd.items():
        assert loaded[name].dtype == arr.dtype and loaded[name].shape == arr.shape
        np.testing.assert_array_equal(loaded[name], arr)
    assert b"".join(stream.chunks()) == data  # re-iterable for retries
    assert stream.sha256() == weight_sha256(sd)


def test_torch_state_dict_stream_matches_the_weight_hash(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    sd = {
        "w": torch.randn(4, 3, dtype=torch.bfloat16),
        "b": torch.arange(5, dtype=torch.int32),
        "t": torch.randn(6, 4).t(),  # non-contiguous
    }
    stream = SafetensorsStream.from_state_dict(sd)
    path = tmp_path / "w.safetensors"
    path.write_bytes(b"".join(stream.chunks()))
    from safetensors.torch import load_file

    loaded = load_file(str(path))
    for name, t in sd.items():
        assert torch.equal(loaded[name], t)
    assert stream.sha256() == weight_sha256(sd) == safetensors_sha256(path)


def _write_shards(tmp_path: Path) -> tuple[Path, dict[str, np.ndarray]]:
    from safetensors.numpy import save_file

    sd = _state_dict()
    names = sorted(sd)
    shard_dir = tmp_path / "shards"
    shard_dir.mkdir()
    save_file({n: sd[n] for n in names[:2]}, str(shard_dir / "model-00001-of-00002.safetensors"))
    save_file({n: sd[n] for n in names[2:]}, str(shard_dir / "model-00002-of-00002.safetensors"))
    return shard_dir, sd


def test_publish_state_dict_file_and_shards(
    fakes: dict[str, FakeTransport], tmp_path: Path
) -> None:
    shard_dir, sd = _write_shards(tmp_path)
    single = tmp_path / "single.safetensors"
    from safetensors.numpy import save_file

    save_file(sd, str(single))
    expected_sha = weight_sha256(sd)
    with Client("http://a:1") as c:
        sources: list[Any] = [sd, single, str(shard_dir)]
        for i, weights in enumerate(sources):
            res = c.publish(i, weights, progress=True)
            assert res.weight_sha256 == expected_sha and res.policy_version == i
            header = fakes["http://a:1"].calls[-1][1][0]
            assert header.sha256 == expected_sha and not header.delta
            upload = fakes["http://a:1"].uploads[-1]
            assert header.total_bytes == len(upload)
            loaded = _load(upload)
            assert set(loaded) == set(sd)
            for name in sd:
                np.testing.assert_array_equal(loaded[name], sd[name])
        # delta=True: the first such publish has nothing to diff against and sends it all;
        # the next one sends a delta against it (tests/unit/test_codec.py checks the format).
        c.publish(3, sd, delta=True)
        header = fakes["http://a:1"].calls[-1][1][0]
        assert header.sha256 == expected_sha and not header.delta
        c.publish(4, sd, delta=True)
        header = fakes["http://a:1"].calls[-1][1][0]
        assert header.delta and header.parent == 3 and header.sha256 == expected_sha
        with pytest.raises(errors.WeightsMismatch):
            c.publish(5, sd, delta=True, sha256="0" * 64)


def test_publish_by_path_never_reads_the_files(
    fakes: dict[str, FakeTransport], tmp_path: Path
) -> None:
    shard_dir, _ = _write_shards(tmp_path)
    with Client("grpc://a:1") as c:
        c.publish(5, shard_dir, by_path=True)
        header, path = fakes["grpc://a:1"].calls[-1][1]
        assert path == str(shard_dir) and header.sha256 is None  # the service hashes
        c.publish(6, "/only/on/the/server", by_path=True, sha256="abc")
        header, path = fakes["grpc://a:1"].calls[-1][1]
        assert path == "/only/on/the/server" and header.sha256 == "abc"
        with pytest.raises(errors.InvalidRequest) as info:
            c.publish(7, _state_dict(), by_path=True)
        assert info.value.parameter == "weights"
        with pytest.raises(errors.InvalidRequest):
            c.publish(7, {})


def test_publish_restarts_the_stream_after_a_dropped_connection(
    fakes: dict[str, FakeTransport], monkeypatch: pytest.MonkeyPatch
) -> None:
    import oldlogit.contract.safetensors as publish_mod

    monkeypatch.setattr(publish_mod, "CHUNK_BYTES", 128)
    sd = _state_dict()
    with Client("http://a:1", backoff_s=0.001) as c:
        c.info()
        fakes["http://a:1"].fail_upload_after = 2
        c.publish(1, sd)
    assert [n for n, _ in fakes["http://a:1"].calls].count("publish") == 2
    assert set(_load(fakes["http://a:1"].uploads[-1])) == set(sd)


# ---------------------------------------------------------------- HTTP transport (MockTransport)


def _http(
    handler: Callable[[httpx.Request], Any], encoding: str = wire.MSGPACK_TYPE
) -> HttpTransport:
    return HttpTransport(
        "http://svc:8000/",
        token="s3cret",
        encoding=encoding,
        transport=httpx.MockTransport(handler),
    )


@pytest.mark.parametrize("encoding", [wire.MSGPACK_TYPE, wire.JSON_TYPE])
async def test_http_logprobs_speaks_the_wire_format(encoding: str) -> None:
    seen: dict[str, Any] = {}

    def handler(request: httpx.Request) -> httpx.Response:
        seen["auth"] = request.headers["authorization"]
        seen["path"] = request.url.path
        req = wire.decode_request(request.content, request.headers["content-type"])
        kind = wire.negotiate(request.headers["accept"])
        resp = LogprobsResponse(
            results=[
                SequenceResult(
                    logprobs=np.where(s.scored_mask(), -np.inf, np.nan).astype(np.float32),
                    versions=[1],
                    weight_sha256={1: "h"},
                )
                for s in req.sequences
            ]
        )
        body = wire.encode_response(resp, req, kind)
        return httpx.Response(200, content=body, headers={"content-type": kind})

    t = _http(handler, encoding)
    req = LogprobsRequest(sequences=[Sequence(token_ids=[1, 2, 3], policy_version=1, score_from=2)])
    resp = await t.logprobs(req, 5.0)
    np.testing.assert_array_equal(resp.results[0].logprobs, [np.nan, np.nan, -np.inf])
    assert seen == {"auth": "Bearer s3cret", "path": "/v1/logprobs"}
    await t.aclose()


async def test_http_errors_and_connection_failures_are_typed() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/info":
            status, body, headers = wire.encode_error(errors.Overloaded("busy", retry_after_s=2.5))
            return httpx.Response(status, content=body, headers=headers)
        if request.url.path == "/v1/versions/3":
            err = errors.VersionEvicted(
                "gone", parameter="policy_version", details={"retained": [5, 9]}
            )
            status, body, headers = wire.encode_error(err)
            return httpx.Response(status, content=body, headers=headers)
        if request.url.path == "/v1/watermark":
            raise httpx.ReadTimeout("slow", request=request)
        raise httpx.ConnectError("refused", request=request)

    t = _http(handler)
    with pytest.raises(errors.Overloaded) as over:
        await t.info(1.0)
    assert over.value.retry_after_s == 2.5
    with pytest.raises(errors.VersionEvicted) as gone:
        await t.get_version(3, 1.0)
    assert gone.value.details == {"retained": [5, 9]} and gone.value.parameter == "policy_version"
    with pytest.raises(errors.DeadlineExceeded):
        await t.set_watermark(1, 1.0)
    with pytest.raises(errors.Unavailable):
        await t.list_versions(1.0)
    await t.aclose()


async def test_http_publish_and_management_routes() -> None:
    seen: list[tuple[str, str, dict[str, str], bytes]] = []
    lengths: list[str | None] = []

    async def handler(request: httpx.Request) -> httpx.Response:
        body = await request.aread()
        lengths.append(request.headers.get("content-length"))
        seen.append((request.method, request.url.raw_path.decode(), dict(request.url.params), body))
        path = request.url.path
        if path.startswith("/v1/versions") and request.method in ("PUT", "POST"):
            v = (
                int(path.rsplit("/", 1)[1])
                if request.method == "PUT"
                else json.loads(body)["policy_version"]
            )
            sha = hashlib.sha256(body).hexdigest() if request.method == "PUT" else "p"
            return httpx.Response(
                200, json={"policy_version": v, "weight_sha256": sha, "created": True}
            )
        if path == "/v1/versions":
            return httpx.Response(200, json={"versions": [], "watermark": None})
        if path == "/v1/leases":
            req = json.loads(body)
            return httpx.Response(200, json={"lease_id": "a/b", "expires_at": 1.0, **req})
        if request.method == "DELETE":
            return httpx.Response(200, json={"released": path.rsplit("/", 1)[1]})
        return httpx.Response(200, json={"watermark": json.loads(body)["policy_version"]})

    t = _http(handler)

    async def chunks() -> AsyncIterator[bytes]:
        yield b"abc"
        yield b"def"

    res = await t.publish(
        PublishHeader(4, "s", delta=True, parent=3, total_bytes=6), chunks(), None
    )
    assert res.weight_sha256 == hashlib.sha256(b"abcdef").hexdigest()
    assert seen[-1][0] == "PUT" and seen[-1][1].startswith("/v1/versions/4?")
    assert seen[-1][2] == {"sha256": "s", "delta": "true", "parent": "3"}
    assert seen[-1][3] == b"abcdef" and lengths[-1] == "6"
    res = await t.publish_by_path(PublishHeader(5, "s"), "/data/w", None)
    assert res.policy_version == 5
    assert json.loads(seen[-1][3]) == {
        "policy_version": 5,
        "path": "/data/w",
        "sha256": "s",
        "delta": False,
        "parent": None,
    }
    assert await t.list_versions(None) == ([], None)
    assert await t.set_watermark(3, None) == 3
    lease = await t.create_lease(2, "me", 9.0, None)
    assert lease.lease_id == "a/b"
    await t.delete_lease("a/b", None)
    assert seen[-1][0] == "DELETE" and seen[-1][1] == "/v1/leases/a%2Fb"
    await t.aclose()


# ---------------------------------------------------------------- gRPC transport (fake servicer)


class FakeServicer(pb_grpc.OldLogitServicer):
    def __init__(self) -> None:
        self.metadata: list[tuple[str, str]] = []
        self.uploads: list[tuple[PublishHeader, bytes]] = []

    async def Logprobs(self, request: pb.LogprobsRequest, context: Any) -> pb.LogprobsResponse:
        self.metadata = list(context.invocation_metadata())
        req = convert.request_from_proto(request)
        resp = LogprobsResponse(
            results=[
                SequenceResult(
                    logprobs=np.where(s.scored_mask(), -1.5, np.nan).astype(np.float32),
                    versions=[2],
                    weight_sha256={2: "h"},
                    cached=True,
                )
                for s in req.sequences
            ]
        )
        return convert.response_to_proto(resp, req)

    async def GetVersion(self, request: pb.GetVersionRequest, context: Any) -> pb.VersionInfo:
        err = errors.VersionEvicted(
            "gone", parameter="policy_version", details={"retained": [4, 6]}
        )
        await context.abort(
            convert.grpc_code(err),
            err.message,
            trailing_metadata=convert.grpc_trailing_metadata(err),
        )
        raise AssertionError("unreachable")

    async def GetInfo(self, request: pb.GetInfoRequest, context: Any) -> pb.Info:
        err = errors.Overloaded("busy", retry_after_s=0.75)
        await context.abort(
            convert.grpc_code(err),
            err.message,
            trailing_metadata=convert.grpc_trailing_metadata(err),
        )
        raise AssertionError("unreachable")

    async def Publish(self, request_iterator: Any, context: Any) -> pb.PublishResult:
        header: PublishHeader | None = None
        data = bytearray()
        async for chunk in request_iterator:
            if header is None:
                header = PublishHeader.from_proto(chunk)
            else:
                data += chunk.data
        assert header is not None
        self.uploads.append((header, bytes(data)))
        result = PublishResult(
            policy_version=header.policy_version, weight_sha256=header.sha256, created=True
        )
        return convert.publish_result_to_proto(result)


@pytest.fixture
async def grpc_server() -> Any:
    servicer = FakeServicer()  # type: ignore[abstract]
    server = grpc.aio.server()
    pb_grpc.add_OldLogitServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    yield f"grpc://127.0.0.1:{port}", servicer
    await server.stop(None)


async def test_grpc_round_trip_errors_and_publish(grpc_server: Any) -> None:
    url, servicer = grpc_server
    async with AsyncClient(url, token="tok", retries=0) as c:
        r = await c.logprobs([1, 2, 3, 4], policy_version=2, score_from=2)
        np.testing.assert_array_equal(r.logprobs, [np.nan, np.nan, -1.5, -1.5])
        assert r.cached and r.weight_sha256 == {2: "h"}
        assert ("authorization", "Bearer tok") in servicer.metadata
        with pytest.raises(errors.VersionEvicted) as gone:
            await c.version(3)
        assert (
            gone.value.details == {"retained": [4, 6]} and gone.value.parameter == "policy_version"
        )
        with pytest.raises(errors.Overloaded) as busy:
            await c.info()
        assert busy.value.retry_after_s == 0.75
        sd = _state_dict()
        res = await c.publish(7, sd)
        header, data = servicer.uploads[-1]
        assert header.total_bytes == len(data) and res.weight_sha256 == weight_sha256(sd)
        assert set(_load(data)) == set(sd)
        with pytest.raises(errors.InternalError):  # not implemented by the fake: UNIMPLEMENTED
            await c.versions()


async def test_grpc_unreachable_replica_fails_over(grpc_server: Any) -> None:
    url, _ = grpc_server
    async with AsyncClient(["grpc://127.0.0.1:1", url], retries=0, timeout_s=10.0) as c:
        r = await c.logprobs([1, 2], policy_version=2)
        assert r.versions == [2]


# ---------------------------------------------------------------- import hygiene


def test_importing_the_client_does_not_import_torch() -> None:
    code = (
        "import sys, oldlogit, oldlogit.client, oldlogit.contract.wire, oldlogit.contract.convert, "
        "oldlogit.publishing.publisher, oldlogit.transport.http, oldlogit.transport.grpc; "
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_rendezvous_order_is_stable_spread_and_minimal_on_removal() -> None:
    from collections import Counter

    from oldlogit.transport.retry import ReplicaSet

    urls = [f"grpc://10.0.0.{i}:50051" for i in range(1, 5)]
    a = ReplicaSet(urls)
    b = ReplicaSet(list(reversed(urls)))  # another client, another configured order
    owners = {}
    for v in range(400):
        assert a.order(v) == b.order(v)  # every client agrees
        assert sorted(a.order(v)) == sorted(urls)
        owners[v] = a.order(v)[0]
    spread = Counter(owners.values())
    assert min(spread.values()) > 60  # roughly even over 4 replicas
    # Removing a replica moves only the versions it owned.
    a.update(urls[:3])
    moved = [v for v in range(400) if a.order(v)[0] != owners[v]]
    assert all(owners[v] == urls[3] for v in moved)
    # A failed replica goes last but keeps its place for everyone else.
    first = a.order(7)[0]
    a.mark_down(first)
    assert a.order(7)[-1] == first
    assert a.order(None) == [u for u in urls[:3] if u != first] + [first]


def test_publish_and_session_arguments_are_checked_once_in_their_contract_types() -> None:
    """``PublishHeader`` and ``OpenSession`` refuse bad fields when they are made, wherever that
    is (the client, the HTTP route, the gRPC servicer), naming the parameter."""
    from oldlogit.contract.types import OpenSession

    with pytest.raises(errors.InvalidRequest) as info:
        PublishHeader(4, None, parent=3)
    assert info.value.parameter == "parent"
    with pytest.raises(errors.InvalidRequest) as info:
        PublishHeader(-1, None)
    assert info.value.parameter == "policy_version"
    assert PublishHeader(4, None, delta=True, parent=3).parent == 3
    good = {"session_id": "abcdefgh", "policy_version": 1, "members": 2}
    for bad, parameter in (
        ({"session_id": "short"}, "session_id"),
        ({"members": 0}, "members"),
        ({"delta": True}, "parent"),
        ({"parent": 0}, "parent"),
        ({"ttl_s": 0.0}, "ttl_s"),
        ({"sha256": "xyz"}, "sha256"),
        ({"policy_version": 2**63}, "policy_version"),
    ):
        with pytest.raises(errors.InvalidRequest) as info:
            OpenSession(**{**good, **bad})
        assert info.value.parameter == parameter, bad
    assert OpenSession(**good).members == 2
