"""The parity matrix's multi-process rows: DDP and FSDP2 on two gloo ranks (CPU).

Each rank (tests/integration/parity_worker.py) scores its own micro-batch under
``trainer_numerics(model, like=the service's spec)`` and runs the backward. DDP over a bfloat16
model and FSDP2 float32 masters with ``MixedPrecisionPolicy(param_dtype=bfloat16)`` (what verl's
FSDP2 actor and torchtitan run) are bitwise equal to the bfloat16 service on every scored token,
and ``oldlogit.parity.verify`` passes on every rank (weights gathered from the shards):
``like=`` judges the dtype the forward computes in, not the masters' dtype. FSDP2 without a
param_dtype computes in float32 and is refused by name, and so is ``torch.autocast`` over
FSDP2's float32 shards (autocast casts per op; the service runs a bfloat16 model). FSDP1 with
``MixedPrecision(param_dtype=bfloat16, buffer_dtype=bfloat16)`` is bitwise too (its buffer cast
of inv_freq is overridden at each call). torch's tensor parallelism is refused by name at the
first forward (its row-parallel sums cross ranks in an order the tiles do not fix). The ranks run
with the service's CPU thread count (part of the numerics).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tests.integration.conftest import Served, start_served
from tests.integration.parity_worker import VERSION

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bf16_served(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[Served]:
    s = start_served(tmp_path_factory.mktemp("dist"), model_dir, dtype="bfloat16")
    yield s
    s.server.stop()


def _run(setup: str, served: Served, model_dir: Path, tmp: Path) -> list[dict[str, object]]:
    weights = tmp / "weights.safetensors"
    save_file({k: v.contiguous() for k, v in served.weights[VERSION].items()}, str(weights))
    threads = str(torch.get_num_threads())  # the service's: part of the numerics on CPU
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": threads}
    procs, outs = [], []
    for rank in range(2):
        out = tmp / f"{setup}-rank{rank}.json"
        outs.append(out)
        cmd = [sys.executable, "-m", "tests.integration.parity_worker", setup, str(rank), "2"]
        cmd += [str(tmp / f"{setup}-init"), served.server.http_url, str(model_dir)]
        cmd += [str(weights), str(out)]
        procs.append(
            subprocess.Popen(
                cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
        )
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=240)[0])
        except subprocess.TimeoutExpired:
            p.kill()
            logs.append(p.communicate()[0])
            pytest.fail(f"a rank of {setup} hung:\n{logs[-1][-3000:]}")
    seen = [json.loads(o.read_text()) for o in outs]
    for s, log in zip(seen, logs, strict=True):
        assert "error" not in s, str(s.get("error", "")) + log[-3000:]
    return seen


@pytest.mark.parametrize("setup", ["ddp", "fsdp2_mp", "fsdp1_mp"])
def test_bitwise_on_every_rank(setup: str, bf16_served: Served, model_dir: Path, tmp_path: Path):
    seen = _run(setup, bf16_served, model_dir, tmp_path)
    for s in seen:
        assert "refused" not in s, s["refused"]
        assert s["tokens"] > 100 and s["equal"] == s["tokens"], s
        assert s["max_abs"] == 0.0
        assert s["grads"] == s["params"]  # the backward reached every parameter
        assert s["verified_tokens"] > 100  # oldlogit.parity.verify passed on this rank


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        ("fsdp2_fp32", "compute dtype 'float32' here (from parameters (FSDP without param_dtype))"),
        ("fsdp2_fp32", "fully_shard(..., mp_policy=MixedPrecisionPolicy(param_dtype=torch.b"),
        ("fsdp2_autocast", "fully_shard(..., mp_policy=MixedPrecisionPolicy(param_dtype=torch.b"),
        ("tp", "tensor parallelism (parallelize_module) is not covered"),
    ],
)
def test_refused_by_name_on_every_rank(
    setup: str, message: str, bf16_served: Served, model_dir: Path, tmp_path: Path
):
    seen = _run(setup, bf16_served, model_dir, tmp_path)
    for s in seen:
        assert message.lower() in str(s.get("refused", "")).lower(), s
