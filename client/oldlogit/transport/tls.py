"""The client's TLS options, and failed handshakes translated into ``TlsError``.

In: ``ca_file`` (a private CA, PEM), ``cert_file`` + ``key_file`` (a client certificate for
mutual TLS); out: an ``ssl.SSLContext`` for httpx, ``grpc.ChannelCredentials`` for grpc.aio,
and ``TlsError`` (naming the reason and the option to change) from an ``ssl.SSLError`` or a
gRPC handshake message. gRPC tells a client whose certificate the server refused only "Socket
closed", so ``diagnose`` repeats the handshake with Python's ssl, which sees the server's alert.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from oldlogit.contract.errors import InvalidRequest, TlsError

__all__ = ["ClientTls", "diagnose", "tls_error_from_grpc", "tls_error_from_ssl"]

# OpenSSL verify codes (x509_vfy.h) for the reasons users act on differently.
_EXPIRED = {9, 10}  # not yet valid, has expired
_HOSTNAME = {62, 64}  # hostname mismatch, IP address mismatch

_FIX = {
    "untrusted": ("ca_file", "pass ca_file=<the CA that signed the service's certificate>"),
    "expired": ("url", "the service's certificate must be renewed"),
    "hostname_mismatch": ("url", "connect with a name or IP the certificate lists"),
    "not_tls": ("url", "the address speaks plaintext: use http:// or grpc://"),
    "client_certificate_required": (
        "cert_file",
        "the service requires mutual TLS: pass cert_file= and key_file=",
    ),
    "client_certificate_rejected": (
        "cert_file",
        "the service does not accept this client certificate (signed by another CA, or expired)",
    ),
    "handshake_failed": ("url", "the TLS handshake failed"),
}


def _make_error(url: str, reason: str, what: str) -> TlsError:
    parameter, fix = _FIX[reason]
    return TlsError(
        f"TLS handshake with {url} failed ({reason.replace('_', ' ')}): {what}; {fix}",
        parameter=parameter,
        details={"reason": reason},
    )


def _read(path: str | None, option: str) -> bytes | None:
    if path is None:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise InvalidRequest(
            f"cannot read {option} {path}: {exc.strerror or exc}", parameter=option
        ) from exc


@dataclass(frozen=True)
class ClientTls:
    """PEM files read once, when the client is made (so a bad path fails at once)."""

    ca: bytes | None = None
    cert: bytes | None = None
    key: bytes | None = None
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None

    @classmethod
    def load(
        cls, ca_file: str | None, cert_file: str | None, key_file: str | None
    ) -> ClientTls | None:
        """None when no option is given (TLS, if the URL says so, with the system's CAs)."""
        if (cert_file is None) != (key_file is None):
            missing = "key_file" if key_file is None else "cert_file"
            raise InvalidRequest(
                "a client certificate needs both cert_file and key_file", parameter=missing
            )
        if ca_file is None and cert_file is None:
            return None
        tls = cls(
            ca=_read(ca_file, "ca_file"),
            cert=_read(cert_file, "cert_file"),
            key=_read(key_file, "key_file"),
            ca_file=ca_file,
            cert_file=cert_file,
            key_file=key_file,
        )
        tls.ssl_context()  # a file that is not PEM of the right kind fails here, named
        return tls

    def ssl_context(self, alpn: tuple[str, ...] = ("http/1.1",)) -> ssl.SSLContext:
        try:
            ctx = ssl.create_default_context(
                cadata=self.ca.decode("ascii", "replace") if self.ca is not None else None
            )
        except (ssl.SSLError, ValueError) as exc:
            raise InvalidRequest(
                f"ca_file {self.ca_file} holds no PEM certificate: {exc}", parameter="ca_file"
            ) from exc
        if self.cert_file is not None:
            try:
                ctx.load_cert_chain(self.cert_file, self.key_file)
            except (ssl.SSLError, OSError) as exc:
                raise InvalidRequest(
                    f"cert_file {self.cert_file} / key_file {self.key_file}: not a PEM "
                    f"certificate and its private key ({exc})",
                    parameter="cert_file",
                ) from exc
        ctx.set_alpn_protocols(list(alpn))
        return ctx

    def grpc_credentials(self) -> Any:
        import grpc

        return grpc.ssl_channel_credentials(
            root_certificates=self.ca, private_key=self.key, certificate_chain=self.cert
        )


def _ssl_errors(exc: BaseException | None) -> ssl.SSLError | None:
    """The first ``ssl.SSLError`` in an exception's cause/context chain."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, ssl.SSLError):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


def tls_error_from_ssl(exc: BaseException, url: str) -> TlsError | None:
    """``TlsError`` for an ``ssl.SSLError`` somewhere in ``exc``'s chain; None if there is none."""
    err = _ssl_errors(exc)
    if err is None:
        return None
    if isinstance(err, ssl.SSLCertVerificationError):
        code = getattr(err, "verify_code", 0)
        what = str(getattr(err, "verify_message", "") or err)
        if code in _EXPIRED:
            return _make_error(url, "expired", what)
        if code in _HOSTNAME:
            return _make_error(url, "hostname_mismatch", what)
        return _make_error(url, "untrusted", what)
    return _from_text(f"{err.reason or ''} {err}", url)


def _from_text(text: str, url: str) -> TlsError | None:
    t = text.upper()
    if "CERTIFICATE HAS EXPIRED" in t or "CERTIFICATE IS NOT YET VALID" in t:
        return _make_error(url, "expired", "the service's certificate is outside its validity")
    if "HOSTNAME VERIFICATION CHECK FAILED" in t or "HOSTNAME MISMATCH" in t:
        return _make_error(url, "hostname_mismatch", "the certificate does not name this host")
    if "CERTIFICATE_VERIFY_FAILED" in t:
        why = text[t.rindex("CERTIFICATE_VERIFY_FAILED") + len("CERTIFICATE_VERIFY_FAILED") :]
        why = why.strip(" :").removesuffix(": OK").strip() or "certificate verify failed"
        return _make_error(url, "untrusted", why)
    if "WRONG_VERSION_NUMBER" in t or "RECORD_LAYER_FAILURE" in t or "PACKET_LENGTH_TOO_LONG" in t:
        return _make_error(url, "not_tls", "the reply is not TLS")
    if "CERTIFICATE_REQUIRED" in t or "PEER_DID_NOT_RETURN_A_CERTIFICATE" in t:
        return _make_error(url, "client_certificate_required", "no client certificate was sent")
    if "UNKNOWN_CA" in t or "BAD_CERTIFICATE" in t or "CERTIFICATE_EXPIRED" in t:
        return _make_error(url, "client_certificate_rejected", "the service refused it")
    if "SSLV3_ALERT_HANDSHAKE_FAILURE" in t or "TLSV1_ALERT" in t:
        return _make_error(url, "handshake_failed", text.strip())
    return None


def tls_error_from_grpc(details: str | None, url: str) -> TlsError | None:
    """``TlsError`` for a gRPC status message that reports a failed handshake."""
    lowered = (details or "").lower()
    if "handshake" not in lowered and "verification check failed" not in lowered:
        return None
    return _from_text(str(details), url) or _make_error(url, "handshake_failed", str(details))


# What each transport sends first, so a healthy server answers with at least one byte.
HTTP_OPENER = b"GET /healthz HTTP/1.1\r\nHost: oldlogit\r\nConnection: close\r\n\r\n"
GRPC_OPENER = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00"


async def diagnose(
    host: str,
    port: int,
    tls: ClientTls | None,
    url: str,
    *,
    alpn: str,
    opener: bytes,
    timeout_s: float = 5.0,
) -> TlsError | None:
    """Repeat the handshake of a secure connection that closed without an answer, and name why;
    None when the server answers or does not answer at all (a replica that is down).

    With TLS 1.3 the server checks the client's certificate after the client has finished its
    handshake: a refusal arrives as an alert with the first read (gRPC's server), or as the
    connection closed before a single byte of answer (asyncio's server drops the alert).
    """
    ctx = (tls or ClientTls()).ssl_context(alpn=(alpn,))
    writer: asyncio.StreamWriter | None = None
    answer = b""
    try:
        reader, opened = await asyncio.wait_for(
            asyncio.open_connection(host, port, ssl=ctx, server_hostname=host), timeout_s
        )
        writer = opened
        opened.write(opener)
        await opened.drain()
        answer = await asyncio.wait_for(reader.read(1), timeout_s)
    except ssl.SSLError as exc:
        return tls_error_from_ssl(exc, url) or _make_error(url, "handshake_failed", str(exc))
    except asyncio.TimeoutError:
        return None
    except (OSError, EOFError):
        if writer is None:  # no handshake: nothing listens there, or it is going away
            return None
        # Reset after the handshake: closed without an answer, as below.
    finally:
        if writer is not None:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()
    if answer:
        return None
    if tls is None or tls.cert is None:
        return _make_error(
            url, "client_certificate_required", "the service closed the connection at once"
        )
    return _make_error(
        url, "client_certificate_rejected", "the service closed the connection at once"
    )
