"""`oldlogit bench --smoke` runs end to end in seconds, so the suite cannot rot."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import REPO

pytestmark = pytest.mark.e2e


def test_bench_smoke(tmp_path: Path) -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "oldlogit_service.cli",
            "bench",
            "serving",
            "throughput",
            "delta",
            "parity",
            "pipeline",
            "soak",
            "tls",
            "models",
            "--smoke",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=480,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    data = json.loads((tmp_path / "results.json").read_text())
    names = [f["name"] for f in data["figures"]]
    assert any(n.startswith("P1 grpc") for n in names)
    by_name = {f["name"]: f for f in data["figures"]}
    assert by_name["in-process engine"]["value"] > 0
    # Every figure of the suite ran (tiny sizes) and the plots were written.
    for prefix in ("P2 ", "P3 ", "P6 ", "P7 ", "latency", "I1 ", "I2 ", "I3 ", "I4 ", "L1 ", "S1 "):
        assert any(n.startswith(prefix) for n in names), prefix
    assert any("snapshot" in n or "stored" in n or "cold" in n for n in names), names
    assert (tmp_path / "ratios.png").stat().st_size > 1000
    # Parity: the patched trainer is the service at every micro-batch size, even in smoke sizes.
    patched = [f for n, f in by_name.items() if n.startswith("I4 patched")]
    assert len(patched) == 3 and all(f["value"] == 0 for f in patched)
    # TLS ÷ plaintext gRPC throughput: both servers answered (a positive, finite ratio).
    s1 = [f for n, f in by_name.items() if n.startswith("S1 ")]
    assert len(s1) == 2 and all(0 < f["value"] < 100 for f in s1), s1
    # The soak's short configuration: publishes, evictions, load; zero errors.
    assert by_name["soak errors"]["value"] == 0, by_name["soak errors"]["detail"]["errors"]
    assert by_name["soak errors"]["detail"]["requests"] > 20
    # Real size, shrunk: the server started, took 3 versions (full, then deltas) and scored.
    assert by_name["models: start (version 0 + self-check)"]["value"] > 0
    delta = by_name["models: delta publish"]["detail"]
    assert len(delta["seconds"]) == 2 and "patch" in delta["kinds"]
    assert by_name["models: service ÷ in-process HF forward"]["value"] > 0
