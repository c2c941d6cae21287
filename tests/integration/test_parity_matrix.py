"""The parity matrix: trainer setups people run, each bitwise with the service or refused by name.

The rows and the check live in tests/parity_setups.py (a module the oldest-transformers run
shares): a whole-module cast, float32 masters under ``torch.autocast``, activation
checkpointing (reentrant, not, with autocast), ``torch.compile`` and ``model.compile()``, the
eager/sdpa/flex attention implementations, each bitwise on every scored token at micro-batch
sizes 1, 4 and 8 (HTTP and gRPC alternate) with the gradients of the serving-dtype model; float32
masters without autocast, a mismatched autocast dtype, another rope_theta, a PEFT DoRA adapter
and liger-kernel refused by name before any step; a PEFT LoRA adapter bitwise (at PEFT's zero
init of lora_B: its base version's bits). The multi-process rows (DDP, FSDP2) are
tests/integration/test_parity_distributed.py. Each row is also written to
test-artifacts/parity-matrix.json (docs/trainers.md holds the table).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.conftest import Served, start_served
from tests.parity_setups import SETUPS, VERSION, Setup, Skipped, run_setup

RESULTS: list[dict[str, Any]] = []


@pytest.fixture(scope="module")
def services(
    tmp_path_factory: pytest.TempPathFactory, model_dir: Path
) -> Iterator[dict[str, Served]]:
    out = {
        dtype: start_served(tmp_path_factory.mktemp(f"matrix-{dtype}"), model_dir, dtype=dtype)
        for dtype in ("bfloat16", "float16")
    }
    yield out
    for s in out.values():
        s.server.stop()
    path = Path("test-artifacts") / "parity-matrix.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(RESULTS, indent=1))


@pytest.mark.parametrize("setup", SETUPS, ids=[re.sub(r"\W+", "-", s.name) for s in SETUPS])
def test_parity_matrix(setup: Setup, services: dict[str, Served], model_dir: Path) -> None:
    served = services[setup.service]
    urls = [served.server.http_url, served.server.grpc_url]
    try:
        RESULTS.append(run_setup(setup, urls, model_dir, served.weights[VERSION]))
    except Skipped as exc:
        pytest.skip(str(exc))
