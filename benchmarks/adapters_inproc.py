"""adapter-mixed-batches in process: the engine's packed forward with adapters ÷ the same batch
on the bare weights, no server (the bench's small model and batch: benchmarks/serving.py's
defaults, float32, invariant numerics, deterministic mode).

    .venv/bin/python -m benchmarks.adapters_inproc [--rounds 10] [--arms mixed16,contig4,all1]
        [--old]

Arms per round in turn (the order alternates each round; round 0 warms up, untimed): ``whole``
(no adapter), ``mixed16`` (sequence i gets adapter i % 16), ``contig4`` (4 adapters, each on
a contiguous quarter of the sequences), ``all1`` (one adapter on every sequence); ``--old``
adds each arm again as ``<arm>@old`` on the previous per-range path (each range's lora_A and
lora_B calls, its output joined by ``torch.cat``: ``lora._joined``), for a paired
before/after. Prints each
arm's median seconds and the median over rounds of whole ÷ arm (the bench's ratio).
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.adapters import ALPHA, LINEARS, RANK


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--arms", default="mixed16,contig4,all1")
    p.add_argument("--seqs", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--old", action="store_true")
    args = p.parse_args()

    from oldlogit.parity import lora as lora_mod

    new_adapted = lora_mod._adapted

    def old_adapted(call, groups):  # type: ignore[no-untyped-def]
        def forward(x, *a, **kw):  # type: ignore[no-untyped-def]
            result = call(x, *a, **kw)
            flat = result.reshape(-1, result.shape[-1])
            return lora_mod._joined(result, flat, x.reshape(-1, x.shape[-1]), groups)

        forward._oldlogit_lora = True  # type: ignore[attr-defined]
        return forward

    from oldlogit_service.demo.tiny import make_tiny_model_dir
    from oldlogit_service.model.checkpoints import load_weights
    from oldlogit_service.model.engine import Engine, Job, LoraWeights
    from oldlogit_service.model.loaded import load_model

    root = Path(tempfile.mkdtemp(prefix="oldlogit-adapters-inproc-"))
    model_dir = make_tiny_model_dir(
        root / "model",
        arch="qwen2",
        seed=0,
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        num_layers=args.layers,
        num_heads=max(1, args.hidden // 64) * 2,
        num_kv_heads=max(1, args.hidden // 64),
        intermediate_size=args.hidden * 3,
        max_positions=max(2048, args.seq_len * 2),
    )
    model = load_model(model_dir, dtype=args.dtype, device="cpu", numerics="invariant")
    weights = load_weights(model_dir, model)
    assert weights is not None
    engine = Engine(model, mode="deterministic", max_batch_tokens=args.seqs * args.seq_len)
    modules = sorted(
        n.removesuffix(".weight")
        for n in model.param_specs
        if n.endswith(tuple(f"{s}.weight" for s in LINEARS))
    )

    def lora(seed: int) -> LoraWeights:
        g = torch.Generator().manual_seed(seed)
        tensors = {}
        for m in modules:
            out_f, in_f = model.param_specs[f"{m}.weight"][1]
            tensors[f"{m}.lora_A"] = (torch.rand(RANK, in_f, generator=g) * 2 - 1) / in_f**0.5
            tensors[f"{m}.lora_B"] = torch.randn(out_f, RANK, generator=g) * 0.02
        spec = {
            "rank": RANK,
            "alpha": float(ALPHA),
            "use_rslora": False,
            "target_modules": modules,
            "dtype": "float32",
        }
        return LoraWeights(f"{seed:064x}", spec, tensors)

    adapters = [lora(k) for k in range(16)]
    rng = random.Random(0)
    ids = [
        torch.tensor([rng.randrange(args.vocab) for _ in range(args.seq_len)])
        for _ in range(args.seqs)
    ]
    pos = torch.arange(1, args.seq_len)
    quarter = max(1, args.seqs // 4)
    pick: dict[str, Callable[[int], LoraWeights | None]] = {
        "whole": lambda i: None,
        "mixed16": lambda i: adapters[i % 16],
        "contig4": lambda i: adapters[min(3, i // quarter)],
        "all1": lambda i: adapters[0],
    }
    arms = ["whole", *args.arms.split(",")]
    if args.old:
        arms += [f"{a}@old" for a in arms[1:]]
    jobs = {
        a: [Job(x, pos, adapter=pick[a.split("@")[0]](i)) for i, x in enumerate(ids)] for a in arms
    }
    times: dict[str, list[float]] = {a: [] for a in arms}
    with torch.inference_mode():
        for r in range(args.rounds + 1):
            for arm in arms if r % 2 else list(reversed(arms)):
                lora_mod._adapted = old_adapted if arm.endswith("@old") else new_adapted
                t = time.perf_counter()
                engine.run(weights, jobs[arm])
                if r:
                    times[arm].append(time.perf_counter() - t)
            lora_mod._adapted = new_adapted
            print(
                f"round {r}: " + " ".join(f"{a}={v[-1]:.2f}" for a, v in times.items() if v),
                flush=True,
            )
    for arm in arms:
        line = f"{arm:8s} median {statistics.median(times[arm]):.3f} s"
        if arm != "whole":
            ratios = [w / m for w, m in zip(times["whole"], times[arm], strict=True)]
            line += f"  ratio whole/arm median {statistics.median(ratios):.3f}"
            line += f" (min {min(ratios):.3f}, max {max(ratios):.3f})"
        print(line, flush=True)


if __name__ == "__main__":
    main()
