"""The parity matrix with the trainer on the OLDEST transformers the ``trainer`` extra accepts.

The service runs this environment's transformers (the newest of the range); the trainer side
of every row of tests/parity_setups.py runs in ``.venv-verl`` (scripts/trainer_venv.sh:
transformers 5.5.3, verl's pin) as a subprocess. Every row must come out as it does here:
bitwise on every scored token with the same gradients, or refused by name — so a trainer on one
release and a service on another give the same bits (liger-kernel is not installed there; its
row is skipped). Skipped without ``.venv-verl``. MoE routing replay too: a trainer there
replaying a routing record (``tests/integration/routing_worker.py``) gets the service's bits for
each MoE family (``slow``). Every family's config fields and attention windows read the same on
both releases, and transformers' own tensor parallelism is refused there too (``slow``).
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from safetensors.torch import save_file

from tests.architectures import MOE, VOCAB
from tests.architectures import model_dir as arch_dir
from tests.integration.conftest import Served, start_served
from tests.parity_setups import SETUPS, VERSION

pytestmark = pytest.mark.verl
REPO = Path(__file__).resolve().parents[2]
OLD_PYTHON = REPO / ".venv-verl" / "bin" / "python"


@pytest.fixture(scope="module")
def services(
    tmp_path_factory: pytest.TempPathFactory, model_dir: Path
) -> Iterator[dict[str, Served]]:
    if not OLD_PYTHON.exists():
        pytest.skip(".venv-verl is missing: run scripts/trainer_venv.sh (CI does)")
    out = {
        dtype: start_served(tmp_path_factory.mktemp(f"oldest-{dtype}"), model_dir, dtype=dtype)
        for dtype in ("bfloat16", "float16")
    }
    yield out
    for s in out.values():
        s.server.stop()


def test_every_row_holds_with_the_oldest_transformers(
    services: dict[str, Served], model_dir: Path, tmp_path: Path
) -> None:
    spec = {}
    for dtype, served in services.items():
        path = tmp_path / f"{dtype}.safetensors"
        save_file({k: v.contiguous() for k, v in served.weights[VERSION].items()}, str(path))
        spec[dtype] = {
            "urls": [served.server.http_url, served.server.grpc_url],
            "weights": str(path),
        }
    out = tmp_path / "rows.json"
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "OMP_NUM_THREADS": str(torch.get_num_threads()),  # the service's: part of the numerics
        "PYTHONWARNINGS": "ignore",
    }
    cmd = [str(OLD_PYTHON), "-m", "tests.parity_setups", json.dumps(spec), str(model_dir)]
    proc = subprocess.run(
        [*cmd, str(out)], cwd=REPO, env=env, capture_output=True, text=True, timeout=400
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    seen = json.loads(out.read_text())
    assert seen["transformers"] == "5.5.3" != transformers.__version__
    rows = {r["setup"]: r for r in seen["rows"]}
    assert set(rows) == {s.name for s in SETUPS}
    for setup in SETUPS:
        row = rows[setup.name]
        if row["result"] == "skipped":
            assert "liger" in setup.name, row  # only liger-kernel is absent there
            continue
        expected = "refused" if setup.refused else "bitwise"
        assert row["result"] == expected, f"{setup.name}: {row.get('message', row)}"
        if expected == "bitwise":
            assert row["tokens"] > 900 and row["max_abs"] == 0.0


# `slow` (~9 s on 2 cores): the default run replays routing records bitwise on this release
# (tests/unit/test_routing_replay.py, tests/integration/test_routing_served.py).
@pytest.mark.slow
def test_routing_replay_holds_with_the_oldest_transformers(tmp_path: Path) -> None:
    """The engine here (transformers of this environment) and a trainer on 5.5.3 replay one
    routing record — partial, with −1 rows — to the same bits, for every MoE family."""
    if not OLD_PYTHON.exists():
        pytest.skip(".venv-verl is missing: run scripts/trainer_venv.sh (CI does)")
    from oldlogit_service.model.checkpoints import load_weights
    from oldlogit_service.model.engine import Engine, Job
    from oldlogit_service.model.loaded import load_model

    gen = torch.Generator().manual_seed(11)
    lengths = (7, 13)
    t_max = max(lengths)
    spec: dict[str, object] = {"tile_rows": 16, "families": {}}
    served: dict[str, list[torch.Tensor]] = {}
    for arch in MOE:
        hub = arch_dir(tmp_path / arch, arch)
        model = load_model(hub, dtype="float32", device="cpu", tile_rows=16)
        weights = load_weights(hub, model)
        assert weights is not None
        engine = Engine(model)
        assert engine.moe is not None
        layers, k, experts = len(engine.moe.layers), engine.moe.top_k, engine.moe.num_experts
        ids = torch.zeros(len(lengths), t_max, dtype=torch.long)
        mask = torch.zeros_like(ids)
        routed = torch.full((len(lengths), t_max, layers, k), -1, dtype=torch.long)
        jobs = []
        for b, n in enumerate(lengths):
            seq = torch.randint(3, VOCAB, (n,), generator=gen)
            rec = torch.stack(
                [torch.randperm(experts, generator=gen)[:k] for _ in range(n * layers)]
            ).view(n, layers, k)
            rec[2] = -1  # position 2 routes freely
            ids[b, t_max - n :], mask[b, t_max - n :], routed[b, t_max - n :] = seq, 1, rec
            jobs.append(Job(seq, torch.arange(1, n), routing=rec))
        served[arch] = engine.run(weights, jobs)
        spec["families"][arch] = {  # type: ignore[index]
            "dir": str(hub),
            "input_ids": ids.tolist(),
            "attention_mask": mask.tolist(),
            "routed_experts": routed.tolist(),
        }
    spec_path, out = tmp_path / "spec.json", tmp_path / "out.json"
    spec_path.write_text(json.dumps(spec))
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "OMP_NUM_THREADS": str(torch.get_num_threads()),
        "PYTHONWARNINGS": "ignore",
    }
    cmd = [str(OLD_PYTHON), "-m", "tests.integration.routing_worker", str(spec_path), str(out)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    seen = json.loads(out.read_text())
    assert seen["transformers"] == "5.5.3" != transformers.__version__
    for arch in MOE:
        raw = bytes.fromhex(seen["families"][arch])
        trainer = torch.frombuffer(bytearray(raw), dtype=torch.float32).view(len(lengths), t_max)
        for b, n in enumerate(lengths):
            assert torch.equal(trainer[b, t_max - n + 1 :], served[arch][b]), (arch, b)


@pytest.mark.slow  # two ranks on the oldest release: ~10 s on 2 cores (the newest: tp_worker)
def test_transformers_own_tensor_parallelism_is_refused_on_the_oldest_transformers(
    model_dir: Path, tmp_path: Path
) -> None:
    """transformers 5.5.3 splits a ``tp_plan="auto"`` model into plain local shards with hooks
    that all-reduce (nothing on a weight says it is split; measured: bits off by up to 0.13
    against one device). Two ranks there: refused by name, with and without tp_chunks."""
    if not OLD_PYTHON.exists():
        pytest.skip(".venv-verl is missing: run scripts/trainer_venv.sh (CI does)")
    from tests.integration.conftest import run_ranks

    def argv(rank: int) -> list[str]:
        out = str(tmp_path / f"rank{rank}.pt")
        return ["hf-tp-plan", str(rank), "2", str(tmp_path / "init"), str(model_dir), out]

    ranks = run_ranks(
        "tests.integration.tp_worker", argv, 2, threads="1", timeout_s=300, python=str(OLD_PYTHON)
    )
    for rank, (code, log) in enumerate(ranks):
        assert code == 0, log[-4000:]
        said = torch.load(tmp_path / f"rank{rank}.pt")["hf_tp_plan"]
        assert len(said) == 2
        for message in said:
            assert "transformers' own tensor parallelism" in message, message
            assert "parallelize_module" in message, message


def _on_oldest(tmp_path: Path, imports: str, expr: str) -> Any:
    """``expr`` evaluated in .venv-verl (the oldest transformers of the trainer extra), as
    JSON."""
    if not OLD_PYTHON.exists():
        pytest.skip(".venv-verl is missing: run scripts/trainer_venv.sh (CI does)")
    out = tmp_path / "oldest.json"
    script = f"import json, sys\n{imports}\njson.dump({expr}, open(sys.argv[1], 'w'))\n"
    env = {**os.environ, "PYTHONPATH": f"{REPO}:{REPO / 'client'}", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(
        [str(OLD_PYTHON), "-c", script, str(out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def read_on_oldest(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """What the two tests below compare, read in one .venv-verl process (one interpreter start
    with torch and transformers, not one each): every family's ``config_fields`` and
    ``attention_windows`` on the oldest release."""
    return dict(
        _on_oldest(
            tmp_path_factory.mktemp("oldest-reads"),
            "from oldlogit.contract.numerics import config_fields\n"
            "from tests.architectures import ARCHS, attention_windows, config",
            "{'config_fields': {a: dict(config_fields(config(a))) for a in ARCHS},"
            " 'attention_windows': {a: attention_windows(a) for a in ARCHS}}",
        )
    )


# `slow` (one .venv-verl process for both, ~13 s on 2 cores): the default run has ``like=``
# accept the oldest release's reading of the default architecture in every parity row above.
@pytest.mark.slow
def test_the_config_fields_like_compares_read_the_same_on_both_releases(
    read_on_oldest: dict[str, Any],
) -> None:
    """``like=`` compares the config fields of ``CONFIG_FIELDS`` (``/v1/info``
    ``numerics_config``): a trainer on the oldest release must read every family's config as
    the service on the newest does, or it would be refused for nothing."""
    from oldlogit.contract.numerics import config_fields
    from tests.architectures import ARCHS, config

    old = read_on_oldest["config_fields"]
    for arch in ARCHS:
        here = dict(config_fields(config(arch)))
        assert here and old[arch] == here, (arch, old[arch], here)


@pytest.mark.slow  # with the test above
def test_every_layers_sliding_window_is_the_same_on_both_releases(
    read_on_oldest: dict[str, Any],
) -> None:
    """``like=`` holds each layer's attention to the window the service's model computed with
    (``/v1/info`` ``attention_windows``): every family's layers must compute with the same
    windows on the oldest release as on the newest, or a trainer would be refused for nothing.
    The families' configs set windows narrower than the sequences, per layer where they can."""
    from tests.architectures import ARCHS, attention_windows

    old = read_on_oldest["attention_windows"]
    windowed = 0
    for arch in ARCHS:
        here = attention_windows(arch)
        assert here and old[arch] == here, (arch, old[arch], here)
        windowed += any(w for _, w in here)
    assert windowed >= 7  # qwen2, qwen3, mistral, gemma2, gemma3_text, phi3, mixtral
