"""Who may call: the bearer-token check both transports run before anything else.

In: the deployment's ``Settings`` (read token, write token, TLS on or off) and, per call,
whether it writes, the bearer token it carried and the peer's address. Out: nothing, or
``Unauthorized`` / ``Forbidden`` naming ``authorization``. Tokens are compared in constant
time. Without a write token, writes are accepted from loopback only, and not at all with TLS on
(a TLS-terminating proxy beside the server would make every peer loopback).
"""

from __future__ import annotations

import hmac

from oldlogit.contract.errors import Forbidden, Unauthorized
from oldlogit_service.config import Settings

__all__ = ["Auth"]

_LOOPBACK = ("127.", "::1", "localhost", "unix:")


class Auth:
    def __init__(self, settings: Settings) -> None:
        self._write = settings.write_token.get_secret_value() if settings.write_token else None
        self._read = settings.read_token.get_secret_value() if settings.read_token else None
        self._tls = settings.tls_enabled

    def check(self, *, write: bool, token: str | None, peer: str | None) -> None:
        """Allow the call, or raise: the write token for writes, the read token (or the write
        token) for reads when one is set."""
        expected = self._write if write else self._read
        if write and expected is None:
            if self._tls or (peer is not None and not peer.startswith(_LOOPBACK)):
                raise Forbidden(
                    "writes are only accepted from loopback when no --write-token is set"
                    + (", and not at all with TLS on" if self._tls else ""),
                    parameter="authorization",
                )
            return
        if not write and expected is None:
            return
        ok = token is not None and hmac.compare_digest(token.encode(), (expected or "").encode())
        if not ok and not write and self._write is not None and token is not None:
            ok = hmac.compare_digest(token.encode(), self._write.encode())
        if not ok:
            raise Unauthorized(
                "missing or wrong bearer token" + (" for writes" if write else ""),
                parameter="authorization",
            )
