"""Known modeling code outside the numerics' mode (``oldlogit.parity.regions``): the same bits.

The Llama family's RMSNorm and rotary embedding run with torch functions' Python layer off,
their ruled calls handed to the mode's rules directly; logprobs and gradients are bitwise those
of the mode's path, the code they stand for calls nothing else, and anything else (another
source, no patch, a tensor subclass) runs as it is.
"""

from __future__ import annotations

import collections

import pytest
import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
)
from transformers.models.llama import modeling_llama
from transformers.models.qwen2 import modeling_qwen2

from oldlogit.parity import regions, token_logprobs, trainer_numerics
from oldlogit.parity.ops import RULED_ANYWHERE

VOCAB = 256
_CONFIGS = {"qwen2": Qwen2Config, "llama": LlamaConfig, "mistral": MistralConfig}


def _model(arch: str, dtype: torch.dtype = torch.float32, seed: int = 0) -> nn.Module:
    config = _CONFIGS[arch](
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        initializer_range=0.2,
        max_position_embeddings=512,
        **({"sliding_window": 24} if arch == "mistral" else {}),
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(config).to(dtype).eval()


def _batch() -> tuple[Tensor, Tensor]:
    ids = torch.randint(0, VOCAB, (3, 40), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(3, 40, dtype=torch.long)
    mask[1, :13] = 0  # left padding
    return ids, mask


class _Record(TorchFunctionMode):
    """Records every torch function a block of code calls."""

    def __init__(self) -> None:
        super().__init__()
        self.funcs: collections.Counter[object] = collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.funcs[func] += 1
        return func(*args, **(kwargs or {}))


def _without_regions(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(regions, "install", lambda *a: lambda: None)


@pytest.mark.parametrize("arch", ["qwen2", "llama", "mistral"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_regions_give_the_modes_bits_forward_and_backward(arch, dtype, monkeypatch):
    """Logprobs (padded batch, packed row) and every parameter's gradient, with the regions and
    with the mode's path alone: bitwise equal."""
    ids, mask = _batch()
    packed = ids[:1, :36]
    positions = torch.cat([torch.arange(20), torch.arange(16)])[None]

    def run() -> tuple[list[Tensor], dict[str, Tensor]]:
        model = _model(arch, dtype, seed=3)
        with trainer_numerics(model):
            with torch.no_grad():
                outs = [
                    token_logprobs(model, ids, attention_mask=mask),
                    token_logprobs(model, packed, position_ids=positions),
                ]
            loss = token_logprobs(model, ids, attention_mask=mask).nan_to_num(0.0).sum()
            loss.backward()
        return outs, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    with_regions = run()
    monkeypatch.undo()
    _without_regions(monkeypatch)
    alone = run()
    for got, want in zip(with_regions[0], alone[0], strict=True):
        assert torch.equal(got.nan_to_num(), want.nan_to_num())
    assert with_regions[1].keys() == alone[1].keys() and with_regions[1]
    for name, grad in with_regions[1].items():
        assert torch.equal(grad, alone[1][name]), name


def test_the_regions_run_outside_the_mode():
    """Under the patch no call of the RMSNorm or the rotary embedding reaches a torch-function
    mode (a recording mode under the patch's sees the modeling code's other calls only)."""
    model = _model("qwen2")
    ids, mask = _batch()
    with trainer_numerics(model), torch.no_grad(), _Record() as seen:
        token_logprobs(model, ids, attention_mask=mask)
    assert Tensor.transpose in seen.funcs  # the mode hands the attention's views on
    assert torch.rsqrt not in seen.funcs and Tensor.pow not in seen.funcs
    assert Tensor.neg not in seen.funcs  # rotate_half's


def test_the_known_code_calls_only_what_the_regions_say():
    """The code the regions stand for calls, besides the RMSNorm's ruled pow/mean/rsqrt, only
    ``regions.UNRULED`` — functions no rule applies to (else its region would skip a rule)."""
    assert not regions.UNRULED & RULED_ANYWHERE
    norm = modeling_qwen2.Qwen2RMSNorm(16)
    x = torch.randn(3, 5, 16, dtype=torch.bfloat16)
    with _Record() as seen:
        norm(x)
    assert set(seen.funcs) - {Tensor.pow, Tensor.mean, torch.rsqrt} <= regions.UNRULED, seen
    assert {Tensor.pow, Tensor.mean, torch.rsqrt} <= set(seen.funcs)
    q, k = torch.randn(1, 4, 5, 8), torch.randn(1, 2, 5, 8)
    cos, sin = torch.randn(1, 5, 8), torch.randn(1, 5, 8)
    with _Record() as seen:
        modeling_llama.apply_rotary_pos_emb(q, k, cos, sin)
    assert set(seen.funcs) <= regions.UNRULED, seen
    for fn in (modeling_qwen2.apply_rotary_pos_emb, modeling_llama.apply_rotary_pos_emb):
        assert regions.fingerprint(fn) in regions.ROTARY_SOURCES
    assert regions.fingerprint(modeling_llama.LlamaRMSNorm.forward) in regions.RMS_NORM_SOURCES


def test_other_code_and_other_callers_run_as_they_are():
    """A norm with another forward gets no region; the rotary wrapper is in its module only
    while a model is patched (counted across two patched models), and outside a patched
    forward the norm's region runs the original."""
    start = modeling_qwen2.apply_rotary_pos_emb  # a wrapper already if a patch lives on

    class OtherNorm(modeling_qwen2.Qwen2RMSNorm):
        def forward(self, hidden_states: Tensor) -> Tensor:
            return hidden_states * 2

    a, b = _model("qwen2", seed=1), _model("qwen2", seed=2)
    a.model.norm = OtherNorm(64)
    with trainer_numerics(a, strict=False):
        assert "forward" not in a.model.norm.__dict__  # another source: no region
        assert "forward" in a.model.layers[0].input_layernorm.__dict__
        wrapper = modeling_qwen2.apply_rotary_pos_emb
        assert hasattr(wrapper, "_oldlogit_original")
        with trainer_numerics(b):
            assert modeling_qwen2.apply_rotary_pos_emb is wrapper  # shared, counted
        assert modeling_qwen2.apply_rotary_pos_emb is wrapper  # a is still patched
        x = torch.randn(2, 3, 64)
        norm = a.model.layers[0].input_layernorm
        assert torch.equal(norm(x), type(norm).forward(norm, x))  # no mode: the original
    assert modeling_qwen2.apply_rotary_pos_emb is start
    assert "forward" not in a.model.layers[0].input_layernorm.__dict__
