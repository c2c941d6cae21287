"""A forward's stages, digested: where two sides that should agree first part ways.

In: a causal LM (a trainer's under ``trainer_numerics``, or the service's skeleton with a
version's weights), one sequence [1, N] and the sampler's settings. Out: ``TraceStage`` per
stage in the order the forward runs them — the embeddings, the rotary tables, every direct
submodule of every decoder layer (its norms, attention, MLP / experts) and the layer's output,
the final norm, the head's logits, and the processed logprobs — each with the sha256 of its
output's raw bytes plus its float64 sum and max |x|. The trainer (``verify``) and the service
(``/v1/trace``) run this same function on the same sequence alone, so the first stage whose
digests differ is where the two forwards diverge. Must not know about the wire.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from oldlogit.contract.numerics import SamplingParams

from .logprobs import _call, processed_logprobs
from .numerics import active_patch, unwrap_model
from .setups import clean_name

__all__ = ["MAX_TRACE_TOKENS", "TraceStage", "describe_stage", "first_divergence", "forward_trace"]

# A trace digests every stage's full output: the canary is short by design (bounded work and
# response size on the service; the request limit names it).
MAX_TRACE_TOKENS = 512


@dataclass(frozen=True)
class TraceStage:
    """One stage's output: ``name`` is the module path (or "logprobs"), ``sha256`` over the raw
    bytes of every tensor it output, ``total`` their float64 sum, ``absmax`` max |x|."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    sha256: str
    total: float
    absmax: float


def _tensors(output: Any) -> list[Tensor]:
    if isinstance(output, Tensor):
        return [output]
    if isinstance(output, (tuple, list)):
        return [t for item in output for t in _tensors(item)]
    first = getattr(output, "last_hidden_state", None)
    if isinstance(first, Tensor):
        return [first]
    return []


def _digest(name: str, tensors: list[Tensor]) -> TraceStage:
    h = hashlib.sha256()
    total = 0.0
    absmax = 0.0
    for t in tensors:
        data = t.detach().to("cpu").contiguous()
        h.update(str((str(data.dtype), tuple(data.shape))).encode())
        h.update(data.reshape(-1).view(torch.uint8).numpy().tobytes())
        if data.is_floating_point() and data.numel():
            wide = data.double()
            finite = wide[torch.isfinite(wide)]
            total += float(finite.sum())
            absmax = max(absmax, float(finite.abs().max())) if finite.numel() else absmax
    first = tensors[0]
    return TraceStage(
        name=name,
        dtype=str(first.dtype).removeprefix("torch."),
        shape=tuple(int(s) for s in first.shape),
        sha256=h.hexdigest(),
        total=total,
        absmax=absmax,
    )


def _watched(core: nn.Module) -> dict[nn.Module, str]:
    """The modules whose outputs are stages, by module path: the decoder's direct children,
    each layer and its direct children, the head."""
    names = {m: clean_name(n) for n, m in core.named_modules()}
    decoder = core.get_decoder()  # type: ignore[operator]
    watched: dict[nn.Module, str] = {}
    for child in decoder.children():
        if isinstance(child, nn.ModuleList):
            for layer in child:
                for sub in layer.children():
                    watched[sub] = names[sub]
                watched[layer] = names[layer]
        else:
            watched[child] = names[child]
    head = core.get_output_embeddings()  # type: ignore[operator]
    watched[head] = names[head]
    return watched


def forward_trace(
    model: nn.Module,
    input_ids: Tensor,
    *,
    sampling: SamplingParams = SamplingParams(),
    weights: Mapping[str, Tensor] | None = None,
    lm_head_fp32: bool | None = None,
) -> list[TraceStage]:
    """The stages of one forward of ``input_ids`` [1, N] (see the module docstring); no grad.

    Runs ``model`` as the caller has it (patched or plain); ``weights`` substitutes a version's
    tensors (``skeleton.bound_weights``, as the service runs its skeleton).
    """
    if input_ids.dim() != 2 or input_ids.shape[0] != 1 or input_ids.shape[1] < 2:
        raise ValueError(f"trace one sequence of >= 2 tokens [1, N], got {list(input_ids.shape)}")
    core = unwrap_model(model)
    watched = _watched(core)
    stages: list[TraceStage] = []

    def hook(module: nn.Module, _args: Any, output: Any) -> None:
        tensors = _tensors(output)
        if tensors:
            stages.append(_digest(watched[module], tensors))

    handles = [m.register_forward_hook(hook) for m in watched]
    try:
        with torch.no_grad():
            out = _call(
                model,
                weights,
                lm_head_fp32,
                {"input_ids": input_ids, "logits_to_keep": 0, "use_cache": False},
            )
    finally:
        for h in handles:
            h.remove()
    logits = out.logits if hasattr(out, "logits") else out[0]  # [1, N, V]
    with torch.no_grad():
        patch = active_patch(model)
        lp = processed_logprobs(  # [N-1]
            logits[0, :-1],
            input_ids[0, 1:].long(),
            sampling,
            tp_chunks=patch.tp_chunks if patch is not None else 0,
        )
    stages.append(_digest("logprobs", [lp]))
    return stages


def describe_stage(name: str) -> str:
    """A stage's name in words: "layer 3's attention output (model.layers.3.self_attn)"."""
    parts = name.split(".")
    if name == "logprobs":
        return "the processing (float32 logits ÷ temperature, top-k/top-p, log-softmax)"
    if "layers" in parts:
        i = parts.index("layers")
        if i + 1 < len(parts) and parts[i + 1].isdigit():
            layer = parts[i + 1]
            rest = parts[i + 2 :]
            if not rest:
                return f"layer {layer}'s output ({name})"
            sub = rest[0]
            kind = (
                "attention"
                if "attn" in sub or "attention" in sub
                else "MLP"
                if sub in ("mlp", "feed_forward", "block_sparse_moe", "moe")
                else sub
            )
            return f"layer {layer}'s {kind} output ({name})"
    last = parts[-1]
    if "embed" in last and "rotary" not in last:
        return f"the embeddings ({name})"
    if "rotary" in last:
        return f"the rotary tables ({name}: cos/sin from the inv_freq buffer)"
    if "norm" in last:
        return f"the final norm ({name})"
    return f"the head ({name})" if last in ("lm_head", "output", "embed_out") else name


def first_divergence(mine: list[TraceStage], theirs: list[TraceStage]) -> str | None:
    """A sentence naming where two traces first differ (None: they agree)."""
    for i, (a, b) in enumerate(zip(mine, theirs, strict=False)):
        if a.name != b.name:
            return (
                f"the two forwards run different modules at stage {i}: {a.name} here, {b.name} "
                "there (another architecture or module order)"
            )
        if a.sha256 != b.sha256:
            what = describe_stage(a.name)
            detail = []
            if (a.dtype, a.shape) != (b.dtype, b.shape):
                detail.append(f"{a.dtype}{list(a.shape)} here, {b.dtype}{list(b.shape)} there")
            detail.append(f"sum {a.total:.9g} here, {b.total:.9g} there")
            detail.append(f"max |x| {a.absmax:.6g} here, {b.absmax:.6g} there")
            before = f" (the {i} stages before agree)" if i else ""
            return f"first divergence at {what}: {'; '.join(detail)}{before}"
    if len(mine) != len(theirs):
        return f"the traces have {len(mine)} stages here, {len(theirs)} there"
    return None
