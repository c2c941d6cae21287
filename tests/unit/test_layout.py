"""oldlogit.contract.layout: trainer or checkpoint names onto canonical weights (no torch)."""

from __future__ import annotations

import pytest

from oldlogit.contract.errors import WeightsMismatch
from oldlogit.contract.layout import WeightLayout, WeightSource, check_tied, strip_wrappers

SPECS = {
    "model.embed_tokens.weight": ("BF16", (10, 4)),
    "model.layers.0.mlp.experts.gate_up_proj": ("BF16", (3, 8, 4)),
    "model.layers.0.mlp.gate.weight": ("BF16", (3, 4)),
    "model.layers.0.mlp.gate.e_score_correction_bias": ("F32", (3,)),
    "model.norm.weight": ("BF16", (4,)),
}
GATE_UP = WeightSource(
    "model.layers.0.mlp.experts.gate_up_proj",
    (
        "model.layers.0.moe.experts.{expert}.w1.weight",
        "model.layers.0.moe.experts.{expert}.w3.weight",
    ),
    3,
)
LAYOUT = WeightLayout(
    specs=SPECS,
    tied={"lm_head.weight": "model.embed_tokens.weight"},
    sources={
        GATE_UP.name: GATE_UP,
        "model.layers.0.mlp.gate.weight": WeightSource(
            "model.layers.0.mlp.gate.weight", ("model.layers.0.moe.gate.weight",)
        ),
    },
    ignored=frozenset({"model.rotary_emb.inv_freq"}),
)


def test_canonical_names_map_to_themselves():
    a = LAYOUT.assemble(SPECS)
    assert a.parts == {n: (n,) for n in SPECS} and not a.dropped


def test_tied_duplicates_are_dropped_or_renamed_by_the_tie_table():
    a = LAYOUT.assemble([*SPECS, "lm_head.weight"])
    assert a.parts["model.embed_tokens.weight"] == ("model.embed_tokens.weight",)
    assert a.dropped == {"lm_head.weight": "tied to 'model.embed_tokens.weight'"}
    only_head = [n for n in SPECS if n != "model.embed_tokens.weight"] + ["lm_head.weight"]
    assert LAYOUT.assemble(only_head).parts["model.embed_tokens.weight"] == ("lm_head.weight",)
    assert LAYOUT.assemble(only_head).tied == {}  # renamed, nothing dropped to compare


def test_a_dropped_tied_duplicate_is_checked_against_the_tensor_sent_for_it():
    names = [f"_orig_mod.{n}" for n in SPECS] + ["_orig_mod.lm_head.weight"]
    a = LAYOUT.assemble(names)
    assert a.tied == {"_orig_mod.lm_head.weight": "_orig_mod.model.embed_tokens.weight"}
    asked: list[tuple[str, str]] = []
    check_tied(a, lambda x, y: asked.append((x, y)) is None)  # the same values: accepted
    assert asked == [("_orig_mod.lm_head.weight", "_orig_mod.model.embed_tokens.weight")]
    with pytest.raises(WeightsMismatch, match=r"'_orig_mod\.lm_head\.weight' differs") as info:
        check_tied(a, lambda x, y: False, parameter="state_dict")
    assert info.value.parameter == "state_dict"
    assert info.value.details == {
        "tensor": "_orig_mod.lm_head.weight",
        "tied_to": "_orig_mod.model.embed_tokens.weight",
    }


def test_wrapper_prefixes_and_segments_are_stripped():
    assert strip_wrappers("module._orig_mod.model.norm.weight") == "model.norm.weight"
    assert (
        strip_wrappers("model.layers.0._fsdp_wrapped_module._checkpoint_wrapped_module.mlp.w")
        == "model.layers.0.mlp.w"
    )
    names = [f"_orig_mod.{n}" for n in SPECS]
    a = LAYOUT.assemble(names)
    assert a.parts["model.norm.weight"] == ("_orig_mod.model.norm.weight",)


def test_per_expert_tensors_are_joined_in_row_order_and_renames_apply():
    hub = [n for n in SPECS if "experts" not in n and "mlp.gate.weight" not in n]
    hub += [GATE_UP.templates[i % 2].replace("{expert}", str(i // 2)) for i in range(6)][::-1]
    hub += ["model.layers.0.moe.gate.weight", "model.rotary_emb.inv_freq"]
    a = LAYOUT.assemble(hub)
    assert a.parts[GATE_UP.name] == tuple(GATE_UP.names())
    assert GATE_UP.names()[:3] == [
        "model.layers.0.moe.experts.0.w1.weight",
        "model.layers.0.moe.experts.0.w3.weight",
        "model.layers.0.moe.experts.1.w1.weight",
    ]
    assert a.parts["model.layers.0.mlp.gate.weight"] == ("model.layers.0.moe.gate.weight",)
    assert "model.rotary_emb.inv_freq" in a.dropped
    LAYOUT.check_parts(GATE_UP.name, [(4, 4)] * 6, "weights")
    with pytest.raises(WeightsMismatch, match="do not make up"):
        LAYOUT.check_parts(GATE_UP.name, [(4, 5)] * 6, "weights")
    # One tensor needs its exact shape: a transposed matrix has the right size, not the shape.
    with pytest.raises(WeightsMismatch, match=r"shape \[4, 10\]"):
        LAYOUT.check_parts("model.embed_tokens.weight", [(4, 10)], "weights")


@pytest.mark.parametrize(
    ("names", "message", "tensor"),
    [
        ([*SPECS, "model.extra"], "which the model does not have", "model.extra"),
        ([n for n in SPECS if n != "model.norm.weight"], "lack tensor", "model.norm.weight"),
        (
            [*SPECS, "model.layers.0.moe.experts.0.w1.weight"],
            "both whole and per expert",
            GATE_UP.name,
        ),
        (
            [n for n in SPECS if "experts" not in n] + ["model.layers.0.moe.experts.0.w1.weight"],
            "per expert but lack",
            "model.layers.0.moe.experts.0.w3.weight",
        ),
        ([*SPECS, "module.model.norm.weight"], "twice", "model.norm.weight"),
    ],
)
def test_bad_names_are_refused_naming_the_tensor(names, message, tensor):
    with pytest.raises(WeightsMismatch, match=message) as info:
        LAYOUT.assemble(names)
    assert info.value.parameter == "weights" and info.value.details == {"tensor": tensor}


def test_sources_compress_to_expert_templates():
    names = GATE_UP.names()
    assert WeightSource.from_names(GATE_UP.name, names) == GATE_UP
    odd = ["a.x", "b.y", "c.z"]
    assert WeightSource.from_names("t", odd).names() == odd
    assert WeightSource.from_names("t", ["a.b"]) == WeightSource("t", ("a.b",), 1)
