"""The status page as an operator sees it: headless Chromium renders ``GET /`` of a running
demo server (``serve`` with ``--demo``'s settings, on a thread of this process); while traffic
flows, a lease is taken and a version is published,
the page's charts and versions table follow without a reload, the console stays clean, no
request leaves the machine, and a screenshot is saved under test-artifacts/.

Chromium is driven over the DevTools protocol (a websocket); Debian's ``chromium`` is
installed by .ci/run, and the test skips with that reason where it is absent.
"""

from __future__ import annotations

import base64
import itertools
import json
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from oldlogit import Client

from .conftest import REPO, DemoThread

pytestmark = pytest.mark.e2e

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
ARTIFACTS = REPO / "test-artifacts"


class DevTools:
    """The DevTools protocol over one page target: calls, and the events seen meanwhile."""

    def __init__(self, ws: Any) -> None:
        self._ws = ws  # a websockets.sync connection to the page target
        self._ids = itertools.count(1)
        self.events: list[dict[str, Any]] = []

    def call(self, method: str, timeout_s: float = 30.0, **params: Any) -> dict[str, Any]:
        msg_id = next(self._ids)
        self._ws.send(json.dumps({"id": msg_id, "method": method, "params": params}))
        end = time.monotonic() + timeout_s
        while True:
            msg = json.loads(self._ws.recv(timeout=max(0.1, end - time.monotonic())))
            if msg.get("id") == msg_id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return dict(msg.get("result", {}))
            self.events.append(msg)

    def evaluate(self, expression: str) -> Any:
        res = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in res:
            raise RuntimeError(f"{expression}: {res['exceptionDetails']}")
        return res["result"].get("value")

    def wait_for(self, expression: str, timeout_s: float, what: str) -> Any:
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            value = self.evaluate(expression)
            if value:
                return value
            time.sleep(0.25)
        raise AssertionError(f"timed out after {timeout_s:g}s waiting for {what}")


@contextmanager
def chromium(tmp: Path) -> Iterator[DevTools]:
    assert CHROMIUM is not None
    profile = tmp / "profile"
    profile.mkdir()
    log = open(tmp / "chromium.log", "wb")  # noqa: SIM115 - closed in finally
    proc = subprocess.Popen(
        [
            CHROMIUM,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--no-first-run",
            f"--user-data-dir={profile}",
            "--remote-debugging-port=0",  # the port it picks is written to DevToolsActivePort
            "--window-size=1280,1000",
            "about:blank",
        ],
        stdout=log,
        stderr=log,
    )
    try:
        port_file = profile / "DevToolsActivePort"
        end = time.monotonic() + 60
        while not (port_file.exists() and port_file.read_text().strip()):
            if proc.poll() is not None or time.monotonic() > end:
                raise RuntimeError("chromium did not start:\n" + (tmp / "chromium.log").read_text())
            time.sleep(0.1)
        port = int(port_file.read_text().split()[0])
        targets = httpx.get(f"http://127.0.0.1:{port}/json/list", timeout=10).json()
        page = next(t for t in targets if t["type"] == "page")
        from websockets.sync.client import connect

        with connect(page["webSocketDebuggerUrl"], max_size=None, open_timeout=30) as ws:
            yield DevTools(ws)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def _problems(events: list[dict[str, Any]]) -> list[str]:
    """Console errors/warnings, uncaught exceptions, and failed loads (404s, refused...)."""
    out = []
    for e in events:
        method, p = e.get("method"), e.get("params", {})
        if method == "Runtime.exceptionThrown":
            out.append(f"exception: {p['exceptionDetails']}")
        elif method == "Runtime.consoleAPICalled" and p.get("type") in (
            "error",
            "warning",
            "assert",
        ):
            out.append(f"console.{p['type']}: {[a.get('value') for a in p.get('args', [])]}")
        elif method == "Log.entryAdded" and p["entry"]["level"] in ("error", "warning"):
            out.append(
                f"log {p['entry']['level']}: {p['entry'].get('text')} {p['entry'].get('url')}"
            )
        elif method == "Network.loadingFailed":
            out.append(f"load failed: {p.get('errorText')}")
    return out


def _in_background(
    fn: Callable[[threading.Event], None],
) -> tuple[threading.Thread, threading.Event]:
    stop = threading.Event()
    th = threading.Thread(target=fn, args=(stop,), daemon=True)
    th.start()
    return th, stop


def test_status_page_renders_live_data_in_chromium(
    demo_in_process: DemoThread, tmp_path: Path, tiny_loaded_factory: Callable[..., Any]
) -> None:
    if CHROMIUM is None:
        if os.environ.get("CI"):  # a green CI must not hide a missing install step
            pytest.fail("chromium is missing in CI: .ci/run must install it")
        pytest.skip("needs Debian chromium (.ci/run installs it)")
    from oldlogit_service.demo.deployment import DEMO_MODEL_KWARGS

    base = f"http://{demo_in_process.http}"
    info = httpx.get(f"{base}/v1/info").json()
    # Version 4 for the page to pick up live: the demo's base weights with one element moved.
    _, weights = tiny_loaded_factory(dtype=info["dtype"], **DEMO_MODEL_KWARGS)
    new = {k: v.clone() for k, v in weights.items()}
    first = sorted(new)[0]
    new[first].view(-1)[0] += 1

    def traffic(stop: threading.Event) -> None:
        with Client(base) as c:
            for i in range(10_000):  # bounded; the test stops it long before
                if stop.is_set():
                    return
                # New token ids each time, so the forward runs (no result-cache hit).
                token_ids = [(7 * i + j) % 500 + 1 for j in range(160)]
                c.logprobs(token_ids, policy_version=i % 4, score_from=8)

    with chromium(tmp_path) as dt:
        for domain in ("Runtime", "Log", "Network", "Page"):
            dt.call(f"{domain}.enable")
        dt.call("Page.navigate", url=f"{base}/")
        dt.wait_for("document.readyState === 'complete'", 30, "the page to load")
        shown = dt.evaluate("[...document.querySelectorAll('#versions tr[data-version]')].length")
        assert shown == 4  # versions 0..3 of the demo

        worker, stop = _in_background(traffic)
        try:
            with Client(base) as c:
                c.publish(4, new)
                with c.lease(3, ttl_s=120):
                    # Live: the page refreshes itself (no reload) and shows version 4, the
                    # lease on version 3, and a throughput chart with traffic in it.
                    dt.wait_for(
                        "(() => { const row = v => document.querySelector("
                        "  `#versions tr[data-version='${v}']`);"
                        " const t = document.getElementById('chart-tokens');"
                        " return row(4) !== null && row(3) !== null"
                        " && row(3).cells[4].textContent === '1'"
                        " && t !== null && Number(t.dataset.max) > 0"
                        " && Number(t.dataset.samples) >= 3; })()",
                        60,
                        "version 4, the lease and tokens/s to show on the page",
                    )
                    page = dt.evaluate(
                        "({refreshes: Number(document.body.dataset.refreshes || 0),"
                        " versions: [...document.querySelectorAll('#versions tr[data-version]')]"
                        "   .map(tr => Number(tr.dataset.version)),"
                        " leases: [...document.querySelectorAll('#versions tr[data-version]')]"
                        "   .map(tr => Number(tr.cells[4].textContent)),"
                        " charts: [...document.querySelectorAll('#charts svg')].map(s =>"
                        "   ({id: s.id, samples: Number(s.dataset.samples),"
                        "     lines: s.querySelectorAll('polyline').length})),"
                        " tiers: [...document.querySelectorAll('#tiers meter')].length,"
                        " updated: document.getElementById('updated').className})"
                    )
                    server_versions = c.versions()
                    ARTIFACTS.mkdir(exist_ok=True)
                    shot = dt.call("Page.captureScreenshot", format="png")
                    (ARTIFACTS / "status_page.png").write_bytes(base64.b64decode(shot["data"]))
        finally:
            stop.set()
            worker.join(timeout=60)
            assert not worker.is_alive(), "a worker thread did not finish in time"

        assert page["refreshes"] >= 1 and page["updated"] == "ok"
        assert page["versions"] == [4, 3, 2, 1, 0]
        assert page["versions"] == sorted((v.policy_version for v in server_versions), reverse=True)
        assert page["leases"] == [0, 1, 0, 0, 0]
        assert {c["id"] for c in page["charts"]} == {
            "chart-queue",
            "chart-wait",
            "chart-tokens",
            "chart-hits",
        }
        tokens_chart = next(c for c in page["charts"] if c["id"] == "chart-tokens")
        assert tokens_chart["lines"] >= 1
        assert page["tiers"] == 4  # device, host, disk, result cache
        # Offline: every request the page made stayed on this server.
        urls = [
            e["params"]["request"]["url"]
            for e in dt.events
            if e.get("method") == "Network.requestWillBeSent"
        ]
        assert urls and all(u.startswith(base) or u.startswith("data:") for u in urls), urls
        assert _problems(dt.events) == []
        # The console check can fail: an error logged now is caught.
        dt.evaluate("console.error('probe')")
        dt.call("Runtime.evaluate", expression="1")
        assert any("probe" in p for p in _problems(dt.events))
    assert (ARTIFACTS / "status_page.png").stat().st_size > 10_000
