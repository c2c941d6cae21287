"""One rank of tests/integration/test_parity_distributed.py (run as a process per rank).

``python -m tests.integration.parity_worker SETUPS RANK WORLD INIT_FILE URL MODEL_DIR WEIGHTS
OUT``: joins a gloo group and, for each of the comma-separated SETUPS in turn, loads the test
model with the weights of one published version as the setup says —
- ``ddp``: bfloat16 under DistributedDataParallel;
- ``fsdp2_mp``: float32 masters sharded with ``fully_shard(mp_policy=MixedPrecisionPolicy(
  param_dtype=bfloat16, reduce_dtype=float32))``, as verl's FSDP2 actor and torchtitan run;
- ``fsdp1_mp``: float32 masters under FSDP1 with ``MixedPrecision(param_dtype=bfloat16,
  buffer_dtype=bfloat16)``, a unit per decoder layer;
- ``fsdp2_fp32``: FSDP2 without a param_dtype; ``fsdp2_autocast``: that under
  ``torch.autocast(bfloat16)``; ``tp``: bfloat16 under torch's tensor parallelism —
enters ``trainer_numerics(model, like=the service's spec)``, scores its share of the samples
(every rank a different micro-batch), runs the backward and the parity canary. Writes to OUT,
as JSON per setup: tokens compared, tokens bitwise equal, max |Δ|, whether gradients arrived —
or the refusal's message.
"""

from __future__ import annotations

import json
import sys
import traceback
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from oldlogit import Client, Sequence
from oldlogit.parity import (
    InvariantNumericsError,
    NumericsMismatch,
    token_logprobs,
    trainer_numerics,
    verify,
)
from tests.parity_setups import left_padded

VERSION = 2
LENGTHS = (3, 9, 17, 30, 41, 64, 77, 90, 5, 12, 33, 70)


def samples(vocab: int) -> list[np.ndarray]:
    rng = np.random.default_rng(9)
    return [rng.integers(0, vocab, n).astype(np.int64) for n in LENGTHS]


def build(setup: str, model_dir: str, weights: dict[str, torch.Tensor]) -> torch.nn.Module:
    if setup == "ddp":
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
        model.load_state_dict({k: v.to(torch.bfloat16) for k, v in weights.items()})
        return torch.nn.parallel.DistributedDataParallel(model)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.load_state_dict({k: v.float() for k, v in weights.items()})
    if setup == "fsdp1_mp":
        return _fsdp1(model)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    if setup == "tp":
        return _tensor_parallel(model.to(torch.bfloat16), mesh)
    kw: dict[str, Any] = {"mesh": mesh}
    if setup == "fsdp2_mp":
        kw["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32
        )
    for layer in model.model.layers:
        fully_shard(layer, **kw)
    fully_shard(model, **kw)
    return model


def _fsdp1(model: torch.nn.Module) -> torch.nn.Module:
    """FSDP1 float32 masters, bfloat16 compute and buffers (``buffer_dtype`` re-casts inv_freq
    at every forward), one unit per decoder layer."""
    import functools

    from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

    layer = type(model.model.layers[0])
    return FullyShardedDataParallel(
        model,
        device_id=torch.device("cpu"),
        use_orig_params=True,
        auto_wrap_policy=functools.partial(
            transformer_auto_wrap_policy, transformer_layer_cls={layer}
        ),
        mixed_precision=MixedPrecision(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32, buffer_dtype=torch.bfloat16
        ),
    )


def _tensor_parallel(model: torch.nn.Module, mesh: Any) -> torch.nn.Module:
    """torch's tensor parallelism: column-parallel q/k/v and gate/up, row-parallel o/down."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    plan = {
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(),
    }
    for layer in model.model.layers:
        parallelize_module(layer, mesh, plan)
    return model


def run_setup(
    setup: str, rank: int, world: int, url: str, model_dir: str, weights_file: str
) -> dict[str, Any]:
    """One setup on this rank: what it saw (see the module docstring)."""
    seen: dict[str, Any] = {"rank": rank, "setup": setup}
    model = build(setup, model_dir, load_file(weights_file))
    model.train()
    with Client(url, timeout_s=120) as client:
        spec = client.info().numerics_spec()
        vocab = client.info().vocab_size
        mine = samples(vocab)[rank::world]  # every rank its own micro-batch
        served = client.logprobs_batch(
            [Sequence(token_ids=s, policy_version=VERSION, score_from=1) for s in mine],
            use_cache=False,
        )
    ids, mask = left_padded(mine)
    width = ids.shape[1]
    around = (
        torch.autocast("cpu", dtype=torch.bfloat16)
        if setup == "fsdp2_autocast"
        else torch.autocast("cpu", enabled=False)
    )
    try:
        with trainer_numerics(model, like=spec), around:
            out_lp = token_logprobs(model, ids, mask)  # [b, T], with autograd
            (out_lp * mask).sum().backward()
    except (NumericsMismatch, InvariantNumericsError) as exc:
        seen["refused"] = str(exc)
        return seen
    equal = total = 0
    max_abs = 0.0
    for i, (s, res) in enumerate(zip(mine, served, strict=True)):
        got = out_lp[i, width - len(s) + 1 :].detach().float().numpy()
        want = res.logprobs[1:]
        equal += int(np.sum(got == want))
        total += got.size
        max_abs = max(max_abs, float(np.max(np.abs(got - want))))
    seen.update(tokens=total, equal=equal, max_abs=max_abs)
    # Parameters this rank holds elements of (FSDP1 leaves the others empty here).
    local = [p for p in model.parameters() if p.numel() > 0]
    seen["grads"] = sum(p.grad is not None for p in local)
    seen["params"] = len(local)
    # The canary on every rank: weights gathered from the shards and matched by their hash as
    # published (float32 masters cast to the serving dtype), then scored.
    with Client(url, timeout_s=120) as client:
        seen["verified_tokens"] = verify(model, client, VERSION).tokens
    return seen


def main(
    setups: list[str],
    rank: int,
    world: int,
    init_file: str,
    url: str,
    model_dir: str,
    weights_file: str,
    out: str,
) -> None:
    """Every setup in turn in one process group (one process start per rank for all)."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    results: dict[str, Any] = {}
    try:
        for setup in setups:
            try:
                results[setup] = run_setup(setup, rank, world, url, model_dir, weights_file)
            except Exception:
                results[setup] = {"rank": rank, "setup": setup, "error": traceback.format_exc()}
            dist.barrier()
    finally:
        with open(out, "w") as f:
            json.dump(results, f)
        dist.destroy_process_group()


if __name__ == "__main__":
    a = sys.argv[1:]
    main(a[0].split(","), int(a[1]), int(a[2]), a[3], a[4], a[5], a[6], a[7])
