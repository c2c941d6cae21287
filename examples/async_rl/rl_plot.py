"""The comparison figure: reward, PPO clip fraction and each term's KL, one line per run."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only: no display on CI or a headless box
import matplotlib.pyplot as plt

COLORS = {
    "recompute": "tab:red",
    "behaviour": "tab:orange",
    "exact": "tab:green",
    "ewma": "tab:blue",
}


def _smooth(values: Sequence[float], window: int) -> list[float]:
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def plot(runs: dict[str, list[dict[str, Any]]], labels: dict[str, str], path: Path) -> Path:
    """Write the 2×2 figure to ``path`` (PNG)."""
    panels = [
        ("reward", "reward (fraction of digits right)", False),
        ("clipfrac", "PPO clip fraction (actor/pg_clipfrac)", False),
        ("disc_k3", "discrepancy term KL, k3 (rollout_corr/k3_kl)", True),
        ("stale_k3", "staleness term KL, k3 (staleness_corr/k3_kl)", True),
    ]
    fig, axes = plt.subplots(2, 2, figsize=(12, 8), sharex=True)
    for ax, (key, title, log) in zip(axes.flat, panels, strict=True):
        for variant, recs in runs.items():
            steps = [r["step"] for r in recs]
            ys = [float(r[key]) for r in recs]
            window = max(1, len(ys) // 15)
            ax.plot(steps, _smooth(ys, window), label=labels[variant], color=COLORS.get(variant))
        ax.set_title(title, fontsize=10)
        if log:
            ax.set_yscale("symlog", linthresh=1e-6)
        ax.grid(alpha=0.3)
    for ax in axes[1]:
        ax.set_xlabel("trainer step (= published version)")
    axes[0][0].legend(fontsize=8, loc="lower right")
    fig.suptitle("async RL with stale, partial rollouts: what fills the 'old' slot", fontsize=12)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
