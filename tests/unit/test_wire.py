"""HTTP encodings (oldlogit.contract.wire) and proto converters (contract.convert): round trips, the
documented shapes, malformed bodies naming the parameter, errors, and speed."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import grpc
import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from oldlogit._proto.oldlogit.v1 import oldlogit_pb2 as pb
from oldlogit.contract import convert, errors, wire
from oldlogit.contract.types import (
    Info,
    LeaseInfo,
    LogprobsRequest,
    LogprobsResponse,
    PublishResult,
    Sampling,
    Sequence,
    SequenceResult,
    Trace,
    TraceRequest,
    TraceStageInfo,
    VersionInfo,
)

ENCODINGS = [wire.JSON_TYPE, wire.MSGPACK_TYPE]
SHA = {7: "a" * 64, 8: "b" * 64}


def _request() -> LogprobsRequest:
    return LogprobsRequest(
        sequences=[
            Sequence(token_ids=[5, 6, 7, 8, 9], policy_version=7, score_from=3),
            Sequence(token_ids=[1, 2, 3, 4], versions=[-1, 7, -1, 8]),
            Sequence(
                token_ids=[3, 4], policy_version=7, sampling=Sampling(temperature=0.5, top_k=3)
            ),
            Sequence(token_ids=[9, 9, 9]),  # nothing scored
            Sequence(token_ids=[], policy_version=7),
            Sequence(token_ids=[2**31 - 1, 0], policy_version=2**40),
        ],
        sampling=Sampling(temperature=0.7, top_k=50, top_p=0.9),
        proxy="ewma",
        allow_inexact=True,
        use_cache=False,
        timeout_s=12.5,
    )


def _full(seq: Sequence, rng: np.random.Generator) -> np.ndarray:
    """A full-length result: NaN where not scored, some −inf among the scored."""
    mask = seq.scored_mask()
    out = np.full(len(seq.token_ids), np.nan, dtype=np.float32)
    vals = -rng.exponential(2.0, size=int(mask.sum())).astype(np.float32)
    vals[::3] = -np.inf
    out[mask] = vals
    return out


def _response(req: LogprobsRequest, seed: int = 0) -> LogprobsResponse:
    rng = np.random.default_rng(seed)
    return LogprobsResponse(
        results=[
            SequenceResult(
                logprobs=_full(seq, rng),
                versions=sorted({int(v) for v in seq.per_token_versions() if v >= 0}),
                weight_sha256={v: SHA.get(v, "c" * 64) for v in seq.per_token_versions() if v >= 0},
                exact=i % 2 == 0,
                cached=i % 3 == 0,
            )
            for i, seq in enumerate(req.sequences)
        ]
    )


def _assert_requests_equal(a: LogprobsRequest, b: LogprobsRequest) -> None:
    assert a.model_dump(exclude={"sequences"}) == b.model_dump(exclude={"sequences"})
    assert len(a.sequences) == len(b.sequences)
    for x, y in zip(a.sequences, b.sequences, strict=True):
        np.testing.assert_array_equal(x.token_ids, y.token_ids)
        assert y.token_ids.dtype == np.int64
        assert (x.versions is None) == (y.versions is None)
        if x.versions is not None:
            assert y.versions is not None
            np.testing.assert_array_equal(x.versions, y.versions)
        assert (x.policy_version, x.score_from, x.sampling) == (
            y.policy_version,
            y.score_from,
            y.sampling,
        )


def _assert_responses_equal(a: LogprobsResponse, b: LogprobsResponse) -> None:
    assert len(a.results) == len(b.results)
    for x, y in zip(a.results, b.results, strict=True):
        assert y.logprobs.dtype == np.float32
        # Bitwise: same values, NaN in the same places, −inf kept.
        assert x.logprobs.tobytes() == y.logprobs.tobytes()
        assert x.model_dump(exclude={"logprobs"}) == y.model_dump(exclude={"logprobs"})


# ---------------------------------------------------------------- HTTP encodings


@pytest.mark.parametrize("ct", ENCODINGS)
def test_request_round_trip(ct: str) -> None:
    req = _request()
    _assert_requests_equal(req, wire.decode_request(wire.encode_request(req, ct), ct))


@pytest.mark.parametrize("ct", ENCODINGS)
def test_response_round_trip_puts_values_back_in_place(ct: str) -> None:
    req = _request()
    resp = _response(req)
    body = wire.encode_response(resp, req, ct)
    back = wire.decode_response(body, req, ct)
    _assert_responses_equal(resp, back)
    assert np.isnan(back.results[0].logprobs[:3]).all()  # before score_from
    assert np.isnan(back.results[1].logprobs[[0, 2]]).all()  # versions == -1
    assert np.isneginf(back.results[0].logprobs[3])  # −inf survived
    assert back.results[3].logprobs.shape == (3,) and np.isnan(back.results[3].logprobs).all()
    assert back.results[4].logprobs.shape == (0,)


def test_json_shapes_are_the_documented_ones() -> None:
    req = LogprobsRequest(
        sequences=[
            Sequence(token_ids=[1, 2, 3], policy_version=7, score_from=1),
            Sequence(token_ids=[1, 2, 3], versions=[-1, 7, 8]),
        ]
    )
    obj = json.loads(wire.encode_request(req, wire.JSON_TYPE))
    assert obj["sequences"][0] == {"token_ids": [1, 2, 3], "policy_version": 7, "score_from": 1}
    assert obj["sequences"][1] == {"token_ids": [1, 2, 3], "versions": [-1, 7, 8]}
    assert obj["sampling"] == {"temperature": 1.0, "top_k": 0, "top_p": 1.0}
    assert obj["use_cache"] is True and obj["allow_inexact"] is False

    resp = LogprobsResponse(
        results=[
            SequenceResult(
                logprobs=np.array([np.nan, -1.25, -np.inf], np.float32),
                versions=[7],
                weight_sha256={7: "ab"},
            ),
            SequenceResult(
                logprobs=np.array([np.nan, -0.5, -2.0], np.float32),
                versions=[7, 8],
                weight_sha256={7: "ab", 8: "cd"},
                cached=True,
            ),
        ]
    )
    out = json.loads(wire.encode_response(resp, req, wire.JSON_TYPE))
    assert out == {
        "results": [
            {
                "logprobs": [-1.25, "-inf"],
                "versions": [7],
                "weight_sha256": {"7": "ab"},
                "exact": True,
                "cached": False,
            },
            {
                "logprobs": [-0.5, -2.0],
                "versions": [7, 8],
                "weight_sha256": {"7": "ab", "8": "cd"},
                "exact": True,
                "cached": True,
            },
        ]
    }


def test_msgpack_arrays_are_little_endian_bins() -> None:
    req = LogprobsRequest(sequences=[Sequence(token_ids=[1, 2, 300], versions=[-1, 7, 8])])
    obj = msgpack.unpackb(wire.encode_request(req, wire.MSGPACK_TYPE))
    seq = obj["sequences"][0]
    assert seq["token_ids"] == np.array([1, 2, 300], "<i4").tobytes()
    assert seq["versions"] == np.array([-1, 7, 8], "<i8").tobytes()
    resp = LogprobsResponse(
        results=[
            SequenceResult(
                logprobs=np.array([np.nan, -np.inf, -0.25], np.float32),
                versions=[7, 8],
                weight_sha256={7: "x", 8: "y"},
            )
        ]
    )
    out = msgpack.unpackb(wire.encode_response(resp, req, wire.MSGPACK_TYPE))
    assert out["results"][0]["logprobs"] == np.array([-np.inf, -0.25], "<f4").tobytes()
    assert out["results"][0]["weight_sha256"] == {"7": "x", "8": "y"}


def test_msgpack_decoders_accept_plain_arrays() -> None:
    body = msgpack.packb({"sequences": [{"token_ids": [1, 2, 3], "policy_version": 4}]})
    req = wire.decode_request(body, "application/x-msgpack")
    np.testing.assert_array_equal(req.sequences[0].token_ids, [1, 2, 3])
    resp_body = msgpack.packb(
        {"results": [{"logprobs": [-1.0, -2.0], "versions": [4], "weight_sha256": {4: "h"}}]}
    )
    resp = wire.decode_response(resp_body, req, wire.MSGPACK_TYPE)
    assert resp.results[0].weight_sha256 == {4: "h"}
    np.testing.assert_array_equal(resp.results[0].logprobs, [np.nan, -1.0, -2.0])


def test_json_decoders_accept_other_infinity_spellings() -> None:
    req = LogprobsRequest(sequences=[Sequence(token_ids=[1, 2, 3], policy_version=1)])
    body = b'{"results":[{"logprobs":[-Infinity,"-inf"],"versions":[1],"weight_sha256":{"1":"h"}}]}'
    resp = wire.decode_response(body, req, wire.JSON_TYPE)
    assert np.isneginf(resp.results[0].logprobs[1:]).all()


@settings(max_examples=50, deadline=None)
@given(
    versions=st.lists(st.integers(min_value=-1, max_value=3), min_size=0, max_size=40),
    values=st.lists(
        st.floats(width=32, allow_nan=False, max_value=0.0) | st.just(float("-inf")),
        min_size=40,
        max_size=40,
    ),
    ct=st.sampled_from(ENCODINGS),
)
def test_round_trip_is_bitwise_for_any_scored_set(
    versions: list[int], values: list[float], ct: str
) -> None:
    seq = Sequence(token_ids=list(range(len(versions))), versions=versions)
    req = LogprobsRequest(sequences=[seq])
    full = np.full(len(versions), np.nan, dtype=np.float32)
    mask = seq.scored_mask()
    full[mask] = np.array(values[: int(mask.sum())], dtype=np.float32)
    resp = LogprobsResponse(results=[SequenceResult(logprobs=full, versions=[], weight_sha256={})])
    _assert_responses_equal(
        resp, wire.decode_response(wire.encode_response(resp, req, ct), req, ct)
    )
    msg = convert.response_to_proto(resp, req)
    _assert_responses_equal(
        resp,
        convert.response_from_proto(pb.LogprobsResponse.FromString(msg.SerializeToString()), req),
    )


# ---------------------------------------------------------------- malformed bodies


@pytest.mark.parametrize(
    ("body", "ct", "parameter"),
    [
        (b"{not json", wire.JSON_TYPE, "body"),
        (b"[1, 2]", wire.JSON_TYPE, "body"),
        (b"\xc1", wire.MSGPACK_TYPE, "body"),
        (msgpack.packb([1]), wire.MSGPACK_TYPE, "body"),
        (b'{"sequences": [{"token_ids": "abc"}]}', wire.JSON_TYPE, "sequences[0].token_ids"),
        (b'{"sequences": [{"token_ids": [1, 2.5]}]}', wire.JSON_TYPE, "sequences[0].token_ids"),
        (b'{"sequences": [{"token_ids": [[1], [2]]}]}', wire.JSON_TYPE, "sequences[0].token_ids"),
        (
            b'{"sequences": [{"token_ids": [1]}, {"token_ids": [1], "versions": "x"}]}',
            wire.JSON_TYPE,
            "sequences[1].versions",
        ),
        (
            b'{"sequences": [{"token_ids": [1], "colour": 1}]}',
            wire.JSON_TYPE,
            "sequences[0].colour",
        ),
        (
            b'{"sequences": [{"token_ids": [1], "policy_version": "x"}]}',
            wire.JSON_TYPE,
            "sequences[0].policy_version",
        ),
        (b'{"sequences": [], "proxy": "magic"}', wire.JSON_TYPE, "proxy"),
        (
            b'{"sequences": [], "sampling": {"temperature": "hot"}}',
            wire.JSON_TYPE,
            "sampling.temperature",
        ),
        (b"{}", wire.JSON_TYPE, "sequences"),
        (
            msgpack.packb({"sequences": [{"token_ids": b"\x01\x02\x03"}]}),
            wire.MSGPACK_TYPE,
            "sequences[0].token_ids",
        ),
        (
            msgpack.packb({"sequences": [{"token_ids": b"", "versions": b"\x00" * 9}]}),
            wire.MSGPACK_TYPE,
            "sequences[0].versions",
        ),
    ],
)
def test_malformed_requests_name_the_parameter(body: bytes, ct: str, parameter: str) -> None:
    with pytest.raises(errors.InvalidRequest) as info:
        wire.decode_request(body, ct)
    assert info.value.parameter == parameter
    assert parameter in str(info.value) or parameter == "body"


def test_unsupported_content_type_is_invalid() -> None:
    with pytest.raises(errors.InvalidRequest) as info:
        wire.decode_request(b"{}", "text/plain")
    assert info.value.parameter == "content-type"


def test_token_ids_beyond_int32_are_refused_on_binary_wires() -> None:
    req = LogprobsRequest(sequences=[Sequence(token_ids=[1, 2**31], policy_version=1)])
    with pytest.raises(errors.InvalidRequest) as info:
        wire.encode_request(req, wire.MSGPACK_TYPE)
    assert info.value.parameter == "sequences[0].token_ids"
    with pytest.raises(errors.InvalidRequest):
        convert.request_to_proto(req)


@pytest.mark.parametrize("ct", ENCODINGS)
def test_malformed_responses_are_internal_errors(ct: str) -> None:
    req = LogprobsRequest(sequences=[Sequence(token_ids=[1, 2, 3], policy_version=1)])
    bad_count: dict[str, Any] = {"results": []}
    short = {"results": [{"logprobs": [-1.0], "versions": [1], "weight_sha256": {"1": "h"}}]}
    for obj, parameter in ((bad_count, "results"), (short, "results[0].logprobs")):
        body = json.dumps(obj).encode() if ct == wire.JSON_TYPE else msgpack.packb(obj)
        with pytest.raises(errors.InternalError) as info:
            wire.decode_response(body, req, ct)
        assert info.value.parameter == parameter
    wrong_len = LogprobsResponse(
        results=[SequenceResult(logprobs=np.zeros(2, np.float32), versions=[], weight_sha256={})]
    )
    with pytest.raises(errors.InternalError):
        wire.encode_response(wrong_len, req, ct)


# ---------------------------------------------------------------- negotiation and errors


@pytest.mark.parametrize(
    ("accept", "expected"),
    [
        (None, wire.JSON_TYPE),
        ("", wire.JSON_TYPE),
        ("*/*", wire.JSON_TYPE),
        ("application/msgpack", wire.MSGPACK_TYPE),
        ("application/json, application/msgpack", wire.JSON_TYPE),
        ("application/json;q=0.5, application/msgpack", wire.MSGPACK_TYPE),
        ("application/x-msgpack;q=0.9, application/json;q=0.1", wire.MSGPACK_TYPE),
        ("application/msgpack;q=0", wire.JSON_TYPE),
        ("text/html", wire.JSON_TYPE),
    ],
)
def test_negotiate(accept: str | None, expected: str) -> None:
    assert wire.negotiate(accept) == expected


def test_media_type() -> None:
    assert wire.media_type(None) == wire.JSON_TYPE
    assert wire.media_type("application/json; charset=utf-8") == wire.JSON_TYPE
    assert wire.media_type("Application/MsgPack") == wire.MSGPACK_TYPE


ERROR_SAMPLES: list[errors.OldLogitError] = [
    errors.TokenOutOfVocab("token 9999 >= vocab 512", parameter="sequences[0].token_ids"),
    errors.VersionEvicted(
        "version 3 was evicted", parameter="policy_version", details={"retained": [5, 9]}
    ),
    errors.UnknownVersion("no version 42", parameter="policy_version"),
    errors.Overloaded("queue full", retry_after_s=2.5),
    errors.Unavailable("draining", retry_after_s=0.25),
    errors.Unauthorized("missing token"),
    errors.VersionNotIncreasing("7 <= 9", parameter="policy_version"),
    errors.InternalError("boom"),
]


@pytest.mark.parametrize("err", ERROR_SAMPLES, ids=lambda e: type(e).__name__)
def test_http_error_round_trip(err: errors.OldLogitError) -> None:
    status, body, headers = wire.encode_error(err)
    assert status == err.http_status
    assert json.loads(body) == {"error": err.to_payload()}
    back = wire.decode_error(status, body, headers)
    assert type(back) is type(err)
    assert (back.message, back.parameter, back.details) == (err.message, err.parameter, err.details)
    if isinstance(err, errors.Overloaded):
        assert headers["retry-after"] == str(int(np.ceil(err.retry_after_s)))
        assert isinstance(back, errors.Overloaded) and back.retry_after_s == err.retry_after_s
    else:
        assert "retry-after" not in headers


def test_http_errors_from_elsewhere_map_by_status() -> None:
    proxy = wire.decode_error(502, b"<html>bad gateway</html>", {"Retry-After": "3"})
    assert isinstance(proxy, errors.Unavailable) and proxy.retry_after_s == 3.0
    missing = wire.decode_error(404, b'{"detail": "Not Found"}', {})
    assert isinstance(missing, errors.NotFound) and missing.message == "Not Found"
    fastapi = wire.decode_error(
        422,
        json.dumps({"detail": [{"loc": ["query", "sha256"], "msg": "Field required"}]}).encode(),
        {},
    )
    assert isinstance(fastapi, errors.InvalidRequest) and fastapi.parameter == "sha256"
    assert isinstance(wire.decode_error(418, b"", {}), errors.InternalError)


@pytest.mark.parametrize("err", ERROR_SAMPLES, ids=lambda e: type(e).__name__)
def test_grpc_error_round_trip(err: errors.OldLogitError) -> None:
    code = convert.grpc_code(err)
    assert code.name == err.grpc_status
    md = convert.grpc_trailing_metadata(err)
    assert md[0][0] == "oldlogit-error-bin" and isinstance(md[0][1], bytes)
    back = convert.error_from_grpc(code, err.message, md)
    assert type(back) is type(err)
    assert (back.message, back.parameter, back.details) == (err.message, err.parameter, err.details)


def test_grpc_errors_without_our_metadata_map_by_status() -> None:
    down = convert.error_from_grpc(grpc.StatusCode.UNAVAILABLE, "failed to connect", None)
    assert isinstance(down, errors.Unavailable) and down.retry_after_s == 0.0
    assert isinstance(
        convert.error_from_grpc(grpc.StatusCode.DEADLINE_EXCEEDED, "late", ()),
        errors.DeadlineExceeded,
    )
    too_big = convert.error_from_grpc(
        grpc.StatusCode.RESOURCE_EXHAUSTED, "message larger than max", ()
    )
    assert isinstance(too_big, errors.LimitExceeded) and not too_big.retryable
    assert isinstance(
        convert.error_from_grpc(grpc.StatusCode.UNKNOWN, "?", ()), errors.InternalError
    )
    assert isinstance(
        convert.error_from_grpc(
            grpc.StatusCode.INTERNAL, "x", [("oldlogit-error-bin", b"garbage")]
        ),
        errors.InternalError,
    )


# ---------------------------------------------------------------- proto converters


def test_proto_request_round_trip() -> None:
    req = _request()
    msg = pb.LogprobsRequest.FromString(convert.request_to_proto(req).SerializeToString())
    assert not msg.sequences[0].versions and msg.sequences[1].versions == [-1, 7, -1, 8]
    assert not msg.sequences[0].HasField("sampling") and msg.sequences[2].HasField("sampling")
    _assert_requests_equal(req, convert.request_from_proto(msg))


def test_proto_request_defaults_when_fields_are_unset() -> None:
    msg = pb.LogprobsRequest(sequences=[pb.SequenceRequest(token_ids=[1, 2], policy_version=0)])
    req = convert.request_from_proto(msg)
    assert req.sampling == Sampling() and req.use_cache is True and req.timeout_s is None
    assert req.proxy is None and req.sequences[0].policy_version == 0
    assert req.sequences[0].score_from is None and req.sequences[0].versions is None


def test_proto_request_invalid_fields_name_the_parameter() -> None:
    msg = pb.LogprobsRequest(sequences=[pb.SequenceRequest(token_ids=[1])], proxy="magic")
    with pytest.raises(errors.InvalidRequest) as info:
        convert.request_from_proto(msg)
    assert info.value.parameter == "proxy"


def test_proto_response_round_trip() -> None:
    req = _request()
    resp = _response(req, seed=3)
    msg = convert.response_to_proto(resp, req)
    assert list(msg.results[1].logprobs) == list(resp.results[1].logprobs[[1, 3]])
    wire_msg = pb.LogprobsResponse.FromString(msg.SerializeToString())
    _assert_responses_equal(resp, convert.response_from_proto(wire_msg, req))
    with pytest.raises(errors.InternalError):
        convert.response_from_proto(pb.LogprobsResponse(), req)


FLAT_SAMPLES = [
    Sampling(temperature=0.25, top_k=7, top_p=0.5),
    VersionInfo(
        policy_version=3,
        weight_sha256="f" * 64,
        nbytes=123,
        tiers=["device", "disk"],
        kind="patch",
        parent=2,
        leases=1,
        created_at=1.5e9,
    ),
    VersionInfo(policy_version=0, weight_sha256="0" * 64, nbytes=0, tiers=[]),
    LeaseInfo(lease_id="abc", policy_version=3, holder="h:1", ttl_s=60.0, expires_at=2e9),
    Info(
        model_type="qwen2",
        architecture="Qwen2ForCausalLM",
        vocab_size=512,
        max_positions=2048,
        num_parameters=10**6,
        dtype="bfloat16",
        head_dtype="float32",
        device="cpu",
        mode="fast",
        fast_mode_max_abs_deviation=1e-3,
        limits={"max_batch_tokens": 65536.0},
        versions=[1, 2, 3],
        watermark=1,
        server_version="0.1.0",
    ),
    Info(
        model_type="llama",
        architecture="LlamaForCausalLM",
        vocab_size=1,
        max_positions=1,
        num_parameters=1,
        dtype="float32",
        head_dtype="float32",
        device="cpu",
        mode="deterministic",
    ),
    PublishResult(
        policy_version=4, weight_sha256="e" * 64, created=False, nbytes=9, kind="keyframe"
    ),
    Trace(
        policy_version=5,
        weight_sha256="a" * 64,
        numerics="invariant/bfloat16/cpu",
        stages=[
            TraceStageInfo(
                name="model.embed_tokens",
                dtype="bfloat16",
                shape=[1, 7, 64],
                sha256="b" * 64,
                total=-1.0 / 3.0,
                absmax=0.125,
            ),
            TraceStageInfo(name="logprobs", dtype="float32", sha256="c" * 64, total=0, absmax=0),
        ],
    ),
    Trace(policy_version=0, weight_sha256="", numerics=""),
]


@pytest.mark.parametrize("model", FLAT_SAMPLES, ids=lambda m: type(m).__name__)
def test_flat_models_round_trip(model: Any) -> None:
    msg = convert.to_proto(model)
    back = convert.from_proto(type(msg).FromString(msg.SerializeToString()), type(model))
    assert back == model


def test_trace_request_round_trip_defaults_and_refusals() -> None:
    req = TraceRequest(token_ids=[3, 2**40, 0], policy_version=9, temperature=0.5, top_k=4)
    msg = pb.TraceRequest.FromString(convert.trace_request_to_proto(req).SerializeToString())
    back = convert.trace_request_from_proto(msg)
    assert back.token_ids.dtype == np.int64 and back.token_ids.tolist() == [3, 2**40, 0]
    assert back.model_dump(exclude={"token_ids"}) == req.model_dump(exclude={"token_ids"})
    bare = convert.trace_request_from_proto(pb.TraceRequest(token_ids=[1, 2]))
    assert (bare.temperature, bare.top_k, bare.top_p, bare.policy_version) == (1.0, 0, 1.0, 0)
    with pytest.raises(errors.InvalidRequest) as info:
        wire.parse_model(
            TraceRequest, {"token_ids": [[1, 2]], "policy_version": 0}, error=errors.InvalidRequest
        )
    assert info.value.parameter == "token_ids"


def test_from_proto_refuses_the_wrong_message() -> None:
    with pytest.raises(TypeError):
        convert.from_proto(pb.LeaseInfo(), VersionInfo)


def test_versions_and_publish_header_round_trip() -> None:
    infos = [m for m in FLAT_SAMPLES if isinstance(m, VersionInfo)]
    assert convert.versions_from_proto(convert.versions_to_proto(infos, 5)) == (infos, 5)
    assert convert.versions_from_proto(convert.versions_to_proto([], None)) == ([], None)
    for header in (
        convert.PublishHeader(9, "d" * 64, delta=True, parent=8, total_bytes=100),
        convert.PublishHeader(0, "d" * 64),
    ):
        chunk = pb.PublishChunk.FromString(header.to_proto().SerializeToString())
        assert convert.PublishHeader.from_proto(chunk) == header
    with pytest.raises(errors.InvalidRequest):
        convert.PublishHeader.from_proto(pb.PublishChunk(data=b"x"))


# ---------------------------------------------------------------- speed


def _best_ms(fn: Callable[[], object], repeat: int = 3) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def _big() -> tuple[LogprobsRequest, LogprobsResponse]:
    rng = np.random.default_rng(0)
    seqs = [
        Sequence(token_ids=rng.integers(0, 150_000, 512), policy_version=7, score_from=128)
        if i % 2
        else Sequence(token_ids=rng.integers(0, 150_000, 512), versions=rng.integers(-1, 3, 512))
        for i in range(64)
    ]
    req = LogprobsRequest(sequences=seqs)
    return req, _response(req)


@pytest.mark.parametrize(
    ("name", "limit_ms"),
    [(wire.MSGPACK_TYPE, 50.0), ("proto", 50.0), (wire.JSON_TYPE, 250.0)],
)
def test_64x512_encodes_and_decodes_fast(name: str, limit_ms: float) -> None:
    """Binary wires take a few ms; JSON (float repr in Python) is slower: a debugging aid."""
    req, resp = _big()
    if name == "proto":
        req_bytes = convert.request_to_proto(req).SerializeToString()
        resp_bytes = convert.response_to_proto(resp, req).SerializeToString()
        steps: list[Callable[[], object]] = [
            lambda: convert.request_to_proto(req).SerializeToString(),
            lambda: convert.request_from_proto(pb.LogprobsRequest.FromString(req_bytes)),
            lambda: convert.response_to_proto(resp, req).SerializeToString(),
            lambda: convert.response_from_proto(pb.LogprobsResponse.FromString(resp_bytes), req),
        ]
    else:
        req_bytes = wire.encode_request(req, name)
        resp_bytes = wire.encode_response(resp, req, name)
        steps = [
            lambda: wire.encode_request(req, name),
            lambda: wire.decode_request(req_bytes, name),
            lambda: wire.encode_response(resp, req, name),
            lambda: wire.decode_response(resp_bytes, req, name),
        ]
    for step in steps:
        assert _best_ms(step) < limit_ms
