"""`oldlogit bench peer --smoke` runs end to end: oldlogit and the naive server always (Ray
hidden, as where the `peer` extra is not installed), the Ray Serve peer where ray[serve] is."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from .conftest import REPO

pytestmark = pytest.mark.e2e

# `import ray` fails in this process, as without the extra, whether or not it is installed.
WITHOUT_RAY = (
    "import sys; sys.modules['ray'] = None; from oldlogit_service.cli import main; "
    "sys.exit(main(sys.argv[1:]))"
)


def _bench_peer(out: Path, *, hide_ray: bool) -> tuple[str, dict[str, dict[str, Any]]]:
    argv = ["bench", "peer", "--smoke", "--out", str(out)]
    cli = ["-c", WITHOUT_RAY] if hide_ray else ["-m", "oldlogit_service.cli"]
    proc = subprocess.run(
        [sys.executable, *cli, *argv], capture_output=True, text=True, cwd=REPO, timeout=300
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads((out / "results.json").read_text())
    return proc.stdout, {f["figure"]: f for f in data["figures"]}


def _check_servers(detail: dict[str, Any], names: set[str]) -> None:
    servers = detail["servers"]
    assert set(servers) == names, servers
    for r in servers.values():
        assert r["requests"] == 16 and r["tokens_per_s"] > 0
        assert 0 < r["p50_ms"] <= r["p99_ms"]
        # The same sequence at the same version: every server computes the same logprobs.
        assert r["max_abs_diff_vs_naive"] < 1e-3


@pytest.mark.slow  # oldlogit and the naive server start and are measured: ~40 s on 2 cores
def test_bench_peer_without_ray(tmp_path: Path) -> None:
    stdout, rows = _bench_peer(tmp_path, hide_ray=True)
    assert "ray[serve] is not installed: pip install 'oldlogit[peer]'" in stdout
    assert "peer-vs-ray-serve" not in rows and "peer-vs-ray-serve-rl" not in rows
    for figure in ("peer-vs-naive", "peer-vs-naive-rl"):  # the Zipf-like mix and the RL one
        naive = rows[figure]
        assert naive["value"] > 0 and naive["detail"]["ray_serve"] == "not installed"
        _check_servers(naive["detail"], {"oldlogit", "naive"})
    rl = rows["peer-vs-naive-rl"]["detail"]
    assert rl["mix"] == "rl" and rl["clients"] == 4
    assert sum(rl["requests_per_version"].values()) == 16
    assert "oldlogit " in stdout and "tokens/s, p50" in stdout  # the printed line


@pytest.mark.slow  # a local Ray cluster starts and stops: about half a minute on 2 cores
def test_bench_peer_ray_serve(tmp_path: Path) -> None:
    pytest.importorskip(
        "ray.serve", reason="ray[serve] is not installed: pip install 'oldlogit[peer]'"
    )
    stdout, rows = _bench_peer(tmp_path, hide_ray=False)
    ray = rows["peer-vs-ray-serve"]
    assert ray["value"] > 0 and ray["goal"] == ">= 2.5"
    _check_servers(ray["detail"], {"oldlogit", "naive", "ray-serve"})
    ray_rl = rows["peer-vs-ray-serve-rl"]
    assert ray_rl["value"] > 0 and ray_rl["goal"] == ">= 3"
    _check_servers(ray_rl["detail"], {"oldlogit", "naive", "ray-serve"})
    assert rows["peer-vs-naive"]["value"] > 0 and rows["peer-vs-naive-rl"]["value"] > 0
    assert "ray-serve " in stdout
