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
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tests.integration.conftest import Served, run_ranks, start_served
from tests.integration.parity_worker import VERSION

SETUPS = ["ddp", "fsdp2_mp", "fsdp1_mp", "fsdp2_fp32", "fsdp2_autocast", "tp"]


@pytest.fixture(scope="module")
def seen(
    tmp_path_factory: pytest.TempPathFactory, model_dir: Path
) -> Iterator[dict[str, list[dict[str, object]]]]:
    """Every setup on both ranks: one process per rank runs them all in turn."""
    tmp = tmp_path_factory.mktemp("dist")
    served = start_served(tmp, model_dir, dtype="bfloat16")
    try:
        yield _run(served, model_dir, tmp)
    finally:
        served.server.stop()


def _run(served: Served, model_dir: Path, tmp: Path) -> dict[str, list[dict[str, object]]]:
    weights = tmp / "weights.safetensors"
    save_file({k: v.contiguous() for k, v in served.weights[VERSION].items()}, str(weights))
    threads = str(torch.get_num_threads())  # the service's: part of the numerics on CPU
    outs = [tmp / f"rank{rank}.json" for rank in range(2)]

    def argv(rank: int) -> list[str]:
        return [
            *(",".join(SETUPS), str(rank), "2", str(tmp / "init"), served.server.http_url),
            *(str(model_dir), str(weights), str(outs[rank])),
        ]

    logs = [
        log
        for _, log in run_ranks(
            "tests.integration.parity_worker", argv, 2, threads=threads, timeout_s=280
        )
    ]
    ranks = [json.loads(o.read_text()) for o in outs]
    by_setup = {}
    for setup in SETUPS:
        by_setup[setup] = [r[setup] for r in ranks]
        for s, log in zip(by_setup[setup], logs, strict=True):
            assert "error" not in s, str(s.get("error", "")) + log[-3000:]
    return by_setup


@pytest.mark.parametrize("setup", ["ddp", "fsdp2_mp", "fsdp1_mp"])
def test_bitwise_on_every_rank(setup: str, seen: dict[str, list[dict[str, object]]]) -> None:
    for s in seen[setup]:
        assert "refused" not in s, s["refused"]
        assert s["tokens"] > 100 and s["equal"] == s["tokens"], s  # type: ignore[operator]
        assert s["max_abs"] == 0.0
        assert s["grads"] == s["params"]  # the backward reached every parameter
        assert s["verified_tokens"] > 100  # type: ignore[operator]


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        ("fsdp2_fp32", "compute dtype 'float32' here (from parameters (FSDP without param_dtype))"),
        ("fsdp2_fp32", "fully_shard(..., mp_policy=MixedPrecisionPolicy(param_dtype=torch.b"),
        ("fsdp2_autocast", "fully_shard(..., mp_policy=MixedPrecisionPolicy(param_dtype=torch.b"),
        ("tp", "tensor parallelism (parallelize_module) needs the tensor-parallel definition"),
    ],
)
def test_refused_by_name_on_every_rank(
    setup: str, message: str, seen: dict[str, list[dict[str, object]]]
) -> None:
    for s in seen[setup]:
        assert message.lower() in str(s.get("refused", "")).lower(), s
