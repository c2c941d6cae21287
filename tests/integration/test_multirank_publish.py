"""Publishing one version from two ranks: a real gloo group, FSDP2 on CPU, a real server.

Two processes (tests/integration/multirank_worker.py) shard a Qwen3-MoE test model with
``fully_shard`` and publish from both ranks: a full version streamed while the DTensors are
gathered, a delta, each rank's own plain share, and a publish where one rank cannot reach the
service. Each version's hash is the whole model's (computed here from the same seed), it serves
bitwise; the failed publish raises on both ranks and leaves nothing visible.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from oldlogit import Client, UnknownVersion
from oldlogit.contract.weights import weight_sha256
from oldlogit_service.config import Settings
from oldlogit_service.model.checkpoints import canonicalize_weights
from oldlogit_service.model.loaded import load_model
from oldlogit_service.model.numerics import SamplingParams
from oldlogit_service.model.reference import reference_logprobs
from oldlogit_service.server import ServerThread
from tests.architectures import VOCAB, hf_model, model_dir, persistent_state
from tests.integration.multirank_worker import ARCH, nudge_

from .conftest import WRITE_TOKEN

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def float_server(tmp_path: Path) -> Iterator[tuple[ServerThread, Path]]:
    hub = model_dir(tmp_path / "model", ARCH)
    settings = Settings(
        model=hub,
        snapshot_dir=tmp_path / "snapshots",
        http_port=0,
        grpc_port=0,
        dtype="float32",
        tile_rows=16,
        write_token=WRITE_TOKEN,
    )
    server = ServerThread(settings).start()
    yield server, hub
    server.stop()


# `slow` (two FSDP2 ranks and a server: ~11 s on 2 cores). The default run plays the session
# protocol's ranks in one process (tests/integration/test_sessions.py), and publishes from
# DTensor shards on every rank of a real gloo group (tensor_parallel_numerics' TP 2 ranks).
@pytest.mark.slow
def test_two_ranks_publish_one_version(float_server, tmp_path):
    server, hub = float_server
    procs, outs = [], []
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    for rank in range(2):
        out = tmp_path / f"rank{rank}.json"
        outs.append(out)
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "tests.integration.multirank_worker",
                    str(rank),
                    "2",
                    str(tmp_path / "init"),
                    server.grpc_url,
                    str(out),
                ],
                env=env,
                cwd=REPO,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=280)[0])
        except subprocess.TimeoutExpired:
            p.kill()
            logs.append(p.communicate()[0])
    seen = [json.loads(o.read_text()) for o in outs]
    for s, log in zip(seen, logs, strict=True):
        assert "error" not in s, s.get("error", "") + log[-3000:]
    assert all(s["dtensors"] > 0 for s in seen)  # FSDP2's state dict: DTensors
    assert all("publish_sharded" in s["plain"] and s["plain"].startswith("weights") for s in seen)

    model = load_model(hub, dtype="float32", device="cpu", tile_rows=16)
    trainer = hf_model(ARCH, seed=11)
    start = {
        k: v.clone() for k, v in canonicalize_weights(model, persistent_state(trainer)).items()
    }
    with torch.no_grad():
        for p in trainer.parameters():
            nudge_(p)
    moved = canonicalize_weights(model, persistent_state(trainer))
    for s in seen:  # both ranks learn the same, whole-model hash
        assert s["v1"] == s["v2_full"] == weight_sha256(start)
        assert s["v3"] == s["v4"] == weight_sha256(moved) and s["v3_kind"] == "patch"
    # Rank 1 could not reach the service: it raises its own error, rank 0 a conflict naming it.
    assert seen[1]["v5"].startswith("unavailable")
    assert seen[0]["v5"].startswith("conflict") and "rank 1 failed" in seen[0]["v5"]
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, VOCAB, (n,), generator=gen) for n in (5, 30)]
    with Client(server.http_url) as c:
        for version, weights in ((1, start), (3, moved), (4, moved)):
            for ids in seqs:
                r = c.logprobs(ids, policy_version=version, use_cache=False)
                ref = reference_logprobs(model, weights, ids, SamplingParams())
                assert np.array_equal(r.logprobs, ref, equal_nan=True), version
        with pytest.raises(UnknownVersion):
            c.version(5)
