"""Where the time goes on a GPU: the forwards and the service that the GPU figures time, profiled.

    python -m benchmarks.gpu_profile OUT [--smoke] [--device cuda] [--budget-s S]

At Qwen2.5-1.5B's layer shapes (``benchmarks/shapes.py``; tiny with ``--smoke``), bf16, on
``--device``: for each case — transformers' plain forward + float32 log-softmax, the invariant
one (``trainer_numerics`` + ``token_logprobs``), each at 1 × 512 and 16 × 512; the patched
and plain forward + backward at 1 × 512; the service's ``Engine`` in this process at 16 × 512 —
it writes

- ``wall_ms`` (to ``torch.cuda.synchronize``) and ``host_ms`` (until Python returns, the GPU
  still busy: when host ≈ wall, the call is bound by the host, launches and Python, not by the
  GPU);
- from ``torch.profiler``: ``gpu_busy_ms`` (the kernels' own time), the number of kernel
  launches and of host-device synchronisations (``cudaStreamSynchronize``, ``cudaMemcpy``,
  ``cudaDeviceSynchronize``), the top ops by host self time and by GPU time;
- from ``cProfile``: the top Python functions by own time.

Then the service over gRPC (``oldlogit serve --device``) at 16 × 512 against the same Engine in
process, with ``py-spy`` sampling the server where it is installed and allowed (its top
functions by own samples). Everything lands in OUT/gpu-profile.json, rewritten after each part
(a run cut short keeps what it measured). scripts/gpu_checks.sh runs it as its ``profile`` step.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import functools
import io
import json
import os
import pstats
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks import shapes as named_shapes

SYNC_EVENTS = (
    "cudaStreamSynchronize",
    "cudaDeviceSynchronize",
    "cudaMemcpy",
    "cudaEventSynchronize",
)
LAUNCH_EVENTS = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC")


def _settle(device: torch.device) -> None:
    named_shapes.settle(device)


def _median_ms(fn: Callable[[], Any], device: torch.device, reps: int, sync: bool) -> float:
    times = []
    for _ in range(reps):
        _settle(device)
        t = time.perf_counter()
        fn()
        if sync:
            _settle(device)
        times.append((time.perf_counter() - t) * 1e3)
    _settle(device)
    return statistics.median(times)


def _rows(table: Any, key: str, n: int, per: int) -> list[dict[str, Any]]:
    rows = sorted(table, key=lambda e: getattr(e, key, 0), reverse=True)[:n]
    return [
        {
            "name": e.key[:120],
            "calls": e.count // per,
            "self_cpu_us": round(e.self_cpu_time_total / per, 1),
            "self_gpu_us": round(getattr(e, "self_device_time_total", 0) / per, 1),
        }
        for e in rows
    ]


def profiled(fn: Callable[[], Any], device: torch.device, reps: int = 3) -> dict[str, Any]:
    """Wall and host time, then torch.profiler's and cProfile's view of ``fn`` (warmed up)."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(2):
        fn()
    out: dict[str, Any] = {
        "wall_ms": _median_ms(fn, device, 5, sync=True),
        "host_ms": _median_ms(fn, device, 5, sync=False),
    }
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        for _ in range(reps):
            fn()
        _settle(device)
    table = prof.key_averages()
    kernels = [e for e in prof.events() if getattr(e, "device_type", None) is not None
               and str(e.device_type).endswith("CUDA")]  # fmt: skip
    counts: Counter[str] = Counter()
    for e in table:
        for name in (*SYNC_EVENTS, *LAUNCH_EVENTS):
            if e.key.startswith(name):
                counts[name] += e.count
    out["gpu_busy_ms"] = (
        sum(k.self_device_time_total for k in kernels) / reps / 1e3 if kernels else None
    )
    out["launches"] = sum(counts[n] for n in LAUNCH_EVENTS) // reps
    out["syncs"] = {n: counts[n] // reps for n in SYNC_EVENTS if counts[n]}
    out["top_host_ops"] = _rows(table, "self_cpu_time_total", 20, reps)
    if device.type == "cuda":
        out["top_gpu_ops"] = _rows(table, "self_device_time_total", 15, reps)
    prof_py = cProfile.Profile()
    prof_py.enable()
    for _ in range(reps):
        fn()
    _settle(device)
    prof_py.disable()
    out["top_python"] = _python_rows(prof_py, reps, 35)
    return out


def _python_rows(prof_py: cProfile.Profile, per: int, n: int) -> list[dict[str, Any]]:
    stats = pstats.Stats(prof_py, stream=io.StringIO())
    rows = []
    for (file, line, func), (_, nc, tt, ct, _) in stats.stats.items():  # type: ignore[attr-defined]
        rows.append((tt, ct, nc, f"{_short(file)}:{line}({func})"))
    rows.sort(reverse=True)
    return [
        {"func": f, "calls": nc // per, "own_ms": round(tt * 1e3 / per, 3),
         "cum_ms": round(ct * 1e3 / per, 3)}
        for tt, ct, nc, f in rows[:n]
    ]  # fmt: skip


def _short(file: str) -> str:
    for mark in ("site-packages/", "/client/", "/service/", "/benchmarks/"):
        if mark in file:
            return file.split(mark, 1)[1]
    return file


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="benchmarks.gpu_profile", description=__doc__)
    p.add_argument("out", type=Path)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--smoke", action="store_true", help="tiny model and rows (the CPU rehearsal)")
    p.add_argument("--budget-s", type=float, default=120.0)
    p.add_argument(
        "--parts",
        nargs="*",
        default=os.environ.get("PROFILE_PARTS", "").split(),
        help="only the parts whose names start so (e.g. 'invariant 1x' engine service; "
        "default: $PROFILE_PARTS, else all)",
    )
    args = p.parse_args(argv)
    args.shapes = "qwen2.5-1.5b"
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.device(args.device)
    start = time.monotonic()
    result: dict[str, Any] = {"device": str(device), "smoke": args.smoke, "parts": {}}
    if device.type == "cuda":
        result["device_name"] = torch.cuda.get_device_name(device)

    def write() -> None:
        (args.out / "gpu-profile.json").write_text(json.dumps(result, indent=1) + "\n")

    def part(name: str, fn: Callable[[], Any]) -> None:
        if args.parts and not any(name.startswith(w) for w in args.parts):
            return
        if time.monotonic() - start > args.budget_s:
            result["parts"][name] = {"skipped": "out of time"}
            write()
            return
        t = time.monotonic()
        try:
            result["parts"][name] = fn()
        except Exception as e:  # one part's failure is recorded; the next one runs
            result["parts"][name] = {"error": f"{type(e).__name__}: {e}"[:2000]}
        result["parts"][name]["part_s"] = round(time.monotonic() - t, 1)
        print(f"gpu_profile: {name} {result['parts'][name]['part_s']} s", flush=True)
        write()

    from oldlogit.parity import token_logprobs, trainer_numerics

    fields = named_shapes.config(args)
    model = named_shapes.build(fields, device=device)
    rows = [(1, 32), (4, 32)] if args.smoke else [(1, 512), (16, 512)]
    gen = torch.Generator().manual_seed(0)
    batches = {r: torch.randint(0, fields["vocab_size"], r, generator=gen).to(device) for r in rows}

    def plain_lp(ids: torch.Tensor) -> torch.Tensor:
        logits = model(input_ids=ids, use_cache=False).logits[:, :-1]
        return torch.log_softmax(logits.float(), dim=-1).gather(-1, ids[:, 1:, None])[..., 0]

    def entered(fn: Callable[[], None]) -> dict[str, Any]:
        # The patch entered once around the timing, as a trainer's loop and the
        # invariant-vs-plain figure do; its entry is a part of its own.
        with trainer_numerics(model):
            return profiled(fn, device)

    for b, t in rows:
        ids = batches[(b, t)]

        def plain(ids: torch.Tensor = ids) -> None:
            with torch.inference_mode():
                plain_lp(ids)

        def invariant(ids: torch.Tensor = ids) -> None:
            with torch.inference_mode():
                token_logprobs(model, ids)

        part(f"plain {b}x{t}", functools.partial(profiled, plain, device))
        part(f"invariant {b}x{t}", functools.partial(entered, invariant))

    def entry() -> None:
        with trainer_numerics(model):
            pass

    part("trainer_numerics entry", functools.partial(profiled, entry, device))

    ids1 = batches[rows[0]]

    def plain_step() -> None:
        model.zero_grad(set_to_none=True)
        plain_lp(ids1).mean().backward()  # type: ignore[no-untyped-call]

    def patched_step() -> None:
        model.zero_grad(set_to_none=True)
        token_logprobs(model, ids1).mean().backward()  # type: ignore[no-untyped-call]

    b, t = rows[0]
    part(f"plain step {b}x{t}", functools.partial(profiled, plain_step, device))
    part(f"patched step {b}x{t}", functools.partial(entered, patched_step))
    model.zero_grad(set_to_none=True)

    root = Path(tempfile.mkdtemp(prefix="oldlogit-profile-"))
    model_dir = root / "model"
    model.save_pretrained(str(model_dir))
    model.to("cpu")  # the GPU to the engine and the server
    if device.type == "cuda":
        torch.cuda.empty_cache()
    big = rows[-1]
    part(f"engine {big[0]}x{big[1]}", lambda: _engine(model_dir, device, batches[big]))
    part(f"service {big[0]}x{big[1]}", lambda: _service(model_dir, device, batches[big], args.out))
    shutil.rmtree(root, ignore_errors=True)
    result["wall_s"] = round(time.monotonic() - start, 1)
    write()
    return 0


def _engine(model_dir: Path, device: torch.device, ids: torch.Tensor) -> dict[str, Any]:
    from oldlogit_service.model.checkpoints import load_weights
    from oldlogit_service.model.engine import Engine, Job
    from oldlogit_service.model.loaded import load_model
    from oldlogit_service.model.numerics import SamplingParams

    model = load_model(model_dir, dtype=torch.bfloat16, device=device)
    weights = load_weights(model_dir, model)
    assert weights is not None
    weights = {k: v.to(device) for k, v in weights.items()}
    engine = Engine(model, mode="deterministic")
    cpu_ids = ids.cpu()
    jobs = [
        Job(token_ids=row, positions=torch.arange(1, row.numel()), sampling=SamplingParams())
        for row in cpu_ids
    ]
    return profiled(lambda: engine.run(weights, jobs), device)


def _service(model_dir: Path, device: torch.device, ids: torch.Tensor, out: Path) -> dict[str, Any]:
    from benchmarks.common import ServerProcess
    from oldlogit import Client, Sequence

    tokens = ids.numel()
    server = ServerProcess(
        ["--model", str(model_dir), "--snapshot-dir", str(model_dir.parent / "snap"),
         "--dtype", "bfloat16", "--device", device.type, "--max-batch-tokens", str(tokens),
         "--cache-budget-mib", "0", "--max-wait-ms", "1"]
    )  # fmt: skip
    res: dict[str, Any] = {}
    try:
        seqs = [Sequence(token_ids=row.tolist(), policy_version=0) for row in ids.cpu()]
        with Client(server.grpc_url, timeout_s=600) as c:

            def call() -> None:
                c.logprobs_batch(seqs, use_cache=False)

            for _ in range(2):
                call()
            res["wall_ms"] = _median_ms(call, torch.device("cpu"), 7, sync=False)
            client_prof = cProfile.Profile()
            client_prof.enable()
            for _ in range(3):
                call()
            client_prof.disable()
            res["client_top_python"] = _python_rows(client_prof, 3, 20)
            spy = _py_spy()
            if spy is None:
                res["py_spy"] = "not installed"
            else:
                raw = out / "server-pyspy.txt"

                def record(*extra: str) -> subprocess.Popen[str]:
                    return subprocess.Popen(
                        [spy, "record", "--pid", str(server.proc.pid), "--rate", "500",
                         "--format", "raw", "--output", str(raw), "--duration", "8",
                         "--threads", *extra],
                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                    )  # fmt: skip

                # --native: the C frames too (a CUDA copy or synchronisation a Python line
                # waits in; it pauses the server for each sample, so the calls under it are
                # slower than wall_ms); non-blocking Python frames where it cannot unwind.
                rec = record("--native")
                time.sleep(1.0)
                if rec.poll() is not None:
                    res["py_spy_native"] = (rec.communicate()[0] or "")[-600:]
                    rec = record("--nonblocking")
                    time.sleep(1.0)
                end = time.monotonic() + 6
                n = 0
                while time.monotonic() < end and rec.poll() is None:
                    call()
                    n += 1
                text, _ = rec.communicate(timeout=30)
                res["py_spy"] = {"calls": n, "rc": rec.returncode, "log": text[-600:]}
                if raw.is_file():
                    res["py_spy"]["top_own"] = _collapsed_top(raw.read_text(), 30)
    finally:
        with contextlib.suppress(Exception):
            server.proc.kill()
    return res


def _py_spy() -> str | None:
    """py-spy on PATH, or the one a ``pip install --target`` put beside the packages
    (scripts/gpu_checks.sh's $SITE/bin)."""
    found = shutil.which("py-spy")
    if found:
        return found
    beside = Path(sys.executable).parent / "py-spy"  # a virtual environment's bin/
    if beside.is_file():
        return str(beside)
    for entry in sys.path:
        cand = Path(entry) / "bin" / "py-spy"
        if entry and cand.is_file():
            cand.chmod(0o755)
            return str(cand)
    return None


def _collapsed_top(text: str, n: int) -> list[dict[str, Any]]:
    """From py-spy's collapsed stacks: the frames with the most samples on top of the stack
    (own time), and each thread's share."""
    own: Counter[str] = Counter()
    compute: Counter[str] = Counter()  # the engine's thread alone (its forwards)
    threads: Counter[str] = Counter()
    total = 0
    for line in text.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        total += int(count)
        threads[frames[0][:60]] += int(count)
        # The innermost Python frame, and the native frame the sample was in under it (with
        # --native): which line waits in what.
        py = [f for f in frames if ".py:" in f]
        leaf = frames[-1] if not py or frames[-1] != py[-1] else ""
        where = (py[-1] if py else frames[-1])[:160] + (f" <- {leaf[:80]}" if leaf else "")
        own[where] += int(count)
        if "oldlogit-compute" in frames[0]:
            compute[where] += int(count)
    funcs: Counter[str] = Counter()
    for frame, c in own.items():  # "func (file:line) <- native" -> "func (file)"
        funcs[re.sub(r":\d+\)$", ")", frame.split(" <- ")[0])] += c
    rows = [{"function": f, "share": round(c / max(total, 1), 4)} for f, c in funcs.most_common(n)]
    rows += [{"line": f, "share": round(c / max(total, 1), 4)} for f, c in own.most_common(n)]
    busy = sum(compute.values())
    rows += [{"compute": f, "share": round(c / max(busy, 1), 4)} for f, c in compute.most_common(n)]
    rows.append({"threads": {t: round(c / max(total, 1), 4) for t, c in threads.most_common(8)}})
    return rows


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
