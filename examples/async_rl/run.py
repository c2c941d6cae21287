"""Run the four variants of the async RL example and write metrics and the comparison plot.

    python examples/async_rl/run.py            # the full configuration (minutes on 2 cores)
    python examples/async_rl/run.py --smoke    # a few steps: what CI runs

Writes OUT/metrics.jsonl (one record per step and run), OUT/summary.json and OUT/async_rl.png.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import logging
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from oldlogit.parity.numerics import hardware_name

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the example's sibling modules

from rl_loop import SMOKE, VARIANTS, Config, run_variant
from rl_plot import plot


def summarize(records: list[dict[str, Any]], last: int) -> dict[str, Any]:
    """One run's figures, as the README's table reports them: means over the last ``last``
    steps (the end of training), medians over all steps of the k3 estimates, the first step
    whose reward reached 0.9 (None: never), the mean clip fraction over all steps, and the
    number of steps on which each health flag was raised."""
    tail = records[-last:]

    def mean(rows: list[dict[str, Any]], key: str) -> float:
        return sum(float(r[key]) for r in rows) / len(rows)

    keys = ["reward", "clipfrac", "disc_k3", "stale_k3", "true_disc_k3", "true_stale_k3"]
    out: dict[str, Any] = {k: mean(tail, k) for k in keys}
    out["reward_first"] = mean(records[:last], "reward")
    out["seconds_per_step"] = mean(tail, "seconds")
    out["first_step_reward_0_9"] = next((r["step"] for r in records if r["reward"] >= 0.9), None)
    out["clipfrac_mean_all"] = mean(records, "clipfrac")
    for k in ("disc_k3", "stale_k3", "true_disc_k3", "true_stale_k3"):
        out[f"{k}_median"] = statistics.median(float(r[k]) for r in records)
    flags: dict[str, int] = {}
    for r in records:
        for f in r["flags"]:
            flags[f] = flags.get(f, 0) + 1
    out["flag_steps"] = dict(sorted(flags.items()))
    return out


def source_digest() -> str:
    """sha256 over the example's own sources and the correction toolkit it trains with: the
    committed results carry it, and a test fails when these change without a new run."""
    here = Path(__file__).resolve().parent
    computing = ("rl_loop.py", "rl_policy.py", "rl_task.py", "run.py")  # not the plot/table
    files = [here / name for name in computing] + sorted(
        (here.parents[1] / "client" / "oldlogit" / "correction").glob("*.py")
    )
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="a few steps, small batches (CI)")
    p.add_argument("--steps", type=int, default=None, help="override the number of steps")
    p.add_argument("--seed", type=int, default=None, help="override the seed (default 0)")
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset")
    p.add_argument("--out", type=Path, default=Path("async_rl_out"), help="output directory")
    p.add_argument("--threads", type=int, default=1, help="torch threads (tiny model: 1 is best)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(args.threads)
    cfg = SMOKE if args.smoke else Config()
    if args.steps is not None:
        cfg = dataclasses.replace(cfg, steps=args.steps)
    if args.seed is not None:
        cfg = dataclasses.replace(cfg, seed=args.seed)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    args.out.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[dict[str, Any]]] = {}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="oldlogit-async-rl-") as tmp:
        for v in variants:
            runs[v] = run_variant(cfg, v, Path(tmp), log=lambda m: print(m, flush=True)).records
    with (args.out / "metrics.jsonl").open("w") as f:
        for recs in runs.values():
            for r in recs:
                f.write(json.dumps(r) + "\n")
    last = max(1, min(20, cfg.steps // 5))
    summary = {
        "config": dataclasses.asdict(cfg),
        "seconds": time.perf_counter() - t0,
        "source_sha256": source_digest(),
        # The bits, and so the trajectories, depend on the CPU's kernels (docs/exactness.md).
        "machine": {"hardware": hardware_name("cpu"), "torch": torch.__version__},
        "runs": {v: summarize(recs, last) for v, recs in runs.items()},
    }
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
    png = plot(runs, VARIANTS, args.out / "async_rl.png")
    print(
        f"\n{'run':10s} {'reward first->last':>20s} {'clip':>7s} {'disc k3':>9s} {'stale k3':>9s}"
    )
    for v, s in summary["runs"].items():
        floats = [x for x in s.values() if isinstance(x, float)]
        assert all(math.isfinite(x) for x in floats), f"non-finite metric in {v}"
        print(
            f"{v:10s} {s['reward_first']:9.3f} -> {s['reward']:.3f} {s['clipfrac']:7.3f} "
            f"{s['disc_k3']:9.2e} {s['stale_k3']:9.2e}"
        )
    print(f"\nwrote {png} and {args.out / 'metrics.jsonl'} in {summary['seconds']:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
