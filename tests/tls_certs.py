"""A private certificate authority made in the test, with the ``cryptography`` package.

``CertAuthority(name)`` is a self-signed CA (EC P-256, fast to make); ``issue(...)`` writes a
leaf certificate and its key as PEM files and returns their paths: a server certificate for
127.0.0.1 / localhost, or a client certificate; ``expired=True`` makes one whose validity ended
yesterday. Nothing here touches the network.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class Pair:
    cert: Path
    key: Path


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> None:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )


class CertAuthority:
    def __init__(self, directory: Path, name: str = "oldlogit test CA") -> None:
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)
        self.name = name
        self._key = _key()
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        now = dt.datetime.now(dt.timezone.utc)
        self.cert = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(subject)
            .public_key(self._key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(days=1))
            .not_valid_after(now + dt.timedelta(days=30))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .sign(self._key, hashes.SHA256())
        )
        safe = name.replace(" ", "-")
        self.pem = self.dir / f"{safe}.pem"
        self.pem.write_bytes(self.cert.public_bytes(serialization.Encoding.PEM))

    def issue(
        self,
        stem: str,
        *,
        client: bool = False,
        expired: bool = False,
        hosts: tuple[str, ...] = ("127.0.0.1", "localhost"),
    ) -> Pair:
        """A leaf certificate signed by this CA, written as ``stem.crt`` / ``stem.key``."""
        key = _key()
        now = dt.datetime.now(dt.timezone.utc)
        start, end = (
            (now - dt.timedelta(days=3), now - dt.timedelta(days=1))
            if expired
            else (now - dt.timedelta(hours=1), now + dt.timedelta(days=7))
        )
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, stem)]))
            .issuer_name(self.cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(start)
            .not_valid_after(end)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.ExtendedKeyUsage(
                    [ExtendedKeyUsageOID.CLIENT_AUTH if client else ExtendedKeyUsageOID.SERVER_AUTH]
                ),
                critical=False,
            )
        )
        if not client:
            names: list[x509.GeneralName] = []
            for h in hosts:
                try:
                    names.append(x509.IPAddress(ipaddress.ip_address(h)))
                except ValueError:
                    names.append(x509.DNSName(h))
            builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
        cert = builder.sign(self._key, hashes.SHA256())
        pair = Pair(self.dir / f"{stem}.crt", self.dir / f"{stem}.key")
        # Chain: the leaf, then the CA (what cert-manager's tls.crt holds).
        pair.cert.write_bytes(
            cert.public_bytes(serialization.Encoding.PEM)
            + self.cert.public_bytes(serialization.Encoding.PEM)
        )
        _write_key(key, pair.key)
        return pair
