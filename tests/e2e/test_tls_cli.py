"""`oldlogit serve` with TLS flags as a user runs it: mutual TLS on both ports, the plain probe
port, `oldlogit publish` and `oldlogit parity` with --ca-file/--cert-file/--key-file, refusals
in one line, a bad certificate file refused at start-up, and SIGHUP re-reading the files.

``slow``: a server and a dozen CLI runs, ~35 s on 2 cores. The default run serves mutual TLS
on both transports in-process, rotation included (tests/integration/test_tls.py), and checks
the client's TLS errors (tests/unit/test_tls_errors.py)."""

from __future__ import annotations

import signal
import socket
import ssl
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from ..tls_certs import CertAuthority
from .conftest import REPO, start_cli

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

TOKEN = "tls-cli-token"


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "oldlogit_service.cli", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )


def leaf(host_port: str, ca: Path, alpn: str) -> bytes:
    host, port = host_port.rsplit(":", 1)
    ctx = ssl.create_default_context(cafile=str(ca))
    ctx.set_alpn_protocols([alpn])
    with socket.create_connection((host, int(port)), timeout=10) as raw:
        with ctx.wrap_socket(raw, server_hostname=host) as s:
            der = s.getpeercert(binary_form=True)
    assert der is not None
    return der


def test_serve_with_mutual_tls_publish_parity_and_sighup(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    from oldlogit_service.demo.deployment import DEMO_MODEL_KWARGS
    from oldlogit_service.demo.tiny import make_tiny_model_dir
    from oldlogit_service.model.checkpoints import load_weights
    from oldlogit_service.model.loaded import load_model

    ca, other = CertAuthority(tmp_path / "pki", "cli CA"), CertAuthority(tmp_path / "pki", "x")
    server, client = ca.issue("server"), ca.issue("client", client=True)
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    cert.write_bytes(server.cert.read_bytes())
    key.write_bytes(server.key.read_bytes())

    bad = cli(
        "serve", "--demo", "--tls-cert-file", str(tmp_path / "nope.crt"), "--tls-key-file", str(key)
    )
    assert bad.returncode == 2 and "--tls-cert-file" in bad.stderr and "Traceback" not in bad.stderr
    half = cli("serve", "--demo", "--tls-cert-file", str(cert))
    assert half.returncode == 2 and "--tls-key-file" in half.stderr

    probe = ssl.create_default_context(cafile=str(ca.pem))
    probe.load_cert_chain(client.cert, client.key)
    tls_flags = ["--tls-cert-file", str(cert), "--tls-key-file", str(key)]
    srv = start_cli(
        [
            "--demo",
            "--snapshot-dir",
            str(tmp_path / "snap"),
            "--http-port",
            "0",
            "--grpc-port",
            "0",
            "--health-port",
            "0",
            "--write-token",
            TOKEN,
            *tls_flags,
            "--tls-client-ca-file",
            str(ca.pem),
        ],
        tls=probe,
    )
    try:
        (health,) = [ln.split("=", 1)[1] for ln in srv.lines if ln.startswith("health=")]
        assert httpx.get(f"http://{health}/readyz", timeout=10).status_code == 200
        assert httpx.get(f"http://{health}/healthz", timeout=10).status_code == 200
        assert httpx.get(f"http://{health}/v1/versions", timeout=10).status_code == 404
        assert httpx.get(f"http://{health}/metrics", timeout=10).status_code == 404

        model_dir = make_tiny_model_dir(tmp_path / "m", **DEMO_MODEL_KWARGS)
        import torch

        model = load_model(model_dir, dtype=torch.bfloat16, device=torch.device("cpu"))
        w = load_weights(model_dir, model)
        assert w is not None
        weights = tmp_path / "v9.safetensors"
        save_file(
            {k: (v.float() * 1.01).to(v.dtype).contiguous() for k, v in w.items()}, str(weights)
        )
        mine = [
            "--ca-file",
            str(ca.pem),
            "--cert-file",
            str(client.cert),
            "--key-file",
            str(client.key),
        ]
        pub = ["publish", "--version", "9", "--weights", str(weights), "--no-progress"]
        out = cli(*pub, "--url", f"https://{srv.http}", "--token", TOKEN, *mine)
        assert out.returncode == 0, out.stderr
        assert "version 9 published" in out.stdout
        out = cli(*pub, "--url", f"grpcs://{srv.grpc}", "--token", TOKEN, *mine)
        assert out.returncode == 0 and "already published" in out.stdout, out.stderr
        # Refusals are one line naming the problem, for each transport.
        for url in (f"https://{srv.http}", f"grpcs://{srv.grpc}"):
            out = cli(*pub, "--url", url, "--token", TOKEN, "--ca-file", str(ca.pem))
            assert out.returncode == 1, out.stderr
            assert out.stderr.startswith("oldlogit publish: tls_error (cert_file):"), out.stderr
            assert "client certificate required" in out.stderr
            out = cli(
                "parity", "--url", url, "--model", str(model_dir), "--ca-file", str(other.pem),
                "--cert-file", str(client.cert), "--key-file", str(client.key),
            )  # fmt: skip
            assert out.returncode == 1
            assert out.stderr.strip().count("\n") == 0 and "untrusted" in out.stderr, out.stderr

        # SIGHUP: a rotated certificate is served to new handshakes on both ports.
        rotated = ca.issue("rotated")
        cert.write_bytes(rotated.cert.read_bytes())
        key.write_bytes(rotated.key.read_bytes())
        srv.proc.send_signal(signal.SIGHUP)
        want = ssl.PEM_cert_to_DER_cert(
            rotated.cert.read_text().split("-----END CERTIFICATE-----")[0]
            + "-----END CERTIFICATE-----\n"
        )
        end = time.monotonic() + 30
        while leaf(srv.http, ca.pem, "http/1.1") != want or leaf(srv.grpc, ca.pem, "h2") != want:
            assert time.monotonic() < end, "SIGHUP did not reload the certificates"
            time.sleep(0.1)
        out = cli(*pub, "--url", f"grpcs://{srv.grpc}", "--token", TOKEN, *mine)
        assert out.returncode == 0, out.stderr
    finally:
        assert srv.stop() == 0
