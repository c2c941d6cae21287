"""verl's own actor against a live oldlogit service (run by tests/integration/test_verl_actor.py).

Runs in ``.venv-verl`` (scripts/trainer_venv.sh: verl 0.9.1, transformers 5.5.3), one process
per rank of a gloo group (world size 1, or more: then FSDP2 shards the model across the
processes and each rank holds its own share of the batch, as verl's dispatch gives it):

    .venv-verl/bin/python tests/integration/verl_worker.py URL MODEL_DIR VERSION [RANK WORLD PORT]

MODEL_DIR holds the weights the service publishes as VERSION. For ``use_remove_padding`` on and
off it builds verl's actor worker — ``ActorRolloutRefWorker(config, role="actor")`` from verl's
own PPO trainer config, ``init_model()``: a ``TrainingWorker`` over ``FSDPEngineWithLMHead``
(FSDP2) with verl's ``ppo_loss`` — on MODEL_DIR, patches it with
``oldlogit.integrations.verl.patch_verl_engine``, and on a verl rollout batch (prompts
left-padded, responses right-padded) at temperatures 1 and 0.7:
- runs the worker's ``compute_log_prob`` on the batch as verl's trainer converts it
  (``left_right_2_no_padding``) with several micro-batch sizes and dynamic batching, and compares
  each with the service's π_old (``compute_old_log_prob``);
- runs the worker's ``update_actor`` (forward, verl's PPO loss, backward, optimizer step) with
  ``old_log_probs`` = the service's values, recording the ratio verl's loss computes (a
  policy-loss mode registered with verl's own ``register_policy_loss`` wrapping
  ``compute_policy_loss_vanilla``).
Before patching, verl's own compute_log_prob is compared too (the control: not bitwise). Last,
an engine built with ``use_fused_kernels=True`` must be refused by the adapter. verl's default
activation checkpointing is on throughout. Prints one JSON line (prefixed ``RESULT ``) with
the counts.

verl 0.9.1 has no CPU platform: ``get_platform()`` falls back to 'nvidia' and the engine's
``forward_backward_batch`` calls ``get_device_id()`` = ``torch.cuda.current_device()``, which a
CPU torch refuses. A CPU platform is registered here through verl's own plugin API
(``PlatformRegistry.register`` / ``set_platform``), and the FSDP engine under device "cpu"
(``EngineRegistry.register``); verl's code runs unmodified.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
import traceback
from contextlib import nullcontext
from pathlib import Path
from typing import Any

RANK, WORLD = (int(sys.argv[4]), int(sys.argv[5])) if len(sys.argv) > 5 else (0, 1)
os.environ.update(
    RANK=str(RANK), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(RANK), LOCAL_WORLD_SIZE=str(WORLD)
)
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
if len(sys.argv) > 6:
    os.environ["MASTER_PORT"] = sys.argv[6]
elif "MASTER_PORT" not in os.environ:
    with socket.socket() as _s:
        _s.bind(("127.0.0.1", 0))
        os.environ["MASTER_PORT"] = str(_s.getsockname()[1])
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from verl.plugin.platform import PlatformBase, PlatformRegistry, set_platform  # noqa: E402


class _CpuDeviceModule:
    """What verl calls on ``get_torch_device()``: torch.cpu, memory figures as 0."""

    def __getattr__(self, name: str) -> Any:
        found = getattr(torch.cpu, name, None)
        return found if found is not None else (lambda *a, **k: 0)

    def current_device(self) -> str:
        return "cpu"

    def mem_get_info(self, *a: Any) -> tuple[int, int]:
        return (0, 0)

    def get_device_name(self, *a: Any) -> str:
        return "CPU"

    def is_available(self) -> bool:
        return True

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    manual_seed_all = manual_seed


@PlatformRegistry.register(platform="cpu")
class PlatformCPU(PlatformBase):
    device_name = property(lambda self: "cpu")  # type: ignore[assignment]
    vendor_name = property(lambda self: "cpu")  # type: ignore[assignment]
    device_module = property(lambda self: _CpuDeviceModule())  # type: ignore[assignment]

    def is_available(self) -> bool:
        return True

    def current_device(self) -> Any:
        return "cpu"

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        pass

    def synchronize(self, device_index: int | None = None) -> None:
        pass

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    manual_seed_all = manual_seed

    def set_allocator_settings(self, settings: str) -> None:
        pass

    def empty_cache(self) -> None:
        pass

    def get_device_capability(self, device_index: int = 0) -> tuple[None, None]:
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "CUDA_VISIBLE_DEVICES"

    def nvtx_range(self, msg: str) -> Any:
        return nullcontext()

    def profiler_start(self) -> None:
        pass

    def profiler_stop(self) -> None:
        pass

    def ray_resource_name(self) -> str:
        return "CPU"

    def ray_noset_envvars(self) -> list[str]:
        return []

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self) -> Any:
        return None


set_platform(PlatformCPU())  # before verl's engine modules read the device name at import

from omegaconf import OmegaConf  # noqa: E402
from verl import DataProto  # noqa: E402
from verl.trainer.ppo.core_algos import (  # noqa: E402
    compute_policy_loss_vanilla,
    register_policy_loss,
)
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.utils.model import compute_position_id_with_mask  # noqa: E402
from verl.workers.engine import EngineRegistry  # noqa: E402
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead  # noqa: E402
from verl.workers.engine_workers import ActorRolloutRefWorker  # noqa: E402
from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding  # noqa: E402

from oldlogit import Client  # noqa: E402
from oldlogit.integrations.verl import compute_old_log_prob, patch_verl_engine  # noqa: E402
from oldlogit.parity.numerics import active_patch  # noqa: E402

EngineRegistry.register(model_type="language_model", backend=["fsdp", "fsdp2"], device="cpu")(
    FSDPEngineWithLMHead
)

BATCH = 6  # sequences per rank, divisible by every micro-batch size below
MICRO_BATCH_SIZES = (1, 2, 3, 6)
TEMPERATURES = (1.0, 0.7)
SEEN: list[dict[str, torch.Tensor]] = []  # what verl's policy loss was handed


@register_policy_loss("oldlogit_recorded")  # type: ignore[arg-type]
def recorded_vanilla(old_log_prob: torch.Tensor, log_prob: torch.Tensor, *a: Any, **k: Any) -> Any:
    """verl's vanilla PPO loss, recording its inputs (the ratio is recomputed from them)."""
    mask = k.get("response_mask", a[1] if len(a) > 1 else None)
    SEEN.append({"old": old_log_prob.detach(), "new": log_prob.detach(), "mask": mask.detach()})
    return compute_policy_loss_vanilla(old_log_prob, log_prob, *a, **k)


def rollout_batch(seed: int, vocab: int, temperature: float) -> DataProto:
    """A verl rollout batch: prompts left-padded, responses right-padded, as verl's trainer
    holds it after generation (position_ids from the mask)."""
    gen = torch.Generator().manual_seed(seed)
    width_p, width_r = 24, 20
    prompts = torch.zeros(BATCH, width_p, dtype=torch.long)
    responses = torch.zeros(BATCH, width_r, dtype=torch.long)
    mask = torch.zeros(BATCH, width_p + width_r, dtype=torch.long)
    for i in range(BATCH):
        p = int(torch.randint(1, width_p + 1, (1,), generator=gen))
        r = int(torch.randint(1, width_r + 1, (1,), generator=gen))
        if i == 0:
            p, r = width_p, width_r  # one row without padding
        prompts[i, width_p - p :] = torch.randint(0, vocab, (p,), generator=gen)
        responses[i, :r] = torch.randint(0, vocab, (r,), generator=gen)
        mask[i, width_p - p : width_p + r] = 1
    input_ids = torch.cat([prompts, responses], dim=1)
    return DataProto.from_dict(
        tensors={
            "prompts": prompts,
            "responses": responses,
            "input_ids": input_ids,
            "attention_mask": mask,
            "position_ids": compute_position_id_with_mask(mask),
            "response_mask": mask[:, width_p:],
        },
        meta_info={"temperature": temperature},
    )


def build(
    model_dir: str, *, remove_padding: bool, dtype: str, fused: bool = False, lora_rank: int = 0
) -> Any:
    """verl's actor worker (``ActorRolloutRefWorker``, role "actor") from verl's own PPO trainer
    config (``_generated_ppo_trainer.yaml``: its defaults), with what this CPU test changes."""
    import verl

    root = OmegaConf.load(Path(verl.__file__).parent / "trainer/config/_generated_ppo_trainer.yaml")
    cfg = root.actor_rollout_ref
    model, actor, rollout = cfg.model, cfg.actor, cfg.rollout
    model.path = model_dir
    model.override_config = {"attn_implementation": "sdpa"}  # no flash-attn on CPU
    model.use_remove_padding = remove_padding
    model.use_fused_kernels = fused
    model.fused_kernel_options = {"impl_backend": "torch"} if fused else {}
    # LoRA: verl's get_peft_model over the loaded weights (target_modules: verl's all-linear).
    if lora_rank:
        model.lora_rank, model.lora_alpha = lora_rank, 2 * lora_rank
    # enable_gradient_checkpointing: verl's default (True), whose recompute runs under the
    # parity numerics (transformers 5.5.3 checkpoints in the layer's __call__).
    assert model.enable_gradient_checkpointing
    # verl's default strategy "fsdp" (FSDP1) cannot build on CPU: FSDP(sync_module_states=True)
    # requires the parameters on a GPU. FSDP2 (fully_shard) runs on CPU with gloo.
    actor.strategy = "fsdp2"
    # verl's default: float32 master weights (model_dtype fp32), the forward in
    # mixed_precision.param_dtype — bfloat16 unless set: the service's dtype decides here.
    if dtype == "float32":
        actor.fsdp_config.mixed_precision = {"param_dtype": "fp32", "reduce_dtype": "fp32"}
    actor.fsdp_config.use_torch_compile = False  # verl compiles its entropy: slow on CPU
    actor.ppo_mini_batch_size = BATCH * WORLD
    actor.ppo_micro_batch_size_per_gpu = 2
    actor.optim.lr = 1e-4
    actor.optim.total_training_steps = 4
    actor.policy_loss.loss_mode = "oldlogit_recorded"  # verl's vanilla loss, recording its inputs
    rollout.name = "vllm"  # required by the config; role "actor" builds no rollout
    rollout.n = 1
    rollout.log_prob_micro_batch_size_per_gpu = 2
    worker = ActorRolloutRefWorker(config=cfg, role="actor")
    worker.init_model()  # FSDP2 module, optimizer, verl's ppo_loss as the loss function
    return worker


def bitwise(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a.contiguous().view(torch.int32) == b.contiguous().view(torch.int32)


def compare(verl_lp: torch.Tensor, old: torch.Tensor, mask: torch.Tensor) -> dict[str, Any]:
    scored = mask.bool()
    equal = bitwise(verl_lp.float(), old.float()) & scored
    delta = (verl_lp.float() - old.float()).abs()[scored]
    return {
        "tokens": int(scored.sum()),
        "bitwise_equal": int(equal.sum()),
        "max_abs_delta": float(delta.max()) if delta.numel() else 0.0,
    }


def compute_log_prob(worker: Any, batch: DataProto, **settings: Any) -> torch.Tensor:
    """verl's trainer ``_compute_old_log_prob``: → no-padding TensorDict → the actor worker's
    ``compute_log_prob`` → back to [bs, R]."""
    td = left_right_2_no_padding(batch.to_tensordict())
    tu.assign_non_tensor(td, calculate_entropy=True, compute_loss=False, **settings)
    out = worker.compute_log_prob(td)
    return no_padding_2_padding(tu.get(out, "log_probs"), td).float()


def update_actor(worker: Any, batch: DataProto) -> dict[str, Any]:
    """verl's trainer ``_update_actor``: one mini-batch, one epoch, verl's PPO loss."""
    td = left_right_2_no_padding(batch.to_tensordict())
    tu.assign_non_tensor(
        td,
        calculate_entropy=False,
        global_batch_size=BATCH * WORLD,
        mini_batch_size=BATCH * WORLD,  # one mini-batch: the whole (global) batch
        epochs=1,
        seed=42,
        dataloader_kwargs={"shuffle": False},
        compute_loss=True,
    )
    out = worker.update_actor(td)
    return dict(tu.get(out, "metrics"))


def log_prob_runs(
    client: Any, worker: Any, version: int, vocab: int, temperature: float
) -> tuple[DataProto, torch.Tensor, list[dict[str, Any]]]:
    """verl's compute_log_prob at every micro-batching vs the service's π_old at ``version``."""
    seed = 17 + int(temperature * 10) + 100 * RANK  # each rank its own share of the batch
    batch = rollout_batch(seed=seed, vocab=vocab, temperature=temperature)
    served = compute_old_log_prob(client, batch, policy_version=version, temperature=temperature)
    old, mask = served["old_log_probs"], batch.batch["response_mask"]
    runs: list[dict[str, Any]] = [{"micro_batch_size_per_gpu": m} for m in MICRO_BATCH_SIZES]
    runs.append({"use_dynamic_bsz": True, "max_token_len_per_gpu": 96})
    out = []
    for settings in runs:
        verl_lp = compute_log_prob(worker, batch, **settings)
        out.append({"settings": settings, **compare(verl_lp, old, mask)})
    return batch, old.float(), out


def update_run(worker: Any, batch: DataProto, old: torch.Tensor) -> dict[str, Any]:
    """verl's policy update with the service's π_old as ``old_log_probs``; what its loss saw."""
    mask = batch.batch["response_mask"]
    gen = torch.Generator().manual_seed(5)
    batch.batch["old_log_probs"] = old
    batch.batch["advantages"] = torch.randn(mask.shape, generator=gen) * mask
    SEEN.clear()
    metrics = update_actor(worker, batch)
    seen_tokens = seen_one = bitwise_equal = 0
    max_delta = 0.0
    for rec in SEEN:
        m = rec["mask"].bool()
        # verl's own formula (compute_policy_loss_vanilla): exp(clamp(log_prob - old, ±20)).
        ratio = torch.exp(torch.clamp(rec["new"] - rec["old"], min=-20.0, max=20.0))[m]
        seen_tokens += int(m.sum())
        seen_one += int((ratio == 1.0).sum())
        bitwise_equal += int((bitwise(rec["new"], rec["old"]) & m).sum())
        delta = (rec["new"] - rec["old"]).abs()[m]
        max_delta = max(max_delta, float(delta.max()) if delta.numel() else 0.0)
    grad_norm = metrics.get("grad_norm", float("nan"))
    # After the optimizer step the weights are no longer the version's: π_θ moved off π_old.
    after = compare(compute_log_prob(worker, batch), old, mask)
    return {
        "temperature": batch.meta_info["temperature"],
        "micro_batches": len(SEEN),
        "tokens": seen_tokens,
        "ratio_exactly_one": seen_one,
        "bitwise_equal": bitwise_equal,
        "max_abs_delta": max_delta,
        "ppo_kl": [float(v) for v in metrics.get("actor/ppo_kl", [])],
        "pg_clipfrac": [float(v) for v in metrics.get("actor/pg_clipfrac", [])],
        "grad_norm": float(grad_norm[0] if isinstance(grad_norm, list) else grad_norm),
        "after_step": after,
    }


def main(url: str, model_dir: str, version: int) -> dict[str, Any]:
    result: dict[str, Any] = {"rank": RANK, "world": WORLD, "cases": [], "updates": []}
    result["unpatched"] = []
    start = time.perf_counter()
    timings: dict[str, float] = result.setdefault("seconds", {})

    def lap(name: str) -> None:
        timings[name] = round(time.perf_counter() - start - sum(timings.values()), 2)

    with Client(url, timeout_s=120) as client:
        info = client.info()
        torch.set_num_threads(info.threads)  # CPU numerics depend on the thread count
        spec = info.numerics_spec()
        result["service"] = {"dtype": info.dtype, "threads": info.threads, "key": spec.key}
        dist.init_process_group("gloo")
        vocab = 384
        for remove_padding in (True, False):
            worker = build(model_dir, remove_padding=remove_padding, dtype=info.dtype)
            lap(f"build rmpad={remove_padding}")
            # The control: verl's own log-probs, before the patch.
            batch = rollout_batch(seed=3 + 100 * RANK, vocab=vocab, temperature=0.7)
            served = compute_old_log_prob(client, batch, policy_version=version, temperature=0.7)
            own = compare(
                compute_log_prob(worker, batch),
                served["old_log_probs"],
                batch.batch["response_mask"],
            )
            result["unpatched"].append({"use_remove_padding": remove_padding, **own})
            lap(f"unpatched rmpad={remove_padding}")
            # version=: the parity canary on the engine at once (every rank), before any step.
            patch = patch_verl_engine(worker, client, version=version)
            result["trainer_key"] = patch.numerics.spec.key
            lap(f"patch rmpad={remove_padding}")
            batches = {}
            for temperature in TEMPERATURES:
                batch, old, runs = log_prob_runs(client, worker, version, vocab, temperature)
                batches[temperature] = (batch, old)
                result["cases"].append(
                    {
                        "use_remove_padding": remove_padding,
                        "temperature": temperature,
                        "compute_log_prob": runs,
                    }
                )
            # One update per engine (its optimizer step moves the weights off the version):
            # temperature 0.7 with use_remove_padding, 1 without.
            lap(f"compute_log_prob rmpad={remove_padding}")
            update_t = TEMPERATURES[1] if remove_padding else TEMPERATURES[0]
            update = update_run(worker, *batches[update_t])
            result["updates"].append({"use_remove_padding": remove_padding, **update})
            patch.restore()
            engine = worker.actor.engine
            result.setdefault("restored", []).append(
                active_patch(engine.module) is None
                and "prepare_model_outputs" not in vars(engine)
                and "prepare_model_inputs" not in vars(engine)
            )
            lap(f"update rmpad={remove_padding}")
        # Last (verl's fused-kernel patch replaces the model class's forward process-wide).
        worker = build(model_dir, remove_padding=True, dtype=info.dtype, fused=True)
        try:
            patch_verl_engine(worker, client)
            result["fused_refusal"] = None
        except Exception as exc:
            result["fused_refusal"] = f"{type(exc).__name__}: {exc}"
        lap("refusals")
    return result


def main_lora(url: str, model_dir: str, base: int) -> dict[str, Any]:
    """verl's LoRA actor (``lora_rank`` 4): its adapter published over ``base`` (the weights
    verl loaded) before and after an update; compute_log_prob and the update's ratio against
    the service's π_old at each adapter version; the canary on the second."""
    result: dict[str, Any] = {"rank": RANK, "world": WORLD, "adapters": []}
    start = time.perf_counter()
    token = os.environ["OLDLOGIT_VERL_TOKEN"]  # the service's write token
    with Client(url, timeout_s=120, token=token) as client:
        info = client.info()
        torch.set_num_threads(info.threads)
        dist.init_process_group("gloo")
        worker = build(model_dir, remove_padding=True, dtype=info.dtype, lora_rank=4)
        patch = patch_verl_engine(worker, client)
        for step, version in enumerate((20, 21)):
            published = patch.publish_adapter(version, base_version=base)
            entry: dict[str, Any] = {"version": version, "kind": published.kind}
            if step == 1:
                entry["verify_tokens"] = patch.verify(version, temperature=0.7).tokens
            batch, old, runs = log_prob_runs(client, worker, version, 384, 0.7)
            entry["compute_log_prob"] = runs
            base_lp = compute_old_log_prob(client, batch, policy_version=base, temperature=0.7)
            entry["vs_base"] = compare(old, base_lp["old_log_probs"], batch.batch["response_mask"])
            entry["update"] = update_run(worker, batch, old)
            result["adapters"].append(entry)
        patch.restore()
    result["seconds"] = round(time.perf_counter() - start, 2)
    return result


if __name__ == "__main__":
    try:
        lora = os.environ.get("OLDLOGIT_VERL_LORA") == "1"
        out = (main_lora if lora else main)(sys.argv[1], sys.argv[2], int(sys.argv[3]))
    except Exception:
        out = {"error": traceback.format_exc()}
    print("RESULT " + json.dumps(out), flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()
