"""`oldlogit serve` as a user runs it: a subprocess, ports read from its output."""

from __future__ import annotations

import os
import re
import signal
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[2]


@dataclass
class CliServer:
    proc: subprocess.Popen[str]
    http: str  # host:port
    grpc: str
    lines: list[str] = field(default_factory=list)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout=timeout)


def start_cli(
    args: list[str],
    *,
    env: dict[str, str] | None = None,
    timeout_s: float = 120.0,
    tls: ssl.SSLContext | None = None,
) -> CliServer:
    """``tls``: the server speaks TLS; its readiness is asked over https with this context."""
    cmd = [sys.executable, "-m", "oldlogit_service.cli", "serve", *args]
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=full_env, cwd=REPO
    )
    lines: list[str] = []
    found: dict[str, str] = {}

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            m = re.fullmatch(r"(http|grpc)=(\S+)", line.strip())
            if m:
                found[m.group(1)] = m.group(2)

    threading.Thread(target=pump, daemon=True).start()
    end = time.monotonic() + timeout_s
    while time.monotonic() < end and len(found) < 2:
        if proc.poll() is not None:
            time.sleep(0.2)
            raise RuntimeError("oldlogit serve exited:\n" + "\n".join(lines[-40:]))
        time.sleep(0.05)
    if len(found) < 2:
        proc.kill()
        raise TimeoutError("no ports printed:\n" + "\n".join(lines[-40:]))
    srv = CliServer(proc, found["http"], found["grpc"], lines)
    # Ports are printed once both servers listen; readiness must follow at once.
    scheme = "https" if tls is not None else "http"
    r = httpx.get(f"{scheme}://{srv.http}/readyz", timeout=10, verify=tls or True)
    assert r.status_code == 200
    return srv


def start_clis(many: list[list[str]]) -> list[CliServer]:
    """Several ``oldlogit serve`` processes started at once (as replicas of a deployment
    are), each ready when this returns; if one fails, the others are stopped."""
    with ThreadPoolExecutor(len(many)) as pool:
        futures = [pool.submit(start_cli, args) for args in many]
    errors = [f.exception() for f in futures if f.exception() is not None]
    if errors:
        for f in futures:
            if f.exception() is None:
                f.result().stop(signal.SIGKILL)
        raise errors[0]  # type: ignore[misc]
    return [f.result() for f in futures]


@pytest.fixture(scope="module")
def demo_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CliServer]:
    snap = tmp_path_factory.mktemp("demo-snapshots")
    srv = start_cli(["--demo", "--http-port", "0", "--grpc-port", "0", "--snapshot-dir", str(snap)])
    yield srv
    srv.stop()


@dataclass
class DemoThread:
    """``oldlogit serve --demo``'s server in this process (``http``/``grpc``: host:port, as
    ``CliServer`` has them)."""

    http: str
    grpc: str


@pytest.fixture(scope="module")
def demo_in_process(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DemoThread]:
    """The demo service (``serve`` with ``--demo``'s settings) on a thread of this process: for
    tests of what a client or a browser sees of a demo server, not of the command that starts
    it (tests/e2e/test_cli.py starts it as ``oldlogit serve --demo``). No interpreter to start
    and import torch in: ~1 s where a ``demo_server`` takes ~8 on 2 cores."""
    from oldlogit_service.config import Settings
    from oldlogit_service.server import ServerThread

    snap = tmp_path_factory.mktemp("demo-snapshots")
    server = ServerThread(Settings(demo=True, http_port=0, grpc_port=0, snapshot_dir=snap))
    server.start()
    try:
        yield DemoThread(
            server.http_url.removeprefix("http://"), server.grpc_url.removeprefix("grpc://")
        )
    finally:
        server.stop()
