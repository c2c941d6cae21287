"""The parity matrix: trainer setups people run, each bitwise with the service or refused by name.

Every row loads the trainer's model as that setup does (a whole-module cast, float32 masters
under ``torch.autocast``, activation checkpointing, ``torch.compile``, an attention
implementation, PEFT, liger-kernel), enters ``trainer_numerics(model, like=info.numerics_spec())``
exactly as the README shows, and computes π_θ with ``token_logprobs`` on left-padded
micro-batches of 1, 4 and 8. Bitwise rows: every scored token equals the service's π_old at the
same version (HTTP and gRPC alternate), and the backward of a masked sum of those logprobs gives
the very gradients of the reference setup (the model loaded in the serving dtype): the forward
and the backward are one function on both sides. Refused rows raise before any step, naming
the cause. The multi-process rows (DDP, FSDP2) are tests/integration/test_parity_distributed.py.
Each row is also written to test-artifacts/parity-matrix.json (docs/trainers.md holds the table).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from oldlogit import Client, Sequence
from oldlogit.parity import (
    InvariantNumericsError,
    NumericsMismatch,
    token_logprobs,
    trainer_numerics,
)
from tests.integration.conftest import Served, start_served

VERSION = 2
LENGTHS = (3, 9, 17, 30, 41, 64, 77, 90)  # one tile and past it; padded to 90 in a batch
RESULTS: list[dict[str, Any]] = []


@pytest.fixture(scope="module")
def services(
    tmp_path_factory: pytest.TempPathFactory, model_dir: Path
) -> Iterator[dict[str, Served]]:
    out = {
        dtype: start_served(tmp_path_factory.mktemp(f"matrix-{dtype}"), model_dir, dtype=dtype)
        for dtype in ("bfloat16", "float16")
    }
    yield out
    for s in out.values():
        s.server.stop()
    path = Path("test-artifacts") / "parity-matrix.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(RESULTS, indent=1))


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


def _lora(model: torch.nn.Module) -> torch.nn.Module:
    peft = pytest.importorskip("peft")
    return peft.get_peft_model(  # type: ignore[no-any-return]
        model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    )


def _liger(model: torch.nn.Module) -> torch.nn.Module:
    liger = pytest.importorskip("liger_kernel.transformers", reason="liger-kernel not installed")
    liger.apply_liger_kernel_to_qwen2(model=model)
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
        "PEFT LoRA adapter",
        "bfloat16",
        _then(_load(BF16), _lora),
        refused=r"peft\..*PEFT adapter computes W·x \+ B·A·x.*merge_and_unload",
    ),
    Setup(
        "liger-kernel apply_liger_kernel_to_qwen2(model=...)",
        "bfloat16",
        _then(_load(BF16), _liger),
        refused=r"runs liger_kernel\.transformers\..*apply_liger_kernel_to_\*",
    ),
]


def _padded(seqs: list[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, width - len(s) :] = torch.from_numpy(s)
        mask[i, width - len(s) :] = 1
    return ids, mask


def _samples(vocab: int) -> list[np.ndarray]:
    rng = np.random.default_rng(5)
    return [rng.integers(0, vocab, n).astype(np.int64) for n in LENGTHS]


def _served(served: Served, seqs: list[np.ndarray]) -> list[np.ndarray]:
    out = []
    for i, clients in enumerate((served.server.http_url, served.server.grpc_url)):
        with Client(clients) as c:
            half = seqs[i::2]
            res = c.logprobs_batch(
                [Sequence(token_ids=s, policy_version=VERSION, score_from=1) for s in half],
                use_cache=False,
            )
            out.extend((i + 2 * j, r.logprobs[1:]) for j, r in enumerate(res))
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
        ids, mask = _padded(chunk)
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
    served: Served, dtype: str, model_dir: Path, seqs: list[np.ndarray]
) -> dict[str, torch.Tensor]:
    if dtype not in _REFERENCE_GRADS:
        model = _load(getattr(torch, dtype))(model_dir, served.weights[VERSION])
        model.train()
        with trainer_numerics(model, like=Client(served.server.http_url).info().numerics_spec()):
            _, loss = _pi_theta(model, seqs, len(seqs), grad=True)
            loss.backward()
        _REFERENCE_GRADS[dtype] = _grads(model)
    return _REFERENCE_GRADS[dtype]


@pytest.mark.parametrize("setup", SETUPS, ids=[re.sub(r"\W+", "-", s.name) for s in SETUPS])
def test_parity_matrix(setup: Setup, services: dict[str, Served], model_dir: Path) -> None:
    served = services[setup.service]
    weights = served.weights[VERSION]
    with Client(served.server.http_url) as c:
        spec = c.info().numerics_spec()
    seqs = _samples(served.model.vocab_size)
    model = setup.load(model_dir, weights)
    model.train()  # dropout is 0 in these configs; checkpointing needs training mode
    row: dict[str, Any] = {"setup": setup.name, "service": setup.service}
    if setup.refused is not None:
        with pytest.raises((NumericsMismatch, InvariantNumericsError)) as err:
            with trainer_numerics(model, like=spec), setup.around():
                _pi_theta(model, seqs, 4, grad=False)
        assert re.search(setup.refused, str(err.value)), str(err.value)
        row.update(result="refused", message=str(err.value))
        RESULTS.append(row)
        return
    reference = _served(served, seqs)
    checked = 0
    max_abs = 0.0
    with trainer_numerics(model, like=spec):
        for size in (1, 4, 8):
            with setup.around():
                rows, _ = _pi_theta(model, seqs, size, grad=False)
            for mine, theirs in zip(rows, reference, strict=True):
                got = mine.detach().float().numpy()
                max_abs = max(max_abs, float(np.max(np.abs(got - theirs))))
                assert np.array_equal(got, theirs), (setup.name, size)
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
        ref = _reference_grads(served, setup.grads_like, model_dir, seqs)
        assert set(grads) == set(ref)
        for name, g in grads.items():
            # float32 masters: the cast's backward is exact, so the master gradient is the
            # reference gradient widened.
            assert torch.equal(g, ref[name].to(g.dtype)), (setup.name, name)
    row.update(result="bitwise", tokens=checked, max_abs=max_abs, micro_batches=[1, 4, 8])
    RESULTS.append(row)
