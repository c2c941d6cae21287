"""The tensor-parallel definition on one process: its refusals, its spec and its order.

The multi-rank bits (TP 2 and 4 ≡ TP 1) are in
tests/integration/test_tensor_parallel_numerics.py.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers

from oldlogit.contract.numerics import NumericsSpec
from oldlogit.parity import tensor_parallel, token_logprobs, trainer_numerics
from oldlogit.parity.tensor_parallel import TensorParallelError, check_degree, tree_sum


def _config(**kw: object) -> transformers.Qwen2Config:
    base: dict[str, object] = dict(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=256,
    )
    base.update(kw)
    return transformers.Qwen2Config(**base)


@pytest.mark.parametrize(
    ("degree", "chunks", "config", "named"),
    [
        (8, 8, dict(num_attention_heads=12, hidden_size=192), "num_attention_heads 12"),
        (4, 8, dict(num_key_value_heads=2), "num_key_value_heads 2"),
        (3, 8, {}, "does not divide tp_chunks 8"),
        (2, 8, dict(intermediate_size=260), "intermediate_size 260"),
        (2, 8, dict(vocab_size=510), "vocab_size 510"),
        (2, 0, {}, "tp_chunks must be positive"),
    ],
)
def test_bad_setups_refused_by_name(
    degree: int, chunks: int, config: dict[str, object], named: str
) -> None:
    with pytest.raises(TensorParallelError, match=named):
        check_degree(_config(**config), degree, chunks)


def test_moe_refused_by_name() -> None:
    moe = transformers.Qwen3MoeConfig(
        vocab_size=512, hidden_size=128, num_attention_heads=8, num_key_value_heads=4
    )
    with pytest.raises(TensorParallelError, match="mixture-of-experts"):
        check_degree(moe, 2, 8)


def test_good_degrees_pass() -> None:
    for degree in (1, 2, 4):
        check_degree(_config(), degree, 8)


@pytest.mark.parametrize(
    ("arch", "named"),
    [
        ("olmo2", "'colwise_gather_output'"),  # q/k norms over the whole projection
        ("phi3", "'colwise_gather_output'|'rowwise_split_input'"),  # fused qkv, gate/up
        ("qwen2", None),
        ("llama", None),
        ("gemma3_text", None),
    ],
)
def test_service_ranks_refuse_plans_their_shards_cannot_run(arch: str, named: str | None) -> None:
    """The service's ranks hold plain contiguous shards: a decoder layer whose plan style asks
    for a gathered output or a split input (the model's code needs the whole projection) is
    refused by name at start-up; plain column/row plans pass."""
    from tests.architectures import hf_model

    model = hf_model(arch)
    if named is None:
        tensor_parallel.check_rank_shards(model)
    else:
        with pytest.raises(TensorParallelError, match=named):
            tensor_parallel.check_rank_shards(model)


def test_model_without_a_plan_refused() -> None:
    model = transformers.AutoModelForCausalLM.from_config(_config())
    model.config.base_model_tp_plan = {"layers.*.self_attn.q_proj": "colwise"}
    model._tp_plan = {"lm_head": "colwise_gather_output"}  # transformers' merged plan
    with pytest.raises(TensorParallelError, match="no tensor-parallel plan"):
        trainer_numerics(model, tp_chunks=8).__enter__()


def test_tree_sum_is_the_fixed_pairwise_order() -> None:
    # float32 sums whose order matters: 2**24 + 1 rounds back to 2**24.
    big = float(2**24)
    parts = torch.tensor([[big], [1.0], [1.0], [1.0], [-big], [1.0], [1.0], [1.0]])
    p = [torch.tensor(v, dtype=torch.float32) for v in parts.flatten().tolist()]
    pairs = [p[0] + p[1], p[2] + p[3], p[4] + p[5], p[6] + p[7]]  # float32 adds
    want = ((pairs[0] + pairs[1]) + (pairs[2] + pairs[3])).reshape(1)
    assert want.item() == 5.0  # 2**24 + 1 rounds to 2**24 at the first level
    got = tree_sum(parts)
    assert torch.equal(got, want)
    sequential = parts.cumsum(0)[-1]
    assert not torch.equal(got, sequential)  # the order is the tree's, not left to right
    # An odd count carries its last part up.
    assert torch.equal(tree_sum(torch.tensor([[1.0], [2.0], [4.0]])), torch.tensor([7.0]))


def test_spec_names_the_chunk_count() -> None:
    base = NumericsSpec("invariant", "bfloat16", "cpu", 64, 2, False, tp_chunks=8)
    plain = dataclasses.replace(base, tp_chunks=0)
    assert "tp_chunks=8" in base.key and "tp_chunks" not in plain.key
    assert any("tp_chunks: 8 here, 0 there" in m for m in base.mismatches(plain))
    # Thread counts: compared for the single-device definition, not between two TP sides.
    assert base.mismatches(dataclasses.replace(base, threads=1)) == []
    assert plain.mismatches(dataclasses.replace(plain, threads=1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_device_definition_is_batch_invariant(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_config()).to(dtype)
    ids = torch.randint(0, 512, (3, 70))
    mask = torch.ones_like(ids)
    mask[1, :30] = 0
    with trainer_numerics(model, tp_chunks=8) as patch, torch.no_grad():
        assert patch.spec.tp_chunks == 8
        batch = token_logprobs(model, ids, mask)
        alone = token_logprobs(model, ids[1:2, 30:])
        sampled = token_logprobs(model, ids, mask, temperature=0.8, top_k=30, top_p=0.95)
        sampled_alone = token_logprobs(model, ids[2:3], temperature=0.8, top_k=30, top_p=0.95)
    assert torch.equal(batch[1, 30:], alone[0])
    assert torch.equal(sampled[2], sampled_alone[0])
    with trainer_numerics(model) as patch, torch.no_grad():
        default = token_logprobs(model, ids, mask)
    assert patch.spec.tp_chunks == 0
    # Another definition: close, not the same bits.
    assert torch.allclose(default, batch, atol=0.1) and not torch.equal(default, batch)


def test_shard_rules_split_by_the_plan() -> None:
    model = transformers.AutoModelForCausalLM.from_config(_config(tie_word_embeddings=False))
    rules = tensor_parallel.shard_rules(model)
    assert rules.dim("model.layers.0.self_attn.q_proj.weight") == 0
    assert rules.dim("model.layers.0.self_attn.q_proj.bias") == 0
    assert rules.dim("model.layers.1.mlp.down_proj.weight") == 1
    assert rules.dim("model.layers.1.self_attn.o_proj.weight") == 1
    assert rules.dim("lm_head.weight") == 0
    assert rules.dim("model.embed_tokens.weight") is None
    assert rules.dim("model.norm.weight") is None
    w = torch.arange(512 * 128, dtype=torch.float32).view(512, 128)
    parts = [tensor_parallel.shard_weight("lm_head.weight", w, r, 4, rules) for r in range(4)]
    assert torch.equal(torch.cat(parts), w) and parts[1].is_contiguous()
