"""LoRA adapters: the spec, the checks against a base, PEFT's formats, and every PEFT setup
``trainer_numerics`` refuses by name before a step runs (client/oldlogit/parity/lora.py,
client/oldlogit/parity/lora_trainer.py). The bitwise parity runs are
tests/integration/test_lora_parity.py."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
import torch
from torch import nn

from oldlogit.parity import InvariantNumericsError, lora_trainer, trainer_numerics
from oldlogit.parity.lora import (
    Adapter,
    LoraSpec,
    adapter_from_peft,
    check_adapter,
    serving_adapters,
)

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

Q = "model.layers.0.self_attn.q_proj"
V = "model.layers.0.self_attn.v_proj"


def _spec(**kw: Any) -> LoraSpec:
    base: dict[str, Any] = dict(
        rank=4, alpha=8.0, use_rslora=False, target_modules=(Q, V), dtype="float32"
    )
    return LoraSpec(**{**base, **kw})


def _adapter(spec: LoraSpec | None = None, **shapes: tuple[int, ...]) -> Adapter:
    spec = spec or _spec()
    tensors = {}
    for m in spec.target_modules:
        tensors[f"{m}.lora_A"] = torch.zeros(shapes.get("A", (spec.rank, 32)))
        tensors[f"{m}.lora_B"] = torch.zeros(shapes.get("B", (32, spec.rank)))
    return Adapter(spec, tensors)


BASE = {f"{Q}.weight": (32, 32), f"{V}.weight": (32, 32), "lm_head.weight": (100, 32)}


def test_spec_scaling_and_canonical_dict() -> None:
    assert _spec().scaling == 2.0
    assert _spec(use_rslora=True, alpha=7).scaling == 7 / math.sqrt(4)
    spec = _spec(alpha=16)
    data = spec.as_dict()
    assert LoraSpec.from_dict(json.loads(json.dumps(data))) == spec
    assert list(data) == sorted(data)  # canonical: json.dumps(sort_keys=True) hashes it
    with pytest.raises(ValueError, match="unknown keys \\['r'\\]"):
        LoraSpec.from_dict({**data, "r": 4})
    cases: list[tuple[dict[str, Any], str]] = [
        (dict(rank=0), "rank"),
        (dict(alpha=float("nan")), "alpha"),
        (dict(target_modules=(V, Q)), "sorted"),
        (dict(dtype="int8"), "dtype"),
        (dict(use_rslora=1), "use_rslora"),
    ]
    for bad, match in cases:
        with pytest.raises(ValueError, match=match):
            _spec(**bad)


def test_check_adapter_names_each_mismatch() -> None:
    check_adapter(_adapter(), BASE)
    cases: list[tuple[Adapter, str]] = [
        (_adapter(_spec(target_modules=(Q, V, "model.layers.1.nope"))), "1.nope.*has no"),
        (_adapter(A=(4, 16)), "lora_A is \\[4, 16\\]: in_features 16.*takes 32"),
        (_adapter(B=(8, 4)), "lora_B is \\[8, 4\\]: out_features 8.*gives 32"),
        (_adapter(A=(2, 32), B=(32, 2)), "rank: the config says 4"),
        (_adapter(_spec(dtype="bfloat16")), "dtype: the config says bfloat16"),
    ]
    for adapter, match in cases:
        with pytest.raises(ValueError, match=match):
            check_adapter(adapter, BASE)
    partial = dict(_adapter().tensors)
    del partial[f"{V}.lora_B"]
    with pytest.raises(ValueError, match=r"v_proj.lora_B' is missing"):
        check_adapter(Adapter(_spec(), partial), BASE)
    with pytest.raises(ValueError, match="not the lora_A/lora_B of a target"):
        check_adapter(Adapter(_spec(), {**partial, "x.lora_A": torch.zeros(1, 1)}), BASE)


def _peft_pair(**config: Any) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    prefix = "base_model.model."
    state = {
        f"{prefix}{Q}.lora_A.weight": torch.ones(4, 32),
        f"{prefix}{Q}.lora_B.weight": torch.ones(32, 4),
        f"{prefix}{V}.lora_A.weight": torch.ones(4, 32),
        f"{prefix}{V}.lora_B.weight": torch.ones(32, 4),
    }
    return state, {"peft_type": "LORA", "r": 4, "lora_alpha": 8, **config}


def test_adapter_from_a_state_dict_and_config() -> None:
    for targets in (["q_proj", "v_proj"], r".*\.(q|v)_proj", "all-linear", None):
        adapter = adapter_from_peft(_peft_pair(target_modules=targets))
        assert adapter.spec == _spec()
        check_adapter(adapter, BASE)
    state, config = _peft_pair(target_modules=["q_proj", "v_proj"])
    named = {k.replace(".weight", ".other.weight"): v for k, v in state.items()}
    assert adapter_from_peft((named, config), adapter_name="other").spec == _spec()
    bad: list[tuple[Any, str, str]] = [
        (_peft_pair(target_modules=["q_proj"]), "adapter_name", "v_proj holds tensors"),
        (_peft_pair(use_dora=True), "adapter_name", "DoRA"),
        (_peft_pair(rank_pattern={"q_proj": 8}), "adapter_name", "rank_pattern"),
        (_peft_pair(bias="all"), "adapter_name", "bias='all'"),
        (_peft_pair(peft_type="IA3"), "adapter_name", "IA3"),
        (_peft_pair(r=8), "adapter_name", "r=8"),
        (({**state, "base_model.model.lm_head.weight": torch.ones(1)}, config), "x", "lm_head"),
        ((named, config), "default", "no lora_A/lora_B tensors of adapter 'default'"),
        ("/nonexistent", "x", "adapter_config.json"),
        (42, "x", "source: a PeftModel"),
    ]
    for source, name, match in bad:
        kw = {} if name in ("x", "adapter_name") else {"adapter_name": name}
        with pytest.raises(ValueError, match=match):
            adapter_from_peft(source, **kw)


def test_serving_adapters_refuses_bad_rows() -> None:
    model = nn.Sequential()
    model.add_module("lin", nn.Linear(4, 4))
    spec = LoraSpec(2, 2.0, False, ("lin",), "float32")
    adapter = Adapter(spec, {"lin.lora_A": torch.ones(2, 4), "lin.lora_B": torch.ones(4, 2)})
    with (
        pytest.raises(ValueError, match="overlaps"),
        serving_adapters(model, [(0, 3, adapter), (2, 4, None)]),
    ):
        pass
    other = Adapter(LoraSpec(2, 2.0, False, ("nope",), "float32"), {})
    with (
        pytest.raises(ValueError, match="'nope' is not a linear"),
        serving_adapters(model, [(0, 1, other)]),
    ):
        pass
    x = torch.randn(3, 4)
    with serving_adapters(model, [(1, 2, adapter)]), torch.no_grad():
        y = model(x)
    with torch.no_grad():
        base = model(x)  # restored
        delta = (x[1:2] @ torch.ones(4, 2) @ torch.ones(2, 4)) * 1.0
    assert "forward" not in model.lin.__dict__
    assert torch.equal(y[0], base[0]) and torch.equal(y[2], base[2])
    assert torch.allclose(y[1:2], base[1:2] + delta)
    with serving_adapters(model, [(0, 9, adapter)]), pytest.raises(ValueError, match="beyond"):
        model(x)


# -- refused by name, before a step runs --------------------------------------------------------


def _tiny() -> Any:
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(
        vocab_size=100,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    return transformers.AutoModelForCausalLM.from_config(cfg)


def _lora(**kw: Any) -> Any:
    kw.setdefault("target_modules", ["q_proj", "v_proj"])
    return peft.get_peft_model(_tiny(), peft.LoraConfig(r=4, lora_dropout=0.0, **kw))


def _refused(model: Any, match: str) -> None:
    with pytest.raises(InvariantNumericsError, match=match), trainer_numerics(model):
        pass


def test_plain_lora_is_vouched_for() -> None:
    pm = _lora()
    core: Any = pm.base_model.model
    q_proj: Any = core.model.layers[0].self_attn.q_proj
    with trainer_numerics(pm) as patch:
        assert patch.model is core  # unwrapped to the transformers model
        assert "forward" in q_proj.__dict__  # checked at each call
    assert "forward" not in q_proj.__dict__


def test_refusals_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    _refused(_lora(use_dora=True), r"q_proj: DoRA \(use_dora=True\)")
    _refused(_lora(target_modules=["embed_tokens"]), "embed_tokens is LoRA on an embedding")
    _refused(_lora(target_modules=["lm_head"]), "lm_head is LoRA on the head")
    _refused(_lora(lora_bias=True), r"LoRA biases \(lora_bias=True\)")
    _refused(_lora(modules_to_save=["lm_head"]), "modules_to_save")
    _refused(_lora(trainable_token_indices=[1, 2]), "trainable_token_indices")
    two = _lora()
    two.add_adapter("other", peft.LoraConfig(r=4, target_modules=["q_proj"]))
    two.base_model.set_adapter(["default", "other"])
    _refused(two, "several active")
    merged = _lora()
    merged.merge_adapter()
    _refused(merged, r"merged adapters \['default'\].*unmerge")
    fan = _lora()
    fan.base_model.model.model.layers[0].self_attn.q_proj.fan_in_fan_out = True
    _refused(fan, "fan_in_fan_out=True")

    quantized = _lora()
    base = quantized.base_model.model.model.layers[0].self_attn.v_proj.base_layer
    base.__class__ = type("Linear4bit", (nn.Linear,), {"__module__": "bitsandbytes.nn.modules"})
    _refused(quantized, "v_proj is LoRA over a quantized base")

    conv = _lora()
    conv.base_model.model.model.add_module(
        "conv",
        peft.tuners.lora.layer.Conv1d(
            nn.Conv1d(4, 4, 1), "default", config=peft.LoraConfig(r=2), r=2, lora_alpha=2
        ),
    )
    _refused(conv, "conv is LoRA on a convolution")
    ia3 = peft.get_peft_model(
        _tiny(), peft.IA3Config(target_modules=["q_proj"], feedforward_modules=[])
    )
    _refused(ia3, "a PEFT IA3 adapter: only LoRA")
    monkeypatch.setattr(lora_trainer, "LINEAR_FORWARD_SOURCES", frozenset())
    _refused(_lora(), r"lora.Linear.forward is not the code.*peft>=0.21,<0.22")


def test_strict_false_runs_it_anyway() -> None:
    with trainer_numerics(_lora(use_dora=True), strict=False):
        pass
