"""The RL-like trace of ``oldlogit bench delta`` runs at its smoke size and reports both
figures per learning rate (the full-size figures are in docs/performance.md)."""

from __future__ import annotations

import argparse

from benchmarks import delta_trace


def test_trace_smoke_reports_storage_and_cold_serve() -> None:
    p = argparse.ArgumentParser()
    delta_trace.add_args(p)
    args = p.parse_args(["--trace-lrs", "1e-6,1e-4"])
    delta_trace.smoke(args)
    figures = {f.name: f for f in delta_trace.run(args)}
    assert len(figures) == 4
    small = next(f for n, f in figures.items() if "lr=1e-06: bytes" in n)
    large = next(f for n, f in figures.items() if "lr=0.0001: bytes" in n)
    # A step at lr 1e-6 changes a few % of the bf16 elements; at 1e-4 most of them.
    assert 1.0 < small.value < large.value <= args.trace_versions + 0.5
    assert small.detail["patches"] > 0 and max(small.detail["changed_per_step_pct"]) < 20
    for f in figures.values():
        assert f.value > 0
