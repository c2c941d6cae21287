"""The parity matrix's rows: trainer setups people run, and the check that each is bitwise with
the service or refused by name.

Imported by tests/integration/test_parity_matrix.py (the trainer in this environment) and run
as ``python -m tests.parity_setups`` by tests/integration/test_parity_oldest_transformers.py
from ``.venv-verl`` (the oldest transformers release the ``trainer`` extra accepts) against a
service on the newest. Needs the client and torch/transformers only, never the service.

A row loads the trainer's model as that setup does, enters ``trainer_numerics(model,
like=info.numerics_spec())`` as docs/exactness.md shows, and computes π_θ with ``token_logprobs`` on
left-padded micro-batches of 1, 4 and 8: every scored token must equal the service's π_old at
the same version, and the backward of a masked sum of those logprobs must give the very
gradients of the reference setup (the model loaded in the serving dtype). A refused row must
raise before any step, naming the cause.
"""

from __future__ import annotations

import importlib
import json
import re
import sys
import traceback
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers
from transformers import AutoModelForCausalLM

from oldlogit import Client
from oldlogit import Sequence as WireSequence
from oldlogit.parity import (
    InvariantNumericsError,
    NumericsMismatch,
    token_logprobs,
    trainer_numerics,
)

VERSION = 2
LENGTHS = (3, 9, 17, 30, 41, 64, 77, 90)  # one tile and past it; padded to 90 in a batch


@dataclass
class Setup:
    name: str
    service: str  # the service's dtype
    load: Callable[[Path, dict[str, torch.Tensor]], torch.nn.Module]
    around: Callable[[], AbstractContextManager[Any]] = nullcontext  # around every forward
    refused: str | None = None  # a regex the refusal must match
    grads_like: str | None = None  # compare gradients with this dtype's reference setup
    extra: dict[str, Any] = field(default_factory=dict)


def _load(
    dtype: torch.dtype, **kw: Any
) -> Callable[[Path, dict[str, torch.Tensor]], torch.nn.Module]:
    def load(model_dir: Path, weights: dict[str, torch.Tensor]) -> torch.nn.Module:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, **kw)
        model.load_state_dict({k: v.to(dtype) for k, v in weights.items()})
        return model

    return load


def _then(
    load: Callable[[Path, dict[str, torch.Tensor]], torch.nn.Module],
    step: Callable[[torch.nn.Module], torch.nn.Module | None],
) -> Callable[[Path, dict[str, torch.Tensor]], torch.nn.Module]:
    def run(model_dir: Path, weights: dict[str, torch.Tensor]) -> torch.nn.Module:
        model = load(model_dir, weights)
        out = step(model)
        return model if out is None else out

    return run


def _checkpointing(reentrant: bool) -> Callable[[torch.nn.Module], None]:
    def step(model: torch.nn.Module) -> None:
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": reentrant}
        )

    return step


def _torch_checkpoint_wrapper(model: torch.nn.Module) -> None:
    """torch's own activation checkpointing (torchtitan's way): a CheckpointWrapper per layer."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        apply_activation_checkpointing,
    )

    layer_type = type(model.model.layers[0])
    apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, layer_type))


def _rope_theta(model: torch.nn.Module) -> torch.nn.Module:
    """A trainer whose config says another rope theta (its inv_freq is another tensor)."""
    cfg = model.config
    params = dict(getattr(cfg, "rope_parameters", None) or {})
    params["rope_theta"] = float(params.get("rope_theta", 10000.0)) * 2
    cfg.rope_parameters = params
    rotary = model.model.rotary_emb
    fresh = type(rotary)(config=cfg)
    rotary.inv_freq = fresh.inv_freq
    return model


def _lora(**extra: Any) -> Callable[[torch.nn.Module], torch.nn.Module]:
    """A PEFT LoRA adapter as get_peft_model makes it: lora_B at 0, so the adapter's logprobs
    are its base version's (trained adapters: tests/integration/test_lora_parity.py)."""

    def step(model: torch.nn.Module) -> torch.nn.Module:
        peft = _import_or_skip("peft")
        config = peft.LoraConfig(
            r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, **extra
        )
        return peft.get_peft_model(model, config)  # type: ignore[no-any-return]

    return step


def _liger(model: torch.nn.Module) -> torch.nn.Module:
    liger = _import_or_skip("liger_kernel.transformers")
    from transformers.models.qwen2 import modeling_qwen2

    # liger also swaps transformers' Qwen2 classes process-wide (for models built later):
    # undone right away; this model keeps the instance patches it got.
    module_names = dict(vars(modeling_qwen2))
    causal_forward = modeling_qwen2.Qwen2ForCausalLM.forward
    try:
        liger.apply_liger_kernel_to_qwen2(model=model)
    finally:
        for name, value in module_names.items():
            setattr(modeling_qwen2, name, value)
        modeling_qwen2.Qwen2ForCausalLM.forward = causal_forward
    return model


BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


def _autocast(dtype: torch.dtype) -> Callable[[], AbstractContextManager[Any]]:
    return lambda: torch.autocast("cpu", dtype=dtype)


SETUPS = [
    Setup("from_pretrained(dtype=bfloat16) (the reference)", "bfloat16", _load(BF16)),
    Setup(
        "from_pretrained() then model.to(torch.bfloat16)",
        "bfloat16",
        _then(_load(FP32), lambda m: m.to(BF16)),
        grads_like="bfloat16",
    ),
    Setup(
        "from_pretrained() then model.bfloat16()",
        "bfloat16",
        _then(_load(FP32), lambda m: m.bfloat16()),
        grads_like="bfloat16",
    ),
    Setup(
        "from_pretrained() then model.half() (float16 service)",
        "float16",
        _then(_load(FP32), lambda m: m.half()),
        grads_like="float16",
    ),
    Setup(
        "float32 masters under torch.autocast(bfloat16)",
        "bfloat16",
        _load(FP32),
        around=_autocast(BF16),
        grads_like="bfloat16",
    ),
    Setup(
        "float32 masters under torch.autocast(float16) (float16 service)",
        "float16",
        _load(FP32),
        around=_autocast(FP16),
        grads_like="float16",
    ),
    Setup(
        "float32 masters, no autocast",
        "bfloat16",
        _load(FP32),
        refused=r"compute dtype 'float32' here \(from parameters\), 'bfloat16' there",
    ),
    Setup(
        "torch.autocast(float16) over a bfloat16 service",
        "bfloat16",
        _load(FP32),
        around=_autocast(FP16),
        refused=r"compute dtype 'float16' here \(from torch.autocast",
    ),
    Setup(
        "activation checkpointing, reentrant",
        "bfloat16",
        _then(_load(BF16), _checkpointing(True)),
        grads_like="bfloat16",
    ),
    Setup(
        "activation checkpointing, non-reentrant",
        "bfloat16",
        _then(_load(BF16), _checkpointing(False)),
        grads_like="bfloat16",
    ),
    Setup(
        "activation checkpointing, non-reentrant, float32 masters under autocast(bfloat16)",
        "bfloat16",
        _then(_load(FP32), _checkpointing(False)),
        around=_autocast(BF16),
        grads_like="bfloat16",
    ),
    Setup(
        "torch apply_activation_checkpointing (CheckpointWrapper per layer)",
        "bfloat16",
        _then(_load(BF16), _torch_checkpoint_wrapper),
        grads_like="bfloat16",
    ),
    Setup(
        "torch.compile(model)",
        "bfloat16",
        _then(_load(BF16), lambda m: torch.compile(m)),
        grads_like="bfloat16",
    ),
    Setup(
        "model.compile() (in place)",
        "bfloat16",
        _then(_load(BF16), lambda m: m.compile()),
        grads_like="bfloat16",
    ),
    Setup(
        "attn_implementation='eager'",
        "bfloat16",
        _load(BF16, attn_implementation="eager"),
        grads_like="bfloat16",
    ),
    Setup(
        "attn_implementation='sdpa'",
        "bfloat16",
        _load(BF16, attn_implementation="sdpa"),
        grads_like="bfloat16",
    ),
    Setup(
        "attn_implementation='flex_attention'",
        "bfloat16",
        _load(BF16, attn_implementation="flex_attention"),
        grads_like="bfloat16",
    ),
    Setup(
        "config with another rope_theta (inv_freq differs)",
        "bfloat16",
        _then(_load(BF16), _rope_theta),
        refused=r"buffer model\.rotary_emb\.inv_freq: float32:\w+ here, float32:\w+ there",
    ),
    Setup(
        "PEFT LoRA adapter (lora_B at its zero init: the base version's bits)",
        "bfloat16",
        _then(_load(BF16), _lora()),
    ),
    Setup(
        "PEFT DoRA adapter",
        "bfloat16",
        _then(_load(BF16), _lora(use_dora=True)),
        refused=r"q_proj: DoRA \(use_dora=True\) adds a weight-norm term",
    ),
    Setup(
        "liger-kernel apply_liger_kernel_to_qwen2(model=...)",
        "bfloat16",
        _then(_load(BF16), _liger),
        refused=r"runs liger_kernel\.transformers\..*apply_liger_kernel_to_\*",
    ),
]


def left_padded(seqs: Sequence[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
    """A left-padded batch (ids, attention mask), each [len(seqs), longest]."""
    width = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, width - len(s) :] = torch.from_numpy(np.asarray(s, dtype=np.int64))
        mask[i, width - len(s) :] = 1
    return ids, mask


def _samples(vocab: int) -> list[np.ndarray]:
    rng = np.random.default_rng(5)
    return [rng.integers(0, vocab, n).astype(np.int64) for n in LENGTHS]


def _served(urls: Sequence[str], seqs: list[np.ndarray]) -> list[np.ndarray]:
    """The service's π_old of each sequence, half asked over each URL (HTTP, gRPC)."""
    out = []
    for i, url in enumerate(urls):
        with Client(url) as c:
            half = seqs[i :: len(urls)]
            res = c.logprobs_batch(
                [WireSequence(token_ids=s, policy_version=VERSION, score_from=1) for s in half],
                use_cache=False,
            )
            out.extend((i + len(urls) * j, r.logprobs[1:]) for j, r in enumerate(res))
    return [row for _, row in sorted(out, key=lambda x: x[0])]


def _pi_theta(
    model: torch.nn.Module, seqs: list[np.ndarray], size: int, grad: bool
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """π_θ of every sequence (positions 1…n−1) in micro-batches of ``size`` and the masked
    sum of all of them (the loss whose gradients are compared)."""
    rows: list[torch.Tensor] = []
    total = torch.zeros(())
    for lo in range(0, len(seqs), size):
        chunk = seqs[lo : lo + size]
        ids, mask = left_padded(chunk)
        with torch.set_grad_enabled(grad):
            out = token_logprobs(model, ids, mask)  # [b, T]
        width = ids.shape[1]
        for i, s in enumerate(chunk):
            rows.append(out[i, width - len(s) + 1 :])
        total = total + (out * mask).sum()
    return rows, total


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    from oldlogit.parity.setups import clean_name

    return {
        clean_name(n).removeprefix("_orig_mod."): p.grad.detach().clone()
        for n, p in model.named_parameters()
        if p.grad is not None
    }


_REFERENCE_GRADS: dict[str, dict[str, torch.Tensor]] = {}


def _reference_grads(
    url: str, dtype: str, model_dir: Path, weights: dict[str, torch.Tensor], seqs: list[np.ndarray]
) -> dict[str, torch.Tensor]:
    if dtype not in _REFERENCE_GRADS:
        model = _load(getattr(torch, dtype))(model_dir, weights)
        model.train()
        with trainer_numerics(model, like=Client(url).info().numerics_spec()):
            _, loss = _pi_theta(model, seqs, len(seqs), grad=True)
            loss.backward()
        _REFERENCE_GRADS[dtype] = _grads(model)
    return _REFERENCE_GRADS[dtype]


class Skipped(Exception):
    """A row whose library is not installed here."""


def _import_or_skip(name: str) -> Any:
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise Skipped(f"{name} is not installed") from exc


def run_setup(
    setup: Setup, urls: Sequence[str], model_dir: Path, weights: dict[str, torch.Tensor]
) -> dict[str, Any]:
    """One row: ``urls`` are the service's (serving ``setup.service``), HTTP then gRPC;
    ``weights`` the version's. Returns the row; raises AssertionError where parity fails."""
    with Client(urls[0]) as c:
        spec = c.info().numerics_spec()
        vocab = c.info().vocab_size
    seqs = _samples(vocab)
    model = setup.load(model_dir, weights)
    model.train()  # dropout is 0 in these configs; checkpointing needs training mode
    row: dict[str, Any] = {"setup": setup.name, "service": setup.service}
    if setup.refused is not None:
        try:
            with trainer_numerics(model, like=spec), setup.around():
                _pi_theta(model, seqs, 4, grad=False)
        except (NumericsMismatch, InvariantNumericsError) as err:
            assert re.search(setup.refused, str(err)), str(err)
            row.update(result="refused", message=str(err))
            return row
        raise AssertionError(f"{setup.name}: expected a refusal matching {setup.refused!r}")
    reference = _served(urls, seqs)
    checked = 0
    max_abs = 0.0
    with trainer_numerics(model, like=spec):
        for size in (1, 4, 8):
            with setup.around():
                rows, _ = _pi_theta(model, seqs, size, grad=False)
            for mine, theirs in zip(rows, reference, strict=True):
                got = mine.detach().float().numpy()
                max_abs = max(max_abs, float(np.max(np.abs(got - theirs))))
                assert np.array_equal(got, theirs), (setup.name, size, max_abs)
                checked += got.size
        # The backward: one batch, a masked sum of π_θ, gradients against the reference setup.
        with setup.around():
            rows, loss = _pi_theta(model, seqs, len(seqs), grad=True)
        for mine, theirs in zip(rows, reference, strict=True):
            assert np.array_equal(mine.detach().float().numpy(), theirs), setup.name
        loss.backward()
    grads = _grads(model)
    assert grads, "no gradient reached the parameters"
    if setup.grads_like is not None:
        ref = _reference_grads(urls[0], setup.grads_like, model_dir, weights, seqs)
        assert set(grads) == set(ref)
        for name, g in grads.items():
            # float32 masters: the cast's backward is exact, so the master gradient is the
            # reference gradient widened.
            assert torch.equal(g, ref[name].to(g.dtype)), (setup.name, name)
    row.update(result="bitwise", tokens=checked, max_abs=max_abs, micro_batches=[1, 4, 8])
    return row


def main(services: dict[str, dict[str, Any]], model_dir: str) -> list[dict[str, Any]]:
    """Every row, for a trainer in another environment (``python -m tests.parity_setups``).
    ``services``: per serving dtype, its ``urls`` and the version's ``weights`` file."""
    from safetensors.torch import load_file

    weights = {dtype: load_file(s["weights"]) for dtype, s in services.items()}
    out = []
    for setup in SETUPS:
        urls = services[setup.service]["urls"]
        try:
            out.append(run_setup(setup, urls, Path(model_dir), weights[setup.service]))
        except Skipped as exc:
            out.append({"setup": setup.name, "result": "skipped", "message": str(exc)})
        except Exception:
            out.append({"setup": setup.name, "result": "FAILED", "message": traceback.format_exc()})
    return out


if __name__ == "__main__":
    # python -m tests.parity_setups SERVICES_JSON MODEL_DIR OUT_JSON
    args = sys.argv[1:]
    result = main(json.loads(args[0]), args[1])
    Path(args[2]).write_text(json.dumps({"transformers": transformers.__version__, "rows": result}))
