"""The engine with adapter jobs: several adapters and the bare weights in one packed forward,
each job's bits those of the job alone; the hf profile per sequence; fast mode refused."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from oldlogit.contract.errors import InvalidRequest
from oldlogit_service.model.engine import Engine, Job, LoraWeights


def _lora(model: Any, seed: int, rank: int, suffixes: tuple[str, ...]) -> LoraWeights:
    g = torch.Generator().manual_seed(seed)
    modules = sorted(
        n.removesuffix(".weight")
        for n in model.param_specs
        if n.endswith(tuple(f"{s}.weight" for s in suffixes))
    )
    tensors = {}
    for m in modules:
        out_f, in_f = model.param_specs[f"{m}.weight"][1]
        tensors[f"{m}.lora_A"] = torch.randn(rank, in_f, generator=g) * 0.3
        tensors[f"{m}.lora_B"] = torch.randn(out_f, rank, generator=g) * 0.3
    spec = {
        "rank": rank,
        "alpha": 2.0 * rank,
        "use_rslora": seed % 2 == 1,
        "target_modules": modules,
        "dtype": "float32",
    }
    return LoraWeights(f"{seed:064x}", spec, tensors)


def test_adapters_and_the_bare_weights_share_one_forward(tiny_loaded_factory: Any) -> None:
    model, weights = tiny_loaded_factory()
    a = _lora(model, 1, 4, ("q_proj", "v_proj"))
    b = _lora(model, 2, 2, ("o_proj", "down_proj"))
    x = torch.arange(3, 40, dtype=torch.int64)
    y = torch.arange(7, 20, dtype=torch.int64)
    pos_x, pos_y = torch.arange(1, 37), torch.arange(1, 13)
    jobs = [
        Job(x, pos_x, adapter=a),
        Job(y, pos_y, adapter=b),
        Job(x, pos_x),
        Job(x, pos_x, adapter=b),
        Job(x.clone(), pos_x, adapter=a),  # the same sequence and adapter: one group
    ]
    engine = Engine(model)
    decoder = model.module.get_decoder()
    calls: list[tuple[int, ...]] = []

    def hook(m: torch.nn.Module, _a: object, kw: dict[str, Any]) -> None:
        stand_in = getattr(m.__dict__.get("forward"), "__qualname__", "")
        if not stand_in.endswith("<locals>.answer"):
            calls.append(tuple(kw["input_ids"].shape))

    handle = decoder.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        together = engine.run(weights, jobs)
    finally:
        handle.remove()
    assert calls == [(1, 37 + 13 + 37 + 37)]  # one packed forward; x under a counted once
    alone = [engine.run(weights, [job])[0] for job in jobs]
    for i, (t, s) in enumerate(zip(together, alone, strict=True)):
        assert torch.equal(t, s), i
    assert not torch.equal(together[0], together[2]) and not torch.equal(together[0], together[3])
    assert torch.equal(together[0], together[4])


def test_hf_profile_per_sequence_and_fast_mode_refused(tiny_loaded_factory: Any) -> None:
    model, weights = tiny_loaded_factory(numerics="hf")
    a = _lora(model, 3, 4, ("q_proj",))
    x = torch.arange(3, 30, dtype=torch.int64)
    pos = torch.arange(1, 27)
    engine = Engine(model)
    both = engine.run(weights, [Job(x, pos, adapter=a), Job(x, pos)])
    assert torch.equal(both[0], engine.run(weights, [Job(x, pos, adapter=a)])[0])
    assert not torch.equal(both[0], both[1])
    with pytest.raises(InvalidRequest, match="fast"):
        Engine(model, mode="fast").run(weights, [Job(x, pos, adapter=a)])
