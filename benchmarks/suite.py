"""`oldlogit bench`: run the figures, print a table, write JSON to the output directory."""

from __future__ import annotations

import argparse
import platform
from pathlib import Path

import torch

from benchmarks import delta_trace, serving, soak
from benchmarks.common import print_table, write_results

FIGURES = {"serving": serving, "soak": soak, "delta": delta_trace}
DEFAULT = ["serving"]  # the soak runs for minutes: ask for it by name


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="oldlogit bench")
    p.add_argument("figures", nargs="*", help=f"which figures (default all): {sorted(FIGURES)}")
    p.add_argument("--out", type=Path, default=Path("bench-out"))
    p.add_argument("--smoke", action="store_true", help="tiny sizes: seconds, for CI")
    serving.add_args(p)
    soak.add_args(p)
    delta_trace.add_args(p)
    args = p.parse_args(argv)
    args.figures = args.figures or list(DEFAULT)
    unknown = sorted(set(args.figures) - set(FIGURES))
    if unknown:
        p.error(f"unknown figures {unknown}; choose from {sorted(FIGURES)}")
    if args.smoke:
        args.hidden, args.layers, args.vocab = 64, 2, 512
        args.seqs, args.seq_len, args.concurrency, args.single_len, args.reps = 4, 64, 4, 16, 1
        args.duration_s, args.capacity_s, args.publish_every_s = 8.0, 3.0, 1.0
        delta_trace.smoke(args)
    figures = []
    for name in args.figures:
        figures.extend(FIGURES[name].run(args))
    print_table(figures)
    meta = {
        "machine": platform.machine(),
        "processor": platform.processor(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "args": {k: str(v) for k, v in vars(args).items()},
    }
    path = write_results(args.out, figures, meta)
    print(f"results: {path}")
    return 0
