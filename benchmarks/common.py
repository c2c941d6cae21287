"""Shared benchmark plumbing: a server subprocess, timing with warm-up, result tables."""

from __future__ import annotations

import json
import os
import random
import re
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

# The mixed-version workload of versions-vs-naive (benchmarks/throughput.py) and of
# benchmarks/peer.py: VERSIONS versions, requests Zipf-like toward the newest, a device budget
# of BUDGET_VERSIONS versions (the server's --device-budget-gib; the Ray Serve peer's
# max_num_models_per_replica).
VERSIONS = 16
BUDGET_VERSIONS = 4


@dataclass
class Figure:
    """One measured row. ``figure`` names what is measured (kebab case, stable across runs:
    compare runs by it, docs/performance.md lists them); ``name`` says which row and how."""

    figure: str
    name: str
    value: float
    unit: str
    goal: str = ""
    detail: dict[str, Any] = field(default_factory=dict)


def timed(fn: Callable[[], Any], *, reps: int, warmup: int = 1) -> list[float]:
    """Wall seconds of ``reps`` calls after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def interleaved(
    a: tuple[Callable[[], Any], Callable[[], None]],
    b: tuple[Callable[[], Any], Callable[[], None]],
    *,
    rounds: int,
    reps: int,
) -> tuple[list[float], list[float], list[float]]:
    """Two arms, each (a context-manager factory entered around its timing, the call), timed
    in turn ``rounds`` times (the same machine state for both): per round, the median seconds
    of ``reps`` calls of each, and a ÷ b."""
    a_s: list[float] = []
    b_s: list[float] = []
    for _ in range(rounds):
        for (enter, fn), out in ((a, a_s), (b, b_s)):
            with enter():
                out.append(statistics.median(timed(fn, reps=reps, warmup=1)))
    return a_s, b_s, [x / y for x, y in zip(a_s, b_s, strict=True)]


def summary(times: list[float]) -> dict[str, float]:
    return {
        "median_s": statistics.median(times),
        "min_s": min(times),
        "max_s": max(times),
        "spread": (max(times) - min(times)) / statistics.median(times) if times else 0.0,
    }


class ServerProcess:
    """`oldlogit serve` in a subprocess; the ports come from its `http=`/`grpc=` lines."""

    def __init__(
        self,
        args: list[str],
        env: dict[str, str] | None = None,
        cmd: list[str] | None = None,
        ports: tuple[str, ...] = ("http", "grpc"),
        log_level: str = "WARNING",
    ) -> None:
        serve = [sys.executable, "-m", "oldlogit_service.cli", "serve", *args]
        serve += ["--http-port", "0", "--grpc-port", "0", "--log-level", log_level]
        cmd = cmd or serve
        self.want = ports
        self.proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        )
        self.ports: dict[str, str] = {}
        self.lines: list[str] = []
        threading.Thread(target=self._pump, daemon=True).start()
        end = time.monotonic() + 300
        while len(self.ports) < len(self.want):
            if self.proc.poll() is not None or time.monotonic() > end:
                self.proc.kill()
                raise RuntimeError("server did not start:\n" + "\n".join(self.lines[-30:]))
            time.sleep(0.05)

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip())
            m = re.fullmatch(r"(http|grpc)=(\S+)", line.strip())
            if m:
                self.ports[m.group(1)] = m.group(2)

    @property
    def http_url(self) -> str:
        return f"http://{self.ports['http']}"

    @property
    def grpc_url(self) -> str:
        return f"grpc://{self.ports['grpc']}"

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def write_results(out_dir: Path, figures: list[Figure], meta: dict[str, Any]) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "results.json"
    path.write_text(json.dumps({"meta": meta, "figures": [asdict(f) for f in figures]}, indent=2))
    return path


def print_table(figures: list[Figure]) -> None:
    wf = max(len(f.figure) for f in figures)
    wn = max(len(f.name) for f in figures)
    print(f"{'figure':<{wf}}  {'row':<{wn}}  {'value':>10}  {'unit':<10}  goal")
    for f in figures:
        print(f"{f.figure:<{wf}}  {f.name:<{wn}}  {f.value:>10.3f}  {f.unit:<10}  {f.goal}")
        if "printed" in f.detail:  # counts a reader needs beside the ratio
            print(f"    {f.detail['printed']}")


def concurrent(n: int, fn: Callable[[int], None]) -> float:
    """Run ``fn(0..n-1)`` on n threads released together; wall seconds until all are done
    (the first error is raised)."""
    barrier = threading.Barrier(n)
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            barrier.wait()
            fn(i)
        except BaseException as exc:
            errors.append(exc)

    ts = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    t0 = time.perf_counter()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    if errors:
        raise errors[0]
    return time.perf_counter() - t0


def p50_p99_ms(latencies_s: list[float]) -> dict[str, float]:
    """The median and 99th percentile of per-request latencies, in milliseconds."""
    lats = sorted(latencies_s)
    return {
        "p50_ms": 1000 * lats[len(lats) // 2],
        "p99_ms": 1000 * lats[min(len(lats) - 1, int(0.99 * len(lats)))],
    }


def write_versions(base: dict[str, torch.Tensor], vdir: Path) -> list[dict[str, torch.Tensor]]:
    """VERSIONS versions of ``base`` (each 3 % of the elements moved from the last), written
    as ``vdir/v{v}.safetensors`` for the servers that load a version from a file (the naive
    server, the Ray Serve peer); returns them for ``Client.publish``."""
    from safetensors.torch import save_file

    from oldlogit_service.demo.deployment import demo_versions

    versions = demo_versions(base, VERSIONS, changed_fraction=0.03)
    vdir.mkdir(parents=True, exist_ok=True)
    for v, w in enumerate(versions):
        save_file({k: t.contiguous() for k, t in w.items()}, str(vdir / f"v{v}.safetensors"))
    return versions


def recent_skewed_requests(rng: random.Random, requests: int, clients: int) -> dict[int, list[int]]:
    """``requests`` requests over VERSIONS versions, Zipf-like toward the newest, dealt round
    robin to ``clients`` clients: client -> the versions it asks for, in order."""
    newest = VERSIONS - 1
    per_client: dict[int, list[int]] = {}
    for i in range(requests):
        v = newest - min(newest, int(rng.expovariate(0.35)))
        per_client.setdefault(i % clients, []).append(v)
    return per_client


# An RL trainer's mix (benchmarks/peer.py's ``-rl`` figures): the share of requests at the
# newest version, at the one before it, spread over the next RL_NEAR_SPAN older ones; the rest
# at very old versions (uniform over what is older still).
RL_NEWEST, RL_SECOND, RL_NEAR, RL_NEAR_SPAN = 0.55, 0.30, 0.10, 3


def rl_skewed_requests(rng: random.Random, requests: int, clients: int) -> dict[int, list[int]]:
    """``requests`` requests over VERSIONS versions as an RL trainer asks for them: most at the
    newest two (RL_NEWEST + RL_SECOND), a few one to RL_NEAR_SPAN versions older, the rest
    (5 %) at very old versions; dealt round robin to ``clients`` clients."""
    newest = VERSIONS - 1
    per_client: dict[int, list[int]] = {}
    for i in range(requests):
        u = rng.random()
        if u < RL_NEWEST:
            v = newest
        elif u < RL_NEWEST + RL_SECOND:
            v = newest - 1
        elif u < RL_NEWEST + RL_SECOND + RL_NEAR:
            v = newest - 2 - rng.randrange(RL_NEAR_SPAN)
        else:
            v = rng.randrange(newest - 1 - RL_NEAR_SPAN)
        per_client.setdefault(i % clients, []).append(v)
    return per_client


def naive_server(
    model_dir: Path, vdir: Path, dtype: str = "float32", device: str = "cpu"
) -> ServerProcess:
    """benchmarks/naive_server.py in a subprocess, on the versions ``write_versions`` wrote."""
    cmd = [sys.executable, "-m", "benchmarks.naive_server", "--model", str(model_dir)]
    cmd += ["--versions", str(vdir), "--dtype", dtype, "--device", device]
    return ServerProcess([], cmd=cmd, ports=("http",))


def versions_server(
    model_dir: Path,
    snapshot_dir: Path,
    base: dict[str, torch.Tensor],
    *,
    mode: str = "deterministic",
    dtype: str = "float32",
    max_batch_tokens: int,
    device: str = "cpu",
) -> ServerProcess:
    """`oldlogit serve` as the versions workload measures it: no response cache, a device
    budget of BUDGET_VERSIONS versions of ``base``'s size, a 2 ms batching window; the
    invariant numerics in deterministic mode, the plain ones in fast mode."""
    one_gib = sum(t.numel() * t.element_size() for t in base.values()) / 1024**3
    return ServerProcess(
        [
            "--model",
            str(model_dir),
            "--snapshot-dir",
            str(snapshot_dir),
            "--dtype",
            dtype,
            "--mode",
            mode,
            "--numerics",
            "invariant" if mode == "deterministic" else "hf",
            "--cache-budget-mib",
            "0",
            "--device-budget-gib",
            f"{(BUDGET_VERSIONS + 0.5) * one_gib:.9f}",
            "--max-wait-ms",
            "2",
            "--max-batch-tokens",
            str(max_batch_tokens),
            "--device",
            device,
        ]
    )
