"""``oldlogit.parity.verify``: the parity canary passes for bitwise setups and, when one thing
is broken, names that thing.

Each fault below is injected into an otherwise bitwise trainer, one at a time, and ``verify``
must raise ``ParityBroken`` naming the stage it breaks: a non-weight buffer's dtype (the
rotary tables), one layer's attention kernel, the head's dtype, the temperature the service is
asked with. Passing setups: the serving-dtype model, a module cast and float32 masters under
autocast (matched by the hash of their weights as published). Bad input: a version whose
weights the model does not hold, a model that is not a causal LM, a client without read access:
one clear error each. Over both transports.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from oldlogit import Client
from oldlogit.contract import errors
from oldlogit.parity import NumericsMismatch, ParityBroken, trainer_numerics, verify
from oldlogit.parity.numerics import NumericsPatch
from tests.integration.conftest import Served, start_served

VERSION = 2


@pytest.fixture(scope="module")
def bf16(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[Served]:
    s = start_served(tmp_path_factory.mktemp("verify"), model_dir, dtype="bfloat16")
    yield s
    s.server.stop()


def _model(served: Served, model_dir: Path, dtype: torch.dtype) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    model.load_state_dict({k: v.to(dtype) for k, v in served.weights[VERSION].items()})
    return model


def test_bitwise_setups_pass(bf16: Served, model_dir: Path, transport: str) -> None:
    with Client(bf16.url(transport)) as c:
        for model, around in (
            (_model(bf16, model_dir, torch.bfloat16), None),
            (_model(bf16, model_dir, torch.float32).to(torch.bfloat16), None),
            (_model(bf16, model_dir, torch.float32), torch.bfloat16),
        ):
            ctx: Any = (
                torch.autocast("cpu", dtype=around)
                if around
                else torch.autocast("cpu", enabled=False)
            )
            with ctx:
                report = verify(model, c, VERSION, temperature=0.7)
            assert report.tokens > 100 and report.policy_version == VERSION
            assert report.numerics == c.info().numerics_spec().key


def test_a_cast_buffer_is_named(
    bf16: Served, model_dir: Path, transport: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = _model(bf16, model_dir, torch.bfloat16)
    with Client(bf16.url(transport)) as c:
        with trainer_numerics(model, like=c.info().numerics_spec()):
            # Fault, after like= has checked the buffers: the patch stops holding them to the
            # config's values and inv_freq is cast to bfloat16 (what a module cast did before
            # trainer_numerics judged buffers).
            monkeypatch.setattr(NumericsPatch, "install_buffers", lambda self, dtype: None)
            rotary = model.model.rotary_emb
            rotary.inv_freq = rotary.inv_freq.to(torch.bfloat16)
            with pytest.raises(ParityBroken) as err:
                verify(model, c, VERSION)
    assert err.value.stage == "model.rotary_emb", str(err.value)
    assert "the rotary tables" in str(err.value) and "inv_freq" in str(err.value)
    assert 0 < err.value.tokens_off <= err.value.tokens


def test_one_layers_attention_kernel_is_named(bf16: Served, model_dir: Path, transport: str):
    model = _model(bf16, model_dir, torch.bfloat16)
    with Client(bf16.url(transport)) as c:
        spec = c.info().numerics_spec()
        # strict=False: the strict patch would refuse the foreign kernel's matmuls outright.
        with trainer_numerics(model, like=spec, strict=False):
            # Fault: layer 1 alone runs transformers' eager attention (its own config copy).
            attn = model.model.layers[1].self_attn
            attn.config = copy.copy(attn.config)
            attn.config._attn_implementation_internal = "eager"
            with pytest.raises(ParityBroken) as err:
                verify(model, c, VERSION)
    assert err.value.stage == "model.layers.1.self_attn", str(err.value)
    assert "layer 1's attention output" in str(err.value)
    # embeddings, rotary tables, layer 0's four submodules and output, layer 1's input norm
    assert "(the 8 stages before agree)" in str(err.value)


def test_a_config_that_computes_another_function_is_refused_by_like(
    bf16: Served, model_dir: Path, transport: str
) -> None:
    """/v1/info carries the config fields that decide the bits beyond weights and buffers, over
    both transports; a trainer whose config says another ``rms_norm_eps`` (same weights, same
    buffers: nothing else would tell) is refused by ``like=`` naming the field."""
    with Client(bf16.url(transport)) as c:
        spec = c.info().numerics_spec()
        fields = dict(spec.config)
        assert fields["rms_norm_eps"] and fields["num_hidden_layers"] == "2", fields
        model = _model(bf16, model_dir, torch.bfloat16)
        with trainer_numerics(model, like=spec):
            pass
        model.config.rms_norm_eps = 1e-3
        with pytest.raises(NumericsMismatch, match=r"config rms_norm_eps: 0\.001 here"):
            with trainer_numerics(model, like=spec):
                pass


def test_a_trainer_whose_attention_sees_other_keys_is_refused_by_like(
    bf16: Served, model_dir: Path, transport: str
) -> None:
    """/v1/info carries the window each layer's attention computed with at start-up, over both
    transports; a trainer whose layer computes with another window (set on the module, as a
    config edit or another transformers release would) is refused by ``like=`` once a sequence
    is longer than the narrower window, and scores the service's bits below that."""
    from oldlogit import Sequence
    from oldlogit.parity import token_logprobs

    with Client(bf16.url(transport)) as c:
        info = c.info()
        assert info.attention_windows == {0: 0, 1: 0}  # this Qwen2 config: no window
        from oldlogit.parity.numerics import hardware_name

        assert info.hardware == hardware_name("cpu")  # the processor kind, over both transports
        spec = info.numerics_spec()
        model = _model(bf16, model_dir, torch.bfloat16)
        model.model.layers[1].self_attn.sliding_window = 4
        ids = torch.randint(3, 300, (1, 12), generator=torch.Generator().manual_seed(5))
        with trainer_numerics(model, like=spec):
            short = token_logprobs(model, ids[:, :4])[0]
            with pytest.raises(NumericsMismatch, match=r"layer 1's attention .* window of 4"):
                token_logprobs(model, ids)
        (served,) = c.logprobs_batch(
            [Sequence(token_ids=ids[0, :4].tolist(), policy_version=VERSION)]
        )
        # position 0 has no logprob (NaN from the service, 0 from token_logprobs)
        assert torch.equal(short[1:].float(), torch.from_numpy(served.logprobs[1:]))


def test_the_heads_dtype_is_named(bf16: Served, model_dir: Path, transport: str) -> None:
    model = _model(bf16, model_dir, torch.bfloat16)
    with Client(bf16.url(transport)) as c:
        with trainer_numerics(model, like=c.info().numerics_spec()) as patch:
            patch.lm_head_fp32 = True  # Fault: an fp32 head on the trainer's side only
            with pytest.raises(ParityBroken) as err:
                verify(model, c, VERSION)
    assert err.value.stage == "lm_head", str(err.value)
    assert "the head (lm_head)" in str(err.value) and "fp32 head" in str(err.value)


class _OtherTemperature:
    """A client whose requests carry another temperature than the trainer's (a pipeline that
    asks for π_old at the wrong sampling settings)."""

    def __init__(self, client: Client) -> None:
        self.client = client

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)

    def logprobs_batch(self, *a: Any, **k: Any) -> Any:
        return self.client.logprobs_batch(*a, **{**k, "temperature": 1.0})

    def trace(self, *a: Any, **k: Any) -> Any:
        return self.client.trace(*a, **{**k, "temperature": 1.0})


def test_the_temperature_is_named(bf16: Served, model_dir: Path, transport: str) -> None:
    model = _model(bf16, model_dir, torch.bfloat16)
    with Client(bf16.url(transport)) as c, pytest.raises(ParityBroken) as err:
        verify(model, _OtherTemperature(c), VERSION, temperature=0.7)
    assert err.value.stage == "logprobs", str(err.value)
    assert "the processing" in str(err.value) and "temperature" in str(err.value)


def test_bad_input_gets_one_clear_error_each(bf16: Served, model_dir: Path, transport: str):
    model = _model(bf16, model_dir, torch.bfloat16)
    with Client(bf16.url(transport)) as c:
        with pytest.raises(errors.WeightsMismatch, match="does not hold the weights of version 1"):
            verify(model, c, 1)  # the model holds version 2
        with pytest.raises(errors.UnknownVersion):
            verify(model, c, 7)
        with pytest.raises(TypeError, match="Linear is not a transformers causal LM"):
            verify(torch.nn.Linear(4, 4), c, VERSION)


def test_a_client_without_read_access(tmp_path: Path, model_dir: Path) -> None:
    guarded = start_served(tmp_path, model_dir, dtype="bfloat16", read_token="reader")
    try:
        model = _model(guarded, model_dir, torch.bfloat16)
        with Client(guarded.server.http_url) as c, pytest.raises(errors.Unauthorized):
            verify(model, c, VERSION)
        with Client(guarded.server.http_url, token="reader") as c:
            assert verify(model, c, VERSION).tokens > 100
    finally:
        guarded.server.stop()
