"""Model backends: how to build a parameter-free skeleton and run it with a weights dict.

In: an HF config dict (or a builder function) and the serving dtype. Out: a module whose
parameters live on the meta device (``params_on_meta``) with real buffers, in eval mode, and
the backend calls that run it with a version's weights (``oldlogit.parity.skeleton.bound_weights``).
``TransformersBackend`` serves ``AutoModelForCausalLM`` families; ``CallableBackend`` plugs in
other models. No weights are held here.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor, nn

from oldlogit.parity.skeleton import bound_weights, build_skeleton, params_on_meta

__all__ = [
    "CallableBackend",
    "ModelBackend",
    "TransformersBackend",
    "auto_causal_lm",
    "params_on_meta",
]

# The skeleton (parameters on meta, real buffers) is built by oldlogit.parity.skeleton, the same
# code a trainer under trainer_numerics takes its non-weight buffers from.


@runtime_checkable
class ModelBackend(Protocol):
    """How to build a skeleton and run it with a weights dict; plug in non-transformers models.

    Weights are keyed by the canonical names, ``dict(module.named_parameters())`` keys (tied
    parameters appear once). Implementations must be pure functions of their inputs.
    """

    def build(self, config: dict[str, Any], dtype: torch.dtype) -> nn.Module:
        """The skeleton: parameters on meta (use ``params_on_meta``), real buffers, eval mode."""
        ...

    def hidden_states(
        self,
        module: nn.Module,
        weights: Mapping[str, Tensor],
        input_ids: Tensor,
        attention_mask: Tensor | None,
    ) -> Tensor:
        """input_ids [B, T] int64, attention_mask [B, T] or None → final normed hidden [B, T, H]."""
        ...

    def head(
        self, module: nn.Module, weights: Mapping[str, Tensor]
    ) -> tuple[Tensor, Tensor | None]:
        """The lm_head's weight [V, H] and bias [V] (or None), taken from ``weights``."""
        ...


def auto_causal_lm() -> Any:
    # Imported lazily (transformers is slow to import) and typed Any: its from_config is untyped.
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM


@dataclass(frozen=True)
class _HFLayout:
    decoder: nn.Module
    decoder_prefix: str  # "model." for Qwen2ForCausalLM
    head_weight: str
    head_bias: str | None


class TransformersBackend:
    """HF causal LMs (``AutoModelForCausalLM``): decoder via ``get_decoder()``, head via
    ``get_output_embeddings()``; tied embeddings resolve to the embedding's canonical name."""

    def __init__(self, attn_implementation: str | None = None) -> None:
        self.attn_implementation = attn_implementation
        self._layouts: weakref.WeakKeyDictionary[nn.Module, _HFLayout] = weakref.WeakKeyDictionary()

    def build(self, config: dict[str, Any], dtype: torch.dtype) -> nn.Module:
        return build_skeleton(config, dtype, attn_implementation=self.attn_implementation)

    def _layout(self, module: nn.Module) -> _HFLayout:
        layout = self._layouts.get(module)
        if layout is None:
            get_decoder = getattr(module, "get_decoder", None)
            decoder = get_decoder() if callable(get_decoder) else getattr(module, "model", None)
            if not isinstance(decoder, nn.Module):
                raise TypeError(f"{type(module).__name__} has no decoder (get_decoder/model)")
            prefix = next((n for n, m in module.named_modules() if m is decoder), None)
            if prefix is None:
                raise TypeError(f"the decoder of {type(module).__name__} is not a submodule")
            head = module.get_output_embeddings()  # type: ignore[operator]
            if not isinstance(head, nn.Module):
                raise TypeError(f"{type(module).__name__} has no output embeddings (lm_head)")
            names = {id(p): n for n, p in module.named_parameters()}  # first name of tied params
            bias = getattr(head, "bias", None)
            layout = _HFLayout(
                decoder=decoder,
                decoder_prefix=f"{prefix}." if prefix else "",
                head_weight=names[id(head.weight)],
                head_bias=names[id(bias)] if isinstance(bias, nn.Parameter) else None,
            )
            self._layouts[module] = layout
        return layout

    def hidden_states(
        self,
        module: nn.Module,
        weights: Mapping[str, Tensor],
        input_ids: Tensor,
        attention_mask: Tensor | None,
    ) -> Tensor:
        layout = self._layout(module)
        cut = len(layout.decoder_prefix)
        decoder_weights = {
            name[cut:]: tensor
            for name, tensor in weights.items()
            if name.startswith(layout.decoder_prefix)
        }
        with bound_weights(layout.decoder, decoder_weights):
            out = layout.decoder(
                input_ids=input_ids, attention_mask=attention_mask, use_cache=False
            )
        hidden: Tensor = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        return hidden  # [B, T, H]

    def head(
        self, module: nn.Module, weights: Mapping[str, Tensor]
    ) -> tuple[Tensor, Tensor | None]:
        layout = self._layout(module)
        bias = weights[layout.head_bias] if layout.head_bias is not None else None
        return weights[layout.head_weight], bias


class CallableBackend:
    """A backend around ``build_fn(config, dtype) -> nn.Module`` for non-transformers models.

    The module's ``forward(input_ids [B, T] int64, attention_mask [B, T] | None)`` must return
    the final normed hidden states [B, T, H] (not logits), be causal, and treat padded positions
    (mask 0, right padding) as absent. Its parameters ``head_weight`` [V, H] (and ``head_bias``
    [V]) are the lm_head; the backend builds the module under ``params_on_meta``.
    """

    def __init__(
        self,
        build_fn: Callable[[dict[str, Any], torch.dtype], nn.Module],
        *,
        head_weight: str = "lm_head.weight",
        head_bias: str | None = None,
    ) -> None:
        self.build_fn = build_fn
        self.head_weight = head_weight
        self.head_bias = head_bias

    def build(self, config: dict[str, Any], dtype: torch.dtype) -> nn.Module:
        with params_on_meta():
            module = self.build_fn(config, dtype)
        module.eval()
        return module

    def hidden_states(
        self,
        module: nn.Module,
        weights: Mapping[str, Tensor],
        input_ids: Tensor,
        attention_mask: Tensor | None,
    ) -> Tensor:
        with bound_weights(module, weights):
            hidden: Tensor = module(input_ids, attention_mask)
        return hidden  # [B, T, H]

    def head(
        self, module: nn.Module, weights: Mapping[str, Tensor]
    ) -> tuple[Tensor, Tensor | None]:
        bias = weights[self.head_bias] if self.head_bias is not None else None
        return weights[self.head_weight], bias
