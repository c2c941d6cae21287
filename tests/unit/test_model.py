"""Model skeletons, weight loading and the tiny model builder."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoModelForCausalLM

from oldlogit.contract.errors import InvalidRequest, WeightsMismatch
from oldlogit_service.demo.tiny import make_tiny_model_dir
from oldlogit_service.model.backends import (
    CallableBackend,
    ModelBackend,
    TransformersBackend,
    params_on_meta,
)
from oldlogit_service.model.checkpoints import canonicalize_weights, load_weights
from oldlogit_service.model.engine import Engine, Job
from oldlogit_service.model.loaded import (
    UnsupportedModel,
    dtype_from_name,
    dtype_name,
    load_model,
    model_from_config,
    resolve_device,
    safetensors_dtype_name,
)
from oldlogit_service.model.reference import reference_logprobs


def test_params_on_meta_keeps_buffers_real():
    with params_on_meta():
        linear = nn.Linear(4, 3)
        norm = nn.BatchNorm1d(3)
    assert linear.weight.device.type == "meta" and linear.bias.device.type == "meta"
    assert norm.running_mean.device.type == "cpu"
    assert nn.Linear(2, 2).weight.device.type == "cpu"  # the patch is gone afterwards


def test_skeleton_has_no_parameter_memory_and_real_buffers(tiny_model):
    assert isinstance(tiny_model.backend, ModelBackend)
    assert all(p.device.type == "meta" for p in tiny_model.module.parameters())
    buffers = dict(tiny_model.module.named_buffers())
    assert buffers and all(b.device.type == "cpu" for b in buffers.values())
    assert not tiny_model.module.training


@pytest.mark.parametrize("tie", [False, True])
def test_functional_forward_is_bitwise_the_hf_model(tiny_model_factory, tiny_loaded_factory, tie):
    model, weights = tiny_loaded_factory(arch="qwen2", tie_word_embeddings=tie, numerics="hf")
    hf = AutoModelForCausalLM.from_pretrained(
        tiny_model_factory(arch="qwen2", tie_word_embeddings=tie), dtype=torch.float32
    ).eval()
    ids = torch.randint(0, model.vocab_size, (1, 33), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        expected = hf(ids).logits
        got = torch.func.functional_call(model.module, weights, (ids,)).logits
        assert torch.equal(got, expected)
        hidden = model.hidden_states(weights, ids, None)
        assert torch.equal(hidden, hf.model(input_ids=ids).last_hidden_state)
    head_weight, head_bias = model.head(weights)
    assert head_bias is None
    assert torch.equal(head_weight, hf.lm_head.weight)
    expected_name = "model.embed_tokens.weight" if tie else "lm_head.weight"
    assert head_weight is weights[expected_name]


def test_bound_weights_binds_as_functional_call_does():
    """``bound_weights`` binds as ``functional_call`` for the block (a tied name binds its whole tie
    group, a buffer binds, a name not given keeps the module's own), everything restored after,
    also on an exception; conflicting tied values and unknown names are refused."""
    from torch.func import functional_call

    from oldlogit.parity.skeleton import bound_weights

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Linear(3, 3, bias=False)
            self.head = nn.Linear(3, 3)
            self.head.weight = self.emb.weight  # tied
            self.register_buffer("scale", torch.tensor(2.0))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.emb(x)) * self.scale

    net = Net()
    own = {n: t for n, t in net.named_parameters(remove_duplicate=False)}
    x = torch.randn(2, 3)
    w = torch.randn(3, 3)
    given = {"head.weight": w, "head.bias": torch.randn(3), "scale": torch.tensor(3.0)}
    with bound_weights(net, given):
        got = net(x)
        assert net.emb.weight is w and net.head.weight is w  # the tie group, bound together
    assert torch.equal(got, functional_call(net, given, (x,)))
    for n, t in net.named_parameters(remove_duplicate=False):
        assert t is own[n]
    assert float(net.scale) == 2.0
    partial = {"head.bias": torch.zeros(3)}  # the rest keeps the module's own
    with bound_weights(net, partial):
        assert torch.equal(net(x), functional_call(net, partial, (x,)))
    with pytest.raises(RuntimeError, match="inside"), bound_weights(net, given):
        raise RuntimeError("inside")
    assert net.head.weight is own["head.weight"] and float(net.scale) == 2.0
    with (
        pytest.raises(ValueError, match="tied"),
        bound_weights(net, {"emb.weight": w, "head.weight": w.clone()}),
    ):
        pass
    with bound_weights(net, {"extra": w, "head.bias": torch.zeros(3)}):  # functional_call's way
        assert net.extra is w and torch.equal(net.head.bias, torch.zeros(3))
    assert not hasattr(net, "extra") and net.head.weight is own["head.weight"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("tie", [False, True])
def test_param_specs_and_metadata(tiny_model_factory, dtype, tie):
    model_dir = tiny_model_factory(arch="llama", tie_word_embeddings=tie, vocab_size=300)
    model = load_model(model_dir, dtype=dtype, device="cpu", numerics="hf")
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    hf_params = dict(hf.named_parameters())
    assert list(model.param_specs) == list(hf_params)
    st = "F32" if dtype == "float32" else "BF16"
    for name, (st_dtype, shape) in model.param_specs.items():
        assert st_dtype == st
        assert shape == tuple(hf_params[name].shape)
    assert ("lm_head.weight" in model.param_specs) is (not tie)
    assert model.aliases == ({"lm_head.weight": "model.embed_tokens.weight"} if tie else {})
    assert model.vocab_size == 300
    assert model.max_positions == 2048
    assert model.model_type == "llama" and model.architecture == "LlamaForCausalLM"
    assert model.attn_implementation == hf.config._attn_implementation
    assert model.profile == "hf" and model.tile_rows is None
    invariant = load_model(model_dir, dtype=dtype, device="cpu", tile_rows=32)
    assert invariant.profile == "invariant" and invariant.tile_rows == 32
    assert invariant.attn_implementation == "oldlogit_invariant"
    assert invariant.param_specs == model.param_specs
    spec = invariant.numerics_spec(lm_head_fp32=True)
    assert (spec.profile, spec.dtype, spec.device_kind, spec.tile_rows) == (
        "invariant",
        dtype,
        "cpu",
        32,
    )
    assert spec.lm_head_fp32 and spec.threads == torch.get_num_threads()
    assert model.dtype == dtype_from_name(dtype) and model.dtype_name == dtype
    assert model.head_dtype_name(True) == "float32" and model.head_dtype_name(False) == dtype
    assert model.num_parameters == sum(p.numel() for p in hf_params.values())
    assert model.nbytes == model.num_parameters * (4 if dtype == "float32" else 2)
    weights = load_weights(model_dir, model)
    assert list(weights) == list(model.param_specs)
    for name, tensor in weights.items():
        assert tensor.device.type == "cpu" and tensor.is_contiguous()
        assert tensor.dtype == model.dtype
        assert torch.equal(tensor, hf_params[name].detach().to(model.dtype))


@pytest.mark.parametrize("tie", [False, True])
def test_sharded_load_equals_single_file_load(tiny_model_factory, tie):
    single = tiny_model_factory(seed=3, tie_word_embeddings=tie)
    sharded = tiny_model_factory(seed=3, tie_word_embeddings=tie, shards=3)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 3
    assert not (sharded / "model.safetensors").exists()
    model = load_model(single, dtype="float32", device="cpu")
    a = load_weights(single, model)
    b = load_weights(sharded, model)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_tiny_model_is_seeded_and_leaves_global_rng_alone(tmp_path):
    torch.manual_seed(123)
    before = torch.rand(3)
    torch.manual_seed(123)
    first = make_tiny_model_dir(tmp_path / "a", seed=5, vocab_size=100, hidden_size=32)
    assert torch.equal(torch.rand(3), before)
    second = make_tiny_model_dir(tmp_path / "b", seed=5, vocab_size=100, hidden_size=32)
    third = make_tiny_model_dir(tmp_path / "c", seed=6, vocab_size=100, hidden_size=32)
    ta, tb, tc = (load_file(d / "model.safetensors") for d in (first, second, third))
    assert all(torch.equal(ta[k], tb[k]) for k in ta)
    assert not torch.equal(ta["model.embed_tokens.weight"], tc["model.embed_tokens.weight"])
    # Constant-initialised parameters got noise: every parameter moves the logits.
    assert all(t.numel() == 1 or t.std() > 0 for t in ta.values())
    with pytest.raises(ValueError, match="architecture"):
        make_tiny_model_dir(tmp_path / "d", arch="gpt2")


def test_tiny_model_is_not_near_uniform(tiny_model, tiny_weights):
    ids = torch.randint(0, tiny_model.vocab_size, (64,), generator=torch.Generator().manual_seed(1))
    lp = reference_logprobs(tiny_model, tiny_weights, ids)[1:]
    uniform = -np.log(tiny_model.vocab_size)
    assert lp.std() > 0.5 and lp.min() < uniform - 2


def _write(tmp_path, tiny_model_dir, tensors):
    out = tmp_path / "edited"
    out.mkdir(parents=True)
    (out / "config.json").write_text((tiny_model_dir / "config.json").read_text())
    save_file(tensors, str(out / "model.safetensors"))
    return out


def test_missing_unexpected_and_misshapen_tensors_are_refused(tmp_path, tiny_model, tiny_model_dir):
    tensors = load_file(tiny_model_dir / "model.safetensors")
    cases = {
        "missing": (
            {k: v for k, v in tensors.items() if k != "model.norm.weight"},
            "model.norm.weight",
        ),
        "unexpected": ({**tensors, "model.extra.weight": torch.zeros(2)}, "model.extra.weight"),
        "shape": (
            {**tensors, "model.layers.1.mlp.up_proj.weight": torch.zeros(3, 3)},
            "model.layers.1.mlp.up_proj.weight",
        ),
    }
    for kind, (bad, name) in cases.items():
        with pytest.raises(WeightsMismatch) as info:
            load_weights(_write(tmp_path / kind, tiny_model_dir, bad), tiny_model)
        assert info.value.parameter == "weights"
        assert name in str(info.value), kind
        assert info.value.details["tensor"] == name


def test_canonicalize_dtype_and_saved_buffers(tiny_model, tiny_weights):
    as_bf16 = {k: v.to(torch.bfloat16) for k, v in tiny_weights.items()}
    cast = canonicalize_weights(tiny_model, as_bf16)
    assert all(t.dtype == torch.float32 for t in cast.values())
    with pytest.raises(WeightsMismatch, match="dtype"):
        canonicalize_weights(tiny_model, as_bf16, cast=False)
    with_buffer = {**tiny_weights, "model.rotary_emb.inv_freq": torch.ones(8)}
    assert canonicalize_weights(tiny_model, with_buffer, cast=False).keys() == tiny_weights.keys()


def test_tied_checkpoint_variants(tmp_path, tiny_loaded_factory, tiny_model_factory):
    model, weights = tiny_loaded_factory(tie_word_embeddings=True)
    embed = weights["model.embed_tokens.weight"]
    # A state_dict of a tied model names the head too (sharing storage): the duplicate is dropped.
    both = {**weights, "lm_head.weight": embed}
    assert canonicalize_weights(model, both).keys() == weights.keys()
    # Written to disk (separate copies, equal values): also fine.
    model_dir = tiny_model_factory(tie_word_embeddings=True)
    loaded = load_weights(
        _write(tmp_path / "both", model_dir, {**weights, "lm_head.weight": embed.clone()}), model
    )
    assert torch.equal(loaded["model.embed_tokens.weight"], embed)
    # Only the head's name present: renamed to the canonical one.
    only_head = {k: v for k, v in weights.items() if k != "model.embed_tokens.weight"}
    only_head["lm_head.weight"] = embed
    assert torch.equal(canonicalize_weights(model, only_head)["model.embed_tokens.weight"], embed)
    # Ties come from the model's tie table, never from values: the canonical tensor wins, as
    # in transformers (whose tied head reads the embedding).
    differs = canonicalize_weights(model, {**weights, "lm_head.weight": embed + 1})
    assert torch.equal(differs["model.embed_tokens.weight"], embed)


def test_load_weights_without_weights_and_load_model_without_config(
    tmp_path, tiny_model, tiny_model_dir
):
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text((tiny_model_dir / "config.json").read_text())
    assert load_weights(bare, tiny_model) is None
    with pytest.raises(UnsupportedModel, match=r"config\.json"):
        load_model(tmp_path / "nothing", dtype="float32", device="cpu")


def test_dtype_and_device_helpers():
    assert dtype_from_name("bfloat16") is torch.bfloat16
    assert dtype_from_name("torch.float16") is torch.float16
    assert dtype_from_name(torch.float32) is torch.float32
    with pytest.raises(ValueError, match="unsupported dtype"):
        dtype_from_name("int8")
    assert dtype_name(torch.bfloat16) == "bfloat16"
    assert [safetensors_dtype_name(d) for d in (torch.bfloat16, torch.float16, torch.float32)] == [
        "BF16",
        "F16",
        "F32",
    ]
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device(torch.device("cpu")) == torch.device("cpu")
    if torch.cuda.is_available():
        assert resolve_device("auto").type == "cuda"
    else:
        assert resolve_device("auto") == torch.device("cpu")
        with pytest.raises(ValueError, match="CUDA"):
            resolve_device("cuda")


class _TinyLM(nn.Module):
    """A non-transformers model: embedding → causal running mean → norm; separate head."""

    def __init__(self, config, dtype):
        super().__init__()
        self.embed = nn.Embedding(config["vocab_size"], config["hidden"], dtype=dtype)
        self.norm = nn.LayerNorm(config["hidden"], dtype=dtype)
        self.out = nn.Linear(config["hidden"], config["vocab_size"], dtype=dtype)

    def forward(self, input_ids, attention_mask=None):
        x = self.embed(input_ids)  # [B, T, H]
        steps = torch.arange(1, x.shape[1] + 1, dtype=x.dtype, device=x.device)
        return self.norm(x.cumsum(1) / steps[:, None])  # [B, T, H]


def test_callable_backend_plugs_in():
    backend = CallableBackend(_TinyLM, head_weight="out.weight", head_bias="out.bias")
    config = {"vocab_size": 50, "hidden": 16, "max_position_embeddings": 128}
    with pytest.raises(ValueError, match="invariant numerics need a transformers model"):
        model_from_config(config, dtype="float32", device="cpu", backend=backend)
    model = model_from_config(config, dtype="float32", device="cpu", backend=backend, numerics="hf")
    assert all(p.device.type == "meta" for p in model.module.parameters())
    assert model.vocab_size == 50 and model.max_positions == 128
    assert set(model.param_specs) == {
        "embed.weight",
        "norm.weight",
        "norm.bias",
        "out.weight",
        "out.bias",
    }
    gen = torch.Generator().manual_seed(0)
    weights = {k: torch.randn(shape, generator=gen) for k, (_, shape) in model.param_specs.items()}
    ids = torch.randint(0, 50, (70,), generator=gen)
    ref = reference_logprobs(model, weights, ids)
    out = Engine(model).run(weights, [Job(ids, torch.arange(1, 70))])[0]
    assert np.array_equal(out.numpy(), ref[1:])
    real = _TinyLM(config, torch.float32)
    real.load_state_dict(weights)
    with torch.no_grad():
        logits = real.out(real(ids[None]))[0]  # [T, V]
    plain = torch.log_softmax(logits, -1)[:-1].gather(-1, ids[1:, None])[:, 0]
    np.testing.assert_allclose(ref[1:], plain.numpy(), rtol=0, atol=1e-5)
    assert isinstance(TransformersBackend(), ModelBackend)


def test_a_trace_needs_a_transformers_model():
    backend = CallableBackend(_TinyLM, head_weight="out.weight", head_bias="out.bias")
    config = {"vocab_size": 50, "hidden": 16, "max_position_embeddings": 128}
    model = model_from_config(config, dtype="float32", device="cpu", backend=backend, numerics="hf")
    weights = {k: torch.zeros(shape) for k, (_, shape) in model.param_specs.items()}
    job = Job(torch.tensor([1, 2, 3]), torch.arange(1, 3), trace=True)
    with pytest.raises(InvalidRequest, match=r"CallableBackend.*transformers model"):
        Engine(model).trace(weights, job)
