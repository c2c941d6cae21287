"""verl's own actor computes π_θ bitwise equal to the service's π_old; its PPO ratio is exactly 1.

A real verl 0.9.1 (``.venv-verl``, made by scripts/trainer_venv.sh: transformers 5.5.3, the
oldest release the ``trainer`` extra accepts) runs in a subprocess (tests/integration/
verl_worker.py): verl's actor ``TrainingWorker`` (FSDP2 ``FSDPEngineWithLMHead``, verl's
``ppo_loss``) on the weights the service publishes as version 2, patched with
``oldlogit.integrations.verl.patch_verl_engine``. For a float32 (``slow``) and a bfloat16
service (verl's default mixed precision: float32 masters, bfloat16 forward),
``use_remove_padding`` on and off, temperature 1 and 0.7, verl's ``compute_log_prob`` at
micro-batch sizes 1/2/3/6 and with dynamic batching equals ``compute_old_log_prob`` from the
service on every response token, bitwise; verl's policy update, handed those values as
``old_log_probs``, sees a ratio of exactly 1.0 on every token (and ``ppo_kl`` 0,
``pg_clipfrac`` 0); after its optimizer step π_θ has moved off the version. Also with two
processes (FSDP2 sharding the model over a gloo group of 2, each rank its share of the batch;
``slow``). verl's default activation checkpointing stays on (its recompute runs under the
parity numerics; transformers 5.5.3 checkpoints in the layer's ``__call__``). An engine built
with ``use_fused_kernels=True`` is refused, naming the option and its fix. verl's LoRA actor
(``lora_rank`` > 0) publishes its adapter over the version verl loaded
(``VerlEnginePatch.publish_adapter``, before and after an update): compute_log_prob is the
adapter version's π_old bitwise, the update's ratio exactly 1, the canary passes on the FSDP2
``PeftModel`` (``slow``, one and two ranks). Skipped without ``.venv-verl``.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import save_file

from tests.integration.conftest import WRITE_TOKEN, start_served

pytestmark = [pytest.mark.integration, pytest.mark.verl]
REPO = Path(__file__).resolve().parents[2]
VERL_PYTHON = REPO / ".venv-verl" / "bin" / "python"
WORKER = REPO / "tests" / "integration" / "verl_worker.py"
VERSION = 2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_workers(
    url: str, model_dir: Path, world: int, *, lora: bool = False
) -> list[dict[str, Any]]:
    """One verl worker process per rank (a gloo group of ``world``); each rank's result."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MASTER_", "VERL_"))}
    env.update(PYTHONPATH=str(REPO / "client"), PYTHONWARNINGS="ignore", RAY_DEDUP_LOGS="0")
    env.update(OLDLOGIT_VERL_LORA="1" if lora else "0", OLDLOGIT_VERL_TOKEN=WRITE_TOKEN)
    argv = [str(VERL_PYTHON), str(WORKER), url, str(model_dir), str(VERSION)]
    port = str(free_port())
    procs = [
        subprocess.Popen(
            [*argv, str(rank), str(world), port],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(world)
    ]
    results = []
    for proc in procs:
        try:
            log = proc.communicate(timeout=240)[0]
        except subprocess.TimeoutExpired:
            proc.kill()
            log = proc.communicate()[0]
        lines = [ln for ln in log.splitlines() if ln.startswith("RESULT ")]
        assert lines, f"verl worker exited {proc.returncode} without a result:\n{log[-4000:]}"
        result: dict[str, Any] = json.loads(lines[-1].removeprefix("RESULT "))
        assert "error" not in result, result["error"] + "\n" + log[-4000:]
        results.append(result)
    return results


@pytest.mark.skipif(
    not VERL_PYTHON.exists(),
    reason="needs .venv-verl (verl 0.9.1 on transformers 5.5.3): run scripts/trainer_venv.sh",
)
@pytest.mark.parametrize(
    ("dtype", "world"),
    [
        # The default run keeps verl's default (float32 masters, a bfloat16 forward) on one
        # rank: ~20 s on 2 cores. A float32 service (~20 s) and two FSDP2 ranks (~40 s) are
        # `slow`; the default run has float32 trainers bitwise the service in-process
        # (tests/integration/test_trainer_parity.py) and shards over 2 ranks with DDP and FSDP2
        # (tests/integration/test_parity_distributed.py).
        pytest.param("float32", 1, marks=pytest.mark.slow),
        ("bfloat16", 1),
        pytest.param("bfloat16", 2, marks=pytest.mark.slow),
    ],
    ids=["float32", "bfloat16", "bfloat16-2ranks"],
)
def test_verl_actor_log_prob_is_the_service_pi_old(
    dtype: str, world: int, model_dir: Path, tmp_path: Path
) -> None:
    served = start_served(tmp_path, model_dir, dtype=dtype)
    try:
        # The trainer's weights at version 2, as a model directory verl loads.
        trainer_dir = tmp_path / "trainer"
        trainer_dir.mkdir()
        (trainer_dir / "config.json").write_text((model_dir / "config.json").read_text())
        weights = {k: v.contiguous() for k, v in served.weights[VERSION].items()}
        save_file(weights, str(trainer_dir / "model.safetensors"), metadata={"format": "pt"})
        results = run_workers(served.url("http"), trainer_dir, world)
    finally:
        served.server.stop()
    for result in results:
        check(f"{dtype} rank {result['rank']}/{world}", result)


@pytest.mark.skipif(
    not VERL_PYTHON.exists(),
    reason="needs .venv-verl (verl 0.9.1 on transformers 5.5.3): run scripts/trainer_venv.sh",
)
# One rank in the default run (~20 s on 2 cores): the only test of verl's adapter publishing
# (``VerlEnginePatch.publish_adapter``); two ranks are `slow`.
@pytest.mark.parametrize(
    "world", [1, pytest.param(2, marks=pytest.mark.slow)], ids=["1rank", "2ranks"]
)
def test_verl_lora_actor_publishes_adapters_pi_theta_is_pi_old(
    world: int, model_dir: Path, tmp_path: Path
) -> None:
    """verl's LoRA actor (``lora_rank`` 4 over all linears, float32 masters, a bfloat16
    forward): its adapter, published over the version verl loaded, is served bitwise equal
    to compute_log_prob, and verl's update sees a ratio of exactly 1."""
    served = start_served(tmp_path, model_dir, dtype="bfloat16")
    try:
        trainer_dir = tmp_path / "trainer"
        trainer_dir.mkdir()
        (trainer_dir / "config.json").write_text((model_dir / "config.json").read_text())
        weights = {k: v.contiguous() for k, v in served.weights[VERSION].items()}
        save_file(weights, str(trainer_dir / "model.safetensors"), metadata={"format": "pt"})
        results = run_workers(served.url("http"), trainer_dir, world, lora=True)
    finally:
        served.server.stop()
    for result in results:
        label = f"lora rank {result['rank']}/{world}"
        print(f"\n[{label}] seconds {result['seconds']}")
        first, second = result["adapters"]
        for entry in (first, second):
            assert entry["kind"] == "adapter"  # on every rank, once rank 0 has published
            for run in entry["compute_log_prob"]:
                print(f"[{label} v{entry['version']}] {run}")
                assert run["tokens"] > 0 and run["bitwise_equal"] == run["tokens"], run
            up = entry["update"]
            print(f"[{label} v{entry['version']}] update {up}")
            assert up["ratio_exactly_one"] == up["bitwise_equal"] == up["tokens"] > 0, up
            assert all(v == 0.0 for v in up["ppo_kl"]) and up["grad_norm"] > 0
            assert up["after_step"]["bitwise_equal"] < up["after_step"]["tokens"]
        # lora_B starts at 0 (the base's bits); after a step the adapter is a real term.
        assert first["vs_base"]["bitwise_equal"] == first["vs_base"]["tokens"]
        assert second["vs_base"]["bitwise_equal"] < second["vs_base"]["tokens"]
        assert second["verify_tokens"] > 100


def check(label: str, result: dict[str, Any]) -> None:
    print(f"\n[{label}] service numerics {result['service']['key']}")
    print(f"[{label}] verl numerics    {result['trainer_key']}")
    print(f"[{label}] seconds {result['seconds']}")
    cases = result["cases"]
    assert {(c["use_remove_padding"], c["temperature"]) for c in cases} == {
        (r, t) for r in (True, False) for t in (1.0, 0.7)
    }
    for own in result["unpatched"]:
        print(
            f"[{label} use_remove_padding={own['use_remove_padding']} T=0.7] verl's own "
            f"compute_log_prob (unpatched): {own['bitwise_equal']}/{own['tokens']} bitwise equal, "
            f"max |Δ| {own['max_abs_delta']:.3g}"
        )
    for case in cases:
        name = f"{label} use_remove_padding={case['use_remove_padding']} T={case['temperature']}"
        for run in case["compute_log_prob"]:
            print(
                f"[{name}] compute_log_prob {run['settings']}: {run['bitwise_equal']}/"
                f"{run['tokens']} bitwise equal, max |Δ| {run['max_abs_delta']:.3g}"
            )
            assert run["tokens"] > 0
            assert run["bitwise_equal"] == run["tokens"], (name, run)
            assert run["max_abs_delta"] == 0.0

    assert [u["use_remove_padding"] for u in result["updates"]] == [True, False]
    for up in result["updates"]:
        name = f"{label} use_remove_padding={up['use_remove_padding']} T={up['temperature']}"
        after = up["after_step"]
        print(
            f"[{name}] update_actor: {up['micro_batches']} micro-batches, ratio == 1 exactly on "
            f"{up['ratio_exactly_one']}/{up['tokens']} tokens (π_θ bitwise π_old on "
            f"{up['bitwise_equal']}), ppo_kl {up['ppo_kl']}, pg_clipfrac {up['pg_clipfrac']}, "
            f"grad_norm {up['grad_norm']:.4g}; after the step {after['bitwise_equal']}/"
            f"{after['tokens']} equal, max |Δ| {after['max_abs_delta']:.3g}"
        )
        assert up["micro_batches"] == 3  # 6 sequences, micro-batches of 2
        assert up["tokens"] > 0
        assert up["ratio_exactly_one"] == up["bitwise_equal"] == up["tokens"], (name, up)
        assert up["max_abs_delta"] == 0.0
        assert all(v == 0.0 for v in up["ppo_kl"]) and all(v == 0.0 for v in up["pg_clipfrac"])
        assert up["grad_norm"] > 0  # a real backward through the patched forward
        assert after["bitwise_equal"] < after["tokens"]  # the step moved π_θ off version 2

    assert result["restored"] == [True, True]  # restore() leaves verl's engine as it was

    for option, fix in (("fused_refusal", "use_fused_kernels=False"),):
        refusal = result[option]
        print(f"[{label}] {option}: {refusal}")
        assert refusal is not None and refusal.startswith("NumericsMismatch"), refusal
        assert fix in refusal  # names the option and says how to fix it
