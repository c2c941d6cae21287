"""Real servers on 127.0.0.1 (port 0) over a tiny random model; references computed here."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from oldlogit_service.config import Settings
from oldlogit_service.demo.deployment import demo_versions
from oldlogit_service.demo.tiny import make_tiny_model_dir
from oldlogit_service.model.checkpoints import load_weights
from oldlogit_service.model.loaded import LoadedModel, load_model
from oldlogit_service.server import ServerThread

WRITE_TOKEN = "test-write-token"
REPO = Path(__file__).resolve().parents[2]


def run_ranks(
    module: str,
    argv_of: Callable[[int], list[str]],
    world: int,
    *,
    threads: str,
    timeout_s: float,
    python: str = sys.executable,
) -> list[tuple[int, str]]:
    """``python -m module *argv_of(rank)`` for every rank at once (the repository on the path,
    ``threads`` CPU threads each); (exit code, output) per rank. A rank that does not finish
    in ``timeout_s`` kills them all and fails the test with its output."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": threads}
    procs = [
        subprocess.Popen(
            [python, "-m", module, *argv_of(rank)],
            env=env,
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(world)
    ]
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=timeout_s)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"a rank hung:\n{p.communicate()[0][-3000:]}")
    return [(p.returncode, log) for p, log in zip(procs, logs, strict=True)]


@dataclass
class Served:
    server: ServerThread
    model: LoadedModel  # an independent load of the same architecture, for the reference
    weights: dict[int, dict[str, torch.Tensor]]
    settings: Settings

    def url(self, transport: str) -> str:
        return self.server.http_url if transport == "http" else self.server.grpc_url


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model_dir(
        tmp_path_factory.mktemp("model"),
        arch="qwen2",
        seed=3,
        vocab_size=384,
        hidden_size=64,
        num_layers=2,
        max_positions=1024,
    )


def start_served(tmp: Path, model_dir: Path, **overrides: object) -> Served:
    kw: dict[str, object] = dict(
        model=model_dir,
        snapshot_dir=tmp / "snapshots",
        http_port=0,
        grpc_port=0,
        dtype="bfloat16",
        lm_head_fp32=False,
        max_wait_ms=2.0,
        write_token=WRITE_TOKEN,
        max_seq_len=512,
        max_sequences_per_request=128,
        publish_roots=[tmp / "roots"],
        drain_timeout_s=5.0,
    )
    kw.update(overrides)
    settings = Settings(**kw)  # type: ignore[arg-type]
    (tmp / "roots").mkdir(exist_ok=True)
    server = ServerThread(settings).start()
    assert server.runtime is not None
    model = load_model(model_dir, dtype=server.runtime.model.dtype, device=torch.device("cpu"))
    base = load_weights(model_dir, model)
    assert base is not None
    weights = dict(enumerate(demo_versions(base, 4)))
    store = server.runtime.store
    for v, w in weights.items():
        store.publish(v, w)  # version 0 (the dir's weights) is already there: idempotent
    weights[10] = weights[3]  # a gap (4..9 never published) for VersionNotIncreasing
    store.publish(10, weights[10])
    return Served(server, model, weights, settings)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[Served]:
    s = start_served(tmp_path_factory.mktemp("served"), model_dir)
    yield s
    s.server.stop()


@pytest.fixture(params=["http", "grpc"])
def transport(request: pytest.FixtureRequest) -> str:
    return str(request.param)
