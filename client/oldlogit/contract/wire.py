"""HTTP body encodings of the contract, symmetric for the server and the client.

In: contract types (``types``) or raw bodies; out: bytes or contract types. Malformed
request bodies raise ``InvalidRequest`` naming the parameter (never a pydantic/msgpack error);
malformed response bodies raise ``InternalError``. This module does no I/O and holds no state.

Encodings of ``POST /v1/logprobs`` (request ``Content-Type`` and response ``Accept``):

``application/json`` (default). The request is ``LogprobsRequest`` as JSON::

    {"sequences": [{"token_ids": [1, 2, 3], "policy_version": 7, "score_from": 1},
                   {"token_ids": [1, 2, 3], "versions": [-1, 7, 8]}],
     "sampling": {"temperature": 1.0, "top_k": 0, "top_p": 1.0},
     "allow_inexact": false, "use_cache": true, "timeout_s": 30.0}

The response holds, per sequence, ONLY the scored values, in increasing position order (the
positions where ``Sequence.scored_mask()`` is true: ``versions[i] >= 0``, or ``i >= score_from``
with ``policy_version``; never position 0). JSON has no infinity, so −inf (a token outside the
top-k/top-p support) is the string ``"-inf"`` (``"inf"`` and ``"nan"`` likewise); finite values are
numbers that round-trip to the exact float32::

    {"results": [{"logprobs": [-1.25, "-inf"], "versions": [7],
                  "weight_sha256": {"7": "<hex>"}, "exact": true, "cached": false}]}

``application/msgpack``. The same maps, but every array is one msgpack ``bin`` of raw
little-endian values: ``token_ids`` int32 (``<i4``), ``versions`` int64 (``<i8``) and
``logprobs`` float32 (``<f4``, −inf and NaN as IEEE values). Decoders also accept plain msgpack
arrays of numbers. ``weight_sha256`` keys are decimal strings in both encodings.

MoE routing records (a sequence's ``routed_experts``; with ``"return_routing": true`` each
result's ``routed_experts``, one per entry of ``versions``) are ``{"ids": [[[e, …], …], …],
"start": s}`` in JSON — ids nested [rows][MoE layers][top_k] — and ``{"ids": bin, "dtype":
"<i2" | "<i4", "shape": [rows, layers, top_k], "start": s}`` in msgpack (int16 whenever every
id fits, ``oldlogit.contract.routing.wire_dtype``).

The receiver puts the compact values back in place: ``SequenceResult.logprobs`` has the full
sequence length, NaN where not scored. Errors are ``{"error": {"code", "message", "parameter"?,
"details"?}}`` with the error's HTTP status and, for 503, a ``Retry-After`` header (seconds).
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import msgpack
import numpy as np
import numpy.typing as npt
from pydantic import BaseModel, ValidationError

from oldlogit.contract.errors import (
    Conflict,
    DeadlineExceeded,
    Forbidden,
    InternalError,
    InvalidRequest,
    LimitExceeded,
    NotFound,
    OldLogitError,
    OutOfMemory,
    Overloaded,
    Unauthorized,
    Unavailable,
    VersionEvicted,
    error_from_payload,
)
from oldlogit.contract.routing import wire_dtype
from oldlogit.contract.types import (
    LogprobsRequest,
    LogprobsResponse,
    RoutedExperts,
    Sequence,
    SequenceResult,
)

__all__ = [
    "JSON_TYPE",
    "MSGPACK_TYPE",
    "compact_logprobs",
    "decode_error",
    "decode_request",
    "decode_response",
    "decode_routing",
    "encode_error",
    "encode_request",
    "encode_response",
    "encode_routing",
    "expand_logprobs",
    "media_type",
    "negotiate",
    "parameter_path",
    "parse_model",
    "retry_after_header",
    "token_ids_int32",
]

logger = logging.getLogger(__name__)

JSON_TYPE = "application/json"
MSGPACK_TYPE = "application/msgpack"
_MSGPACK_ALIASES = frozenset({MSGPACK_TYPE, "application/x-msgpack", "application/vnd.msgpack"})

_I32 = np.dtype("<i4")
_I64 = np.dtype("<i8")
_F32 = np.dtype("<f4")
_INT32_MIN, _INT32_MAX = int(np.iinfo(np.int32).min), int(np.iinfo(np.int32).max)

M = TypeVar("M", bound=BaseModel)
# How an array travels in one encoding: (array, wire dtype) -> JSON list or msgpack bin.
ArrayEncoder = Callable[[npt.NDArray[Any], np.dtype[Any]], Any]


# ---------------------------------------------------------------- content negotiation


def media_type(content_type: str | None) -> str:
    """The canonical encoding named by a Content-Type header (absent means JSON)."""
    if not content_type:
        return JSON_TYPE
    base = content_type.split(";", 1)[0].strip().lower()
    if base in _MSGPACK_ALIASES:
        return MSGPACK_TYPE
    if base == JSON_TYPE or base.endswith("+json"):
        return JSON_TYPE
    raise InvalidRequest(
        f"unsupported content type {content_type!r}: send {JSON_TYPE} or {MSGPACK_TYPE}",
        parameter="content-type",
    )


def negotiate(accept: str | None) -> str:
    """The response encoding for an Accept header: the best-quality supported one, else JSON."""
    best, best_q = JSON_TYPE, -1.0
    for part in (accept or "").split(","):
        fields = [f.strip() for f in part.split(";")]
        base = fields[0].lower()
        q = 1.0
        for param in fields[1:]:
            if param.startswith("q="):
                try:
                    q = float(param[2:])
                except ValueError:
                    q = 0.0
        kind = (
            MSGPACK_TYPE if base in _MSGPACK_ALIASES else JSON_TYPE if base == JSON_TYPE else None
        )
        if kind is not None and q > 0 and q > best_q:
            best, best_q = kind, q
    return best


# ---------------------------------------------------------------- shared helpers


def parameter_path(loc: tuple[int | str, ...] | list[int | str]) -> str:
    """A pydantic error location as a parameter path: ("sequences", 2, "token_ids") ->
    "sequences[2].token_ids". Validator tags ("function-before[...]", "[key]") are dropped."""
    out = ""
    for part in loc:
        if isinstance(part, int) or (isinstance(part, str) and part.isdigit()):
            out += f"[{part}]"
        elif isinstance(part, str) and part.isidentifier():
            out += f".{part}" if out else part
    return out or "body"


def parse_model(cls: type[M], obj: Any, *, error: type[OldLogitError] = InternalError) -> M:
    """Validate ``obj`` into ``cls``, raising ``error`` (naming the parameter) on failure."""
    try:
        return cls.model_validate(obj)
    except ValidationError as exc:
        first = exc.errors()[0]
        parameter = parameter_path(first["loc"])
        raise error(f"{parameter}: {first['msg']}", parameter=parameter) from exc


def token_ids_int32(seq: Sequence, index: int) -> npt.NDArray[np.int32]:
    """The token ids as little-endian int32 (their width on the binary wire and in the proto)."""
    ids = seq.token_ids
    if ids.size and (int(ids.min()) < _INT32_MIN or int(ids.max()) > _INT32_MAX):
        parameter = f"sequences[{index}].token_ids"
        raise InvalidRequest(f"{parameter}: token ids must fit in int32", parameter=parameter)
    return ids.astype(_I32)


def compact_logprobs(result: SequenceResult, seq: Sequence, index: int) -> npt.NDArray[np.float32]:
    """The scored values of a full-length result, in position order: what travels."""
    n = len(seq.token_ids)
    if len(result.logprobs) != n:
        parameter = f"results[{index}].logprobs"
        raise InternalError(
            f"{parameter}: {len(result.logprobs)} values for a sequence of {n} tokens",
            parameter=parameter,
        )
    return np.ascontiguousarray(result.logprobs[seq.scored_mask()], dtype=np.float32)


def expand_logprobs(values: Any, seq: Sequence, index: int) -> npt.NDArray[np.float32]:
    """Put the compact scored values back in place: full length, NaN where not scored."""
    mask = seq.scored_mask()
    parameter = f"results[{index}].logprobs"
    try:
        vals = np.asarray(values, dtype=np.float32)
    except (TypeError, ValueError) as exc:
        raise InternalError(f"{parameter}: not numbers ({exc})", parameter=parameter) from exc
    count = int(mask.sum())
    if vals.ndim != 1 or vals.shape[0] != count:
        raise InternalError(
            f"{parameter}: expected {count} scored values, got shape {tuple(vals.shape)}",
            parameter=parameter,
        )
    out = np.full(mask.shape[0], np.nan, dtype=np.float32)  # [n]
    out[mask] = vals
    return out


# ---------------------------------------------------------------- array encodings


def _json_array(arr: npt.NDArray[Any], dtype: np.dtype[Any]) -> list[Any]:
    if dtype.kind != "f":
        return arr.tolist()  # type: ignore[no-any-return]
    # float32 -> float64 is exact, and repr of that double parses back to the same float32.
    out: list[Any] = arr.astype(np.float64).tolist()
    for k in np.flatnonzero(~np.isfinite(arr)).tolist():
        v = out[k]
        out[k] = "nan" if math.isnan(v) else ("-inf" if v < 0 else "inf")
    return out


def _msgpack_array(arr: npt.NDArray[Any], dtype: np.dtype[Any]) -> bytes:
    return np.ascontiguousarray(arr, dtype=dtype).tobytes()


def _from_bin(value: Any, dtype: np.dtype[Any], parameter: str, error: type[OldLogitError]) -> Any:
    """A msgpack bin back to an array; other values pass through to the type's validators."""
    if not isinstance(value, (bytes, bytearray)):
        return value
    if len(value) % dtype.itemsize:
        raise error(
            f"{parameter}: a binary array of {len(value)} bytes is not a whole number of "
            f"{dtype.itemsize}-byte values",
            parameter=parameter,
        )
    return np.frombuffer(value, dtype=dtype)


def _load(body: bytes, kind: str, error: type[OldLogitError]) -> dict[str, Any]:
    try:
        if kind == MSGPACK_TYPE:
            obj = msgpack.unpackb(body, raw=False, strict_map_key=False)
        else:
            obj = json.loads(body)
    except (
        ValueError,
        TypeError,
        msgpack.ExtraData,
        msgpack.FormatError,
        msgpack.StackError,
    ) as exc:
        raise error(f"body is not valid {kind}: {exc}", parameter="body") from exc
    if not isinstance(obj, dict):
        raise error(f"body must be a {kind} object", parameter="body")
    return obj


def _dump(obj: dict[str, Any], kind: str) -> bytes:
    if kind == MSGPACK_TYPE:
        return msgpack.packb(obj, use_bin_type=True)  # type: ignore[no-any-return]
    return json.dumps(obj, separators=(",", ":")).encode()


def _encoder(kind: str) -> ArrayEncoder:
    return _msgpack_array if kind == MSGPACK_TYPE else _json_array


# ---------------------------------------------------------------- routing records

_ROUTING_DTYPES: dict[str, np.dtype[Any]] = {"<i2": np.dtype("<i2"), "<i4": np.dtype("<i4")}


def encode_routing(record: RoutedExperts, kind: str) -> dict[str, Any]:
    """A routing record as it travels in ``kind`` (see the module docstring)."""
    if kind != MSGPACK_TYPE:
        return {"ids": record.ids.tolist(), "start": record.start}
    dtype = wire_dtype(record.ids)
    return {
        "ids": np.ascontiguousarray(record.ids, dtype=dtype).tobytes(),
        "dtype": dtype.str,
        "shape": [int(x) for x in record.ids.shape],
        "start": record.start,
    }


def decode_routing(value: Any, parameter: str, error: type[OldLogitError]) -> Any:
    """A received routing record's fields (binary ids reshaped); other shapes of value pass
    through to the type's validators, which name what is wrong."""
    if not isinstance(value, dict) or not isinstance(value.get("ids"), (bytes, bytearray)):
        return value
    out = dict(value)
    raw = out.pop("ids")
    dtype = _ROUTING_DTYPES.get(str(out.pop("dtype", "")))
    shape = out.pop("shape", None)
    if dtype is None:
        raise error(f"{parameter}.dtype must be '<i2' or '<i4'", parameter=parameter)
    if (
        not isinstance(shape, list)
        or len(shape) != 3
        or not all(isinstance(x, int) and x >= 0 for x in shape)
        or shape[0] * shape[1] * shape[2] * dtype.itemsize != len(raw)
    ):
        raise error(
            f"{parameter}.shape must be [rows, layers, top_k] matching its {len(raw)} bytes of "
            f"{dtype.str} ids, got {shape!r}",
            parameter=parameter,
        )
    out["ids"] = np.frombuffer(raw, dtype=dtype).reshape(shape)
    return out


# ---------------------------------------------------------------- POST /v1/logprobs


def encode_request(req: LogprobsRequest, content_type: str | None = JSON_TYPE) -> bytes:
    """Serialise a request body in the encoding named by ``content_type``."""
    kind = media_type(content_type)
    arr = _encoder(kind)
    # return_routing only when asked: a server without routing replay knows no such field.
    skip = {"sequences"} if req.return_routing else {"sequences", "return_routing"}
    obj = req.model_dump(exclude=skip, exclude_none=True)
    seqs = []
    for i, seq in enumerate(req.sequences):
        d = seq.model_dump(exclude={"token_ids", "versions", "routed_experts"}, exclude_none=True)
        d["token_ids"] = arr(
            token_ids_int32(seq, i) if kind == MSGPACK_TYPE else seq.token_ids, _I32
        )
        if seq.versions is not None:
            d["versions"] = arr(seq.versions, _I64)
        if seq.routed_experts is not None:
            d["routed_experts"] = encode_routing(seq.routed_experts, kind)
        seqs.append(d)
    obj["sequences"] = seqs
    return _dump(obj, kind)


def decode_request(body: bytes, content_type: str | None = JSON_TYPE) -> LogprobsRequest:
    """Parse a request body; ``InvalidRequest`` names the offending parameter."""
    kind = media_type(content_type)
    obj = _load(body, kind, InvalidRequest)
    seqs = obj.get("sequences")
    if isinstance(seqs, list):
        for i, seq in enumerate(seqs):
            if not isinstance(seq, dict):
                continue  # pydantic reports it with its path
            for name, dtype in (("token_ids", _I32), ("versions", _I64)):
                if name in seq:
                    seq[name] = _from_bin(
                        seq[name], dtype, f"sequences[{i}].{name}", InvalidRequest
                    )
            if "routed_experts" in seq:
                seq["routed_experts"] = decode_routing(
                    seq["routed_experts"], f"sequences[{i}].routed_experts", InvalidRequest
                )
    return parse_model(LogprobsRequest, obj, error=InvalidRequest)


def encode_response(
    resp: LogprobsResponse, req: LogprobsRequest, content_type: str | None = JSON_TYPE
) -> bytes:
    """Serialise a response compactly: per sequence, only the scored values travel."""
    kind = media_type(content_type)
    arr = _encoder(kind)
    if len(resp.results) != len(req.sequences):
        raise InternalError(
            f"{len(resp.results)} results for {len(req.sequences)} sequences", parameter="results"
        )
    results = []
    for i, (res, seq) in enumerate(zip(resp.results, req.sequences, strict=True)):
        d = res.model_dump(mode="json", exclude={"logprobs", "routed_experts"})
        d["logprobs"] = arr(compact_logprobs(res, seq, i), _F32)
        if res.routed_experts is not None:
            d["routed_experts"] = [encode_routing(r, kind) for r in res.routed_experts]
        results.append(d)
    return _dump({"results": results}, kind)


def decode_response(
    body: bytes, req: LogprobsRequest, content_type: str | None = JSON_TYPE
) -> LogprobsResponse:
    """Parse a response and put the scored values back in place (NaN elsewhere)."""
    kind = media_type(content_type)
    obj = _load(body, kind, InternalError)
    results = obj.get("results")
    if not isinstance(results, list) or len(results) != len(req.sequences):
        raise InternalError(f"expected a list of {len(req.sequences)} results", parameter="results")
    for i, (res, seq) in enumerate(zip(results, req.sequences, strict=True)):
        if not isinstance(res, dict) or "logprobs" not in res:
            raise InternalError("result without logprobs", parameter=f"results[{i}].logprobs")
        values = _from_bin(res["logprobs"], _F32, f"results[{i}].logprobs", InternalError)
        res["logprobs"] = expand_logprobs(values, seq, i)
        records = res.get("routed_experts")
        if isinstance(records, list):
            res["routed_experts"] = [
                decode_routing(r, f"results[{i}].routed_experts[{j}]", InternalError)
                for j, r in enumerate(records)
            ]
    return parse_model(LogprobsResponse, obj, error=InternalError)


# ---------------------------------------------------------------- errors


def retry_after_header(err: OldLogitError) -> str | None:
    """The Retry-After value (whole seconds, rounded up) for retryable errors, else None."""
    if isinstance(err, Overloaded):
        return str(max(0, math.ceil(err.retry_after_s)))
    return None


def encode_error(err: OldLogitError) -> tuple[int, bytes, dict[str, str]]:
    """(status, body, headers) of an error response on HTTP."""
    body = json.dumps({"error": err.to_payload()}, default=str).encode()
    headers = {"content-type": JSON_TYPE}
    retry_after = retry_after_header(err)
    if retry_after is not None:
        headers["retry-after"] = retry_after
    return err.http_status, body, headers


# Errors answered by something other than our handler (a proxy, the framework's own 404/422).
_BY_STATUS: dict[int, type[OldLogitError]] = {
    400: InvalidRequest,
    401: Unauthorized,
    403: Forbidden,
    404: NotFound,
    409: Conflict,
    410: VersionEvicted,
    413: LimitExceeded,
    422: InvalidRequest,
    429: Overloaded,
    502: Unavailable,
    503: Unavailable,
    504: DeadlineExceeded,
    507: OutOfMemory,
}


def decode_error(status: int, body: bytes, headers: Mapping[str, str]) -> OldLogitError:
    """Rebuild the typed error from an HTTP error response (the inverse of ``encode_error``).

    Also maps bodies that did not come from our handler (a proxy's 502, the framework's own
    404/422) to the nearest class by status, so callers always get an ``OldLogitError``.
    """
    try:
        obj = json.loads(body) if body else None
    except ValueError:
        obj = None
    err: OldLogitError
    ours = isinstance(obj, dict) and isinstance(obj.get("error"), dict) and "code" in obj["error"]
    if ours:
        assert isinstance(obj, dict)
        err = error_from_payload(obj["error"])
    else:
        cls = _BY_STATUS.get(status, InternalError)
        detail = obj.get("detail") if isinstance(obj, dict) else None
        parameter = None
        if isinstance(detail, list) and detail and isinstance(detail[0], dict):
            # FastAPI's own validation body: {"detail": [{"loc": ["query", "sha256"], ...}]}
            loc = [p for p in detail[0].get("loc", []) if p not in ("body", "query", "path")]
            parameter = parameter_path(loc)
            message = f"{parameter}: {detail[0].get('msg', 'invalid')}"
        elif isinstance(detail, str):
            message = detail
        else:
            message = f"HTTP {status}: {body[:200].decode('utf-8', 'replace')}"
        err = cls(message, parameter=parameter)
    retry_after = {k.lower(): v for k, v in headers.items()}.get("retry-after")
    # The body's retry_after_s is more precise than the whole-second header: it wins when present.
    if (
        isinstance(err, Overloaded)
        and retry_after
        and not (ours and "retry_after_s" in err.details)
    ):
        try:
            err.details["retry_after_s"] = float(retry_after)
        except ValueError:
            logger.debug("ignoring a non-numeric Retry-After header %r", retry_after)
    return err
