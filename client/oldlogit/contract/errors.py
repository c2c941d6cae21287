"""One error tree, shared by the service and the client.

Every class carries a stable ``code``, its HTTP status and its gRPC status code name as class
attributes, so one FastAPI handler and one gRPC interceptor map every error, and the client
rebuilds the same class from the wire (``error_from_payload``). Messages name the offending
parameter; ``parameter`` carries it separately for programs.

    OldLogitError
    ├── InvalidRequest            400  INVALID_ARGUMENT   invalid_request
    │   ├── TokenOutOfVocab       400  INVALID_ARGUMENT   token_out_of_vocab
    │   ├── SequenceTooLong       400  INVALID_ARGUMENT   sequence_too_long
    │   ├── BadSampling           400  INVALID_ARGUMENT   bad_sampling
    │   ├── MalformedVersions     400  INVALID_ARGUMENT   malformed_versions
    │   ├── LimitExceeded         413  INVALID_ARGUMENT   limit_exceeded
    │   └── WeightsMismatch       422  INVALID_ARGUMENT   weights_mismatch
    ├── Unauthorized              401  UNAUTHENTICATED    unauthorized
    ├── Forbidden                 403  PERMISSION_DENIED  forbidden
    ├── NotFound                  404  NOT_FOUND          not_found
    │   ├── UnknownVersion        404  NOT_FOUND          unknown_version
    │   └── UnknownLease          404  NOT_FOUND          unknown_lease
    ├── VersionEvicted            410  OUT_OF_RANGE       version_evicted
    ├── Conflict                  409  ALREADY_EXISTS     conflict
    │   ├── VersionConflict       409  ALREADY_EXISTS     version_conflict
    │   ├── VersionNotIncreasing  409  FAILED_PRECONDITION version_not_increasing
    │   └── ParentMissing         409  FAILED_PRECONDITION parent_missing
    ├── Overloaded                503  RESOURCE_EXHAUSTED overloaded        (retry_after_s)
    ├── Unavailable               503  UNAVAILABLE        unavailable       (retry_after_s)
    ├── DeadlineExceeded          504  DEADLINE_EXCEEDED  deadline_exceeded
    ├── TlsError                  495  UNAVAILABLE        tls_error         (details.reason)
    ├── OutOfMemory               507  RESOURCE_EXHAUSTED out_of_memory
    └── InternalError             500  INTERNAL           internal
"""

from __future__ import annotations

from typing import Any, ClassVar

__all__ = [
    "BadSampling",
    "Conflict",
    "DeadlineExceeded",
    "Forbidden",
    "InternalError",
    "InvalidRequest",
    "LimitExceeded",
    "MalformedVersions",
    "NotFound",
    "OldLogitError",
    "OutOfMemory",
    "Overloaded",
    "ParentMissing",
    "SequenceTooLong",
    "TlsError",
    "TokenOutOfVocab",
    "Unauthorized",
    "Unavailable",
    "UnknownLease",
    "UnknownVersion",
    "VersionConflict",
    "VersionEvicted",
    "VersionNotIncreasing",
    "WeightsMismatch",
    "error_class_for_code",
    "error_from_payload",
]


class OldLogitError(Exception):
    """Base of every error the service can answer with."""

    code: ClassVar[str] = "error"
    http_status: ClassVar[int] = 500
    grpc_status: ClassVar[str] = "UNKNOWN"
    retryable: ClassVar[bool] = False

    def __init__(
        self,
        message: str,
        *,
        parameter: str | None = None,
        details: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.parameter = parameter
        self.details: dict[str, Any] = dict(details or {})

    def __str__(self) -> str:
        return self.message

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.message!r}, parameter={self.parameter!r})"

    def to_payload(self) -> dict[str, Any]:
        """The error body both transports send: ``{"error": {...}}`` on HTTP."""
        body: dict[str, Any] = {"code": self.code, "message": self.message}
        if self.parameter is not None:
            body["parameter"] = self.parameter
        if self.details:
            body["details"] = self.details
        return body


class InvalidRequest(OldLogitError):
    code = "invalid_request"
    http_status = 400
    grpc_status = "INVALID_ARGUMENT"


class TokenOutOfVocab(InvalidRequest):
    code = "token_out_of_vocab"


class SequenceTooLong(InvalidRequest):
    code = "sequence_too_long"


class BadSampling(InvalidRequest):
    code = "bad_sampling"


class MalformedVersions(InvalidRequest):
    code = "malformed_versions"


class LimitExceeded(InvalidRequest):
    code = "limit_exceeded"
    http_status = 413


class WeightsMismatch(InvalidRequest):
    """Published weights do not match the model (names, shapes, dtypes) or their sha256."""

    code = "weights_mismatch"
    http_status = 422


class Unauthorized(OldLogitError):
    code = "unauthorized"
    http_status = 401
    grpc_status = "UNAUTHENTICATED"


class Forbidden(OldLogitError):
    code = "forbidden"
    http_status = 403
    grpc_status = "PERMISSION_DENIED"


class NotFound(OldLogitError):
    code = "not_found"
    http_status = 404
    grpc_status = "NOT_FOUND"


class UnknownVersion(NotFound):
    code = "unknown_version"


class UnknownLease(NotFound):
    code = "unknown_lease"


class VersionEvicted(OldLogitError):
    """The version was acknowledged once but is no longer retained.

    ``details`` holds ``retained`` = [lowest, highest] retained version (or null when none).
    """

    code = "version_evicted"
    http_status = 410
    grpc_status = "OUT_OF_RANGE"


class Conflict(OldLogitError):
    code = "conflict"
    http_status = 409
    grpc_status = "ALREADY_EXISTS"


class VersionConflict(Conflict):
    code = "version_conflict"


class VersionNotIncreasing(Conflict):
    code = "version_not_increasing"
    grpc_status = "FAILED_PRECONDITION"


class ParentMissing(Conflict):
    code = "parent_missing"
    grpc_status = "FAILED_PRECONDITION"


class Overloaded(OldLogitError):
    code = "overloaded"
    http_status = 503
    grpc_status = "RESOURCE_EXHAUSTED"
    retryable = True

    def __init__(
        self,
        message: str,
        *,
        parameter: str | None = None,
        details: dict[str, Any] | None = None,
        retry_after_s: float = 1.0,
    ) -> None:
        details = dict(details or {})
        details.setdefault("retry_after_s", retry_after_s)
        super().__init__(message, parameter=parameter, details=details)

    @property
    def retry_after_s(self) -> float:
        return float(self.details.get("retry_after_s", 1.0))


class Unavailable(Overloaded):
    code = "unavailable"
    grpc_status = "UNAVAILABLE"


class DeadlineExceeded(OldLogitError):
    code = "deadline_exceeded"
    http_status = 504
    grpc_status = "DEADLINE_EXCEEDED"


class TlsError(OldLogitError):
    """The TLS handshake with a replica failed: raised by the client, never sent by the service.

    ``details["reason"]`` names the problem: ``untrusted`` (not signed by a CA the client
    trusts: pass ``ca_file``), ``expired``, ``hostname_mismatch``, ``not_tls`` (the address
    speaks plaintext: use http:// or grpc://), ``client_certificate_required`` (the service
    wants mutual TLS: pass ``cert_file`` and ``key_file``), ``client_certificate_rejected``
    (not signed by the CA the service trusts), or ``handshake_failed``. ``parameter`` names the
    client option to change. Not retried and not failed over: every replica of a deployment
    shares its certificates, so another attempt fails the same way (495: nginx's "SSL
    Certificate Error"; gRPC reports a failed handshake as UNAVAILABLE).
    """

    code = "tls_error"
    http_status = 495
    grpc_status = "UNAVAILABLE"

    @property
    def reason(self) -> str:
        return str(self.details.get("reason", "handshake_failed"))


class OutOfMemory(OldLogitError):
    code = "out_of_memory"
    http_status = 507
    grpc_status = "RESOURCE_EXHAUSTED"


class InternalError(OldLogitError):
    code = "internal"
    http_status = 500
    grpc_status = "INTERNAL"


def _all_subclasses(cls: type[OldLogitError]) -> list[type[OldLogitError]]:
    out: list[type[OldLogitError]] = [cls]
    for sub in cls.__subclasses__():
        out.extend(_all_subclasses(sub))
    return out


_BY_CODE: dict[str, type[OldLogitError]] = {c.code: c for c in _all_subclasses(OldLogitError)}


def error_class_for_code(code: str) -> type[OldLogitError]:
    """The class for a wire ``code``; unknown codes (a newer server) map to the base class."""
    return _BY_CODE.get(code, OldLogitError)


def error_from_payload(payload: dict[str, Any]) -> OldLogitError:
    """Rebuild the typed error from a wire body (the inverse of ``to_payload``)."""
    cls = error_class_for_code(str(payload.get("code", "error")))
    err = cls.__new__(cls)
    OldLogitError.__init__(
        err,
        str(payload.get("message", "")),
        parameter=payload.get("parameter"),
        details=payload.get("details") or {},
    )
    return err
