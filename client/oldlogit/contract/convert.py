"""Protobuf <-> contract types, and typed errors <-> gRPC status, for the server and the client.

In: ``types`` models or ``oldlogit_pb2`` messages; out: the other side. Logprobs travel
compactly (scored positions only, as in ``wire``) and are put back in place on receipt.
Malformed requests raise ``InvalidRequest`` naming the parameter; malformed responses
``InternalError``. No I/O here: the transports call these and do the talking.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import grpc
import numpy as np
from google.protobuf.message import Message
from pydantic import BaseModel

from oldlogit._proto.oldlogit.v1 import oldlogit_pb2 as pb
from oldlogit.contract.errors import (
    Conflict,
    DeadlineExceeded,
    Forbidden,
    InternalError,
    InvalidRequest,
    LimitExceeded,
    NotFound,
    OldLogitError,
    Overloaded,
    Unauthorized,
    Unavailable,
    VersionEvicted,
    error_from_payload,
)
from oldlogit.contract.routing import wire_dtype
from oldlogit.contract.types import (
    Info,
    LeaseInfo,
    LogprobsRequest,
    LogprobsResponse,
    PublishResult,
    RoutedExperts,
    Sampling,
    SessionInfo,
    Trace,
    TraceRequest,
    TraceStageInfo,
    VersionInfo,
    check_version,
)
from oldlogit.contract.wire import compact_logprobs, expand_logprobs, parse_model, token_ids_int32

__all__ = [
    "ERROR_METADATA_KEY",
    "RETRY_AFTER_METADATA_KEY",
    "PublishHeader",
    "error_from_grpc",
    "from_proto",
    "grpc_code",
    "grpc_trailing_metadata",
    "info_to_proto",
    "lease_info_to_proto",
    "publish_result_to_proto",
    "request_from_proto",
    "request_to_proto",
    "response_from_proto",
    "response_to_proto",
    "routing_from_proto",
    "routing_to_proto",
    "to_proto",
    "trace_request_from_proto",
    "trace_request_to_proto",
    "trace_to_proto",
    "version_info_to_proto",
    "versions_from_proto",
    "versions_to_proto",
]

logger = logging.getLogger(__name__)

M = TypeVar("M", bound=BaseModel)

ERROR_METADATA_KEY = "oldlogit-error-bin"  # UTF-8 JSON of OldLogitError.to_payload()
RETRY_AFTER_METADATA_KEY = "retry-after"  # seconds, decimal string

# Flat models whose proto message has the same field names (see oldlogit.proto).
_FLAT: dict[type[BaseModel], type[Message]] = {
    Sampling: pb.Sampling,
    VersionInfo: pb.VersionInfo,
    LeaseInfo: pb.LeaseInfo,
    Info: pb.Info,
    PublishResult: pb.PublishResult,
    SessionInfo: pb.SessionInfo,
    TraceRequest: pb.TraceRequest,
    TraceStageInfo: pb.TraceStage,
    Trace: pb.TraceResponse,
}


# ---------------------------------------------------------------- flat messages


def to_proto(obj: BaseModel) -> Message:
    """A flat contract model (Sampling, VersionInfo, LeaseInfo, Info, PublishResult, Trace…) as
    proto.

    None leaves a proto3 ``optional`` field unset; lists and numpy arrays extend repeated fields
    (lists of models add messages); dicts fill maps.
    """
    msg = _FLAT[type(obj)]()
    _fill(msg, obj)
    return msg


def _fill(msg: Message, obj: BaseModel) -> None:
    for name in type(obj).model_fields:
        value = getattr(obj, name)
        if value is None:
            continue
        if isinstance(value, dict):
            field = getattr(msg, name)
            for k, v in value.items():
                if isinstance(v, BaseModel):  # a map of messages (Info.weight_specs)
                    _fill(field[k], v)
                else:
                    field[k] = v
        elif isinstance(value, list):
            field = getattr(msg, name)
            if value and isinstance(value[0], BaseModel):  # repeated messages (Trace.stages)
                for item in value:
                    _fill(field.add(), item)
            else:
                field.extend(value)
        elif isinstance(value, np.ndarray):  # an IntArray (TraceRequest.token_ids)
            getattr(msg, name).extend(value.tolist())
        elif isinstance(value, BaseModel):  # a message field (SessionInfo.result)
            _fill(getattr(msg, name), value)
        else:
            setattr(msg, name, value)


def _fields(msg: Message, cls: type[BaseModel]) -> dict[str, Any]:
    """The model's fields read off a message; unset optional fields are left to the defaults."""
    out: dict[str, Any] = {}
    by_name = msg.DESCRIPTOR.fields_by_name
    for name in cls.model_fields:
        field = by_name[name]
        if field.has_presence and not msg.HasField(name):
            continue
        value = getattr(msg, name)
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            entry = field.message_type.fields_by_name["value"]
            if entry.message_type is not None:  # a map of messages: their fields by name
                value = {k: _message_fields(v) for k, v in value.items()}
            else:
                value = dict(value)
        elif field.is_repeated and field.message_type is not None:  # repeated messages
            value = [_message_fields(v) for v in value]
        elif field.is_repeated:
            value = list(value)
        elif field.message_type is not None:
            value = _message_fields(value)
        out[name] = value
    return out


def _message_fields(msg: Message) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for field in msg.DESCRIPTOR.fields:
        value = getattr(msg, field.name)
        out[field.name] = list(value) if field.is_repeated else value
    return out


def from_proto(msg: Message, cls: type[M]) -> M:
    """The inverse of ``to_proto``: ``from_proto(msg, VersionInfo)``."""
    expected = _FLAT.get(cls)
    if expected is None or not isinstance(msg, expected):
        raise TypeError(f"cannot convert {type(msg).__name__} to {cls.__name__}")
    return parse_model(cls, _fields(msg, cls))


# Typed forms of ``to_proto`` for the servicer's return values.
def _sampling_to_proto(sampling: Sampling) -> pb.Sampling:
    return cast(pb.Sampling, to_proto(sampling))


def version_info_to_proto(info: VersionInfo) -> pb.VersionInfo:
    return cast(pb.VersionInfo, to_proto(info))


def lease_info_to_proto(lease: LeaseInfo) -> pb.LeaseInfo:
    return cast(pb.LeaseInfo, to_proto(lease))


def info_to_proto(info: Info) -> pb.Info:
    return cast(pb.Info, to_proto(info))


def publish_result_to_proto(result: PublishResult) -> pb.PublishResult:
    return cast(pb.PublishResult, to_proto(result))


def trace_request_to_proto(req: TraceRequest) -> pb.TraceRequest:
    return cast(pb.TraceRequest, to_proto(req))


def trace_request_from_proto(msg: pb.TraceRequest) -> TraceRequest:
    """A received trace request; malformed fields raise ``InvalidRequest`` naming them."""
    return parse_model(TraceRequest, _fields(msg, TraceRequest), error=InvalidRequest)


def trace_to_proto(trace: Trace) -> pb.TraceResponse:
    return cast(pb.TraceResponse, to_proto(trace))


def versions_to_proto(
    versions: Iterable[VersionInfo], watermark: int | None
) -> pb.ListVersionsResponse:
    msg = pb.ListVersionsResponse()
    for info in versions:
        msg.versions.append(version_info_to_proto(info))
    if watermark is not None:
        msg.watermark = watermark
    return msg


def versions_from_proto(msg: pb.ListVersionsResponse) -> tuple[list[VersionInfo], int | None]:
    infos = [from_proto(v, VersionInfo) for v in msg.versions]
    return infos, (msg.watermark if msg.HasField("watermark") else None)


@dataclass(frozen=True)
class PublishHeader:
    """What a publish says besides its bytes: the first message of a Publish stream, the HTTP
    PUT's query parameters, and (with a path beside it) a publish by path. Checked once, when
    it is made, wherever that is: a bad field raises ``InvalidRequest`` naming it."""

    policy_version: int
    sha256: str | None  # None: the service computes the hash (no end-to-end check)
    delta: bool = False
    parent: int | None = None
    total_bytes: int = 0
    base_version: int | None = None  # set: an adapter's tensors over this base version

    def __post_init__(self) -> None:
        check_version(self.policy_version)
        if self.parent is not None:
            check_version(self.parent, "parent")
            if not self.delta:
                raise InvalidRequest("parent applies to delta publishes only", parameter="parent")
        if self.base_version is not None:
            check_version(self.base_version, "base_version")
            if self.delta:
                raise InvalidRequest(
                    "an adapter is published whole (no delta)", parameter="base_version"
                )

    def to_proto(self) -> pb.PublishChunk:
        header = pb.PublishHeader(
            policy_version=self.policy_version,
            sha256=self.sha256 or "",
            delta=self.delta,
            total_bytes=self.total_bytes,
        )
        if self.parent is not None:
            header.parent = self.parent
        if self.base_version is not None:
            header.base_version = self.base_version
        return pb.PublishChunk(header=header)

    @classmethod
    def from_proto(cls, chunk: pb.PublishChunk) -> PublishHeader:
        if chunk.WhichOneof("payload") != "header":
            raise InvalidRequest(
                "the first Publish message must carry the header", parameter="header"
            )
        return cls.from_fields(chunk.header)

    @classmethod
    def from_fields(cls, msg: pb.PublishHeader | pb.PublishByPathRequest) -> PublishHeader:
        """From a message carrying the header's fields (a stream's header, or a publish by
        path's request)."""
        return cls(
            policy_version=msg.policy_version,
            sha256=msg.sha256 or None,
            delta=msg.delta,
            parent=msg.parent if msg.HasField("parent") else None,
            total_bytes=msg.total_bytes if isinstance(msg, pb.PublishHeader) else 0,
            base_version=msg.base_version
            if isinstance(msg, pb.PublishHeader) and msg.HasField("base_version")
            else None,
        )


# ---------------------------------------------------------------- logprobs


def routing_to_proto(record: RoutedExperts, msg: pb.RoutedExperts) -> None:
    """Fill ``msg`` with a routing record (ids as int16 whenever every id fits)."""
    dtype = wire_dtype(record.ids)
    rows, layers, top_k = (int(x) for x in record.ids.shape)
    msg.start = record.start
    msg.rows, msg.layers, msg.top_k = rows, layers, top_k
    msg.width = dtype.itemsize
    msg.ids = np.ascontiguousarray(record.ids, dtype=dtype).tobytes()


def routing_from_proto(msg: pb.RoutedExperts, parameter: str, error: type[OldLogitError]) -> Any:
    """A received record's fields: ids [rows, layers, top_k] from their bytes."""
    widths: dict[int, np.dtype[Any]] = {2: np.dtype("<i2"), 4: np.dtype("<i4")}
    dtype = widths.get(msg.width)
    shape = (msg.rows, msg.layers, msg.top_k)
    if (
        dtype is None
        or min(shape) < 0
        or msg.rows * msg.layers * msg.top_k * dtype.itemsize != len(msg.ids)
    ):
        raise error(
            f"{parameter}: {len(msg.ids)} bytes of ids do not hold {list(shape)} ids of width "
            f"{msg.width} (2 or 4)",
            parameter=parameter,
        )
    return {"ids": np.frombuffer(msg.ids, dtype=dtype).reshape(shape), "start": msg.start}


def request_to_proto(req: LogprobsRequest) -> pb.LogprobsRequest:
    msg = pb.LogprobsRequest(
        allow_inexact=req.allow_inexact, use_cache=req.use_cache, return_routing=req.return_routing
    )
    msg.sampling.CopyFrom(_sampling_to_proto(req.sampling))
    if req.proxy is not None:
        msg.proxy = req.proxy
    if req.timeout_s is not None:
        msg.timeout_s = req.timeout_s
    for i, seq in enumerate(req.sequences):
        s = msg.sequences.add()
        s.token_ids.extend(token_ids_int32(seq, i).tolist())
        try:
            if seq.policy_version is not None:
                s.policy_version = seq.policy_version
            if seq.score_from is not None:
                s.score_from = seq.score_from
        except ValueError as exc:  # a Python int beyond int64
            raise InvalidRequest(str(exc), parameter=f"sequences[{i}]") from exc
        if seq.versions is not None:
            s.versions.extend(seq.versions.tolist())
        if seq.sampling is not None:
            s.sampling.CopyFrom(_sampling_to_proto(seq.sampling))
        if seq.routed_experts is not None:
            routing_to_proto(seq.routed_experts, s.routed_experts)
    return msg


def request_from_proto(msg: pb.LogprobsRequest) -> LogprobsRequest:
    sequences: list[dict[str, Any]] = []
    for s in msg.sequences:
        d: dict[str, Any] = {"token_ids": np.array(s.token_ids, dtype=np.int64)}
        if s.HasField("policy_version"):
            d["policy_version"] = s.policy_version
        if s.HasField("score_from"):
            d["score_from"] = s.score_from
        if len(s.versions):  # per-token mode iff non-empty
            d["versions"] = np.array(s.versions, dtype=np.int64)
        if s.HasField("sampling"):
            d["sampling"] = _fields(s.sampling, Sampling)
        if s.HasField("routed_experts"):
            d["routed_experts"] = routing_from_proto(
                s.routed_experts, f"sequences[{len(sequences)}].routed_experts", InvalidRequest
            )
        sequences.append(d)
    obj: dict[str, Any] = {
        "sequences": sequences,
        "allow_inexact": msg.allow_inexact,
        "return_routing": msg.return_routing,
    }
    if msg.HasField("sampling"):
        obj["sampling"] = _fields(msg.sampling, Sampling)
    for name in ("proxy", "use_cache", "timeout_s"):
        if msg.HasField(name):
            obj[name] = getattr(msg, name)
    return parse_model(LogprobsRequest, obj, error=InvalidRequest)


def response_to_proto(resp: LogprobsResponse, req: LogprobsRequest) -> pb.LogprobsResponse:
    """Compact: each result carries only its scored values, in position order."""
    if len(resp.results) != len(req.sequences):
        raise InternalError(
            f"{len(resp.results)} results for {len(req.sequences)} sequences", parameter="results"
        )
    msg = pb.LogprobsResponse()
    for i, (res, seq) in enumerate(zip(resp.results, req.sequences, strict=True)):
        r = msg.results.add(exact=res.exact, cached=res.cached)
        r.logprobs.extend(compact_logprobs(res, seq, i).tolist())
        r.versions.extend(res.versions)
        for version, sha in sorted(res.weight_sha256.items()):
            r.weight_sha256.add(policy_version=version, sha256=sha)
        for record in res.routed_experts or ():
            routing_to_proto(record, r.routed_experts.add())
    return msg


def response_from_proto(msg: pb.LogprobsResponse, req: LogprobsRequest) -> LogprobsResponse:
    """Put each result's scored values back in place (NaN elsewhere)."""
    if len(msg.results) != len(req.sequences):
        raise InternalError(
            f"{len(msg.results)} results for {len(req.sequences)} sequences", parameter="results"
        )
    results = []
    for i, (r, seq) in enumerate(zip(msg.results, req.sequences, strict=True)):
        result: dict[str, Any] = {
            "logprobs": expand_logprobs(np.array(r.logprobs, dtype=np.float32), seq, i),
            "versions": list(r.versions),
            "weight_sha256": {h.policy_version: h.sha256 for h in r.weight_sha256},
            "exact": r.exact,
            "cached": r.cached,
        }
        if req.return_routing:
            result["routed_experts"] = [
                routing_from_proto(rec, f"results[{i}].routed_experts[{j}]", InternalError)
                for j, rec in enumerate(r.routed_experts)
            ]
        results.append(result)
    return parse_model(LogprobsResponse, {"results": results})


# ---------------------------------------------------------------- errors


def grpc_code(err: OldLogitError) -> grpc.StatusCode:
    """The status code an error answers with (its class's ``grpc_status``)."""
    code: grpc.StatusCode = getattr(grpc.StatusCode, err.grpc_status, grpc.StatusCode.UNKNOWN)
    return code


def grpc_trailing_metadata(err: OldLogitError) -> tuple[tuple[str, str | bytes], ...]:
    """Trailing metadata that lets the client rebuild ``err``: pass to ``context.abort``."""
    payload = json.dumps(err.to_payload(), default=str).encode()
    md: list[tuple[str, str | bytes]] = [(ERROR_METADATA_KEY, payload)]
    if isinstance(err, Overloaded):
        md.append((RETRY_AFTER_METADATA_KEY, repr(err.retry_after_s)))
    return tuple(md)


# Statuses raised by gRPC itself (or a server without our metadata) -> the nearest class.
# UNAVAILABLE/CANCELLED are connection-level (peer down, going away): safe to retry elsewhere.
# RESOURCE_EXHAUSTED without our payload is gRPC's message-size limit: not worth retrying.
_BY_STATUS: dict[grpc.StatusCode, type[OldLogitError]] = {
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.CANCELLED: Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.UNAUTHENTICATED: Unauthorized,
    grpc.StatusCode.PERMISSION_DENIED: Forbidden,
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequest,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.OUT_OF_RANGE: VersionEvicted,
    grpc.StatusCode.ALREADY_EXISTS: Conflict,
    grpc.StatusCode.FAILED_PRECONDITION: Conflict,
    grpc.StatusCode.RESOURCE_EXHAUSTED: LimitExceeded,
}


def error_from_grpc(
    code: grpc.StatusCode | None,
    details: str | None,
    trailing_metadata: Iterable[tuple[str, str | bytes]] | None,
) -> OldLogitError:
    """Rebuild the typed error from a failed call's status, details and trailing metadata."""
    md = {key.lower(): value for key, value in (trailing_metadata or ())}
    raw = md.get(ERROR_METADATA_KEY)
    if raw is not None:
        try:
            payload = json.loads(raw)
        except ValueError:
            payload = None
        if isinstance(payload, dict) and "code" in payload:
            err = error_from_payload(payload)
            retry_after = md.get(RETRY_AFTER_METADATA_KEY)
            if isinstance(err, Overloaded) and "retry_after_s" not in err.details and retry_after:
                try:
                    err.details["retry_after_s"] = float(retry_after)
                except ValueError:
                    logger.debug("ignoring a non-numeric retry-after %r", retry_after)
            return err
    cls = _BY_STATUS.get(code, InternalError) if code is not None else InternalError
    name = code.name if code is not None else "UNKNOWN"
    message = f"gRPC {name}: {details or 'no details'}"
    if cls is Unavailable:
        # A transport failure carries no server hint: the client's backoff decides.
        return Unavailable(message, retry_after_s=0.0)
    return cls(message)
