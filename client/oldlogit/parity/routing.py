"""MoE routing replay and recording inside the invariant forward (docs/exactness.md, "Routing
replay").

In: a model's mixture-of-experts blocks (found once, ``moe_layout``) and, per forward, a
``Routing``: forced expert ids per MoE layer for the forward's flattened rows (−1 = route
freely) and/or a request to record the routing used. Out: the router's top-k, as the block
computes it, with the ids replaced where a row is forced; the combine weights are the block's
own code applied to those ids — ``torch.topk``'s values are the router's scores gathered at the
forced ids, so softmax-then-top-k, ``norm_topk_prob`` renormalisation, Mixtral's renormalised
top-k and DeepSeek-V3's sigmoid scores × ``routed_scaling_factor`` follow the model's config,
and DeepSeek-V3's ``e_score_correction_bias`` (it only selects) plays no part in a forced row.
Shared experts are untouched.

How: a forward pre/post hook on each MoE block (installed by ``patch_numerics`` for the patch's
lifetime; idle without a ``Routing``) says which MoE layer runs, and ``TileMode`` hands every
``torch.topk`` to ``routed_topk``: the one on [rows, num_experts] with k = top_k inside a block
is the routing top-k (DeepSeek-V3's group top-k calls have other shapes). Without a ``Routing``
(or outside a block) the stable rule's result is returned as it is: free routing keeps its bits.
A checkpointed layer's recompute re-enters the ``Routing`` its forward ran under
(``numerics._under_numerics``), so the backward replays the same experts.
Must not know about the wire or the service.
"""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from .attention import InvariantNumericsError

__all__ = ["MoeLayout", "Routing", "current", "install", "moe_layout", "routed_topk", "use"]


@dataclass(frozen=True)
class MoeLayout:
    """A model's MoE blocks: decoder layer index of each (in order), experts and top-k."""

    layers: tuple[int, ...]
    num_experts: int
    top_k: int
    num_hidden_layers: int
    blocks: tuple[nn.Module, ...] = field(compare=False, repr=False)


@dataclass
class Routing:
    """One forward's routing. ``forced``: [rows, L, k] integer ids over the forward's
    flattened [B * T] rows (the rows a MoE block sees), −1 rows route freely; None: every row
    routes freely. ``record``: keep the ids each MoE layer used in ``recorded`` ([rows, k]
    int64 per layer)."""

    forced: Tensor | None = None
    record: bool = False
    recorded: dict[int, Tensor] = field(default_factory=dict)
    _free: dict[int, Tensor] = field(default_factory=dict, repr=False)  # layer → [rows] bool

    def free_rows(self, layer: int) -> Tensor:
        """[rows] bool: the rows of ``layer`` without a forced record (cached per layer)."""
        assert self.forced is not None
        mask = self._free.get(layer)
        if mask is None:
            mask = self.forced[:, layer, 0] < 0
            self._free[layer] = mask
        return mask


_ROUTING: contextvars.ContextVar[Routing | None] = contextvars.ContextVar(
    "oldlogit_routing", default=None
)
_scope = threading.local()  # the MoE block running in this thread: (layer, num_experts, top_k)


def current() -> Routing | None:
    """The ``Routing`` of the forward running in this context (None: free routing)."""
    return _ROUTING.get()


@contextmanager
def use(routing: Routing | None) -> Iterator[None]:
    """Forwards in this context route by ``routing`` (None: freely)."""
    token = _ROUTING.set(routing)
    try:
        yield
    finally:
        _ROUTING.reset(token)


def _is_moe_block(module: nn.Module) -> bool:
    experts = getattr(module, "experts", None)
    gate = getattr(module, "gate", None)
    weight = getattr(experts, "gate_up_proj", None)
    return (
        isinstance(experts, nn.Module)
        and isinstance(gate, nn.Module)
        and isinstance(weight, Tensor)
        and weight.dim() == 3
    )


def moe_layout(model: nn.Module) -> MoeLayout | None:
    """The MoE blocks of a transformers causal LM (its decoder's ``layers``), or None for a
    dense model (or MoE blocks oldlogit cannot replay: no single expert count, no
    ``num_experts_per_tok``). Experts per block from the fused expert weights, top-k from the
    config."""
    get_decoder = getattr(model, "get_decoder", None)
    decoder = get_decoder() if callable(get_decoder) else None
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        return None
    found: list[tuple[int, nn.Module]] = []
    for i, layer in enumerate(layers):
        block = next((m for m in layer.modules() if _is_moe_block(m)), None)
        if block is not None:
            found.append((i, block))
    if not found:
        return None
    config: Any = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    top_k = int(getattr(text, "num_experts_per_tok", 0) or 0)
    experts = {int(getattr(b.experts, "gate_up_proj").shape[0]) for _, b in found}  # noqa: B009
    if top_k <= 0 or len(experts) != 1:
        return None  # not a routing oldlogit knows how to replay (one expert count, a top-k)
    return MoeLayout(
        layers=tuple(i for i, _ in found),
        num_experts=experts.pop(),
        top_k=top_k,
        num_hidden_layers=len(layers),
        blocks=tuple(b for _, b in found),
    )


def install(layout: MoeLayout | None) -> Callable[[], None]:
    """Hook the MoE blocks of a model's ``moe_layout`` (idle while no ``Routing`` is in
    use); returns the undo. A dense model (None) gets no hooks."""
    if layout is None:
        return lambda: None
    handles = []
    for j, block in enumerate(layout.blocks):
        scope = (j, layout.num_experts, layout.top_k)

        def enter(_m: nn.Module, _a: Any, scope: tuple[int, int, int] = scope) -> None:
            stack = getattr(_scope, "stack", None)
            if stack is None:
                stack = _scope.stack = []
            stack.append(scope)

        def leave(_m: nn.Module, _a: Any, _o: Any) -> None:
            stack = getattr(_scope, "stack", None)
            if stack:
                stack.pop()

        handles.append(block.register_forward_pre_hook(enter))
        handles.append(block.register_forward_hook(leave, always_call=True))

    def undo() -> None:
        for h in handles:
            h.remove()

    return undo


def routed_topk(x: Tensor, k: int, dim: int, largest: bool, free: Any) -> Any:
    """The top-k a patched forward returns: ``free`` (the stable rule's result) unless a
    ``Routing`` is in use and this is a MoE block's routing top-k, whose ids are then the
    forced ones where a row is forced (and recorded when asked); values are ``x`` gathered at
    the ids, so the block computes its combine weights from them as it always does."""
    routing = _ROUTING.get()
    if routing is None:
        return free
    stack = getattr(_scope, "stack", None)
    if not stack:
        return free
    layer, num_experts, top_k = stack[-1]
    if not (
        x.dim() == 2 and dim in (-1, 1) and largest and k == top_k and x.shape[1] == num_experts
    ):
        return free
    ids: Tensor = free.indices
    values: Tensor = free.values
    if routing.forced is not None:
        rows = int(routing.forced.shape[0])
        if rows != int(x.shape[0]):
            raise InvariantNumericsError(
                f"routing replay: the forward's MoE layer {layer} routes {int(x.shape[0])} rows, "
                f"the record holds {rows}"
            )
        forced = routing.forced[:, layer, :].to(device=ids.device, dtype=ids.dtype)  # [rows, k]
        free_rows = routing.free_rows(layer).to(ids.device)
        ids = torch.where(free_rows[:, None], ids, forced)
        values = x.gather(1, ids)
    if routing.record:
        routing.recorded[layer] = ids.detach().clone()
    return torch.return_types.topk((values, ids))
