"""``trainer_numerics`` on real transformers models: batch-invariant forward and backward.

A token's logprob under the patch depends only on its own sequence: micro-batch size, padding
side, packing and ``logits_to_keep`` change no bit. The patched forward is the model's own
function (close to the plain forward), its gradients match the plain model's, it covers every
matmul the model runs, and the model is restored on exit. The service side of the same
contract is tests/integration/test_trainer_parity.py.
"""

from __future__ import annotations

import collections
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from transformers import AutoModelForCausalLM, Gemma2Config, LlamaConfig, Qwen2Config

from oldlogit.contract.numerics import NUMERICS_REVISION
from oldlogit.parity import (
    ActiveDropout,
    NumericsMismatch,
    NumericsSpec,
    UncoveredMatmul,
    local_spec,
    token_logprobs,
    trainer_numerics,
)
from oldlogit.parity import attention as attention_module
from oldlogit.parity.attention import (
    ATTENTION_NAME,
    InvariantNumericsError,
    plan_segments,
    recording_windows,
)
from oldlogit.parity.ops import TileMode
from oldlogit.parity.tiles import tiled_linear
from tests.packed import packed_logprobs

VOCAB = 300


def _model(arch: str, dtype: torch.dtype, seed: int = 0, **extra: object) -> nn.Module:
    common = {
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 128,
        "initializer_range": 0.2,
        "max_position_embeddings": 1024,
    }
    common.update(extra)
    config = {"qwen2": Qwen2Config, "llama": LlamaConfig, "gemma2": Gemma2Config}[arch](**common)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        for p in model.parameters():  # norms and biases get noise too: every weight matters
            if p.numel() > 1 and bool((p == p.flatten()[0]).all()):
                p.data += 0.1 * torch.randn_like(p)
    return model.to(dtype).eval()


def _sequences(
    rng: np.random.Generator, count: int, lo: int = 2, hi: int = 90
) -> list[torch.Tensor]:
    return [
        torch.from_numpy(rng.integers(0, VOCAB, int(rng.integers(lo, hi)))) for _ in range(count)
    ]


def _padded(seqs: list[torch.Tensor], side: str) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, s in enumerate(seqs):
        sl = slice(0, len(s)) if side == "right" else slice(width - len(s), width)
        ids[i, sl] = s
        mask[i, sl] = 1
    return ids, mask


def _row(out: torch.Tensor, i: int, n: int, side: str) -> torch.Tensor:
    width = out.shape[1]
    return out[i, :n] if side == "right" else out[i, width - n :]


def _sampling(rng: np.random.Generator) -> dict[str, float | int]:
    return {
        "temperature": float(rng.choice([1.0, 0.7, 1.3])),
        "top_k": int(rng.choice([0, 0, 5, 50])),
        "top_p": float(rng.choice([1.0, 1.0, 0.9, 0.5])),
    }


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_micro_batches_padding_and_packing_change_no_bit(arch, dtype):
    model = _model(arch, dtype, seed=1)
    rng = np.random.default_rng(7)
    with trainer_numerics(model, tile_rows=32):
        for case in range(6):
            sampling = _sampling(rng)
            fp32 = bool(case % 2)
            seqs = _sequences(rng, int(rng.choice([1, 3, 8])))
            alone = [token_logprobs(model, s[None], lm_head_fp32=fp32, **sampling)[0] for s in seqs]
            for side in ("left", "right"):
                ids, mask = _padded(seqs, side)
                out = token_logprobs(model, ids, mask, lm_head_fp32=fp32, **sampling)
                for i, s in enumerate(seqs):
                    got = _row(out, i, len(s), side)
                    assert torch.equal(got, alone[i]), (case, side, i)
                    if side == "left":
                        assert not _row(out, i, out.shape[1], side)[: out.shape[1] - len(s)].any()
            # Packed: one row, positions restarting at 0 per sequence.
            ids = torch.cat(seqs)[None]
            pos = torch.cat([torch.arange(len(s)) for s in seqs])[None]
            out = token_logprobs(model, ids, position_ids=pos, lm_head_fp32=fp32, **sampling)[0]
            start = 0
            for i, s in enumerate(seqs):
                assert torch.equal(out[start : start + len(s)], alone[i]), (case, "packed", i)
                start += len(s)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_unpadded_rows_of_one_length_are_their_sequences_alone(dtype):
    """A batch of whole rows (no padding, one length: one attention call over the [B, H, T, D]
    tensors themselves) gives each row the bits of its sequence alone and packed."""
    model = _model("qwen2", dtype, seed=2)
    rng = np.random.default_rng(11)
    with trainer_numerics(model, tile_rows=32):
        for length in (7, 64, 90):
            seqs = _sequences(rng, 4, lo=length, hi=length + 1)
            batch = token_logprobs(model, torch.stack(seqs), temperature=0.8)
            ids = torch.cat(seqs)[None]
            pos = torch.cat([torch.arange(len(s)) for s in seqs])[None]
            packed = token_logprobs(model, ids, position_ids=pos, temperature=0.8)[0]
            for i, s in enumerate(seqs):
                alone = token_logprobs(model, s[None], temperature=0.8)[0]
                assert torch.equal(batch[i], alone), (length, i)
                assert torch.equal(packed[i * length : (i + 1) * length], alone), (length, i)


@pytest.mark.parametrize("threads", [1, 2])
def test_sequences_of_one_length_share_a_call_only_where_that_keeps_their_bits(threads):
    """Sequences of equal length packed (or padded) share one CPU attention call only where a
    check showed each keeps the bits of its own call: at head dim 8 and 2 threads fp32 SDPA
    split over batch × heads gave lengths 23 and 29 other bits (an AMD EPYC); such groups run
    one call per sequence."""
    model = _model("qwen2", torch.float32, seed=4, hidden_size=32)  # head dim 8
    rng = np.random.default_rng(5)
    seqs = [torch.from_numpy(rng.integers(0, VOCAB, n)) for n in (23, 29, 23, 29, 23, 7)]
    was = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with trainer_numerics(model):
            alone = [token_logprobs(model, s[None])[0] for s in seqs]
            for i, got in enumerate(packed_logprobs(model, seqs)):
                assert torch.equal(got, alone[i]), ("packed", i)
            same = torch.stack([seqs[0], seqs[2], seqs[4]])  # one length, no padding
            batch = token_logprobs(model, same)
            for row, i in zip(batch, (0, 2, 4), strict=True):
                assert torch.equal(row, alone[i]), ("batch", i)
    finally:
        torch.set_num_threads(was)


def test_a_group_whose_shared_call_differs_runs_one_call_per_sequence(monkeypatch):
    calls: list[int] = []
    real = attention_module._segment_attention

    def counting(q, k, v, **params):  # type: ignore[no-untyped-def]
        calls.append(q.shape[0])
        return real(q, k, v, **params)

    monkeypatch.setattr(attention_module, "_segment_attention", counting)
    model = _model("qwen2", torch.float32, seed=4)
    seqs = [torch.arange(1, 12), torch.arange(2, 13), torch.arange(3, 9)]
    ids = torch.cat(seqs)[None]
    pos = torch.cat([torch.arange(len(s)) for s in seqs])[None]
    with trainer_numerics(model):
        monkeypatch.setattr(attention_module, "_sharing_agrees", lambda *a: True)
        token_logprobs(model, ids, position_ids=pos)
        assert sorted(calls) == [1, 1, 2, 2]  # 2 layers: (the two of length 11) + (the other)
        calls.clear()
        monkeypatch.setattr(attention_module, "_sharing_agrees", lambda *a: False)
        token_logprobs(model, ids, position_ids=pos)
        assert calls == [1] * 6  # one call per sequence per layer


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logits_to_keep_scores_the_completion_with_the_same_bits(dtype):
    """TRL's layout: prompts left-padded, completions right-padded, logits for the last K."""
    model = _model("qwen2", dtype, seed=2)
    rng = np.random.default_rng(8)
    prompts = _sequences(rng, 4, 3, 20)
    completions = _sequences(rng, 4, 2, 30)
    k = max(len(c) for c in completions)
    p_ids, p_mask = _padded(prompts, "left")
    c_ids, c_mask = _padded(completions, "right")
    ids, mask = torch.cat([p_ids, c_ids], 1), torch.cat([p_mask, c_mask], 1)
    with trainer_numerics(model):
        # The model's own call with logits_to_keep (what TRL does) gives the same logits rows.
        full = model(input_ids=ids, attention_mask=mask).logits
        kept = model(input_ids=ids, attention_mask=mask, logits_to_keep=k + 1).logits
        assert torch.equal(kept, full[:, -(k + 1) :])
        out = token_logprobs(model, ids, mask, logits_to_keep=k, temperature=0.7)
        assert out.shape == (4, k)
        for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
            alone = token_logprobs(model, torch.cat([p, c])[None], temperature=0.7)[0]
            assert torch.equal(out[i, : len(c)], alone[len(p) :])
            assert not out[i, len(c) :].any()  # padding: 0, so masked losses stay finite


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_the_patched_forward_is_the_models_function(arch):
    """Invariant numerics reorder float sums, nothing else: close to the plain forward."""
    model = _model(arch, torch.float32, seed=3)
    rng = np.random.default_rng(9)
    seqs = _sequences(rng, 5, 2, 200)
    ids, mask = _padded(seqs, "right")
    plain = [token_logprobs(model, s[None], temperature=0.8)[0] for s in seqs]
    with trainer_numerics(model):
        patched = token_logprobs(model, ids, mask, temperature=0.8)
    for i, s in enumerate(seqs):
        torch.testing.assert_close(patched[i, : len(s)], plain[i], rtol=0, atol=2e-5)


def test_sliding_window_and_softcaps_are_honoured():
    """Gemma 2 (attention-logit and final-logit soft-capping, sliding window) and Qwen 2 with a
    narrow sliding window: the invariant attention computes what the eager forward does, and is
    batch-invariant there too."""
    rng = np.random.default_rng(10)
    models = {
        "gemma2": _model(
            "gemma2",
            torch.float32,
            seed=4,
            head_dim=16,
            sliding_window=8,
            attn_logit_softcapping=5.0,
            final_logit_softcapping=3.0,
            attn_implementation="eager",
        ),
        "qwen2": _model(
            "qwen2",
            torch.float32,
            seed=5,
            use_sliding_window=True,
            sliding_window=6,
            max_window_layers=1,
            attn_implementation="eager",
        ),
    }
    for name, model in models.items():
        seqs = _sequences(rng, 3, 20, 60)  # longer than the windows
        plain = [token_logprobs(model, s[None])[0] for s in seqs]
        with trainer_numerics(model):
            alone = [token_logprobs(model, s[None])[0] for s in seqs]
            ids, mask = _padded(seqs, "left")
            batch = token_logprobs(model, ids, mask)
        for i, s in enumerate(seqs):
            torch.testing.assert_close(alone[i], plain[i], rtol=0, atol=5e-5, msg=name)
            assert torch.equal(_row(batch, i, len(s), "left"), alone[i]), name


class _CallsFrom(TorchFunctionMode):
    """Counts the torch calls that reach the modes, by the function that made them (past the
    patch's mode handing a call on)."""

    def __init__(self) -> None:
        super().__init__()
        self.callers: collections.Counter[str] = collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        frame = sys._getframe(1)
        while frame.f_code is TileMode.__torch_function__.__code__:
            frame = frame.f_back
        code = frame.f_code
        self.callers[f"{Path(code.co_filename).name}:{code.co_name}"] += 1
        return func(*args, **(kwargs or {}))


def test_the_sdpa_attention_runs_outside_the_mode_and_the_eager_one_inside():
    """The attention's SDPA path calls nothing the numerics' mode rules, so it runs with torch
    functions' Python layer off (a layer's shape reads and views skip the mode's per-call cost);
    the eager path (soft-capped logits: its tanh is a ruled pointwise op) stays inside. A
    counting mode under the patch's sees every call that reaches the patch's."""
    soft = _model("gemma2", torch.float32, seed=4, head_dim=16, attn_logit_softcapping=5.0)
    plain = _model("qwen2", torch.float32, seed=1)
    ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(3))
    inside = ("attention.py:_attention", "attention.py:_segment_attention")
    seen = {}
    for name, model in (("qwen2", plain), ("gemma2", soft)):
        with trainer_numerics(model), torch.no_grad(), _CallsFrom() as calls:
            token_logprobs(model, ids)
        seen[name] = {k: n for k, n in calls.callers.items() if k in inside}
        # the counting mode sees the rest: the modeling code's own calls
        assert any(k.startswith("modeling_") for k in calls.callers), calls.callers
    assert seen["qwen2"] == {}, seen["qwen2"]
    assert seen["gemma2"].get("attention.py:_segment_attention", 0) > 0, seen["gemma2"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_query_heads_read_in_place_give_the_expanded_copies_bits(dtype, monkeypatch):
    """On CPU with no graph recorded, grouped-query attention hands SDPA the key/value heads as
    they are (``enable_gqa``) where that was checked to give the bits of the expanded copies
    the definition names; here, against those copies, at head groups of 2, 4 and 7, one to
    three sequences, lengths 1–300, causal and under a narrower sliding window, at 1 and 2
    threads; and not while autograd records (the copies' backward stays the trainer's)."""
    gen = torch.Generator().manual_seed(5)
    taken = []
    real = attention_module._gqa_in_kernel
    monkeypatch.setattr(
        attention_module,
        "_gqa_in_kernel",
        lambda *a: taken.append(real(*a)) or taken[-1],
    )
    threads = torch.get_num_threads()
    try:
        for n_threads in (1, 2):
            torch.set_num_threads(n_threads)
            for heads, kv_heads, dim in ((4, 2, 16), (8, 2, 32), (7, 1, 64)):
                for n, length in ((1, 1), (3, 37), (2, 130), (1, 300)):
                    q, k, v = (
                        torch.randn(n, h, length, dim, generator=gen).to(dtype)
                        for h in (heads, kv_heads, kv_heads)
                    )
                    rep = heads // kv_heads
                    k_copy, v_copy = (t.repeat_interleave(rep, dim=1) for t in (k, v))
                    for window in (None, 16):
                        params = {
                            "scaling": dim**-0.5,
                            "sliding_window": window,
                            "softcap": None,
                            "dropout": 0.0,
                        }
                        with torch.no_grad():
                            got = attention_module._segment_attention(q, k, v, **params)
                            want = attention_module._segment_attention(
                                q, k_copy, v_copy, **params
                            )  # as many key heads as query heads: nothing to group
                        assert torch.equal(got, want), (n_threads, heads, kv_heads, n, length)
    finally:
        torch.set_num_threads(threads)
    assert taken and all(taken), taken  # the in-place path ran: this torch's kernel agrees
    q = torch.randn(1, 4, 9, 16, requires_grad=True)
    k, v = torch.randn(1, 2, 9, 16), torch.randn(1, 2, 9, 16)
    assert not real(q, k, v, False)  # a graph is recorded: the copies
    with torch.no_grad():
        assert real(q, k, v, False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backward_matches_the_plain_model(dtype):
    rng = np.random.default_rng(11)
    seqs = _sequences(rng, 4, 5, 60)
    ids, mask = _padded(seqs, "left")
    adv = torch.from_numpy(rng.standard_normal((4, 1))).float()

    def grads(patched: bool, checkpointing: bool = False) -> dict[str, torch.Tensor]:
        model = _model("qwen2", dtype, seed=6)
        if checkpointing:
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
            model.train()
        model.zero_grad()
        if patched:
            with trainer_numerics(model):
                lp = token_logprobs(model, ids, mask, temperature=0.7)
                (-(lp * adv * mask).sum()).backward()
        else:
            lp = token_logprobs(model, ids, mask, temperature=0.7)
            (-(lp * adv * mask).sum()).backward()
        return {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}

    plain, patched = grads(False), grads(True)
    assert plain.keys() == patched.keys() and len(plain) > 10
    tol = 1e-4 if dtype == torch.float32 else 5e-2  # bf16: a few ulps of the gradient scale
    for name in plain:
        scale = float(plain[name].abs().max()) + 1e-12
        err = float((patched[name] - plain[name]).abs().max()) / scale
        assert err <= tol, (name, err)
    # Activation checkpointing recomputes layers in the backward under the same numerics.
    recomputed = grads(True, checkpointing=True)
    for name in patched:
        assert torch.equal(recomputed[name], patched[name]), name


def test_every_matmul_is_covered_or_refused():
    model = _model("llama", torch.float32, seed=7)
    ids = torch.randint(0, VOCAB, (2, 17))
    with trainer_numerics(model):
        model(input_ids=ids)  # strict: a forward of the supported architectures passes
    mlp = model.model.layers[0].mlp
    original = type(mlp).forward

    def uncovered(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return torch.matmul(x, self.up_proj.weight.t()) @ self.down_proj.weight.t()

    mlp.forward = uncovered.__get__(mlp)  # type: ignore[method-assign]
    try:
        # A forward that is not transformers' is refused by name before any call ...
        with pytest.raises(InvariantNumericsError, match=r"model\.layers\.0\.mlp runs .*uncovered"):
            with trainer_numerics(model):
                pass
        with trainer_numerics(model, strict=False):
            model(input_ids=ids)  # allowed, without the guarantee
    finally:
        mlp.forward = original.__get__(mlp)  # type: ignore[method-assign]
    # ... and a matmul the tiles cannot compute (two batched activations) is refused where it
    # runs, whoever wrote it; one against a 2-D operand goes through the tiles row by row.
    x = torch.randn(2, 5, 8)
    with TileMode(64, True, None, False), pytest.raises(UncoveredMatmul, match="matmul"):
        torch.matmul(x, x.transpose(1, 2))
    with TileMode(64, False, None, False):
        torch.matmul(x, x.transpose(1, 2))  # strict=False: allowed
    with TileMode(64, True, None, False):
        assert torch.equal(torch.matmul(x[0], x[1].t()), tiled_linear(x[0], x[1]))


def test_a_dropout_that_is_on_is_refused_by_name():
    """A model in train() with attention_dropout > 0 draws a random mask each forward: no
    service forward can give those bits, so strict mode refuses it; in eval(), or with the
    dropout at 0, the same model scores bitwise as the model at inference does."""
    model = _model("qwen2", torch.bfloat16, seed=5, attention_dropout=0.1)
    ids = torch.randint(0, VOCAB, (2, 23), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), trainer_numerics(model):
        want = token_logprobs(model, ids)
    model.train()
    with trainer_numerics(model), pytest.raises(ActiveDropout, match=r"p=0\.1 .*train\(\)"):
        token_logprobs(model, ids)
    with trainer_numerics(model, strict=False):
        token_logprobs(model, ids)  # runs, without the guarantee
    model.config.attention_dropout = 0.0
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.0
    with trainer_numerics(model):
        got = token_logprobs(model, ids)  # train(), dropout off: the inference bits
    assert torch.equal(got, want)
    # A plain nn.Dropout in train() is refused the same way, whoever calls it.
    x = torch.randn(4, 8)
    with TileMode(64, True, None, False):
        assert torch.equal(nn.Dropout(0.2).eval()(x), x)
        assert torch.equal(nn.Dropout(0.0).train()(x), x)
        with pytest.raises(ActiveDropout, match=r"p=0\.2"):
            nn.Dropout(0.2).train()(x)
        with pytest.raises(ActiveDropout):
            torch.dropout(x, 0.5, True)


def test_generation_runs_the_models_own_forward_under_the_patch():
    """A trainer patched for a whole run still generates (TRL samples with the same model)."""
    model = _model("qwen2", torch.float32, seed=10)
    prompt = torch.randint(0, VOCAB, (2, 6))
    mask = torch.ones_like(prompt)
    mask[1, :2] = 0  # left padding
    kwargs = {"max_new_tokens": 5, "do_sample": False, "pad_token_id": 0}
    plain = model.generate(input_ids=prompt, attention_mask=mask, **kwargs)
    with trainer_numerics(model):
        patched = model.generate(input_ids=prompt, attention_mask=mask, **kwargs)
        assert model.config._attn_implementation == ATTENTION_NAME  # scoring numerics again
    assert torch.equal(plain, patched)


def test_a_scoring_call_with_an_empty_cache_is_invariant_and_fills_the_cache():
    """A trainer that passes a fresh ``DynamicCache`` to a scoring call gets the invariant
    forward (it ran the model's own forward before: other bits, silently), and the cache holds
    the sequence afterwards, so a decode step can follow; generation's own prefill, which
    passes an empty cache too, still runs the model's own forward (the test above)."""
    from transformers import DynamicCache

    from tests.architectures import WINDOW, hf_model

    for model in (_model("qwen2", torch.float32, seed=11), hf_model("mistral", seed=4)):
        ids = torch.randint(3, 150, (2, 3 * WINDOW))
        with torch.no_grad(), trainer_numerics(model):
            want = model(input_ids=ids).logits
            cache = DynamicCache(config=model.config)
            with recording_windows() as invariant_layers:  # filled by the invariant attention
                got = model(input_ids=ids, past_key_values=cache).logits
            assert torch.equal(got, want) and len(invariant_layers) == 2
            assert cache.get_seq_length() == ids.shape[1]
            with recording_windows() as invariant_layers:
                step = model(input_ids=ids[:, -1:], past_key_values=cache).logits  # decoding
            assert not invariant_layers  # the model's own forward
        assert step.shape[:2] == (2, 1) and cache.get_seq_length() == ids.shape[1] + 1


def test_the_decoder_called_on_its_own_computes_as_inside_the_forward():
    """A chunked loss calls the decoder itself (``model.model(...)``), then the head over its
    hidden states: under the patch the decoder plans its own batch (it was refused by name:
    no segment plan reached the attention), bitwise with the whole forward's hidden states in
    every family, left padding included, and the head's logits equal the forward's where the
    head is the model's last step; gradients flow."""
    from tests.architectures import ARCHS, hf_model

    after_head = {"gemma2", "gemma3_text", "granite", "cohere"}  # soft-cap / logit scale
    for arch in ARCHS:
        model = hf_model(arch, seed=1).to(torch.bfloat16)
        ids = torch.randint(3, 150, (2, 20))
        mask = torch.ones_like(ids)
        mask[1, :5] = 0
        with trainer_numerics(model):
            whole = model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
            hidden = model.get_decoder()(input_ids=ids, attention_mask=mask).last_hidden_state
            assert torch.equal(hidden, whole.hidden_states[-1]), arch
            if arch not in after_head:
                assert torch.equal(model.get_output_embeddings()(hidden), whole.logits), arch
            hidden.float().sum().backward()
        assert all(p.grad is not None for p in model.get_decoder().layers[0].parameters()), arch


def test_a_trainer_with_reduced_precision_float32_matmuls_scores_the_same_bits():
    """oneDNN's ``fp32_precision = "bf16"`` (and ``set_float32_matmul_precision("medium")``)
    compute float32 GEMMs in bfloat16 on CPUs that have it: other bits, silently, before.
    Under the numerics the forward runs with torch's defaults, as the service does, and the
    process's own settings are back afterwards. (CUDA's TF32: test_parity_cuda.py.)"""
    from oldlogit.parity.settings import default_kernel_settings

    mkldnn = getattr(torch.backends.mkldnn, "matmul", None)
    if mkldnn is None or not hasattr(mkldnn, "fp32_precision"):
        pytest.skip("this torch has no per-backend matmul precision")
    from tests.architectures import hf_model

    model = hf_model("qwen2", seed=1)  # hidden 32: oneDNN takes these GEMMs (measured)
    ids = torch.randint(3, 150, (3, 150))
    with trainer_numerics(model):
        want = token_logprobs(model, ids)
    before = mkldnn.fp32_precision
    try:
        mkldnn.fp32_precision = "bf16"
        with default_kernel_settings():
            assert mkldnn.fp32_precision == "ieee"
        assert mkldnn.fp32_precision == "bf16"
        with trainer_numerics(model):
            got = token_logprobs(model, ids)
        assert mkldnn.fp32_precision == "bf16"
    finally:
        mkldnn.fp32_precision = before
    assert torch.equal(got, want)


def test_a_trainer_with_attention_kernels_switched_off_scores_the_same_bits():
    """``enable_flash_sdp(False)`` or a surrounding ``sdpa_kernel(SDPBackend.MATH)`` makes
    torch pick another attention kernel, on CPU too, and oneDNN switched off another bfloat16
    GEMM: other bits, silently, before (measured). Under the numerics the forward runs with
    torch's default kernels, and the process's choice is back afterwards."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from tests.architectures import hf_model

    for dtype in (torch.float32, torch.bfloat16):
        model = hf_model("llama", seed=1).to(dtype)
        ids = torch.randint(3, 150, (3, 100))
        with trainer_numerics(model):
            want = token_logprobs(model, ids)
        torch.backends.cuda.enable_flash_sdp(False)
        try:
            with trainer_numerics(model):
                assert torch.equal(token_logprobs(model, ids), want), dtype
            assert not torch.backends.cuda.flash_sdp_enabled()
        finally:
            torch.backends.cuda.enable_flash_sdp(True)
        with sdpa_kernel(SDPBackend.MATH), trainer_numerics(model):
            assert torch.equal(token_logprobs(model, ids), want), dtype
            assert not torch.backends.cuda.flash_sdp_enabled()
        with torch.backends.mkldnn.flags(enabled=False), trainer_numerics(model):
            # oneDNN off: bfloat16 GEMMs take another kernel (other bits, measured)
            assert torch.equal(token_logprobs(model, ids), want), dtype
            assert not torch.backends.mkldnn.enabled


def test_the_model_is_restored_on_exit():
    model = _model("qwen2", torch.float32, seed=8)
    before_impl = model.config._attn_implementation
    ids = torch.randint(0, VOCAB, (1, 40))
    with torch.no_grad():
        before = model(input_ids=ids).logits
        with trainer_numerics(model):
            assert model.config._attn_implementation == ATTENTION_NAME
            assert "forward" in model.__dict__
            with pytest.raises(RuntimeError, match="already"):
                with trainer_numerics(model):
                    pass
        after = model(input_ids=ids).logits
    assert model.config._attn_implementation == before_impl
    assert "forward" not in model.__dict__
    assert not any("forward" in m.__dict__ for m in model.modules())
    assert torch.equal(before, after)


def test_like_adopts_the_service_numerics_and_refuses_a_mismatch():
    model = _model("qwen2", torch.bfloat16, seed=9)
    service = NumericsSpec(
        profile="invariant",
        dtype="bfloat16",
        device_kind="cpu",
        tile_rows=16,
        threads=torch.get_num_threads(),
        lm_head_fp32=True,
    )
    with trainer_numerics(model, like=service) as patch:
        assert patch.tile_rows == 16 and patch.lm_head_fp32
        assert patch.spec.mismatches(service) == []
    for change, word in (
        ({"dtype": "float32"}, "dtype"),
        ({"threads": 99}, "threads"),
        ({"revision": 0}, f"numerics revision: {NUMERICS_REVISION} here, 0 there"),  # older
        ({"torch_version": "2.0.0+cpu"}, "torch: "),
    ):
        other = NumericsSpec(**{**service.as_dict(), **change})
        with pytest.raises(NumericsMismatch, match=word):
            with trainer_numerics(model, like=other):
                pass
    # Config fields beyond weights and buffers: compared where both sides report them.
    here = local_spec(model, profile="invariant", tile_rows=16, lm_head_fp32=True)
    assert ("rms_norm_eps", json.dumps(model.config.rms_norm_eps)) in here.config
    changed = tuple((k, "0.5" if k == "rms_norm_eps" else v) for k, v in here.config)
    other_eps = NumericsSpec(**{**here.as_dict(), "config": changed})
    assert here.mismatches(other_eps) == [
        f"config rms_norm_eps: {json.dumps(model.config.rms_norm_eps)} here, 0.5 there"
    ]
    assert here.mismatches(NumericsSpec(**{**here.as_dict(), "config": ()})) == []
    hf = NumericsSpec(**{**service.as_dict(), "profile": "hf", "tile_rows": None})
    with pytest.raises(NumericsMismatch, match="hf"):
        with trainer_numerics(model, like=hf):
            pass
    assert local_spec(model, profile="hf", tile_rows=None, lm_head_fp32=False).attention
    # An unknown torch build (an older service) is not a mismatch; a known one is in the key.
    assert (
        patch.spec.mismatches(NumericsSpec(**{**patch.spec.as_dict(), "torch_version": ""})) == []
    )
    assert (
        f"torch={torch.__version__}" in patch.spec.key
        and f"rev={NUMERICS_REVISION}" in patch.spec.key
    )


def test_like_holds_each_layers_sliding_window_where_it_would_change_the_bits():
    """The service records the window each layer's attention computes with (``/v1/info``
    ``attention_windows``); under ``like=`` a trainer whose layer would see other keys is
    refused naming the layer, and only then: a window at least as long as the forward's
    longest sequence is the same as none."""
    from tests.architectures import WINDOW, hf_model

    service = hf_model("mistral", seed=3)  # a window of WINDOW tokens in every layer
    ids = torch.randint(3, 150, (2, 20))
    with trainer_numerics(service) as patch, recording_windows() as seen:
        want = token_logprobs(service, ids)
        spec = NumericsSpec(**{**patch.spec.as_dict(), "windows": tuple(sorted(seen.items()))})
    assert spec.windows == ((0, WINDOW), (1, WINDOW))
    trainer = hf_model("mistral", seed=3)
    with trainer_numerics(trainer, like=spec):
        assert torch.equal(token_logprobs(trainer, ids), want)  # the same window: bitwise
    trainer.config.sliding_window = None  # a trainer config without the window
    short = ids[:, :WINDOW]
    with trainer_numerics(service):
        want_short = token_logprobs(service, short)
    with trainer_numerics(trainer, like=spec):
        # No key is out of the service's window in a sequence of WINDOW tokens: same bits.
        assert torch.equal(token_logprobs(trainer, short), want_short)
        with pytest.raises(NumericsMismatch) as err:
            token_logprobs(trainer, ids)
    said = str(err.value)
    assert "layer 0's attention" in said and "no sliding window here" in said, said
    assert f"a sliding window of {WINDOW} tokens there" in said and "20 tokens" in said, said
    # A longer window than the service's is refused the same way, once it is narrower than a
    # sequence; without ``like=`` the trainer runs its own config.
    trainer.config.sliding_window = WINDOW + 4
    with trainer_numerics(trainer, like=spec), pytest.raises(NumericsMismatch, match="of 10"):
        token_logprobs(trainer, ids)
    with trainer_numerics(trainer):
        assert not torch.equal(token_logprobs(trainer, ids), want)


def test_like_refuses_a_config_field_switched_off_on_one_side():
    """Gemma 2 recipes switch the attention soft-cap off (``attn_logit_softcapping=None``) to
    reach fused attention kernels: the same weights then compute another function. The field
    is unset on that side only; ``like=`` names it (it compared shared fields only before)."""
    from tests.architectures import config, hf_model

    service = hf_model("gemma2", seed=2)
    spec = local_spec(service, profile="invariant", tile_rows=64, lm_head_fp32=False)
    assert ("attn_logit_softcapping", "4.0") in spec.config
    cfg = config("gemma2")
    cfg.attn_logit_softcapping = None
    trainer = AutoModelForCausalLM.from_config(cfg)
    trainer.load_state_dict(service.state_dict())
    with pytest.raises(NumericsMismatch, match=r"config attn_logit_softcapping: unset here, 4\.0"):
        with trainer_numerics(trainer, like=spec):
            pass
    with trainer_numerics(service, like=spec):
        pass


def test_packed_sequences_under_a_block_diagonal_4d_mask_score_as_alone():
    """Packers that hand the model a [batch, 1, seq, seq] block-diagonal causal mask (bool, or
    additive float) with position ids restarting per sequence: each sequence's logits bitwise
    as when it runs alone, in every family (a 4-D mask was refused before). Without position
    ids, or with a mask that is not block-diagonal and causal, refused by name."""
    from tests.architectures import ARCHS, hf_model

    lengths = (12, 8, 9)
    total = sum(lengths)
    bool_mask = torch.zeros(total, total, dtype=torch.bool)
    at = 0
    for n in lengths:
        bool_mask[at : at + n, at : at + n] = torch.ones(n, n, dtype=torch.bool).tril()
        at += n
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    for arch in ARCHS:
        model = hf_model(arch, seed=5).to(torch.bfloat16)
        seqs = [torch.randint(3, 150, (n,)) for n in lengths]
        with torch.no_grad(), trainer_numerics(model):
            alone = torch.cat([model(input_ids=s[None]).logits[0] for s in seqs])
            for mask in (
                bool_mask,
                torch.where(bool_mask, 0.0, float("-inf")).to(torch.bfloat16),
            ):
                out = model(
                    input_ids=torch.cat(seqs)[None],
                    attention_mask=mask[None, None],
                    position_ids=positions,
                ).logits[0]
                assert torch.equal(out, alone), (arch, mask.dtype)
    ids = torch.cat(seqs)[None]
    with trainer_numerics(model):
        with pytest.raises(InvariantNumericsError, match="without position_ids"):
            model(input_ids=ids, attention_mask=bool_mask[None, None])
        ahead = bool_mask.clone()
        ahead[3, 5] = True  # a token that sees a later one
        with pytest.raises(InvariantNumericsError, match="not block-diagonal and causal"):
            model(input_ids=ids, attention_mask=ahead[None, None], position_ids=positions)
        bias = torch.where(bool_mask, 0.5, float("-inf"))
        with pytest.raises(InvariantNumericsError, match="a bias"):
            model(input_ids=ids, attention_mask=bias[None, None], position_ids=positions)


def test_like_refuses_a_trainer_on_another_processor_kind():
    """ATen's kernels are picked per instruction set: a forward at ``ATEN_CPU_CAPABILITY=avx2``
    gives other bits than at AVX-512 (measured in float32 and bfloat16), as another GPU
    architecture does on CUDA. The spec names the processor; ``like=`` refuses another kind by
    name, and the result-cache key carries it."""
    import os
    import subprocess
    import sys

    from oldlogit.parity.numerics import hardware_name

    model = _model("qwen2", torch.float32, seed=13)
    here = local_spec(model, profile="invariant", tile_rows=64, lm_head_fp32=False)
    assert here.hardware == hardware_name("cpu") and here.hardware.startswith("cpu ")
    assert f"/hw={here.hardware}" in here.key
    script = "import torch; print(torch.backends.cpu.get_cpu_capability())"
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default"}  # the lowest: no vector kernels
    lower = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    ).stdout.strip()
    assert lower and f"cpu {lower}" != here.hardware
    there = NumericsSpec(**{**here.as_dict(), "hardware": f"cpu {lower}"})
    with pytest.raises(NumericsMismatch, match=rf"hardware: {here.hardware} here, cpu {lower}"):
        with trainer_numerics(model, like=there):
            pass
    assert NumericsSpec(**{**here.as_dict(), "hardware": ""}).mismatches(here) == []


def test_families_whose_code_hides_the_plan_or_writes_its_own_linear_hold():
    """StableLM and Nemotron do not pass their forward's keywords to the attention function
    (refused before: no plan reached it): packed and left-padded rows now bitwise as alone,
    also through activation checkpointing's recompute. A linear layer written as
    ``x @ weight.T`` was refused as a matmul outside the tiles; it goes through them now."""
    from transformers import AutoConfig

    base = dict(
        vocab_size=160,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=48,
        max_position_embeddings=256,
        pad_token_id=0,
    )
    seqs = [torch.randint(3, 150, (n,)) for n in (9, 23)]
    # A linear written as a matmul (transformers' Falcon writes ``hidden @ weight.T``): the
    # rows go through the tiles, so a row's bits are the same alone and in any batch.
    weight = torch.randn(48, 32, dtype=torch.bfloat16)
    rows = torch.randn(70, 32, dtype=torch.bfloat16)
    with TileMode(64, True, None, False):
        whole = rows @ weight.T
        assert torch.equal(whole, tiled_linear(rows, weight))
        assert torch.equal((rows[5:6] @ weight.T)[0], whole[5])
        assert torch.equal(torch.matmul(rows[None, :9], weight.T)[0], whole[:9])
    for arch in ("stablelm", "nemotron"):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(7)
            model = AutoModelForCausalLM.from_config(AutoConfig.for_model(arch, **base))
        model = model.to(torch.bfloat16)
        ids = torch.zeros(2, 23, dtype=torch.long)
        mask = torch.zeros_like(ids)
        ids[0, 14:], mask[0, 14:] = seqs[0], 1
        ids[1], mask[1] = seqs[1], 1
        packed = torch.cat(seqs)[None]
        positions = torch.cat([torch.arange(9), torch.arange(23)])[None]
        with trainer_numerics(model):
            alone = [token_logprobs(model, s[None])[0] for s in seqs]
            padded = token_logprobs(model, ids, mask)
            assert torch.equal(padded[0, 14:], alone[0]), arch
            assert torch.equal(padded[1], alone[1]), arch
            both = token_logprobs(model, packed, position_ids=positions)[0]
            assert torch.equal(both, torch.cat(alone)), arch
        model.train()
        model.gradient_checkpointing_enable()
        with trainer_numerics(model):
            out = token_logprobs(model, ids, mask)
            assert torch.equal(out, padded), arch
            out.float().sum().backward()  # the recompute runs the attention again
        assert model.model.layers[0].self_attn.q_proj.weight.grad is not None, arch


def test_segment_plans():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 0, 0], [0, 0, 0, 0, 0]])
    segs, pos = plan_segments(3, 5, mask, None)
    assert segs.rows == ((0, 2, 5), (1, 0, 3))
    assert pos.tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 0, 0], [0, 0, 0, 0, 0]]
    packed = torch.tensor([[0, 1, 2, 0, 1, 0, 0, 1]])
    segs, pos = plan_segments(1, 8, None, packed)
    assert segs.rows == ((0, 0, 3), (0, 3, 5), (0, 5, 6), (0, 6, 8))
    assert torch.equal(pos, packed)
    with pytest.raises(InvariantNumericsError, match="position_ids"):
        plan_segments(1, 5, torch.tensor([[1, 1, 0, 1, 1]]), None)
    assert segs.continued == ()
    # A sequence whose positions do not start at 0 continues one begun outside this batch.
    segs, _ = plan_segments(1, 6, None, torch.tensor([[7, 8, 9, 0, 1, 2]]))
    assert segs.rows == ((0, 0, 3), (0, 3, 6)) and segs.continued == ((0, 0, 7),)


@pytest.mark.parametrize("mask_dtype", [None, torch.long, torch.bool, torch.float32])
def test_a_batch_of_whole_rows_plans_as_the_general_path_does(mask_dtype, monkeypatch):
    """No mask or a mask of ones (the common call) takes a short path: the same segments and
    positions as the general one, which a mask with a zero still takes."""
    for batch, length in ((1, 1), (1, 128), (3, 7)):
        ones = None if mask_dtype is None else torch.ones(batch, length, dtype=mask_dtype)
        short = plan_segments(batch, length, ones, None)
        with monkeypatch.context() as m:
            m.setattr(attention_module, "_all_real", lambda *_: False)
            general = plan_segments(batch, length, ones, None)
        assert short[0] == general[0] and short[0].rows == tuple(
            (b, 0, length) for b in range(batch)
        )
        assert torch.equal(short[1], general[1]) and short[1].dtype == torch.int64
        assert short[1].is_contiguous()
    segs, pos = plan_segments(2, 4, torch.tensor([[1, 1, 1, 1], [0, 1, 1, 1]]), None)
    assert segs.rows == ((0, 0, 4), (1, 1, 4)) and pos.tolist() == [[0, 1, 2, 3], [0, 0, 1, 2]]


def test_a_slice_of_a_sequence_is_refused_and_whole_sequences_hold():
    """Sequence parallelism (verl's Ulysses) hands a rank the middle of a sequence, positions
    continuing: oldlogit's attention would see only the slice, the service scores the whole
    sequence, so strict mode refuses it by name. A slice that starts at a sequence's beginning
    scores each sequence as the whole batch does."""
    model = _model("qwen2", torch.bfloat16, seed=2)
    ids = torch.randint(0, VOCAB, (1, 24), generator=torch.Generator().manual_seed(4))
    pos = torch.cat([torch.arange(12), torch.arange(12)])[None]
    with trainer_numerics(model), torch.no_grad():
        with pytest.raises(InvariantNumericsError, match="start a sequence at position 5"):
            token_logprobs(model, ids[:, 5:12], position_ids=torch.arange(5, 12)[None])
        both = token_logprobs(model, ids, position_ids=pos)
        second = token_logprobs(model, ids[:, 12:], position_ids=pos[:, 12:])
    assert torch.equal(both[:, 12:], second)
    with trainer_numerics(model, strict=False), torch.no_grad():
        token_logprobs(model, ids[:, 5:12], position_ids=torch.arange(5, 12)[None])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_head_called_on_its_own_computes_as_inside_the_forward(dtype):
    """A trainer's chunked loss takes the forward's hidden states and calls the head itself,
    a few rows at a time: under the patch those logits are the forward's own, bit for bit,
    whatever the chunk (with the fp32 head too); on exit the head is the model's again."""
    model = _model("qwen2", dtype, seed=6, hidden_size=256, intermediate_size=512)
    ids = torch.randint(0, VOCAB, (3, 45), generator=torch.Generator().manual_seed(6))
    for fp32 in (False, True):
        with trainer_numerics(model, lm_head_fp32=fp32), torch.no_grad():
            out = model(input_ids=ids, output_hidden_states=True)
            hidden = out.hidden_states[-1].reshape(-1, out.hidden_states[-1].shape[-1])
            want = out.logits.reshape(-1, out.logits.shape[-1])
            for chunk in (1, 7, 37, 64, 100):
                for a in range(0, hidden.shape[0], chunk):
                    got = model.lm_head(hidden[a : a + chunk])
                    assert torch.equal(got, want[a : a + chunk]), (fp32, chunk, a)
    assert "forward" not in model.lm_head.__dict__


def test_a_mask_of_sequence_ids_must_agree_with_the_position_ids():
    """Some packers mark packed sequences by id in the attention mask (1, 1, 2, 2, 2): beside
    position ids that restart there it gives the packed bits; without position ids, or where
    they continue a sequence, it is refused by name instead of read as one long sequence."""
    model = _model("qwen2", torch.float32, seed=8)
    ids = torch.randint(0, VOCAB, (1, 24), generator=torch.Generator().manual_seed(8))
    pos = torch.cat([torch.arange(10), torch.arange(14)])[None]
    seq_ids = torch.cat([torch.ones(10), 2 * torch.ones(14)]).long()[None]
    with trainer_numerics(model), torch.no_grad():
        want = token_logprobs(model, ids, position_ids=pos)
        assert torch.equal(token_logprobs(model, ids, seq_ids, position_ids=pos), want)
        with pytest.raises(InvariantNumericsError, match=r"by id .* without position_ids"):
            token_logprobs(model, ids, seq_ids)
        for other in (torch.arange(24), torch.cat([torch.arange(5), torch.arange(19)])):
            with pytest.raises(InvariantNumericsError, match="start sequences elsewhere"):
                token_logprobs(model, ids, seq_ids, position_ids=other[None])
        with pytest.raises(InvariantNumericsError, match="negative values"):
            token_logprobs(model, ids, torch.where(seq_ids > 1, 0.0, -1e9))


def test_a_micro_batch_of_padding_only_scores_zeros_and_backpropagates():
    """A data-parallel rank's filler micro-batch (every token padding) gives zeros that still
    hang on the graph: the trainer's backward runs and adds nothing."""
    model = _model("qwen2", torch.float32, seed=9)
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(9))
    with trainer_numerics(model):
        lp = token_logprobs(model, ids, torch.zeros_like(ids))
        lp.sum().backward()
    assert torch.equal(lp.detach(), torch.zeros(2, 8))
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(bool((g == 0).all()) for g in grads)


def test_flash_attention_sequence_bounds_must_agree_with_the_position_ids():
    """A packed forward may pass flash-attention's varlen bounds (``cu_seq_lens_q``/``_k``,
    as AReaL does) beside position_ids: bounds that agree change nothing, bounds that mark
    other sequences than the positions do are refused by name instead of being ignored."""
    model = _model("qwen2", torch.float32, seed=4)
    ids = torch.randint(0, VOCAB, (1, 24), generator=torch.Generator().manual_seed(5))
    pos = torch.cat([torch.arange(10), torch.arange(14)])[None]
    cu = torch.tensor([0, 10, 24], dtype=torch.int32)
    varlen = {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": 14, "max_length_k": 14}
    with trainer_numerics(model), torch.no_grad():
        want = model(input_ids=ids, position_ids=pos).logits
        assert torch.equal(model(input_ids=ids, position_ids=pos, **varlen).logits, want)
        with pytest.raises(InvariantNumericsError, match=r"cu_seq_lens .*\[0, 10, 24\].*\[0, 24\]"):
            model(input_ids=ids, position_ids=torch.arange(24)[None], **varlen)


def test_contraction_detection_of_the_tripwire() -> None:
    from oldlogit.parity.ops import _contracted

    a, b = torch.zeros(2, 3), torch.zeros(3, 4)
    assert _contracted(torch.matmul, (a, b)) == 3
    assert _contracted(torch.matmul, (torch.zeros(2, 1), torch.zeros(1, 4))) == 1  # outer
    assert _contracted(torch.addmm, (torch.zeros(4), a, b)) == 3
    assert _contracted(torch.einsum, ("i,j->ij", a, b)) == 1  # RoPE-style outer product
    assert _contracted(torch.einsum, ("ij,jk->ik", a, b)) > 1
    assert _contracted(torch.einsum, ("ij,jk", a, b)) > 1  # implicit output still contracts j
    assert _contracted(torch.einsum, ("ij,kl", a, b)) == 1


def test_token_logprobs_plans_a_batch_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The forward reuses the plan ``token_logprobs`` made of the same mask and positions; a
    direct model call (other tensors) still makes its own."""
    from oldlogit.parity import attention, logprobs

    calls: list[tuple[int, int]] = []
    real = attention.plan_segments

    def counting(batch: int, length: int, *args: object) -> object:
        calls.append((batch, length))
        return real(batch, length, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(attention, "plan_segments", counting)
    monkeypatch.setattr(logprobs, "plan_segments", counting)
    model = _model("qwen2", torch.float32)
    ids, mask = _padded(_sequences(np.random.default_rng(3), 3), "left")
    with trainer_numerics(model), torch.no_grad():
        got = token_logprobs(model, ids, mask)
        assert calls == [(3, ids.shape[1])]
        model(input_ids=ids, attention_mask=mask.clone())
        assert len(calls) == 2
        # The bits are the plan's, however it was reached (one sequence alone, planned anew).
        alone = token_logprobs(model, ids[:1, -int(mask[0].sum()) :])
    assert torch.equal(got[0, -alone.shape[1] :], alone[0])


def test_a_gpu_attention_operand_is_a_fresh_contiguous_copy() -> None:
    from oldlogit.parity.attention import _gpu_operand

    rows = torch.randn(130, 4, 8, requires_grad=True)
    view = rows[40:80].view(1, 40, 4, 8).transpose(1, 2)  # [1, h, L, D], as a packed call's
    u = _gpu_operand(view)
    assert torch.equal(u, view) and u.is_contiguous()
    assert u.data_ptr() != view.data_ptr() and u._base is None
    u.sum().backward()
    assert rows.grad is not None and int(rows.grad.sum()) == 40 * 4 * 8


def test_the_forward_never_takes_cudnns_attention_kernel() -> None:
    """torch documents cuDNN's attention forward as not deterministic: the pinned settings
    switch it off for the forward (the others stay on, as torch starts) and give the process
    its own setting back."""
    from oldlogit.parity.settings import default_kernel_settings

    cuda = torch.backends.cuda
    if not hasattr(cuda, "cudnn_sdp_enabled"):
        pytest.skip("this torch has no cuDNN attention switch")
    before = cuda.cudnn_sdp_enabled()
    try:
        cuda.enable_cudnn_sdp(True)
        with default_kernel_settings():
            assert not cuda.cudnn_sdp_enabled()
            assert cuda.flash_sdp_enabled() and cuda.mem_efficient_sdp_enabled()
        assert cuda.cudnn_sdp_enabled()
    finally:
        cuda.enable_cudnn_sdp(before)
