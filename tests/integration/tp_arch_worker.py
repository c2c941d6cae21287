"""One rank of tests/integration/test_tensor_parallel_architectures.py.

``python -m tests.integration.tp_arch_worker RANK WORLD INIT_FILE ROOT OUT ARCH…``: each
family's model (``ROOT/ARCH``, tests/architectures.py) split by torch's ``parallelize_module``
after the model's own tensor-parallel plan (its config's ``base_model_tp_plan``, translated
to torch's styles by ``torch_plan``), then ``token_logprobs`` under
``trainer_numerics(model, tp_chunks=8)``, raw and processed, and a backward; and the
service's engine on this rank's weight shards (``tp_worker.engine_logprobs``) for the families
its ranks serve. Saves {ARCH: {"raw", "processed", "grads"[, "engine"]}} to OUT.
"""

from __future__ import annotations

import fnmatch
import sys
from typing import Any

import torch
import torch.distributed as dist

PROCESSED = {"temperature": 0.8, "top_k": 20, "top_p": 0.9}
# Families the service's ranks refuse by name (their plan needs gathered projections).
RANKS_REFUSE = ("olmo2", "phi3")


def samples(vocab: int) -> torch.Tensor:
    return torch.randint(3, vocab, (3, 24), generator=torch.Generator().manual_seed(0))


def torch_plan(model: torch.nn.Module) -> dict[str, Any]:
    """The model's own plan (``base_model_tp_plan``) in torch's styles: "colwise" →
    ``ColwiseParallel``, "colwise_gather_output" → its output replicated, "rowwise" →
    ``RowwiseParallel``, "rowwise_split_input" → its input replicated (split locally); the
    head column-parallel with its logits replicated."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    styles = {
        "colwise": ColwiseParallel,
        "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
        "rowwise": RowwiseParallel,
        "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate()),
    }
    plan: dict[str, Any] = {"lm_head": ColwiseParallel(output_layouts=Replicate())}
    base = getattr(type(model.config), "base_model_tp_plan", None) or {}  # type: ignore[union-attr]
    for name, module in model.model.named_modules():  # type: ignore[union-attr, operator]
        for pattern, style in base.items():
            if isinstance(module, torch.nn.Linear) and fnmatch.fnmatchcase(name, pattern):
                plan[f"model.{name}"] = styles[style]()
    return plan


def logprobs(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Raw and processed π of ``samples`` under ``trainer_numerics(tp_chunks=8)``; the
    parameters a backward of the raw sum reached, and how many there are."""
    from oldlogit.parity import token_logprobs, trainer_numerics

    ids = samples(int(model.config.vocab_size))  # type: ignore[union-attr]
    with trainer_numerics(model, tp_chunks=8):
        raw = token_logprobs(model, ids, temperature=0.8)
        with torch.no_grad():
            processed = token_logprobs(model, ids, **PROCESSED)  # type: ignore[arg-type]
        raw.sum().backward()
    grads = sum(p.grad is not None for p in model.parameters())
    params = sum(1 for _ in model.parameters())
    return {
        "raw": raw.detach(),
        "processed": processed,
        "grads": torch.tensor([grads, params]),
    }


def main(argv: list[str]) -> None:
    rank, world, init_file, root, out, *archs = argv
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=int(rank), world_size=int(world)
    )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module
    from transformers import AutoModelForCausalLM

    mesh = init_device_mesh("cpu", (int(world),))
    from oldlogit.parity import tensor_parallel
    from tests.integration import tp_worker

    tp = tensor_parallel.TensorParallel(dist.group.WORLD, int(rank), int(world))
    seen: dict[str, dict[str, Any]] = {}
    for arch in archs:
        model = AutoModelForCausalLM.from_pretrained(f"{root}/{arch}", dtype=torch.float32)
        parallelize_module(model, mesh, torch_plan(model))
        seen[arch] = logprobs(model)
        if arch not in RANKS_REFUSE:  # the service's engine on this rank's plain shards
            seen[arch].update(tp_worker.engine_logprobs(f"{root}/{arch}", "float32", tp))
    torch.save(seen, out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
