"""LoRA adapter versions bitwise on both sides: a PEFT trainer under ``trainer_numerics`` and the
service's skeleton under ``serving_adapters`` (client/oldlogit/parity/lora.py).

Trainer side: ``peft.get_peft_model`` over a tiny Qwen2 / Llama, adapters given random lora_B
(PEFT starts it at 0, which would hide the adapter), π_θ from ``token_logprobs`` at micro-batches
1, 4 and 8, left or right padded, or packed. Service side: the model built from its config
(parameters on meta, the base version's weights bound per call, as the engine runs it), every
sequence packed into one forward, each sequence's rows under its adapter. Every scored token
must be equal (``torch.equal``); the base alone must not be (the adapter changes the answer).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor

from oldlogit.parity import (
    ActiveDropout,
    InvariantNumericsError,
    patch_numerics,
    token_logprobs,
    trainer_numerics,
)
from oldlogit.parity.lora import Adapter, adapter_from_peft, serving_adapters
from oldlogit.parity.skeleton import build_skeleton

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
LENGTHS = (5, 9, 17, 30, 41, 12, 66, 3)  # 8 sequences; one past a 64-row tile


def _config(arch: str) -> Any:
    common: dict[str, Any] = dict(
        vocab_size=100,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    if arch == "qwen2":
        return transformers.Qwen2Config(**common)
    return transformers.LlamaConfig(**common)


def _base(arch: str, dtype: torch.dtype, seed: int = 0) -> tuple[Any, dict[str, Tensor]]:
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(_config(arch), dtype=dtype)
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return model, weights


def _randomize(model: Any, seed: int) -> None:
    """Random lora_B (and lora_A) of every adapter: PEFT starts lora_B at 0."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_A." in name or ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)


def _peft(
    arch: str, dtype: torch.dtype, seed: int = 1, **lora: Any
) -> tuple[Any, dict[str, Tensor]]:
    model, weights = _base(arch, dtype)
    lora.setdefault("lora_dropout", 0.0)
    pm = peft.get_peft_model(model, peft.LoraConfig(**lora))
    _randomize(pm, seed)
    return pm, weights


def _samples(seed: int = 3) -> list[Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 100, (n,), generator=gen) for n in LENGTHS]


def _padded(seqs: Sequence[Tensor], left: bool) -> tuple[Tensor, Tensor]:
    width = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        span = slice(width - len(s), width) if left else slice(0, len(s))
        ids[i, span], mask[i, span] = s, 1
    return ids, mask


def _trainer(model: Any, seqs: Sequence[Tensor], size: int, layout: str) -> list[Tensor]:
    """π_θ of each sequence (its own tokens, [len]) at micro-batches of ``size``."""
    out: list[Tensor] = []
    with trainer_numerics(model):
        for i in range(0, len(seqs), size):
            chunk = seqs[i : i + size]
            if layout == "packed":
                ids = torch.cat(list(chunk))[None]
                pos = torch.cat([torch.arange(len(s)) for s in chunk])[None]
                row = token_logprobs(model, ids, position_ids=pos)[0]
                out.extend(torch.split(row, [len(s) for s in chunk]))
                continue
            ids, mask = _padded(chunk, left=layout == "left")
            lp = token_logprobs(model, ids, mask)
            out.extend(lp[b][mask[b].bool()] for b in range(len(chunk)))
    return [t.detach() for t in out]


_SKELETONS: dict[tuple[str, torch.dtype], Any] = {}


def _service(
    arch: str,
    dtype: torch.dtype,
    weights: dict[str, Tensor],
    seqs: Sequence[Tensor],
    adapters: Sequence[Adapter | None],
) -> list[Tensor]:
    """The service's answer: one packed forward of the skeleton with the base's weights bound,
    each sequence's rows under its adapter."""
    key = (arch, dtype)
    if key not in _SKELETONS:
        skeleton = build_skeleton(_config(arch), dtype)
        patch_numerics(skeleton)
        _SKELETONS[key] = skeleton
    skeleton = _SKELETONS[key]
    ids = torch.cat(list(seqs))[None]
    pos = torch.cat([torch.arange(len(s)) for s in seqs])[None]
    starts = [0]
    for s in seqs:
        starts.append(starts[-1] + len(s))
    rows = [(starts[i], starts[i + 1], a) for i, a in enumerate(adapters)]
    with torch.no_grad(), serving_adapters(skeleton, rows):
        lp = token_logprobs(skeleton, ids, position_ids=pos, weights=weights)[0]
    return list(torch.split(lp, [len(s) for s in seqs]))


def _off(mine: Sequence[Tensor], theirs: Sequence[Tensor]) -> int:
    return sum(int((a != b).sum()) for a, b in zip(mine, theirs, strict=True))


_SLOW = pytest.mark.slow
CASES = [
    # (arch, base dtype, targets, rank, rsLoRA, layout, the model cast to bf16 after wrapping)
    pytest.param("qwen2", torch.bfloat16, "all-linear", 64, True, "left", False),
    pytest.param("llama", torch.float32, ATTENTION, 8, False, "packed", True),
    pytest.param("qwen2", torch.float32, ATTENTION, 8, False, "right", False),
    pytest.param("llama", torch.bfloat16, ATTENTION, 64, False, "packed", False, marks=_SLOW),
    pytest.param("qwen2", torch.float32, "all-linear", 8, True, "left", True, marks=_SLOW),
]


def _case_id(c: Any) -> str:
    arch, dtype, targets, rank, rslora, layout, cast = c.values
    return (
        f"{arch}-{str(dtype)[6:]}-{'all' if targets == 'all-linear' else 'attn'}-r{rank}"
        f"{'-rslora' if rslora else ''}-{layout}{'-bf16cast' if cast else ''}"
    )


@pytest.mark.parametrize(
    ("arch", "dtype", "targets", "rank", "rslora", "layout", "cast"),
    CASES,
    ids=[_case_id(c) for c in CASES],
)
def test_peft_trainer_bitwise_with_service(
    arch: str,
    dtype: torch.dtype,
    targets: Any,
    rank: int,
    rslora: bool,
    layout: str,
    cast: bool,
) -> None:
    pm, weights = _peft(
        arch, dtype, r=rank, lora_alpha=2 * rank - 3, use_rslora=rslora, target_modules=targets
    )
    if cast:  # a module cast after get_peft_model: the adapters are bf16 too, and the base
        pm = pm.bfloat16()
        weights = {k: v.to(torch.bfloat16) for k, v in weights.items()}
        dtype = torch.bfloat16
    lora_dtypes = {p.dtype for n, p in pm.named_parameters() if ".lora_" in n}
    # PEFT keeps a bf16 base's adapters in float32 unless the model is cast after wrapping.
    assert lora_dtypes == {torch.bfloat16 if cast else torch.float32}
    adapter = adapter_from_peft(pm)
    assert adapter.spec.rank == rank and adapter.spec.use_rslora == rslora
    assert adapter.spec.dtype == str(lora_dtypes.pop())[6:]
    seqs = _samples()
    served = _service(arch, dtype, weights, seqs, [adapter] * len(seqs))
    for size in (1, 4, 8):
        mine = _trainer(pm, seqs, size, layout)
        assert _off(mine, served) == 0, (size, layout)
    base = _service(arch, dtype, weights, seqs, [None] * len(seqs))
    assert _off(mine, base) > 0  # the adapter changes the answer: the check can fail


def test_autocast_over_float32_masters_is_a_bf16_base_with_float32_adapters() -> None:
    """torch.autocast(bf16) over float32 masters: the patch casts the base for the forward and
    leaves the adapter in float32, the definition for a bf16 base version and that adapter."""
    pm, weights = _peft("qwen2", torch.float32, r=8, lora_alpha=16, target_modules="all-linear")
    seqs = _samples()[:4]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mine = _trainer(pm, seqs, 4, "left")
    adapter = adapter_from_peft(pm)
    assert adapter.spec.dtype == "float32"
    bf16 = {k: v.to(torch.bfloat16) for k, v in weights.items()}
    assert _off(mine, _service("qwen2", torch.bfloat16, bf16, seqs, [adapter] * 4)) == 0


def test_mixed_adapters_in_one_forward_each_bitwise_its_own() -> None:
    """16 adapters (ranks, targets, rsLoRA differ) and the base in one packed forward over a
    bf16 base: each sequence's rows are its own adapter's PEFT forward."""
    arch, dtype = "qwen2", torch.bfloat16
    model, weights = _base(arch, dtype)
    variants = [
        dict(r=r, lora_alpha=a, use_rslora=rs, target_modules=t)
        for r, a, rs, t in [
            (8, 16, False, ATTENTION),
            (4, 7, True, "all-linear"),
            (16, 16, False, ["down_proj", "up_proj"]),
            (2, 5, False, "all-linear"),
        ]
    ] * 4
    pm = peft.get_peft_model(model, peft.LoraConfig(lora_dropout=0.0, **variants[0]), "a0")
    for i, v in enumerate(variants[1:], 1):
        pm.add_adapter(f"a{i}", peft.LoraConfig(lora_dropout=0.0, **v))
    _randomize(pm, seed=7)
    gen = torch.Generator().manual_seed(11)
    seqs = [torch.randint(1, 100, (int(n),), generator=gen) for n in torch.randint(3, 40, (18,))]
    adapters: list[Adapter | None] = []
    expected: list[Tensor] = []
    for i, seq in enumerate(seqs):
        if i >= len(variants):  # the last two sequences: the base version alone
            adapters.append(None)
            with pm.disable_adapter():
                expected.extend(_trainer(pm, [seq], 1, "left"))
            continue
        pm.set_adapter(f"a{i}")
        adapters.append(adapter_from_peft(pm, adapter_name=f"a{i}"))
        expected.extend(_trainer(pm, [seq], 1, "left"))
    served = _service(arch, dtype, weights, seqs, adapters)
    for i, (mine, theirs) in enumerate(zip(expected, served, strict=True)):
        assert torch.equal(mine, theirs), i
    # The same adapter on every row gives other bits: each row group used its own.
    uniform = _service(arch, dtype, weights, seqs, [adapters[0]] * len(seqs))
    assert _off(expected[1:16], uniform[1:16]) > 0


def _step(model: Any, ids: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """The gradients of one patched step's masked sum of π_θ."""
    model.zero_grad()
    with trainer_numerics(model):
        loss: Any = (token_logprobs(model, ids, mask) * mask).sum()
        loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_gradients_reach_the_adapter_with_and_without_checkpointing() -> None:
    pm, _ = _peft("qwen2", torch.bfloat16, r=8, lora_alpha=16, target_modules="all-linear")
    pm.train()
    ids, mask = _padded(_samples()[:4], left=True)
    grads = _step(pm, ids, mask)
    assert grads and all(".lora_A." in n or ".lora_B." in n for n in grads)
    assert sum(".lora_A." in n for n in grads) == sum(".lora_B." in n for n in grads) == 14
    assert all(bool(g.abs().sum() > 0) for g in grads.values())
    assert not any(p.requires_grad for n, p in pm.named_parameters() if ".lora_" not in n)
    # Activation checkpointing (PEFT's recipe) recomputes under the numerics: the same grads.
    pm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    pm.enable_input_require_grads()
    recomputed = _step(pm, ids, mask)
    assert set(recomputed) == set(grads)
    assert all(torch.equal(recomputed[n], grads[n]) for n in grads)


def test_save_pretrained_round_trips(tmp_path: Path) -> None:
    pm, _ = _peft("llama", torch.float32, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    pm.save_pretrained(tmp_path)
    from_dir = adapter_from_peft(tmp_path)
    live = adapter_from_peft(pm)
    assert from_dir.spec == live.spec
    assert from_dir.spec.target_modules[0] == "model.layers.0.self_attn.q_proj"
    assert set(from_dir.tensors) == set(live.tensors)
    assert all(torch.equal(from_dir.tensors[k], live.tensors[k]) for k in live.tensors)


def test_lora_dropout_is_refused_in_training_and_bitwise_in_eval() -> None:
    pm, weights = _peft("qwen2", torch.float32, r=8, lora_alpha=8, target_modules=ATTENTION,
                        lora_dropout=0.1)  # fmt: skip
    seqs = _samples()[:2]
    pm.train()
    with pytest.raises(ActiveDropout, match=r"lora_dropout p=0\.1.*model\.eval\(\)"):
        _trainer(pm, seqs, 2, "left")
    pm.eval()
    served = _service("qwen2", torch.float32, weights, seqs, [adapter_from_peft(pm)] * 2)
    assert _off(_trainer(pm, seqs, 2, "left"), served) == 0


def test_peft_mixed_adapter_batch_is_refused_and_is_another_function() -> None:
    """PEFT's ``adapter_names=`` batch casts each adapter's output to the base dtype before
    adding: over a bf16 base its logits are not the single-adapter forward's."""
    pm, _ = _peft("qwen2", torch.bfloat16, r=8, lora_alpha=16, target_modules="all-linear")
    pm.eval()  # PEFT itself refuses adapter_names= in training
    ids, mask = _padded(_samples()[:2], left=True)
    with trainer_numerics(pm), pytest.raises(InvariantNumericsError, match="adapter_names="):
        pm(input_ids=ids, attention_mask=mask, adapter_names=["default", "__base__"])
    with trainer_numerics(pm, strict=False), torch.no_grad():
        mixed = pm(input_ids=ids, attention_mask=mask, adapter_names=["default"] * 2).logits
        single = pm(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()
    assert not torch.equal(mixed[real], single[real])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_sixteen_adapters_on_scattered_rows_each_bitwise_its_own(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """16 adapters each on several scattered row ranges (and two on adjacent ones), beside the
    base: the fast path (one lora_A and one lora_B call per adapter over its rows gathered,
    the terms added in place) runs, and each sequence's rows are its adapter's PEFT forward."""
    from oldlogit.parity import lora as lora_mod

    arch = "qwen2"
    model, weights = _base(arch, dtype)
    variants = [
        dict(r=r, lora_alpha=a, use_rslora=rs, target_modules=t)
        for r, a, rs, t in [
            (16, 32, False, "all-linear"),
            (4, 7, True, ATTENTION),
            (8, 16, False, "all-linear"),
            (2, 5, False, ["down_proj", "up_proj"]),
        ]
    ] * 4
    pm = peft.get_peft_model(model, peft.LoraConfig(lora_dropout=0.0, **variants[0]), "a0")
    for i, v in enumerate(variants[1:], 1):
        pm.add_adapter(f"a{i}", peft.LoraConfig(lora_dropout=0.0, **v))
    _randomize(pm, seed=5)
    found: dict[int, Adapter] = {}
    for k in range(16):
        pm.set_adapter(f"a{k}")
        found[k] = adapter_from_peft(pm, adapter_name=f"a{k}")
    gen = torch.Generator().manual_seed(13)
    # Sequence i: adapter i % 16; 32 and 33 both adapter 3 (adjacent ranges, joined); 34: base.
    which: list[int | None] = [i % 16 for i in range(32)] + [3, 3, None]
    seqs = [torch.randint(1, 100, (int(n),), generator=gen) for n in torch.randint(3, 70, (35,))]
    expected: list[Tensor] = []
    for seq, k in zip(seqs, which, strict=True):
        if k is None:
            with pm.disable_adapter():
                expected.extend(_trainer(pm, [seq], 1, "left"))
        else:
            pm.set_adapter(f"a{k}")
            expected.extend(_trainer(pm, [seq], 1, "left"))
    seen: list[int] = []  # ranges per adapter, over every call of the fast path
    real = lora_mod._add_terms

    def counted(flat: Tensor, flat_x: Tensor, plan: Any) -> None:
        seen.extend(len(spans) for *_, spans in plan)
        real(flat, flat_x, plan)

    monkeypatch.setattr(lora_mod, "_add_terms", counted)
    served = _service(arch, dtype, weights, seqs, [None if k is None else found[k] for k in which])
    # Each adapter's scattered ranges in one call: 2 each, adapter 3's 3 (32 and 33 joined).
    assert set(seen) == {2, 3}
    for i, (mine, theirs) in enumerate(zip(expected, served, strict=True)):
        assert torch.equal(mine, theirs), i
