"""Server TLS for both transports, from PEM files that are re-read in place.

In: ``--tls-cert-file`` / ``--tls-key-file`` (the chain and its key) and optionally
``--tls-client-ca-file`` (mutual TLS: a client certificate signed by that CA is required).
Out: one live ``ssl.SSLContext`` for uvicorn and dynamic ``grpc.ServerCredentials``.
``reload()`` re-reads the files (SIGHUP, or a poll: cert-manager rewrites a mounted secret in
place) and swaps the certificates for new handshakes only; open connections and in-flight
requests keep theirs. A pair that does not load (a rotation caught half-written) leaves the
old one in force until the next try.
"""

from __future__ import annotations

import hashlib
import logging
import ssl
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

logger = logging.getLogger(__name__)

__all__ = ["ServerTls", "TlsConfigError"]


class TlsConfigError(ValueError):
    """The TLS files cannot be used: the message names the flag and what is wrong."""


@dataclass(frozen=True)
class _Material:
    chain: bytes
    key: bytes
    client_ca: bytes | None

    @property
    def digest(self) -> str:
        h = hashlib.sha256()
        for part in (self.chain, self.key, self.client_ca or b""):
            h.update(len(part).to_bytes(8, "little") + part)
        return h.hexdigest()


def _read(path: Path, flag: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise TlsConfigError(f"{flag} {path}: cannot read it ({exc.strerror or exc})") from exc


class ServerTls:
    """The certificates both transports serve. ``reload`` runs on the event loop's thread (the
    one uvicorn handshakes on); gRPC fetches from its own threads, under the lock."""

    def __init__(self, cert_file: Path, key_file: Path, client_ca_file: Path | None = None) -> None:
        self.cert_file, self.key_file, self.client_ca_file = cert_file, key_file, client_ca_file
        self._lock = threading.Lock()
        material = self._load_checked()
        self._material = material
        self._served_to_grpc = ""  # the digest gRPC has (set by grpc_credentials)
        # HTTP: this very context is handed to uvicorn (the asyncio server keeps it); reload()
        # loads the new chain into it, which every later handshake uses.
        self.ssl_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self.ssl_context.minimum_version = ssl.TLSVersion.TLSv1_2
        self.ssl_context.set_alpn_protocols(["http/1.1"])
        self.ssl_context.load_cert_chain(self.cert_file, self.key_file)
        if material.client_ca is not None:
            self.ssl_context.verify_mode = ssl.CERT_REQUIRED
            self.ssl_context.load_verify_locations(cadata=material.client_ca.decode("ascii"))
        self.reloads = 0

    @property
    def mutual(self) -> bool:
        return self.client_ca_file is not None

    @property
    def digest(self) -> str:
        """sha256 over the files in force (tests and logs tell rotations apart by it)."""
        with self._lock:
            return self._material.digest

    def _read(self) -> _Material:
        ca = (
            _read(self.client_ca_file, "--tls-client-ca-file")
            if self.client_ca_file is not None
            else None
        )
        return _Material(
            _read(self.cert_file, "--tls-cert-file"), _read(self.key_file, "--tls-key-file"), ca
        )

    def _load_checked(self) -> _Material:
        """Read the files and prove they load, on a scratch context; stable across the check."""
        before = self._read()
        scratch = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        try:
            scratch.load_cert_chain(self.cert_file, self.key_file)
        except (ssl.SSLError, OSError) as exc:
            raise TlsConfigError(
                f"--tls-cert-file {self.cert_file} / --tls-key-file {self.key_file}: not a PEM "
                f"certificate chain and its private key ({exc})"
            ) from exc
        if before.client_ca is not None:
            try:
                scratch.load_verify_locations(cadata=before.client_ca.decode("ascii"))
            except (ssl.SSLError, UnicodeDecodeError, ValueError) as exc:
                raise TlsConfigError(
                    f"--tls-client-ca-file {self.client_ca_file}: no PEM certificate ({exc})"
                ) from exc
        after = self._read()
        if after != before:
            raise TlsConfigError("the TLS files changed while being read; trying again later")
        return after

    def reload(self) -> bool:
        """Re-read the files; True if new certificates are now served to new connections."""
        try:
            material = self._load_checked()
        except TlsConfigError as exc:
            logger.warning("TLS files not reloaded, the previous ones stay in force: %s", exc)
            return False
        with self._lock:
            if material.digest == self._material.digest:
                return False
            self.ssl_context.load_cert_chain(self.cert_file, self.key_file)
            if material.client_ca is not None:
                # OpenSSL can only add to a context's trust store: a CA removed from the
                # bundle stays trusted on HTTP until a restart (gRPC replaces its roots).
                self.ssl_context.load_verify_locations(cadata=material.client_ca.decode("ascii"))
            self._material = material
            self.reloads += 1
        logger.info("TLS certificates reloaded from %s (%s)", self.cert_file, material.digest[:16])
        return True

    # -- gRPC -------------------------------------------------------------------------------
    def _grpc_config(self, material: _Material) -> Any:
        return grpc.ssl_server_certificate_configuration(
            [(material.key, material.chain)], root_certificates=material.client_ca
        )

    def _fetch(self) -> Any:
        # Called by gRPC on its own threads at every new handshake: None keeps the current
        # configuration, a new one replaces it for this and later handshakes.
        with self._lock:
            if self._material.digest == self._served_to_grpc:
                return None
            self._served_to_grpc = self._material.digest
            return self._grpc_config(self._material)

    def grpc_credentials(self) -> grpc.ServerCredentials:
        with self._lock:
            initial = self._grpc_config(self._material)
            self._served_to_grpc = self._material.digest
        return grpc.dynamic_ssl_server_credentials(
            initial, self._fetch, require_client_authentication=self.mutual
        )
