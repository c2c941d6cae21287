"""The reference against independent computations, and the processing steps by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from oldlogit_service.model.numerics import SamplingParams, processed_logprobs
from oldlogit_service.model.reference import reference_logprobs, reference_logprobs_versions

NEG_INF = float("-inf")


def _hf_model(model_dir, dtype):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()


@pytest.mark.parametrize("numerics", ["invariant", "hf"])
@pytest.mark.parametrize("arch", ["qwen2", "llama"])
@pytest.mark.parametrize("tie", [False, True])
def test_reference_matches_plain_hf_forward_fp32(
    tiny_model_factory, tiny_loaded_factory, arch, tie, numerics
):
    """Both profiles compute the model's own function: within float32 rounding of HF's."""
    model, weights = tiny_loaded_factory(arch=arch, tie_word_embeddings=tie, numerics=numerics)
    hf = _hf_model(tiny_model_factory(arch=arch, tie_word_embeddings=tie), torch.float32)
    gen = torch.Generator().manual_seed(1)
    for n, temperature in [(2, 1.0), (37, 1.0), (300, 1.0), (300, 0.6)]:
        ids = torch.randint(0, model.vocab_size, (n,), generator=gen)
        with torch.inference_mode():
            logits = hf(ids[None]).logits[0].float()  # [T, V]
        expected = torch.log_softmax(logits / temperature, -1)[:-1].gather(-1, ids[1:, None])[:, 0]
        got = reference_logprobs(model, weights, ids, SamplingParams(temperature=temperature))
        assert got.dtype == np.float32 and got.shape == (n,)
        assert np.isnan(got[0])
        np.testing.assert_allclose(got[1:], expected.numpy(), rtol=0, atol=1e-5)


def test_reference_bf16_hidden_states_are_hf_bitwise_and_fp32_head(
    tiny_model_factory, tiny_loaded_factory
):
    model, weights = tiny_loaded_factory(dtype="bfloat16", arch="llama", numerics="hf")
    hf = _hf_model(tiny_model_factory(arch="llama"), torch.bfloat16)
    ids = torch.randint(0, model.vocab_size, (120,), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        hf_hidden = hf.model(input_ids=ids[None]).last_hidden_state
        ours = model.hidden_states(weights, ids[None], None)
        assert torch.equal(ours, hf_hidden)  # the skeleton + functional_call is the same forward
        head_fp32 = F.linear(hf_hidden[0].float(), hf.lm_head.weight.float())  # [T, V]
    expected = torch.log_softmax(head_fp32, -1)[:-1].gather(-1, ids[1:, None])[:, 0]
    got = reference_logprobs(model, weights, ids, lm_head_fp32=True)
    np.testing.assert_allclose(got[1:], expected.numpy(), rtol=0, atol=1e-5)
    # Without the fp32 head the logits are bf16-rounded: close, but measurably not the same.
    bf16_head = reference_logprobs(model, weights, ids)
    assert np.abs(bf16_head[1:] - got[1:]).max() < 0.25
    assert not np.array_equal(bf16_head[1:], got[1:])


def test_reference_head_chunking_only_moves_last_bits(tiny_loaded_factory):
    tiny_model, tiny_weights = tiny_loaded_factory(numerics="hf")
    ids = torch.randint(
        0, tiny_model.vocab_size, (300,), generator=torch.Generator().manual_seed(3)
    )
    default = reference_logprobs(tiny_model, tiny_weights, ids)
    small = reference_logprobs(tiny_model, tiny_weights, ids, head_chunk_rows=7)
    np.testing.assert_allclose(default[1:], small[1:], rtol=0, atol=1e-5)


def test_reference_short_sequences(tiny_model, tiny_weights):
    assert reference_logprobs(tiny_model, tiny_weights, []).shape == (0,)
    one = reference_logprobs(tiny_model, tiny_weights, [5])
    assert one.shape == (1,) and np.isnan(one[0])
    two = reference_logprobs(tiny_model, tiny_weights, np.array([5, 9]))
    assert np.isnan(two[0]) and np.isfinite(two[1]) and two[1] < 0


def test_reference_versions_each_version_its_own_forward(tiny_loaded_factory):
    model, w0 = tiny_loaded_factory(seed=0)
    _, w1 = tiny_loaded_factory(seed=1)
    ids = torch.randint(0, model.vocab_size, (40,), generator=torch.Generator().manual_seed(4))
    versions = np.full(40, -1)
    versions[10:25] = 0
    versions[25:] = 7
    versions[0] = 7  # position 0 is never scored, whatever it says
    sampling = SamplingParams(temperature=0.8, top_k=50)
    got = reference_logprobs_versions(model, {0: w0, 7: w1}, ids, versions, sampling)
    full0 = reference_logprobs(model, w0, ids, sampling)
    full7 = reference_logprobs(model, w1, ids, sampling)
    assert np.isnan(got[:10]).all()
    assert np.array_equal(got[10:25], full0[10:25])
    assert np.array_equal(got[25:], full7[25:])
    assert not np.array_equal(full0[25:], full7[25:])
    with pytest.raises(ValueError):
        reference_logprobs_versions(model, {0: w0}, ids, versions[:5], sampling)


# ------------------------------------------------------------------------- processing by hand


def _process(row, target, **sampling):
    logits = torch.tensor([row], dtype=torch.float32)
    return float(processed_logprobs(logits, torch.tensor([target]), SamplingParams(**sampling))[0])


ROW = [2.0, 1.0, 0.0, -1.0]  # softmax ≈ [0.6439, 0.2369, 0.0871, 0.0321]


def test_raw_and_temperature_by_hand():
    z = math.e**2 + math.e + 1 + math.e**-1
    assert _process(ROW, 0) == pytest.approx(2 - math.log(z), abs=1e-6)
    assert _process(ROW, 3) == pytest.approx(-1 - math.log(z), abs=1e-6)
    z_half = math.e**4 + math.e**2 + 1 + math.e**-2  # temperature 0.5 doubles the logits
    assert _process(ROW, 1, temperature=0.5) == pytest.approx(2 - math.log(z_half), abs=1e-6)


def test_top_k_by_hand():
    z2 = math.e**2 + math.e
    assert _process(ROW, 0, top_k=2) == pytest.approx(2 - math.log(z2), abs=1e-6)
    assert _process(ROW, 1, top_k=2) == pytest.approx(1 - math.log(z2), abs=1e-6)
    assert _process(ROW, 2, top_k=2) == NEG_INF
    assert _process(ROW, 3, top_k=2) == NEG_INF
    # top_k = 0 and top_k >= V are off.
    assert _process(ROW, 3, top_k=0) == _process(ROW, 3)
    assert _process(ROW, 3, top_k=4) == _process(ROW, 3)
    assert _process(ROW, 3, top_k=99) == _process(ROW, 3)
    # Ties at the k-th value are all kept.
    assert _process([1.0, 1.0, 0.0], 1, top_k=1) == pytest.approx(math.log(0.5), abs=1e-6)
    assert _process([1.0, 1.0, 0.0], 2, top_k=1) == NEG_INF


def test_top_p_by_hand():
    # Mass strictly before each token (descending): 0, 0.6439, 0.8808, 0.9679.
    z3 = math.e**2 + math.e + 1
    assert _process(ROW, 2, top_p=0.8) == NEG_INF  # 0.8808 ≥ 0.8
    assert _process(ROW, 1, top_p=0.8) == pytest.approx(1 - math.log(math.e**2 + math.e), abs=1e-6)
    assert _process(ROW, 0, top_p=0.9) == pytest.approx(2 - math.log(z3), abs=1e-6)
    assert _process(ROW, 2, top_p=0.9) == pytest.approx(0 - math.log(z3), abs=1e-6)
    assert _process(ROW, 3, top_p=0.9) == NEG_INF
    # The top token is always kept, even with a tiny top_p.
    assert _process(ROW, 0, top_p=1e-9) == 0.0
    assert _process(ROW, 1, top_p=1e-9) == NEG_INF
    # Ties: the stable order keeps the lower index first.
    assert _process([1.0, 1.0, 0.0], 0, top_p=0.3) == 0.0
    assert _process([1.0, 1.0, 0.0], 1, top_p=0.3) == NEG_INF
    # top_p = 1 is off: even a vanishing tail token stays in the support.
    assert math.isfinite(_process([30.0, 0.0, -30.0], 2, top_p=1.0))


def test_top_k_then_top_p_on_renormalised_probabilities():
    # After top_k=3 the probabilities are e^2, e, 1 over z3 ≈ [0.6652, 0.2447, 0.0900]:
    # mass before token 2 is 0.9100 ≥ 0.9, so top_p=0.9 removes it.
    z2 = math.e**2 + math.e
    assert _process(ROW, 2, top_k=3, top_p=0.9) == NEG_INF
    assert _process(ROW, 0, top_k=3, top_p=0.9) == pytest.approx(2 - math.log(z2), abs=1e-6)
    # With temperature 2 first: logits [1, .5, 0, -.5]; top_k=3; probs ∝ e, e^.5, 1 ≈
    # [0.5065, 0.3072, 0.1863]: mass before token 2 is 0.8137 < 0.9, so it is kept.
    z = math.e + math.e**0.5 + 1
    got = _process(ROW, 2, temperature=2.0, top_k=3, top_p=0.9)
    assert got == pytest.approx(-math.log(z), abs=1e-6)


def test_outside_support_is_neg_inf_never_nan():
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(50, 300, generator=gen) * 3
    targets = torch.randint(0, 300, (50,), generator=gen)
    for sampling in [
        SamplingParams(top_k=3),
        SamplingParams(top_p=0.2),
        SamplingParams(0.3, 5, 0.5),
    ]:
        out = processed_logprobs(logits, targets, sampling)
        assert out.dtype == torch.float32
        assert not torch.isnan(out).any()
        assert torch.isneginf(out).sum() > 25  # most random targets fall outside
        assert (out[torch.isfinite(out)] <= 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_processing_is_row_independent(dtype):
    """The engine relies on it: processing any subset of rows gives those rows' bits."""
    gen = torch.Generator().manual_seed(6)
    logits = (torch.randn(150, 512, generator=gen) * 2).to(dtype)
    logits[3, :10] = logits[3, 10]  # ties
    targets = torch.randint(0, 512, (150,), generator=gen)
    for sampling in [
        SamplingParams(),
        SamplingParams(temperature=0.7),
        SamplingParams(top_k=40),
        SamplingParams(top_p=0.9),
        SamplingParams(temperature=1.3, top_k=100, top_p=0.95),
    ]:
        full = processed_logprobs(logits, targets, sampling)
        rows = torch.tensor([0, 3, 64, 65, 149])
        subset = processed_logprobs(logits.index_select(0, rows), targets[rows], sampling)
        assert torch.equal(subset, full[rows])
        for r in (3, 100):
            single = processed_logprobs(logits[r : r + 1], targets[r : r + 1], sampling)
            assert torch.equal(single, full[r : r + 1])
