"""`oldlogit bench --smoke` runs end to end in seconds, so the suite cannot rot."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from .conftest import REPO

# `slow`: about 4 minutes of the default run on 2 cores (two bench processes side by side), the
# longest test there; run it with `pytest -m slow tests/e2e/test_bench_smoke.py`.
pytestmark = [pytest.mark.e2e, pytest.mark.slow]


# The suites in two groups of about equal time, run side by side (most of a smoke run is
# waiting on servers starting and on wall-clock load windows, not computing).
GROUPS = (
    ("throughput", "parity", "models"),
    ("serving", "delta", "pipeline", "soak", "tls"),
)


def test_bench_smoke(tmp_path: Path) -> None:
    figures: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        procs = []
        for i, group in enumerate(GROUPS):
            log = stack.enter_context((tmp_path / f"{i}.log").open("w"))
            cmd = [
                "oldlogit_service.cli",
                "bench",
                *group,
                "--smoke",
                "--out",
                str(tmp_path / str(i)),
            ]
            proc = subprocess.Popen(
                [sys.executable, "-m", *cmd], stdout=log, stderr=subprocess.STDOUT, cwd=REPO
            )
            stack.callback(proc.kill)  # a no-op once it has exited
            procs.append(proc)
        for i, (proc, group) in enumerate(zip(procs, GROUPS, strict=True)):
            proc.wait(timeout=480)
            assert proc.returncode == 0, (tmp_path / f"{i}.log").read_text()
            results = json.loads((tmp_path / str(i) / "results.json").read_text())
            figures += results["figures"]
            # Trainer-side suites ran with the process's own allocator, the rest with the
            # settings `oldlogit serve` sets (glibc here).
            assert results["meta"]["allocator"] == {
                name: "default" if name in ("parity", "models") else "oldlogit serve's"
                for name in group
            }, results["meta"]
            assert (tmp_path / str(i) / "ratios.png").stat().st_size > 1000
    rows: dict[str, list[dict[str, Any]]] = {}  # figure -> its rows
    for f in figures:
        rows.setdefault(f["figure"], []).append(f)
    assert any(f["name"].startswith("grpc") for f in rows["service-vs-inprocess"])
    (inproc,) = rows["inprocess-throughput"]
    assert inproc["value"] > 0
    # Every figure of the suite ran (tiny sizes) and the plots were written.
    for figure in (
        "forward-roofline",
        "concurrent-vs-naive",
        "versions-vs-naive",
        "deterministic-vs-fast",
        "latency-under-load",
        "linear-row-invariance",
        "packed-vs-padded",
        "patched-step-cost",
        "trainer-parity-table",
        "hot-p99-beside-cold",
        "tls-vs-plaintext",
    ):
        assert figure in rows, figure
    assert {"delta-storage", "cold-version-load"} <= rows.keys(), sorted(rows)
    # Parity: the patched trainer is the service at every micro-batch size, even in smoke sizes.
    patched = [f for f in rows["trainer-parity-table"] if f["name"].startswith("patched")]
    assert len(patched) == 3 and all(f["value"] == 0 for f in patched)
    # TLS ÷ plaintext gRPC throughput: both servers answered (a positive, finite ratio).
    tls = rows["tls-vs-plaintext"]
    assert len(tls) == 2 and all(0 < f["value"] < 100 for f in tls), tls
    # The soak's short configuration: publishes, evictions, load; zero errors.
    (errors,) = rows["soak-errors"]
    assert errors["value"] == 0, errors["detail"]["errors"]
    assert errors["detail"]["requests"] > 20
    # Real size, shrunk: the server started, took 3 versions (full, then deltas) and scored.
    (start,) = rows["models-start"]
    assert start["value"] > 0
    (delta,) = rows["models-delta-publish"]
    assert len(delta["detail"]["seconds"]) == 2 and "patch" in delta["detail"]["kinds"]
    (scoring,) = rows["models-vs-hf-forward"]
    assert scoring["value"] > 0
