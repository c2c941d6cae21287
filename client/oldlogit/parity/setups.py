"""What a trainer's forward really computes in, read off the live setup — not off labels.

In: the model a trainer hands to ``trainer_numerics`` (possibly under FSDP2 ``fully_shard``,
FSDP1, DDP, ``torch.compile``, inside ``torch.autocast``, with patched module classes). Out:
- ``compute_dtype``: the dtype the matmuls see — FSDP2 ``MixedPrecisionPolicy.param_dtype`` /
  FSDP1 ``MixedPrecision.param_dtype`` when set, else ``torch.autocast``'s dtype when a call
  runs inside it (float32 parameters only), else the parameters' own dtype;
- ``foreign_code``: modules whose forward is neither transformers' nor torch's (liger-kernel's
  fused patches, PEFT adapters, a hand-written forward): oldlogit cannot vouch for their bits,
  so the strict patch refuses them by name.
Pure inspection: changes nothing. Imports torch; must not know about tiles or the service.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from oldlogit.contract.numerics import NumericsMismatch

__all__ = [
    "ComputeDtype",
    "clean_name",
    "compute_dtype",
    "foreign_code",
    "sharded_precision",
]

# Path segments wrappers add to parameter and buffer names (FSDP1, activation checkpointing,
# torch.compile, a PEFT LoRA layer's base); dropped when a trainer's name is matched with the
# skeleton's.
_WRAPPER_SEGMENTS = (
    "_fsdp_wrapped_module.",
    "_checkpoint_wrapped_module.",
    "_orig_mod.",
    "base_layer.",
)
# Where the forward of a module must come from for the strict patch to vouch for it.
_TRUSTED = ("transformers.", "torch.", "oldlogit.")


def clean_name(name: str) -> str:
    """A parameter/buffer name without the segments wrappers insert."""
    for seg in _WRAPPER_SEGMENTS:
        name = name.replace(seg, "")
    return name


@dataclass(frozen=True)
class ComputeDtype:
    """The dtype a forward computes in and what decided it (said in refusals)."""

    dtype: torch.dtype
    source: str  # e.g. "parameters", "FSDP2 MixedPrecisionPolicy", "torch.autocast"
    cast_params: bool = False  # the patch casts the parameters itself (autocast, no FSDP)
    sharded: bool = False  # FSDP holds the parameters (they are cast by FSDP, or not at all)

    @property
    def name(self) -> str:
        return str(self.dtype).removeprefix("torch.")


def sharded_precision(model: nn.Module) -> tuple[bool, torch.dtype | None, str]:
    """(FSDP present, its forward param dtype or None, which FSDP) over ``model`` and its
    submodules; several FSDP modules that disagree on the dtype are refused by name."""
    fsdp2: tuple[type, ...] = ()
    try:
        from torch.distributed.fsdp import FSDPModule

        fsdp2 = (FSDPModule,)
    except ImportError:  # pragma: no cover - torch built without distributed
        pass
    found: dict[str, torch.dtype | None] = {}
    kind = ""
    for name, module in model.named_modules():
        if fsdp2 and isinstance(module, fsdp2):
            policy = getattr(module._get_fsdp_state(), "_mp_policy", None)  # type: ignore[attr-defined]
            found[name or "<root>"] = getattr(policy, "param_dtype", None)
            kind = "FSDP2 MixedPrecisionPolicy"
        elif type(module).__name__ == "FullyShardedDataParallel":
            policy = getattr(module, "mixed_precision", None)
            found[name or "<root>"] = getattr(policy, "param_dtype", None)
            kind = "FSDP MixedPrecision"
    if not found:
        return False, None, ""
    dtypes = set(found.values())
    if len(dtypes) > 1:
        listing = ", ".join(f"{n}: {d}" for n, d in sorted(found.items(), key=lambda x: x[0]))
        raise NumericsMismatch(
            f"FSDP modules compute in different dtypes ({listing}): the service runs the whole "
            "model in one dtype; give every fully_shard call the same MixedPrecisionPolicy"
        )
    return True, dtypes.pop(), kind


def _param_dtype(model: nn.Module) -> torch.dtype:
    """The parameters' floating dtype: the head's (the dtype most of the model is in)."""
    head = model.get_output_embeddings()  # type: ignore[operator]
    return head.weight.dtype  # type: ignore[no-any-return]


def compute_dtype(
    model: nn.Module,
    device_type: str | None = None,
    *,
    sharded: tuple[bool, torch.dtype | None, str] | None = None,
) -> ComputeDtype:
    """What ``model``'s forward computes in (see the module docstring). ``device_type``: check
    ``torch.autocast`` for that device (a call in progress); None ignores autocast.
    ``sharded``: ``sharded_precision`` of the model as the trainer wraps it (default: of
    ``model``)."""
    is_sharded, fsdp_dtype, kind = sharded if sharded is not None else sharded_precision(model)
    if fsdp_dtype is not None:
        return ComputeDtype(fsdp_dtype, f"{kind}(param_dtype={fsdp_dtype})", sharded=True)
    own = _param_dtype(model)
    if device_type is not None and torch.is_autocast_enabled(device_type):
        auto = torch.get_autocast_dtype(device_type)
        if own == torch.float32 and auto != own:
            if is_sharded:
                raise NumericsMismatch(
                    f"torch.autocast({auto}) over FSDP-sharded float32 parameters without "
                    f"param_dtype: autocast casts per op, the service runs a {auto} model. Use "
                    f"fully_shard(..., mp_policy=MixedPrecisionPolicy(param_dtype={auto})) "
                    "instead of autocast"
                )
            return ComputeDtype(auto, f"torch.autocast(dtype={auto})", cast_params=True)
    source = "parameters" + (" (FSDP without param_dtype)" if is_sharded else "")
    return ComputeDtype(own, source, sharded=is_sharded)


def _origin(fn: Any) -> str:
    """The module a forward function was written in."""
    while True:
        if isinstance(fn, functools.partial):
            fn = fn.func
        elif inspect.ismethod(fn):
            fn = fn.__func__
        elif hasattr(fn, "__wrapped__"):
            fn = fn.__wrapped__
        else:
            break
    return str(getattr(fn, "__module__", "") or "")


def foreign_code(model: nn.Module, own_forward: set[int]) -> list[tuple[str, str]]:
    """(module path, "origin.qualname") of every module whose forward oldlogit cannot vouch
    for. ``own_forward``: ids of forwards the patch itself installed."""
    out = []
    for name, module in model.named_modules():
        fn = module.__dict__.get("forward")
        if fn is not None and id(fn) in own_forward:
            continue
        if fn is None:
            fn = type(module).forward
        origin = _origin(fn)
        if not origin.startswith(_TRUSTED) and origin not in ("torch", "transformers"):
            qual = getattr(fn, "__qualname__", type(fn).__name__)
            out.append((clean_name(name) or "<root>", f"{origin}.{qual}"))
    return out
