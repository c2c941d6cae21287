"""Failed handshakes named from what gRPC and Python's ssl report (messages seen with grpcio
1.85 / BoringSSL and OpenSSL 3.0 against our servers, tests/integration/test_tls.py)."""

from __future__ import annotations

import ssl

import pytest

from oldlogit.contract import errors
from oldlogit.transport.tls import ClientTls, tls_error_from_grpc, tls_error_from_ssl

URL = "grpcs://127.0.0.1:50051"
GRPC = (
    "failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:33165: Tls "
    "handshake failed (TSI_PROTOCOL_FAILURE): SSL_ERROR_SSL: error:1000007d:SSL routines:"
    "OPENSSL_internal:CERTIFICATE_VERIFY_FAILED: {}: OK"
)


@pytest.mark.parametrize(
    ("details", "reason", "parameter"),
    [
        (GRPC.format("self signed certificate in certificate chain"), "untrusted", "ca_file"),
        (GRPC.format("unable to get local issuer certificate"), "untrusted", "ca_file"),
        (GRPC.format("certificate has expired"), "expired", "url"),
        (
            "failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:1: Tls "
            "handshake failed (TSI_PROTOCOL_FAILURE): SSL_ERROR_SSL: error:100000f7:SSL "
            "routines:OPENSSL_internal:WRONG_VERSION_NUMBER",
            "not_tls",
            "url",
        ),
        (
            "failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:39719: "
            "Custom verification check failed with error: UNAUTHENTICATED: Hostname "
            "Verification Check failed.",
            "hostname_mismatch",
            "url",
        ),
    ],
)
def test_grpc_handshake_messages(details: str, reason: str, parameter: str) -> None:
    err = tls_error_from_grpc(details, URL)
    assert isinstance(err, errors.TlsError)
    assert (err.reason, err.parameter, err.code) == (reason, parameter, "tls_error")
    assert URL in err.message and ": OK" not in err.message


def test_other_unavailable_messages_are_not_tls() -> None:
    # A replica that is down stays Unavailable (retried and failed over).
    for details in (
        "failed to connect to all addresses; last error: UNAVAILABLE: ipv4:127.0.0.1:1: "
        "Connection refused",
        "Socket closed",
        None,
    ):
        assert tls_error_from_grpc(details, URL) is None


def test_ssl_errors_by_verify_code() -> None:
    def verify_error(code: int, message: str) -> ssl.SSLCertVerificationError:
        exc = ssl.SSLCertVerificationError(1, f"certificate verify failed: {message}")
        exc.verify_code, exc.verify_message = code, message
        return exc

    wrapped = ConnectionError("connect failed")
    wrapped.__cause__ = verify_error(10, "certificate has expired")
    expired = tls_error_from_ssl(wrapped, "https://h:1")
    assert expired is not None and expired.reason == "expired"
    mismatch = tls_error_from_ssl(verify_error(62, "Hostname mismatch"), "https://h:1")
    assert mismatch is not None and mismatch.reason == "hostname_mismatch"
    untrusted = tls_error_from_ssl(verify_error(19, "self-signed"), "https://h:1")
    assert untrusted is not None and untrusted.reason == "untrusted"
    assert tls_error_from_ssl(ConnectionRefusedError(111, "refused"), "https://h:1") is None


def test_client_tls_options_are_checked_when_made(tmp_path: object) -> None:
    assert ClientTls.load(None, None, None) is None
    with pytest.raises(errors.InvalidRequest) as info:
        ClientTls.load(None, None, "k.pem")
    assert info.value.parameter == "cert_file"
    with pytest.raises(errors.InvalidRequest) as info:
        ClientTls.load(__file__, None, None)  # a file, but no PEM certificate in it
    assert info.value.parameter == "ca_file"
