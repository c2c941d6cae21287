"""`oldlogit bench adapters --smoke` runs end to end (tiny sizes; two server starts make it
about a minute here, hence slow): every figure written, the served adapter rows exact."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import REPO

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_bench_adapters_smoke(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "oldlogit_service.cli", "bench", "adapters", "--smoke"]
    proc = subprocess.run(
        [*cmd, "--out", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    figures = json.loads((tmp_path / "results.json").read_text())["figures"]
    rows: dict[str, list[dict[str, object]]] = {}
    for f in figures:
        rows.setdefault(f["figure"], []).append(f)
    assert set(rows) == {
        "adapter-publish",
        "adapter-publish-time",
        "adapter-mixed-batches",
        "adapter-retention",
    }
    publish = {f["name"].split(":")[0]: f for f in rows["adapter-publish"]}
    assert set(publish) == {"http", "grpc"}
    for f in publish.values():
        d = f["detail"]
        assert 0 < f["value"] < 100  # both arms sent bytes
        assert {"adapter_sent", "delta_sent", "adapter_stored", "delta_stored"} <= set(d)
        assert "extrapolated_24_layers" in d  # smoke runs 2 layers, says so
        assert d["kinds"]["adapter"] == ["adapter"], d["kinds"]
    (mixed,) = rows["adapter-mixed-batches"]
    assert mixed["value"] > 0
    assert mixed["detail"]["exact"] is True and mixed["detail"]["checked_sequences"] >= 2
    (kept,) = rows["adapter-retention"]
    d = kept["detail"]
    assert d["adapters"] == 24 and d["disk_bytes"] >= 24 * d["adapter_tensor_bytes"]
    assert {"cold_p50_s", "cold_p90_s", "warm_p50_s", "warm_p90_s"} <= set(d)
