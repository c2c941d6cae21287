"""One rank of tests/integration/test_tensor_parallel_numerics.py (run as a process per rank).

``python -m tests.integration.tp_worker RANK WORLD INIT_FILE MODEL_DIR DTYPE OUT TIED_DIR URLS``:
joins a gloo group of WORLD ranks (one CPU thread each) and, on this rank's shard of the same
weights, computes under the tensor-parallel definition (``tp_chunks=8``):
- ``trainer``: the model split by torch's ``parallelize_module`` over a 1-D device mesh (the
  vocabulary-split embedding, column-parallel q/k/v, gate/up and head, row-parallel o/down:
  torchtitan's plan) under ``trainer_numerics(model, tp_chunks=8)``: ``token_logprobs`` of a
  left-padded batch, raw and processed (temperature, top-k, top-p), then a backward;
  ``trainer_local_head``: the same with the head's output left split (``use_local_output``:
  each rank holds its vocabulary slice of the logits); ``fsdp_tp``: FSDP2 over the ``dp``
  dimension of a (WORLD/2 × 2) mesh on that model split at TP 2 over ``tp``;
- ``engine``: the service's engine on the skeleton with this rank's shards
  (``tensor_parallel.shard_rules`` / ``shard_weight``) under ``tensor_parallel.use``;
  ``engine_tied``: that for TIED_DIR's model, whose head is its (replicated) embedding;
- ``served``: the TP trainer takes an optimizer-like step, publishes its TP-sharded DTensor
  state from every rank (``publish_sharded``) as version 20 + WORLD to each ``--tp-chunks 8``
  service of URLS (comma-separated: one device, and a service at ``--tensor-parallel 2``),
  and compares its own π (under ``like=`` that service's spec) with each one's answer.
Writes OUT (``torch.save``): the logprobs of each, and whether every parameter got a gradient.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

TOKENS = ((3, 17, 40, 41, 64, 70), 9)  # sequence lengths, seed


def samples(vocab: int) -> list[torch.Tensor]:
    lengths, seed = TOKENS
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen) for n in lengths]


def left_padded(seqs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, width - len(s) :] = s
        mask[i, width - len(s) :] = 1
    return ids, mask


PROCESSED: dict[str, Any] = {"temperature": 0.7, "top_k": 20, "top_p": 0.9}


def trainer_logprobs(
    model: torch.nn.Module, vocab: int, multiple: int = 1
) -> dict[str, torch.Tensor]:
    """Raw and processed π of the samples, then a backward of their sum. ``multiple``: the
    batch left-padded to a length it divides (sequence parallelism splits the sequence
    dimension evenly; torch's collectives fail on uneven splits), the extra columns dropped
    from the answers."""
    from oldlogit.parity import token_logprobs, trainer_numerics

    ids, mask = left_padded(samples(vocab))
    extra = -ids.shape[1] % multiple
    ids = torch.cat([ids.new_zeros(ids.shape[0], extra), ids], dim=1)
    mask = torch.cat([mask.new_zeros(mask.shape[0], extra), mask], dim=1)
    with trainer_numerics(model, tp_chunks=8):
        with torch.no_grad():
            raw = token_logprobs(model, ids, mask)
            processed = token_logprobs(model, ids, mask, **PROCESSED)
        model.zero_grad()
        again = token_logprobs(model, ids, mask)
        again.sum().backward()
    grads = sum(p.grad is not None for p in model.parameters())
    params = sum(1 for _ in model.parameters())
    assert torch.equal(again.detach(), raw), "the graph-recording forward gave other bits"
    raw, processed = raw[:, extra:], processed[:, extra:]
    return {"raw": raw, "processed": processed, "grads": torch.tensor([grads, params])}


def served(
    model: torch.nn.Module, vocab: int, urls: list[str], version: int
) -> dict[str, torch.Tensor]:
    """Step, publish from the shards to every service, and compare π with each one's answer:
    [tokens equal, tokens compared] per service."""
    import numpy as np

    from oldlogit import Client, Sequence
    from oldlogit.integrations import publish_sharded
    from oldlogit.parity import token_logprobs, trainer_numerics
    from tests.integration.conftest import WRITE_TOKEN
    from tests.integration.multirank_worker import nudge_

    with torch.no_grad():
        for p in model.parameters():
            nudge_(p)  # elementwise: the same on a shard as on the whole tensor
    seqs = samples(vocab)
    ids, mask = left_padded(seqs)
    width = ids.shape[1]
    counts = []
    for url in urls:
        with Client(url, token=WRITE_TOKEN, timeout_s=120) as client:
            publish_sharded(client, version, model.state_dict())
            spec = client.info().numerics_spec()
            answers = client.logprobs_batch(
                [Sequence(token_ids=s.numpy(), policy_version=version, score_from=1) for s in seqs],
                use_cache=False,
            )
        with trainer_numerics(model, like=spec), torch.no_grad():
            mine = token_logprobs(model, ids, mask)
        equal = total = 0
        for i, (s, res) in enumerate(zip(seqs, answers, strict=True)):
            got = mine[i, width - len(s) + 1 :].float().numpy()
            equal += int(np.sum(got == res.logprobs[1:]))
            total += got.size
        counts.append([equal, total])
    return {"served": torch.tensor(counts)}


def engine_logprobs(model_dir: str, dtype: str, tp: Any) -> dict[str, torch.Tensor]:
    """The service's engine on this rank's shards: every sample, raw and processed."""
    from safetensors.torch import load_file

    from oldlogit.parity import SamplingParams, tensor_parallel
    from oldlogit_service.model.engine import Engine, Job
    from oldlogit_service.model.loaded import load_model

    loaded = load_model(model_dir, dtype=dtype, device="cpu", tp_chunks=8)
    full = load_file(str(Path(model_dir) / "model.safetensors"))
    rules = tensor_parallel.shard_rules(loaded.module)
    shard = {
        name: tensor_parallel.shard_weight(
            name, full[name].to(loaded.dtype), tp.rank, tp.degree, rules
        )
        for name in loaded.param_specs
    }
    jobs = []
    for sampling in (SamplingParams(), SamplingParams(**PROCESSED)):
        for seq in samples(loaded.vocab_size):
            jobs.append(Job(seq, torch.arange(1, len(seq)), sampling))
    with tensor_parallel.use(tp):
        out = Engine(loaded).run(shard, jobs)
    return {"engine": torch.cat(out)}


def build_trainer(
    model_dir: str, dtype: str, mesh: Any, local_head: bool, sequence_parallel: bool = False
) -> torch.nn.Module:
    """torchtitan's plan; ``sequence_parallel``: its sequence-parallel form too (norms on
    sequence shards, row-parallel outputs reduce-scattered by sequence, the attention and MLP
    inputs gathered back)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
    seq = Shard(1) if sequence_parallel else Replicate()
    plan: dict[str, Any] = {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        "lm_head": ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1))
        if local_head
        else ColwiseParallel(input_layouts=seq, output_layouts=Replicate()),
    }
    if sequence_parallel:
        plan["model.norm"] = SequenceParallel()
    for i in range(len(model.model.layers)):
        p = f"model.layers.{i}."
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"):
            plan[p + name] = ColwiseParallel()
        plan[p + "self_attn.o_proj"] = RowwiseParallel(output_layouts=seq)
        plan[p + "mlp.gate_proj"] = ColwiseParallel()
        plan[p + "mlp.up_proj"] = ColwiseParallel()
        plan[p + "mlp.down_proj"] = RowwiseParallel(output_layouts=seq)
        if sequence_parallel:
            plan[p + "input_layernorm"] = SequenceParallel()
            plan[p + "post_attention_layernorm"] = SequenceParallel()
            plan[p + "self_attn"] = PrepareModuleInput(
                input_kwarg_layouts={"hidden_states": seq},
                desired_input_kwarg_layouts={"hidden_states": Replicate()},
            )
            plan[p + "mlp"] = PrepareModuleInput(
                input_layouts=(seq,), desired_input_layouts=(Replicate(),)
            )
    parallelize_module(model, mesh, plan)
    model.train()
    return model


def fsdp_over_tp(model_dir: str, dtype: str, world: int, vocab: int) -> dict[str, torch.Tensor]:
    """FSDP2 (``fully_shard`` over the ``dp`` dimension) on a TP 2 model of a 2-D mesh
    (world/2 × 2): the forward sees DTensors of the 1-D ``tp`` sub-mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from oldlogit.parity import token_logprobs, trainer_numerics

    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
    model = build_trainer(model_dir, dtype, mesh["tp"], False)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    ids, mask = left_padded(samples(vocab))
    with trainer_numerics(model, tp_chunks=8), torch.no_grad():
        return {"fsdp_tp.raw": token_logprobs(model, ids, mask)}


def transformers_tp_refusals(model_dir: str, dtype: str, mesh: Any) -> list[str]:
    """The model split by transformers' own tensor parallelism (``tp_plan="auto"``) under
    trainer_numerics, with and without tp_chunks: what each refusal says ("" if it ran)."""
    import transformers

    from oldlogit.parity import InvariantNumericsError, trainer_numerics

    # transformers reads the ranks from the launcher's variables (torchrun sets them).
    rank, world = dist.get_rank(), dist.get_world_size()
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=getattr(torch, dtype), tp_plan="auto", device_mesh=mesh
    )
    said = []
    for kw in ({"tp_chunks": 8}, {}):
        try:
            with trainer_numerics(model, **kw):
                pass
            said.append("")
        except InvariantNumericsError as e:
            said.append(str(e))
    return said


def main(argv: list[str]) -> None:
    rank, world, init_file, model_dir, dtype, out, tied_dir, urls = argv
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=int(rank), world_size=int(world)
    )
    from torch.distributed.device_mesh import init_device_mesh

    from oldlogit.parity import tensor_parallel

    mesh = init_device_mesh("cpu", (int(world),))
    tp = tensor_parallel.TensorParallel(dist.group.WORLD, int(rank), int(world))
    seen: dict[str, Any] = {}
    vocab = int(build_trainer(model_dir, dtype, mesh, False).config.vocab_size)
    for key, local_head, sp in (
        ("trainer", False, False),
        ("trainer_local_head", True, False),
        ("trainer_sequence_parallel", False, True),
    ):
        trainer = build_trainer(model_dir, dtype, mesh, local_head, sp)
        got = trainer_logprobs(trainer, vocab, int(world) if sp else 1)
        seen.update({f"{key}.{k}": v for k, v in got.items()})
    seen.update(engine_logprobs(model_dir, dtype, tp))
    seen["engine_tied"] = engine_logprobs(tied_dir, dtype, tp)["engine"]
    seen.update(fsdp_over_tp(model_dir, dtype, int(world), vocab))
    trainer = build_trainer(model_dir, dtype, mesh, False)
    seen.update(served(trainer, vocab, urls.split(","), 20 + int(world)))
    seen["hf_tp_plan"] = transformers_tp_refusals(model_dir, dtype, mesh)
    torch.save(seen, out)
    dist.barrier()
    dist.destroy_process_group()


def main_transformers_tp(argv: list[str]) -> None:
    """``hf-tp-plan RANK WORLD INIT_FILE MODEL_DIR OUT``: only ``transformers_tp_refusals``
    (tests/integration/test_parity_oldest_transformers.py runs it on the oldest transformers)."""
    rank, world, init_file, model_dir, out = argv
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=int(rank), world_size=int(world)
    )
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (int(world),))
    torch.save({"hf_tp_plan": transformers_tp_refusals(model_dir, "bfloat16", mesh)}, out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    if sys.argv[1] == "hf-tp-plan":
        main_transformers_tp(sys.argv[2:])
    else:
        main(sys.argv[1:])
