"""A PEFT LoRA trainer under ``trainer_numerics``: what is vouched for, what is refused by name.

In: the transformers model inside a ``PeftModel`` (``numerics.unwrap_model``). PEFT's LoRA
``Linear`` runs its own ``forward`` — base layer, input cast to lora_A's dtype, ``result +
lora_B(lora_A(x)) * scaling``, cast back — whose ``F.linear`` calls the numerics' mode tiles:
the definition ``lora.serving_adapters`` computes on the service. Vouched for only where that
source is the one checked here (``LINEAR_FORWARD_SOURCES``, a hash as ``regions`` keeps) and
the layer is plain LoRA over an ``nn.Linear``; everything else PEFT computes (DoRA and other
variants, embeddings, conv, quantized bases, biases, saved modules, several adapters, a merge,
an active dropout, a mixed-adapter batch) is refused by name. Must not know about the service.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

from torch import nn

from .attention import InvariantNumericsError
from .ops import ActiveDropout
from .regions import fingerprint

__all__ = [
    "LINEAR_FORWARD_SOURCES",
    "adapter_tensor",
    "check_model",
    "check_wrapper",
    "install",
    "lora_layers",
    "peft_refusal",
]

# PEFT 0.21's ``lora.Linear.forward`` and ``BaseTunerLayer._cast_input_dtype`` (``fingerprint``).
LINEAR_FORWARD_SOURCES = frozenset({("a15acbef02c65d58", "6ae421ef719937a2")})

_FIX = "(strict=False runs it anyway, without the guarantee)"
# Modules of PEFT's quantized-base LoRA layers (QLoRA and the like).
_QUANTIZED = ("bnb", "gptq", "awq", "aqlm", "eetq", "hqq", "torchao", "inc", "te")


_ADAPTER_SEGMENTS = frozenset(
    {"lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "lora_magnitude_vector"}
)


def adapter_tensor(name: str) -> bool:
    """Whether a parameter name is a PEFT LoRA adapter's (not a weight of the base model)."""
    return not _ADAPTER_SEGMENTS.isdisjoint(name.split("."))


def _is_peft(obj: Any) -> bool:
    return str(type(obj).__module__).startswith("peft.")


def lora_layers(core: nn.Module) -> list[tuple[str, Any]]:
    """(module path, layer) of every PEFT LoRA layer in ``core`` (any kind)."""
    return [
        (name, m)
        for name, m in core.named_modules()
        if _is_peft(m) and any(c.__name__ == "LoraLayer" for c in type(m).__mro__)
    ]


@functools.cache
def _sources(cls: Any) -> tuple[str, str]:
    return fingerprint(cls.forward), fingerprint(getattr(cls, "_cast_input_dtype", None))


def peft_refusal(core: nn.Module, name: str, layer: Any, adapters: Sequence[str]) -> str | None:
    """Why the LoRA layer ``name`` with these active ``adapters`` is not the definition (a
    sentence saying what to change), or None."""
    import peft

    kind = type(layer).__name__
    origin = str(type(layer).__module__)
    base = layer.get_base_layer()
    if origin.rsplit(".", 1)[-1] in _QUANTIZED or "bitsandbytes" in str(type(base).__module__):
        return (
            f"{name} is LoRA over a quantized base ({type(base).__name__}: QLoRA, "
            "bitsandbytes 4/8-bit and the like): the service serves the base version's "
            "weights as they are published; train LoRA over an unquantized base"
        )
    if kind == "Embedding":
        return f"{name} is LoRA on an embedding: target only linear layers (target_modules)"
    if kind.startswith("Conv") or kind == "_ConvNd":
        return f"{name} is LoRA on a convolution: target only linear layers (target_modules)"
    if type(layer) is not peft.tuners.lora.layer.Linear:
        return f"{name} is a PEFT {origin}.{kind} layer: only LoRA on nn.Linear is supported"
    if type(base) is not nn.Linear:
        return (
            f"{name} is LoRA over a {type(base).__module__}.{type(base).__name__}, not an "
            "nn.Linear: only LoRA over nn.Linear is supported"
        )
    if getattr(layer, "fan_in_fan_out", False):
        return f"{name} has fan_in_fan_out=True: train with fan_in_fan_out=False"
    if layer is core.get_output_embeddings():  # type: ignore[operator]
        return f"{name} is LoRA on the head: leave the lm_head out of target_modules"
    if not getattr(layer, "cast_input_dtype_enabled", True):
        return f"{name} has input dtype casting off (disable_input_dtype_casting): turn it on"
    if layer.merged:
        return (
            f"{name} has merged adapters {list(layer.merged_adapters)}: the definition is the "
            "unmerged forward; unmerge (model.unmerge_adapter()) before scoring"
        )
    for adapter in adapters:
        if layer.use_dora.get(adapter, False):
            return f"{name}: DoRA (use_dora=True) adds a weight-norm term: use_dora=False"
        if adapter in layer.lora_variant:
            variant = type(layer.lora_variant[adapter]).__name__
            return f"{name}: the LoRA variant {variant} is not supported: plain LoRA only"
        if layer.lora_bias.get(adapter, False):
            return f"{name}: LoRA biases (lora_bias=True): train with lora_bias=False"
    if _sources(type(layer)) not in LINEAR_FORWARD_SOURCES:
        return (
            f"{name}: PEFT {peft.__version__}'s lora.Linear.forward is not the code oldlogit "
            "was checked against (peft 0.21's): install peft>=0.21,<0.22"
        )
    return None


def _active(layer: Any) -> list[str]:
    return [a for a in layer.active_adapters if a in layer.lora_A]


def check_wrapper(model: nn.Module) -> None:
    """Refuse, by name, a PeftModel that is not LoRA (prompt learning, IA3, LoHa, ...) or has
    several active adapters."""
    seen = 0
    while _is_peft(model) and seen < 4:
        seen += 1
        config = getattr(model, "peft_config", None)
        active = getattr(model, "active_adapters", None)
        if isinstance(config, dict) and active is not None:
            names = [active] if isinstance(active, str) else list(active)
            if len(names) > 1:
                raise InvariantNumericsError(
                    f"several active PEFT adapters {names}: a version is one adapter over its "
                    f"base; activate one (model.set_adapter(name)) {_FIX}"
                )
            for name in names:
                cfg = config.get(name)
                kind = getattr(getattr(cfg, "peft_type", None), "value", "")
                if cfg is not None and str(kind).upper() != "LORA":
                    raise InvariantNumericsError(
                        f"a PEFT {kind} adapter: only LoRA adapters are supported {_FIX}"
                    )
        inner = getattr(model, "base_model", None)
        if not isinstance(inner, nn.Module) or inner is model:
            inner = getattr(model, "model", None)
        if not isinstance(inner, nn.Module):
            break
        model = inner


def check_model(core: nn.Module) -> set[str]:
    """The paths of the LoRA layers vouched for; any other PEFT module inside ``core`` (saved
    modules, trainable tokens, another tuner) or a layer ``peft_refusal`` refuses raises
    ``InvariantNumericsError`` by name."""
    vouched: set[str] = set()
    module: Any
    for name, module in core.named_modules():
        if not _is_peft(module):
            continue
        kind = type(module).__name__
        if kind == "ModulesToSaveWrapper":
            raise InvariantNumericsError(
                f"{name} is a PEFT modules_to_save copy: the trained module is not in the base "
                f"version; publish it as a full version, or train without modules_to_save {_FIX}"
            )
        if kind == "TrainableTokensWrapper" or kind == "TrainableTokensLayer":
            raise InvariantNumericsError(
                f"{name} trains embedding rows (trainable_token_indices): not supported {_FIX}"
            )
        if not any(c.__name__ == "LoraLayer" for c in type(module).__mro__):
            continue  # a LoRA layer's own parts (ModuleDicts are torch's); others: foreign code
        active = _active(module)
        if len(active) > 1:
            raise InvariantNumericsError(
                f"{name} has several active adapters {active}: activate one {_FIX}"
            )
        why = peft_refusal(core, name, module, active)
        if why is not None:
            raise InvariantNumericsError(f"{why} {_FIX}")
        vouched.add(name)
    return vouched


def install(
    core: nn.Module, vouched: set[str], set_forward: Callable[[nn.Module, Any], None]
) -> None:
    """Each vouched layer checks, at every call, what can change after the patch (a merge,
    another active adapter, a dropout that is on, PEFT's mixed-adapter batch), then runs
    PEFT's forward."""
    modules = dict(core.named_modules())
    for name in sorted(vouched):
        layer = modules[name]
        set_forward(layer, functools.partial(_checked_forward, core, name, layer, layer.forward))


def _checked_forward(
    core: nn.Module, name: str, layer: Any, call: Callable[..., Any], x: Any, *a: Any, **kw: Any
) -> Any:
    if kw.get("adapter_names") is not None:
        raise InvariantNumericsError(
            f"{name}: adapter_names= runs PEFT's mixed-adapter batch, which casts each "
            "adapter's output before adding (not the single-adapter forward): score each "
            f"adapter's sequences with that adapter active {_FIX}"
        )
    active = [] if layer.disable_adapters else _active(layer)
    if len(active) > 1:
        raise InvariantNumericsError(f"{name} has several active adapters {active} {_FIX}")
    why = peft_refusal(core, name, layer, active)
    if why is not None:
        raise InvariantNumericsError(f"{why} {_FIX}")
    for adapter in active:
        dropout = layer.lora_dropout[adapter]
        if isinstance(dropout, nn.Dropout) and dropout.p > 0 and dropout.training:
            raise ActiveDropout(
                f"{name}: lora_dropout p={dropout.p:g} is on (train() mode): its mask is "
                "random, so no forward of the service gives these logprobs. Set "
                f"lora_dropout=0 (TRL: disable_dropout=True) or score in model.eval() {_FIX}"
            )
    return call(x, *a, **kw)
