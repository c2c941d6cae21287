"""A tied duplicate sent beside its canonical tensor must hold the same bits, on every intake.

A state dict (``state_dict_sources``: ``Client.publish``, ``WeightsCopy``, a publish
session's share) and a safetensors file or shard directory (``file_sources``: a publish by
path, on the client or in the service) that carry ``lm_head.weight`` beside the embedding of a
model that ties them are refused, naming the duplicate, when the two differ in any bit; the
same tensor, a view of it, or an equal copy pass. The value comparison itself
(``same_values``) sees NaN payloads and signed zeros.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from oldlogit.contract.errors import WeightsMismatch
from oldlogit.contract.layout import WeightLayout
from oldlogit.contract.safetensors import file_sources
from oldlogit.contract.weights import same_values
from oldlogit.publishing.sources import state_dict_sources

LAYOUT = WeightLayout(
    specs={"model.embed_tokens.weight": ("F32", (6, 4)), "model.norm.weight": ("F32", (4,))},
    tied={"lm_head.weight": "model.embed_tokens.weight"},
)


def _state(head: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    emb = torch.arange(24, dtype=torch.float32).reshape(6, 4)
    state = {"model.embed_tokens.weight": emb, "model.norm.weight": torch.ones(4)}
    state["lm_head.weight"] = emb if head is None else head
    return state


def test_same_values_compares_bits_not_numbers():
    x = torch.tensor([1.0, 0.0, float("nan")])
    assert same_values(x, x) and same_values(x, x.view(3)) and same_values(x, x.clone())
    assert same_values(x, x.numpy().copy())  # torch against numpy: the bytes
    assert not same_values(x, torch.tensor([1.0, -0.0, float("nan")]))  # signed zero
    other_nan = x.clone()
    other_nan.view(torch.int32)[2] ^= 1  # another NaN payload
    assert not same_values(x, other_nan)
    assert not same_values(x, x.to(torch.float64)) and not same_values(x, x[:2])
    assert not same_values(np.zeros((2, 3), np.float32), np.zeros((3, 2), np.float32))


def test_a_state_dict_with_a_diverged_tied_head_is_refused_naming_it():
    assert [s.name for s in state_dict_sources(_state(), LAYOUT)] == list(LAYOUT.specs)
    equal = _state(head=torch.arange(24, dtype=torch.float32).reshape(6, 4))  # a copy
    assert len(state_dict_sources(equal, LAYOUT)) == 2
    moved = _state(head=torch.arange(24, dtype=torch.float32).reshape(6, 4) + 1e-3)
    with pytest.raises(WeightsMismatch, match=r"'lm_head\.weight' differs") as info:
        state_dict_sources(moved, LAYOUT)
    assert info.value.parameter == "weights"
    assert info.value.details == {
        "tensor": "lm_head.weight",
        "tied_to": "model.embed_tokens.weight",
    }
    # One rank's share (a publish session's part) is checked the same way.
    with pytest.raises(WeightsMismatch, match=r"lm_head\.weight"):
        state_dict_sources(moved, LAYOUT, partial=True)


@pytest.mark.parametrize("sharded", [False, True])
def test_a_checkpoint_with_a_diverged_tied_head_is_refused_naming_it(tmp_path: Path, sharded):
    def write(state: dict[str, torch.Tensor], where: Path) -> Path:
        tensors = {k: v.clone().contiguous() for k, v in state.items()}
        if not sharded:
            save_file(tensors, str(where.with_suffix(".safetensors")))
            return where.with_suffix(".safetensors")
        where.mkdir()
        head = {"lm_head.weight": tensors.pop("lm_head.weight")}
        save_file(tensors, str(where / "model-00001-of-00002.safetensors"))
        save_file(head, str(where / "model-00002-of-00002.safetensors"))
        return where

    same = write(_state(), tmp_path / "same")
    assert [s.name for s in file_sources(same, LAYOUT)[0]] == list(LAYOUT.specs)
    last_bit = torch.arange(24, dtype=torch.float32).reshape(6, 4).clone()
    last_bit.view(torch.int32)[5, 3] ^= 1  # one bit of the last element
    diverged = write(_state(head=last_bit), tmp_path / "diverged")
    with pytest.raises(WeightsMismatch, match=r"'lm_head\.weight' differs") as info:
        file_sources(diverged, LAYOUT)
    assert info.value.details["tied_to"] == "model.embed_tokens.weight"


def test_the_service_refuses_a_diverged_tied_head_published_by_path(tmp_path: Path):
    from oldlogit_service.model.checkpoints import canonical_file

    head = torch.zeros(6, 4)
    save_file(_state(head=head), str(tmp_path / "ckpt.safetensors"))
    with pytest.raises(WeightsMismatch, match=r"'lm_head\.weight' differs"):
        canonical_file(tmp_path / "ckpt.safetensors", LAYOUT, tmp_path)
    assert not list(tmp_path.glob("canonical-*"))  # nothing staged
