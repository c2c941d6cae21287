"""Where the invariant path's fixed per-call cost goes, one thread, in process, no server.

``python -m benchmarks.invariant_overhead [--batch 1] [--tokens 128] [--rounds 25]``
on invariant-vs-plain's float32 model (hidden 256, 4 layers, vocab 4,096). Times, median of
interleaved rounds (two calls each after a warm-up call):

- ``plain forward``: transformers' own forward;
- ``plain forward, empty mode``: the same under a ``TorchFunctionMode`` that only passes every
  call on: what seeing every op costs by itself;
- ``plain forward, TileMode(None)``: under oldlogit's mode with no rule but the head's dtype;
- ``invariant forward``: the model's forward under ``trainer_numerics``;
- ``plain logprobs`` / ``invariant logprobs``: with the float32 log-softmax and gather, and
  ``token_logprobs`` under ``trainer_numerics`` (invariant-vs-plain's two arms);
- ``invariant logprobs, entered``: ``trainer_numerics`` entered and left around every call
  (a training loop that patches per step): the patch's own cost added.

One thread so that the differences are Python's, not the thread pool's wake-ups.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from benchmarks.invariant import _plain_logprobs, fp32_model_dir


class _PassThrough(TorchFunctionMode):
    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        return func(*args, **(kwargs or {}))


def main(argv: list[str] | None = None) -> None:
    from transformers import AutoModelForCausalLM

    from oldlogit.parity import token_logprobs, trainer_numerics
    from oldlogit.parity.ops import TileMode

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=25)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    model_dir = fp32_model_dir(Path(tempfile.mkdtemp(prefix="oldlogit-overhead-")), 256, 4096)
    model: Any = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    ids = torch.randint(
        0, 4096, (args.batch, args.tokens), generator=torch.Generator().manual_seed(0)
    )

    def forward() -> None:
        model(input_ids=ids, use_cache=False)

    def under(mode: Callable[[], TorchFunctionMode]) -> Callable[[], None]:
        def run() -> None:
            with mode():
                forward()

        return run

    def plain_logprobs() -> None:
        _plain_logprobs(model, ids)

    def invariant_logprobs() -> None:
        token_logprobs(model, ids)

    def entered_logprobs() -> None:  # the documented per-step pattern: enter, score, leave
        with trainer_numerics(model):
            token_logprobs(model, ids)

    arms: list[tuple[str, Callable[[], None], bool]] = [
        ("plain forward", forward, False),
        ("plain forward, empty mode", under(_PassThrough), False),
        ("plain forward, TileMode(None)", under(lambda: TileMode(None, True, None, False)), False),
        ("invariant forward", forward, True),
        ("plain logprobs", plain_logprobs, False),
        ("invariant logprobs", invariant_logprobs, True),
        ("invariant logprobs, entered", entered_logprobs, False),
    ]
    times: dict[str, list[float]] = {name: [] for name, _, _ in arms}
    with torch.inference_mode():
        for _ in range(args.rounds):
            for name, fn, patched in arms:
                with trainer_numerics(model) if patched else contextlib.nullcontext():
                    fn()
                    start = time.perf_counter()
                    fn()
                    fn()
                    times[name].append((time.perf_counter() - start) / 2)
    base = statistics.median(times["plain forward"])
    print(f"{args.batch} × {args.tokens}, one thread, median of {args.rounds} rounds")
    for name, got in times.items():
        ms = 1e3 * statistics.median(got)
        print(f"{name:32s} {ms:7.2f} ms   {ms - 1e3 * base:+6.2f} ms vs plain forward")


if __name__ == "__main__":
    main()
