"""A model built from its config alone: what the service runs, and what a trainer is held to.

In: an HF config (a dict from config.json, or a ``PretrainedConfig``) and a dtype. Out: the
causal LM with its parameters on the meta device and its buffers real, exactly as the service
builds its skeleton (``build_skeleton``), and that skeleton's non-weight floating buffers
(``reference_buffers``: rotary ``inv_freq``, embedding scales — the tensors a forward reads
that no checkpoint carries). Both sides get those buffers from here, so a trainer whose
buffers were cast (``model.to(torch.bfloat16)``) computes with the service's values under
``trainer_numerics``. Must not know about tiles, segments or the service.
"""

from __future__ import annotations

import contextlib
import hashlib
import re
import threading
import weakref
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from oldlogit.contract.numerics import BUFFER_CONVENTION

__all__ = [
    "BUFFER_CONVENTION",
    "bound_weights",
    "buffer_digests",
    "build_skeleton",
    "keep_in_fp32",
    "params_on_meta",
    "reference_buffers",
]

_META_LOCK = threading.Lock()


class _Slots:
    """Where each tensor name of a module lives: the (table, attribute) places of its tie group
    (every name under which the same Parameter is reachable; a buffer is a group of its own),
    the table being a submodule's ``_parameters`` or ``_buffers`` dict. Computed once."""

    def __init__(self, module: nn.Module) -> None:
        groups: dict[int, list[tuple[str, dict[str, Any], str]]] = {}
        for prefix, mod in module.named_modules(remove_duplicate=False):
            for table in (mod._parameters, mod._buffers):
                for attr, t in table.items():
                    if t is not None:
                        full = f"{prefix}.{attr}" if prefix else attr
                        groups.setdefault(id(t), []).append((full, table, attr))
        self.places: dict[str, tuple[tuple[dict[str, Any], str], ...]] = {}
        self.group: dict[str, int] = {}  # name -> its tie group
        self.owner: dict[str, Any] = {}  # name -> the tensor it had when mapped
        for gid, group in enumerate(groups.values()):
            places = tuple((table, attr) for _, table, attr in group)
            table, attr = places[0]
            for full, _, _ in group:
                self.places[full] = places
                self.group[full] = gid
                self.owner[full] = table[attr]

    def current(self, names: Iterator[str]) -> bool:
        """Whether the given names are all mapped and still hold what they held then."""
        for name in names:
            places = self.places.get(name)
            if places is None:
                return False
            table, attr = places[0]
            if table.get(attr) is not self.owner[name]:
                return False
        return True


_slots: weakref.WeakKeyDictionary[nn.Module, _Slots] = weakref.WeakKeyDictionary()
_slots_lock = threading.Lock()


@contextlib.contextmanager
def bound_weights(module: nn.Module, weights: Mapping[str, Tensor]) -> Iterator[None]:
    """``module`` computes with ``weights`` (parameter or buffer name → tensor) instead of its
    own while the block runs, as ``torch.func.functional_call`` does (a tied name given binds
    every name of its tie group; a name not given keeps the module's own), at a fraction of
    its per-call cost: where each name lives is computed once per module. A name the module
    does not have goes through ``functional_call``'s own reparametrization (which sets it as
    an attribute). Not thread-safe for one module (neither is ``functional_call``)."""
    with _slots_lock:
        slots = _slots.get(module)
        mapped = slots is not None and slots.current(iter(weights))
        if not mapped:  # first call, or the module's tensors were replaced since
            slots = _slots[module] = _Slots(module)
            mapped = slots.current(iter(weights))
    assert slots is not None
    if not mapped:
        from torch.nn.utils.stateless import _reparametrize_module

        with _reparametrize_module(module, dict(weights), tie_weights=True):
            yield
        return
    bind: dict[int, tuple[str, Tensor]] = {}
    for name, tensor in weights.items():
        first = bind.setdefault(slots.group[name], (name, tensor))
        if first[1] is not tensor:
            raise ValueError(
                f"weights give the tied tensors {first[0]!r} and {name!r} different values"
            )
    saved: list[tuple[dict[str, Any], str, Any]] = []
    try:
        for name, tensor in bind.values():
            for table, attr in slots.places[name]:
                saved.append((table, attr, table[attr]))
                table[attr] = tensor
        yield
    finally:
        for table, attr, old in reversed(saved):
            table[attr] = old


@contextlib.contextmanager
def params_on_meta() -> Iterator[None]:
    """Modules built inside get their parameters on the meta device; buffers stay real.

    Buffers must stay real because some are computed at construction and never loaded (HF
    rotary ``inv_freq``). Patches ``nn.Module.register_parameter`` process-wide while active,
    so a lock serialises builders; build nothing else concurrently in other threads.
    """
    original = nn.Module.register_parameter

    def register_on_meta(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
        original(self, name, param)

    with _META_LOCK:
        nn.Module.register_parameter = register_on_meta  # type: ignore[method-assign]
        try:
            yield
        finally:
            nn.Module.register_parameter = original  # type: ignore[method-assign]


def _hf_config(config: Mapping[str, Any] | Any) -> Any:
    if not isinstance(config, Mapping):
        return config  # a PretrainedConfig already
    from transformers import AutoConfig

    if "model_type" not in config:
        raise ValueError("config.json has no 'model_type': not an HF-format model directory")
    fields = {k: v for k, v in config.items() if k not in ("model_type", "torch_dtype", "dtype")}
    return AutoConfig.for_model(config["model_type"], **fields)


def build_skeleton(
    config: Mapping[str, Any] | Any,
    dtype: torch.dtype,
    *,
    attn_implementation: str | None = None,
    model_class: type[nn.Module] | None = None,
) -> nn.Module:
    """The causal LM for ``config`` at ``dtype``: parameters on meta, real buffers, eval mode.

    ``model_class``: build this class (a trainer's own) rather than the one
    ``AutoModelForCausalLM`` picks for the config. Tied parameters are tied (one meta tensor),
    and the tensors ``from_pretrained(dtype=...)`` keeps in float32 are float32 here too.
    """
    hf_config = _hf_config(config)
    kwargs: dict[str, Any] = {"dtype": dtype}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    with params_on_meta():
        if model_class is not None:
            module: nn.Module = model_class._from_config(hf_config, **kwargs)  # type: ignore[attr-defined]
        else:
            from transformers import AutoModelForCausalLM

            module = AutoModelForCausalLM.from_config(hf_config, **kwargs)  # type: ignore[no-untyped-call]
    # Tying is what makes lm_head.weight *the same* meta Parameter as the embedding, so the
    # canonical names (and functional_call) see one tensor.
    module.tie_weights()  # type: ignore[operator]
    keep_in_fp32(module, dtype)
    module.eval()
    return module


def keep_in_fp32(module: nn.Module, dtype: torch.dtype) -> None:
    """The tensors ``from_pretrained(dtype=...)`` keeps in float32 (a model's
    ``_keep_in_fp32_modules[_strict]``, e.g. DeepSeek-V3's routing bias), float32 here too:
    a trainer's state dict holds them so, and they are part of the numerics."""
    get_plan = getattr(module, "_get_dtype_plan", None)
    plan: dict[str, torch.dtype] = get_plan(dtype) if callable(get_plan) else {}
    if not plan:
        return
    patterns = [re.compile(re.escape(k).replace(r"\*", r"[^.]+")) for k in plan]
    for sub_name, sub in module.named_modules():
        for store in (sub._parameters, sub._buffers):
            for name, tensor in list(store.items()):
                full = f"{sub_name}.{name}" if sub_name else name
                if tensor is None or not any(p.search(full) for p in patterns):
                    continue
                if tensor.is_floating_point() and tensor.dtype != torch.float32:
                    if isinstance(tensor, nn.Parameter):
                        store[name] = nn.Parameter(
                            tensor.detach().to(torch.float32), requires_grad=tensor.requires_grad
                        )
                    else:
                        store[name] = tensor.to(torch.float32)


def reference_buffers(module: nn.Module) -> dict[str, Tensor]:
    """The floating buffers ``module``'s forward reads that are not weights — the
    non-persistent ones, which no state dict carries — by name. Read off each submodule's own
    buffer table (``state_dict()`` would run wrappers' hooks: FSDP1 initialises itself there)."""
    out: dict[str, Tensor] = {}
    for prefix, sub in module.named_modules(remove_duplicate=False):
        for name, buf in sub._buffers.items():
            if (
                buf is not None
                and buf.is_floating_point()
                and name in sub._non_persistent_buffers_set
            ):
                out[f"{prefix}.{name}" if prefix else name] = buf
    return out


def _digest(t: Tensor) -> str:
    data = t.detach().to("cpu").contiguous()
    h = hashlib.sha256(str(tuple(data.shape)).encode())
    h.update(data.reshape(-1).view(torch.uint8).numpy().tobytes())
    return f"{str(t.dtype).removeprefix('torch.')}:{h.hexdigest()[:16]}"


def buffer_digests(buffers: Mapping[str, Tensor]) -> tuple[tuple[str, str], ...]:
    """``(name, "dtype:sha256[:16]")`` per buffer, sorted: what ``NumericsSpec.buffers`` holds
    (the digest covers shape and raw bytes, so a cast or a different formula shows)."""
    return tuple(sorted((n, _digest(t)) for n, t in buffers.items()))
