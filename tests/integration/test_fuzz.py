"""Fuzzing both transports of a live server: no 5xx, no crash, no hang, every refusal coded.

HTTP: schemathesis generates positive and negative cases from the live OpenAPI (seeded,
bounded). gRPC: our own fuzzer sends random bytes, truncated and bit-flipped valid messages,
wrong-typed fields and huge fields to every method. Case counts are printed (`-s`) and
collected in ``FUZZ_COUNTS`` for the resolving report. The default run fuzzes with a smaller
budget (``BUDGETS``, the same seeds; the gRPC fuzzer's cases are the first of the full
budget's); the full budget, ~20 s on 2 cores, runs under the ``slow`` marker.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable

from oldlogit._proto.oldlogit.v1 import oldlogit_pb2 as pb
from oldlogit.contract import errors

from .conftest import WRITE_TOKEN, Served, start_served

pytestmark = pytest.mark.integration

# Hypothesis examples per HTTP operation, gRPC cases per method: the default run's, the full.
BUDGETS = [(8, 16), pytest.param((20, 40), marks=pytest.mark.slow)]
FUZZ_COUNTS: dict[str, int] = {}
_CODES = {c for c in errors._BY_CODE}


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[Served]:
    s = start_served(tmp_path_factory.mktemp("fuzz"), model_dir, request_timeout_s=20.0)
    yield s
    s.server.stop()


def _check_http(resp: httpx.Response | object) -> None:
    status = resp.status_code  # type: ignore[attr-defined]
    text = resp.text  # type: ignore[attr-defined]
    assert status < 500, (status, text[:500])
    assert "Traceback" not in text
    if status >= 400:
        body = json.loads(text)
        assert body["error"]["code"] in _CODES, body


@pytest.mark.parametrize("budget", BUDGETS, ids=["small", "full"])
@pytest.mark.parametrize("mode", ["positive", "negative"])
def test_schemathesis_http(fuzzed: Served, mode: str, budget: tuple[int, int]) -> None:
    import msgpack
    import schemathesis
    from schemathesis.generation import GenerationMode

    @schemathesis.serializer("application/msgpack")
    def _msgpack(ctx: object, value: object) -> bytes:
        return bytes(msgpack.packb(value, use_bin_type=True))

    base = fuzzed.server.http_url
    schema = schemathesis.openapi.from_url(f"{base}/openapi.json")
    gen_mode = GenerationMode.POSITIVE if mode == "positive" else GenerationMode.NEGATIVE
    count = 0
    for result in schema.get_all_operations():
        op = result.ok()

        @settings(
            max_examples=budget[0],
            derandomize=True,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        @given(case=op.as_strategy(generation_mode=gen_mode))
        def run(case: schemathesis.Case) -> None:
            nonlocal count
            count += 1
            headers = {"authorization": f"Bearer {WRITE_TOKEN}"} if count % 2 else {}
            resp = case.call(base_url=base, headers=headers, timeout=30)
            _check_http(resp)

        try:
            run()
        except Unsatisfiable:
            # No way to make an invalid request for this operation (e.g. GET /healthz takes
            # no input): nothing to fuzz in negative mode.
            assert mode == "negative"
    FUZZ_COUNTS[f"http-{mode}-{budget[0]}"] = count
    print(f"schemathesis {mode}: {count} cases, no 5xx")
    assert count >= 50
    # The server is still healthy afterwards.
    assert httpx.get(f"{base}/readyz").status_code == 200


def _mutations(rng: random.Random, valid: bytes) -> Iterator[bytes]:
    yield b""
    yield bytes(rng.randrange(256) for _ in range(rng.randint(1, 64)))
    if valid:
        yield valid[: rng.randrange(len(valid))]  # truncated
        flipped = bytearray(valid)
        for _ in range(rng.randint(1, 4)):
            flipped[rng.randrange(len(flipped))] ^= 1 << rng.randrange(8)
        yield bytes(flipped)
        yield valid + bytes(rng.randrange(256) for _ in range(8))  # trailing garbage
    # Field 1 with the wrong wire type (a varint where a message/packed field is expected)...
    yield b"\x08\x96\x01"
    # ...a length-delimited field claiming far more bytes than follow.
    yield b"\x0a\xff\xff\xff\x0f\x01\x02"


def _valid_messages(rng: random.Random) -> dict[str, list[bytes]]:
    n = rng.randint(0, 40)
    seq = pb.SequenceRequest(
        token_ids=[rng.randrange(-5, 500) for _ in range(n)],
        policy_version=rng.choice([0, 1, 2, 999, -3]),
        score_from=rng.randint(-2, n + 2),
    )
    huge = pb.SequenceRequest(token_ids=[1] * 200_000, policy_version=0)
    return {
        "Logprobs": [
            pb.LogprobsRequest(sequences=[seq]).SerializeToString(),
            pb.LogprobsRequest(sequences=[huge]).SerializeToString(),
            pb.LogprobsRequest(sequences=[seq] * 5000).SerializeToString(),
            pb.LogprobsRequest(
                sequences=[seq],
                sampling=pb.Sampling(
                    temperature=rng.choice([0.0, -1.0, float("nan"), 1e308]),
                    top_k=rng.choice([-1, 0, 2**62]),
                    top_p=rng.choice([0.0, 2.0]),
                ),
            ).SerializeToString(),
            pb.LogprobsRequest(proxy="x" * 100_000).SerializeToString(),
        ],
        "Trace": [
            pb.TraceRequest(
                token_ids=[rng.randrange(-5, 500) for _ in range(rng.choice([0, 1, 5, 513]))],
                policy_version=rng.choice([-1, 0, 2, 999, 2**62]),
                temperature=rng.choice([0.0, -1.0, float("nan"), 0.5]),
                top_k=rng.choice([-1, 0, 3, 2**62]),
                top_p=rng.choice([0.0, 2.0, 0.9]),
            ).SerializeToString(),
            pb.TraceRequest(token_ids=[1, 2, 3], policy_version=1).SerializeToString(),
        ],
        "GetVersion": [
            pb.GetVersionRequest(policy_version=rng.choice([-1, 0, 2**62])).SerializeToString()
        ],
        "ListVersions": [b""],
        "GetInfo": [b""],
        "DeleteVersion": [
            pb.DeleteVersionRequest(policy_version=rng.choice([-7, 12345])).SerializeToString()
        ],
        "SetWatermark": [pb.SetWatermarkRequest(policy_version=-1).SerializeToString()],
        "CreateLease": [
            pb.CreateLeaseRequest(
                policy_version=rng.choice([0, 99]),
                holder="h" * rng.choice([1, 10_000]),
                ttl_s=rng.choice([-1.0, 0.0, 1e30, 5.0]),
            ).SerializeToString()
        ],
        "DeleteLease": [pb.DeleteLeaseRequest(lease_id="\x00" * 100).SerializeToString()],
        "PublishByPath": [
            pb.PublishByPathRequest(policy_version=77, path="../../etc/passwd").SerializeToString()
        ],
        "OpenSession": [
            pb.OpenSessionRequest(
                session_id=rng.choice(["", "x", "../../../x", "s" * 100, "fuzz-session-1"]),
                policy_version=rng.choice([-1, 600, 2**62]),
                members=rng.choice([-1, 0, 2, 10**9]),
                delta=rng.choice([False, True]),
                sha256=rng.choice(["", "zz"]),
                ttl_s=rng.choice([-1.0, 0.0, 1e300, 5.0]),
            ).SerializeToString()
        ],
        "CommitPart": [
            pb.CommitPartRequest(
                session_id=rng.choice(["nope-nope", "fuzz-session-1"]),
                rank=rng.choice([-1, 0, 2**62]),
                sha256="0" * 64,
            ).SerializeToString()
        ],
        "GetSession": [pb.GetSessionRequest(session_id="\x00" * 70).SerializeToString()],
        "AbortSession": [pb.AbortSessionRequest(session_id="nope-nope").SerializeToString()],
    }


def _check_grpc_error(exc: grpc.RpcError) -> None:
    code = exc.code()
    assert code not in (
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.DEADLINE_EXCEEDED,
    ), (code, exc.details())
    md = dict(exc.trailing_metadata() or ())
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED and "oldlogit-error-bin" not in md:
        return  # grpc's own message-size limit, answered before any handler runs
    payload = json.loads(md["oldlogit-error-bin"])
    assert payload["code"] in _CODES, payload


@pytest.mark.parametrize("budget", BUDGETS, ids=["small", "full"])
def test_grpc_fuzzer(fuzzed: Served, budget: tuple[int, int]) -> None:
    rng = random.Random(1234)
    target = fuzzed.server.grpc_url.removeprefix("grpc://")
    count = 0
    md = (("authorization", f"Bearer {WRITE_TOKEN}"),)
    with grpc.insecure_channel(target, options=[("grpc.max_send_message_length", 1 << 30)]) as ch:
        for _ in range(budget[1] // 4):
            for method, valids in _valid_messages(rng).items():
                call = ch.unary_unary(f"/oldlogit.v1.OldLogit/{method}")
                payloads = list(valids)
                for v in valids:
                    payloads.extend(_mutations(rng, v))
                for body in payloads:
                    count += 1
                    try:
                        call(body, timeout=30, metadata=md)
                    except grpc.RpcError as exc:
                        _check_grpc_error(exc)
            # The client-streaming publish: garbage chunks, headers out of order, bad data.
            stream = ch.stream_unary("/oldlogit.v1.OldLogit/Publish")
            header = pb.PublishChunk(header=pb.PublishHeader(policy_version=500, sha256="ab"))
            data = pb.PublishChunk(data=bytes(rng.randrange(256) for _ in range(300)))
            for chunks in (
                [bytes(rng.randrange(256) for _ in range(20))],
                [data.SerializeToString()],
                [header.SerializeToString(), data.SerializeToString()],
                [header.SerializeToString(), header.SerializeToString()],
                [header.SerializeToString()],
                [],
                [header.SerializeToString(), b"\xff\xff\xff"],
            ):
                count += 1
                try:
                    stream(iter(chunks), timeout=30, metadata=md)
                    raise AssertionError("garbage was published")
                except grpc.RpcError as exc:
                    _check_grpc_error(exc)
        # The client-streaming session part: garbage, a header for no session, bad data.
        part = ch.stream_unary("/oldlogit.v1.OldLogit/PublishPart")
        head = pb.PartChunk(header=pb.PartHeader(session_id="fuzz-session-1", rank=0))
        junk = pb.PartChunk(data=bytes(rng.randrange(256) for _ in range(300)))
        for chunks in (
            [bytes(rng.randrange(256) for _ in range(20))],
            [junk.SerializeToString()],
            [head.SerializeToString(), junk.SerializeToString()],
            [head.SerializeToString(), head.SerializeToString()],
            [head.SerializeToString()],
            [],
        ):
            count += 1
            try:
                part(iter(chunks), timeout=30, metadata=md)
            except grpc.RpcError as exc:
                _check_grpc_error(exc)
    FUZZ_COUNTS[f"grpc-{budget[1]}"] = count
    print(f"grpc fuzzer: {count} cases, no INTERNAL/UNKNOWN, all coded")
    assert httpx.get(f"{fuzzed.server.http_url}/readyz").status_code == 200
