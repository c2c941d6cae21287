"""The async RL example as a user runs it: the smoke configuration end to end, plot included."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from .conftest import REPO

pytestmark = pytest.mark.e2e

VARIANTS = {"recompute", "behaviour", "exact", "ewma"}


# `slow`: the four variants trained a few steps each, ~16 s on 2 cores. The default run checks
# that the README's figures are the committed runs of the example's current sources (below).
@pytest.mark.slow
def test_smoke_run_writes_metrics_and_plot(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "examples/async_rl/run.py", "--smoke", "--out", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    # The loop itself asserts that exact answers say exact and EWMA answers do not.
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert (tmp_path / "async_rl.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    by_variant: dict[str, list[dict[str, object]]] = {}
    for r in records:
        by_variant.setdefault(str(r["variant"]), []).append(r)
    summary = json.loads((tmp_path / "summary.json").read_text())
    steps = summary["config"]["steps"]
    assert set(by_variant) == VARIANTS
    assert all([r["step"] for r in rs] == list(range(steps)) for rs in by_variant.values())
    for r in records:
        for k, v in r.items():
            if isinstance(v, float):
                assert math.isfinite(v), (r["variant"], k)
    # What each choice of "old" does to the two terms, visible from the first steps:
    # recomputing at the current weights zeroes the staleness term, reusing μ the discrepancy
    # term, and the exact old logits report the true decomposition.
    assert all(r["stale_k3"] == 0.0 for r in by_variant["recompute"])
    assert all(r["disc_k3"] == 0.0 for r in by_variant["behaviour"])
    for r in by_variant["exact"]:
        assert (r["disc_k3"], r["stale_k3"]) == (r["true_disc_k3"], r["true_stale_k3"])
    # Partial rollouts with a lag: trained tokens are on average more than one version old.
    assert max(float(r["staleness_versions"]) for r in by_variant["exact"]) > 1.0  # type: ignore[arg-type]


def _example_module(name: str) -> Any:
    folder = REPO / "examples" / "async_rl"
    sys.path.insert(0, str(folder))
    try:
        spec = importlib.util.spec_from_file_location(f"async_rl_{name}", folder / f"{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(folder))


def test_readme_figures_are_the_committed_runs_of_the_current_code() -> None:
    """The README's table is rendered from the committed summaries, and those summaries were
    computed by the example's current sources: a change to the example or the correction
    toolkit without a new full run fails here (re-run both seeds, then rl_table.py --write)."""
    table = _example_module("rl_table")
    run = _example_module("run")
    summaries = table.load_summaries()
    assert sorted(summaries) == [0, 1]
    for seed, summary in summaries.items():
        assert summary["config"]["seed"] == seed
        assert summary["config"]["steps"] == 120  # the full configuration
        assert summary["source_sha256"] == run.source_digest(), (
            f"results/summary_seed{seed}.json was computed by other sources: re-run "
            f"`python examples/async_rl/run.py --seed {seed} --out DIR` and copy its summary"
        )
    readme = (REPO / "examples" / "async_rl" / "README.md").read_text()
    assert table.readme_with(table.render(summaries), readme) == readme, (
        "README.md's table is not the committed summaries' rendering: "
        "python examples/async_rl/rl_table.py --write"
    )
