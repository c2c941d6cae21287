"""The parity canary: prove a live trainer setup bitwise with the service, or say where it is not.

In: the trainer's model holding the weights of a published version (any setup: a module cast,
autocast, FSDP, DDP), a client, the version. ``verify`` checks the model holds that version
(the weight hash of its state dict as published: canonical names, cast to the serving dtype,
DTensors gathered), scores a small fixed canary batch on both sides — the trainer's batch
left-padded, under ``trainer_numerics`` with the service's numerics — and compares every
scored token bit for bit. When a bit differs it traces the first such sequence alone on both
sides (``trace.forward_trace``; the service's ``/v1/trace``) and raises ``ParityBroken`` naming
the first stage whose outputs differ: the embeddings, the rotary tables, layer k's attention
or MLP output, the final norm, the head, or the processing. A PEFT LoRA model is checked
against an adapter version: its base weights against the base version's hash, its adapter
against the adapter's. Under FSDP every rank must call it (the forwards and the gather are
collective); the ranks agree on whether to trace.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from oldlogit.contract.numerics import SamplingParams
from oldlogit.contract.safetensors import hash_sources
from oldlogit.publishing.sources import is_dtensor, state_dict_sources

from .logprobs import token_logprobs
from .lora_trainer import adapter_tensor, lora_layers
from .numerics import active_patch, trainer_numerics, unwrap_model
from .setups import clean_name, sharded_precision
from .trace import MAX_TRACE_TOKENS, TraceStage, describe_stage, first_divergence, forward_trace

__all__ = [
    "CANARY_LENGTHS",
    "ParityBroken",
    "VerifyReport",
    "canary_samples",
    "published_adapter",
    "published_sha256",
    "verify",
]

# The canary's sequence lengths: one short of a tile, past one tile, several tiles (64 rows).
CANARY_LENGTHS = (9, 40, 90)


class ParityBroken(RuntimeError):
    """The trainer's π_θ differs from the service's π_old at equal weights; ``stage`` names the
    first stage where the two forwards differ (None: no stage differs alone — the batch layout
    does), ``tokens_off`` how many canary tokens differ, of ``tokens``."""

    def __init__(self, message: str, *, stage: str | None, tokens_off: int, tokens: int) -> None:
        super().__init__(message)
        self.stage = stage
        self.tokens_off = tokens_off
        self.tokens = tokens


@dataclass(frozen=True)
class VerifyReport:
    """A passed canary: ``tokens`` scored tokens bitwise equal at ``policy_version``."""

    policy_version: int
    sequences: int
    tokens: int
    numerics: str  # the service's numerics key


def canary_samples(
    vocab_size: int, max_len: int, lengths: Sequence[int] = CANARY_LENGTHS
) -> list[np.ndarray]:
    """The fixed canary sequences (seeded, within the vocabulary and the length limit)."""
    rng = np.random.default_rng(20261124)
    return [
        rng.integers(0, vocab_size, min(n, max_len, MAX_TRACE_TOKENS)).astype(np.int64)
        for n in lengths
    ]


def published_sha256(model: nn.Module, info: Any) -> str:
    """The weight hash of ``model``'s state dict as ``Client.publish(..., cast=True)`` would
    publish it: canonical names (``info.weight_layout()``), the serving dtype, DTensors
    gathered (a collective: every rank calls it, in the same order). Of a PEFT model: its
    base's weights (``base_layer.`` dropped, no lora_A/lora_B), what its base version holds."""

    core = unwrap_model(model)
    state = {}
    for name, tensor in _full_state_dict(model, core).items():
        if adapter_tensor(name):  # a PEFT model: its base's weights only (the base version)
            continue
        value = tensor.full_tensor() if is_dtensor(tensor) else tensor
        state[clean_name(name)] = value.detach().to("cpu")
    return hash_sources(state_dict_sources(state, info.weight_layout(), cast=True))


def _full_state_dict(model: nn.Module, core: nn.Module) -> dict[str, Any]:
    """The whole model's state dict: an FSDP1 root gathers its flat shards (on every rank)."""
    if type(model).__name__ != "FullyShardedDataParallel":
        return dict(core.state_dict())
    from torch.distributed.fsdp import FullStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    # Offloading copies to host memory shard by shard; with the parameters on the CPU already
    # it only adds copies (and crashed torch 2.13's FSDP1 state-dict hook here).
    on_cpu = next(core.parameters()).device.type == "cpu"
    config = FullStateDictConfig(offload_to_cpu=not on_cpu, rank0_only=False)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, config):
        return dict(model.state_dict())


def _agree(model: nn.Module, flag: bool) -> bool:
    """``flag`` OR-ed over the ranks when the model is sharded across a process group."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return flag
    params = list(unwrap_model(model).parameters())
    if not (sharded_precision(model)[0] or any(is_dtensor(p) for p in params)):
        return flag
    device = params[0].device if params else torch.device("cpu")
    t = torch.tensor([1 if flag else 0], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def _left_padded(seqs: list[np.ndarray], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, width - len(s) :] = torch.from_numpy(s)
        mask[i, width - len(s) :] = 1
    return ids.to(device), mask.to(device)


def verify(
    model: nn.Module,
    client: Any,
    version: int,
    *,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    samples: Sequence[Sequence[int] | np.ndarray] | None = None,
    check_weights: bool = True,
) -> VerifyReport:
    """Score the canary on both sides at ``version``; raise ``ParityBroken`` naming the first
    divergence (see the module docstring). ``samples``: other canary sequences (each ≥ 2
    tokens, scored from position 1). The model runs under ``trainer_numerics`` with the
    service's numerics unless it is patched already; dropout is off for the canary (eval mode,
    restored after). A model not holding the version's weights raises ``WeightsMismatch``
    (parameter ``version``); a setup that cannot be bitwise raises ``NumericsMismatch`` or
    ``InvariantNumericsError`` naming the cause, as ``trainer_numerics`` does.

    A PEFT LoRA model (one active adapter, as ``trainer_numerics`` takes it) is verified
    against an adapter version (``Client.publish_adapter``): its base weights must hash to the
    base version's, its adapter (``published_adapter``) to the adapter version's. The
    trace names the first diverging stage as for full weights — the stages are the layers'
    direct submodules, so a LoRA term and the base linear it sits on are one stage; the
    message names the adapter's target modules inside that stage.
    """
    from oldlogit.contract.types import Sequence as WireSequence

    core = unwrap_model(model)
    if not callable(getattr(core, "get_output_embeddings", None)):
        raise TypeError(f"{type(core).__name__} is not a transformers causal LM")
    targets = [name for name, _ in lora_layers(core)]
    sampling = SamplingParams(float(temperature), int(top_k), float(top_p))
    info = client.info()
    spec = info.numerics_spec()
    if check_weights:
        _check_weights(model, client, info, version, adapted=bool(targets))
    max_len = int(info.limits.get("max_seq_len", MAX_TRACE_TOKENS))
    seqs = (
        [np.asarray(s, dtype=np.int64) for s in samples]
        if samples is not None
        else canary_samples(info.vocab_size, max_len)
    )
    if not seqs or any(len(s) < 2 for s in seqs):
        raise ValueError("samples must hold sequences of at least 2 tokens")
    served = client.logprobs_batch(
        [WireSequence(token_ids=s, policy_version=version, score_from=1) for s in seqs],
        use_cache=False,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
    )
    patch = active_patch(core)
    ctx: Any = nullcontext() if patch is not None else trainer_numerics(model, like=spec)
    device = next(core.parameters()).device
    was_training = core.training
    core.eval()
    try:
        with ctx, torch.no_grad():
            ids, mask = _left_padded(seqs, device)
            out = (
                token_logprobs(model, ids, mask, temperature=temperature, top_k=top_k, top_p=top_p)
                .float()
                .cpu()
            )
            width = ids.shape[1]
            off, total, max_abs, first_off = 0, 0, 0.0, None
            for i, (s, res) in enumerate(zip(seqs, served, strict=True)):
                mine = out[i, width - len(s) + 1 :].numpy()
                want = res.logprobs[1:]
                differs = mine != want
                both_inf = np.isneginf(mine) & np.isneginf(want)
                differs &= ~both_inf
                if differs.any():
                    first_off = i if first_off is None else first_off
                    with np.errstate(invalid="ignore"):
                        gap = np.abs(mine.astype(np.float64) - want)[differs]
                    max_abs = max(max_abs, float(np.nan_to_num(gap, nan=np.inf).max()))
                off += int(differs.sum())
                total += len(mine)
            if not _agree(model, first_off is not None):
                return VerifyReport(version, len(seqs), total, spec.key)
            first_off = 0 if first_off is None else first_off  # another rank differed
            seq = seqs[first_off][:MAX_TRACE_TOKENS]
            mine_trace = forward_trace(
                model, torch.from_numpy(seq)[None].to(device), sampling=sampling
            )
    finally:
        core.train(was_training)
    theirs_trace = [
        TraceStage(s.name, s.dtype, tuple(s.shape), s.sha256, s.total, s.absmax)
        for s in client.trace(
            seq, version, temperature=temperature, top_k=top_k, top_p=top_p
        ).stages
    ]
    where = first_divergence(mine_trace, theirs_trace)
    stage = next(
        (a.name for a, b in zip(mine_trace, theirs_trace, strict=False) if a.sha256 != b.sha256),
        None,
    )
    head = (
        f"π_θ ≠ π_old at version {version}: {off} of {total} canary tokens differ "
        f"(max |Δ| {max_abs:.3g}); "
    )
    if where is None:
        raise ParityBroken(
            head + "every stage of the first differing sequence, run alone, agrees with the "
            "service: the difference comes from the batch (padding or packing) — is the model "
            "under trainer_numerics, and does its forward receive the attention mask?",
            stage=None,
            tokens_off=off,
            tokens=total,
        )
    raise ParityBroken(
        head + where + (_lora_hint(stage, targets) or _hint(stage)),
        stage=stage,
        tokens_off=off,
        tokens=total,
    )


def _check_weights(
    model: nn.Module, client: Any, info: Any, version: int, *, adapted: bool
) -> None:
    """Raise ``WeightsMismatch`` (parameter ``version``) unless ``model`` holds ``version``:
    full weights by their hash, a PEFT model's base by its base version's and its adapter by
    the adapter version's (``AdapterUpload.sha256``, as ``Client.publish_adapter`` sends it)."""
    from oldlogit.contract.errors import WeightsMismatch

    served = client.version(version)
    ours = published_sha256(model, info)
    if adapted != (served.adapter_of is not None):
        what = (
            f"an adapter version over base version {served.adapter_of}"
            if served.adapter_of is not None
            else "full weights"
        )
        fix = (
            "publish the adapter with Client.publish_adapter and verify that version"
            if adapted
            else "verify the PeftModel holding the adapter, or the base version"
        )
        raise WeightsMismatch(
            f"version {version} is {what}, the model "
            f"{'has' if adapted else 'has no'} PEFT LoRA layers: {fix}",
            parameter="version",
        )
    if adapted:
        base = client.version(served.adapter_of)
        if ours != base.weight_sha256:
            raise WeightsMismatch(
                f"the model's base weights are not those of version {version}'s base version "
                f"{served.adapter_of} (sha256 {ours[:12]}… here, {base.weight_sha256[:12]}… "
                "there): the base version holds the model's weights before get_peft_model",
                parameter="version",
            )
        ours = _adapter_sha256(model, ours)
    if ours != served.weight_sha256:
        kind = "adapter" if adapted else "weights"
        raise WeightsMismatch(
            f"the model does not hold the {kind} of version {version} as published "
            f"(sha256 {ours[:12]}… here, {served.weight_sha256[:12]}… there): verify a version "
            f"the trainer's {kind} were published as",
            parameter="version",
        )


def published_adapter(model: nn.Module) -> Any:
    """The active adapter of a PEFT model as its forward computes it, an
    ``oldlogit.parity.lora.Adapter`` for ``Client.publish_adapter``: sharded factors gathered
    (a collective: every rank calls it) and, under FSDP mixed precision, cast to its
    ``param_dtype`` (FSDP casts the adapter for the forward too; autocast does not)."""
    from .lora import Adapter, LoraSpec, adapter_from_peft

    _, layer = lora_layers(unwrap_model(model))[0]
    names = [a for a in layer.active_adapters if a in layer.lora_A]
    adapter = adapter_from_peft(model, adapter_name=names[0] if names else "default")
    _, dtype, _ = sharded_precision(model)
    tensors: dict[str, Any] = {}
    factor: Any
    for name, factor in adapter.tensors.items():
        full = (factor.full_tensor() if is_dtensor(factor) else factor).detach().to("cpu")
        tensors[name] = full if dtype is None else full.to(dtype)
    spec = adapter.spec.as_dict()
    spec["dtype"] = str(next(iter(tensors.values())).dtype).removeprefix("torch.")
    return Adapter(LoraSpec.from_dict(spec), tensors)


def _adapter_sha256(model: nn.Module, base_sha256: str) -> str:
    """The weight hash ``Client.publish_adapter(version, published_adapter(model), ...)``
    gives over a base of hash ``base_sha256``."""
    from oldlogit.contract.adapters import AdapterConfig
    from oldlogit.publishing.adapters import AdapterUpload

    adapter = published_adapter(model)
    config = AdapterConfig.from_dict(adapter.spec.as_dict())
    return AdapterUpload.from_tensors(config, adapter.tensors).sha256(base_sha256)


def _lora_hint(stage: str | None, targets: list[str]) -> str:
    """For a PEFT model: the adapter's target modules inside the diverging stage ("" when
    none: the usual hint then)."""
    inside = [clean_name(t) for t in targets if stage and clean_name(t).startswith(f"{stage}.")]
    if not inside:
        return ""
    shown = ", ".join(inside[:4]) + (f" and {len(inside) - 4} more" if len(inside) > 4 else "")
    return (
        f". The stage holds the adapter's LoRA layers {shown}: the trace does not split a "
        "LoRA term from the base linear under it — compare their lora_A/lora_B, scaling "
        "(alpha, rank, rsLoRA) and dtype with the adapter version's"
    )


# What usually moves the bits at a stage (by a word in ``describe_stage``'s sentence).
_HINTS = (
    (
        "rotary",
        "the rotary tables come from non-weight buffers (inv_freq): a cast or another "
        "config changes them",
    ),
    (
        "embeddings",
        "the embeddings differ before any matmul: the weights' dtype or an embedding scale",
    ),
    (
        "attention",
        "attention differs first: the attention kernel, a window or softcap setting, "
        "or the positions",
    ),
    (
        "head",
        "the head differs first: its dtype (an fp32 head on one side only?) or a logit "
        "scale or softcap",
    ),
    (
        "processing",
        "only the processing differs: temperature, top-k or top-p are not the same on both sides",
    ),
)


def _hint(stage: str | None) -> str:
    if stage is None:
        return ""
    what = describe_stage(stage)
    return next((f". Usually: {hint}" for word, hint in _HINTS if word in what), "")
