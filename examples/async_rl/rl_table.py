"""The README's results table, rendered from the committed summaries (results/summary_seed*.json).

    python examples/async_rl/rl_table.py           # print the table
    python examples/async_rl/rl_table.py --write   # put it into README.md between its markers

tests/e2e/test_async_rl_example.py holds README.md to this rendering, and the summaries to the
sources they were computed with (``source_sha256``), so the figures cannot drift silently.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
README = HERE / "README.md"
BEGIN = "<!-- results table: rendered by rl_table.py from results/summary_seed*.json -->"
END = "<!-- end of results table -->"
LABELS = {
    "recompute": "(a) recompute",
    "behaviour": "(b) behaviour",
    "exact": "(c) exact",
    "ewma": "(d) ewma",
}


def load_summaries(results: Path = RESULTS) -> dict[int, dict[str, Any]]:
    """Each committed full run's summary, by seed."""
    out = {}
    for f in sorted(results.glob("summary_seed*.json")):
        out[int(f.stem.removeprefix("summary_seed"))] = json.loads(f.read_text())
    return out


def render(summaries: dict[int, dict[str, Any]]) -> str:
    """The Markdown table: per run, each seed's figures side by side (k3 columns: seed 0)."""
    seeds = sorted(summaries)
    first = summaries[seeds[0]]

    def per_seed(run: str, fmt: Any) -> str:
        return ", ".join(fmt(summaries[s]["runs"][run]) for s in seeds)

    def first_09(r: dict[str, Any]) -> str:
        step = r["first_step_reward_0_9"]
        return "never" if step is None else str(step)

    def k3(r: dict[str, Any], term: str) -> str:
        seen, true = r[f"{term}_k3_median"], r[f"true_{term}_k3_median"]
        return f"{_g(seen)} / {_g(true)}"

    seed_list = ", ".join(f"seed {s}" for s in seeds)
    lines = [
        f"| run | first step with reward ≥ 0.9 ({seed_list}) | final reward ({seed_list}) "
        f"| mean clip fraction ({seed_list}) | discrepancy k3 seen / true (seed {seeds[0]}) "
        f"| staleness k3 seen / true (seed {seeds[0]}) "
        f"| steps with `rollout_corr:kl_high` ({seed_list}) |",
        "|---|---|---|---|---|---|---|",
    ]
    for run, label in LABELS.items():
        if run not in first["runs"]:
            continue
        lines.append(
            f"| {label} | {per_seed(run, first_09)} "
            f"| {per_seed(run, lambda r: format(r['reward'], '.3f'))} "
            f"| {per_seed(run, lambda r: format(r['clipfrac_mean_all'], '.3f'))} "
            f"| {k3(first['runs'][run], 'disc')} | {k3(first['runs'][run], 'stale')} "
            f"| {per_seed(run, _kl_high)} |"
        )
    steps = first["config"]["steps"]
    walls = ", ".join(f"{summaries[s]['seconds']:.0f} s" for s in seeds)
    lines.append("")
    lines.append(
        f"{steps} steps per run; final = mean over the last {min(20, steps // 5)} steps; k3 "
        f"columns are medians over steps. Wall time of the four runs together ({seed_list}): "
        f"{walls}."
    )
    return "\n".join(lines)


def _kl_high(r: dict[str, Any]) -> str:
    return str(r["flag_steps"].get("rollout_corr:kl_high", 0))


def _g(x: float) -> str:
    return "0" if x == 0 else f"{x:.1e}"


def readme_with(table: str, readme: str) -> str:
    """README.md's text with the table between its markers replaced by ``table``."""
    head, rest = readme.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{table}\n{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--write", action="store_true", help="rewrite README.md's table")
    args = p.parse_args(argv)
    table = render(load_summaries())
    if args.write:
        README.write_text(readme_with(table, README.read_text()))
    else:
        print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
