"""Put an HF causal LM under the batch-invariant numerics, forward and backward.

In: a transformers ``PreTrainedModel`` (a causal LM; DDP's ``.module`` and ``torch.compile``'s
``_orig_mod`` are unwrapped). While patched, every call of the model: plans the batch's
segments from its attention mask / position ids (``attention.plan_segments``), runs its own
forward with positions counted per sequence, the invariant attention and a torch-function mode
that sends every ``F.linear`` (the head too) through fixed-shape tiles (``tiles.tiled_linear``),
and refuses any other matmul it cannot vouch for (strict mode). Mixture-of-experts layers run
transformers' eager experts (one ``F.linear`` per expert, so tiled) and route with an explicit
top-k rule (``stable_topk``: dropless, ties to the lower expert index, descending order), so a
token's expert choice and its sum over experts never depend on the batch. A decoder layer's
activation checkpointing recomputes it under the same mode, so the backward sees the forward's
numerics.
A call with a KV cache (``generate``) runs the model's own forward: sampling is not scoring.
On exit (``restore``) the model is exactly as before.
"""

from __future__ import annotations

import contextvars
import functools
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from . import attention
from ._spec import DEFAULT_TILE_ROWS, NumericsMismatch, NumericsSpec
from .attention import ATTENTION_NAME, SEGMENTS_KWARG, InvariantNumericsError, plan_segments
from .ops import TileMode, UncoveredMatmul, stable_topk

__all__ = [
    "EAGER_EXPERTS",
    "NumericsPatch",
    "UncoveredMatmul",
    "active_patch",
    "head_fp32_override",
    "local_spec",
    "patch_numerics",
    "stable_topk",
    "trainer_numerics",
    "unwrap_model",
]

# transformers' experts implementation that calls ``F.linear`` once per expert (the batched and
# grouped ones call bmm / grouped_mm, whose rows are not tiled).
EAGER_EXPERTS = "eager"
_ = (UncoveredMatmul, stable_topk)  # re-exported: part of this module's public names

_PATCH_ATTR = "_oldlogit_numerics_patch"

# token_logprobs(..., lm_head_fp32=…) overrides the patch's default for one call.
_HEAD_FP32: contextvars.ContextVar[bool | None] = contextvars.ContextVar(
    "oldlogit_head_fp32", default=None
)


def unwrap_model(model: nn.Module) -> nn.Module:
    """The HF model inside DDP/FSDP-style wrappers (``.module``) and ``torch.compile``."""
    seen = 0
    while seen < 8:
        seen += 1
        compiled = getattr(model, "_orig_mod", None)
        wrapped = getattr(model, "module", None)
        if isinstance(compiled, nn.Module):
            model = compiled
        elif isinstance(wrapped, nn.Module) and (
            type(model).__name__ in ("DistributedDataParallel", "DataParallel")
            or not hasattr(model, "get_output_embeddings")
        ):
            model = wrapped
        else:
            break
    return model


_mode_depth = threading.local()


@contextmanager
def _tile_mode(patch: NumericsPatch | None, head: nn.Module | None, fp32: bool) -> Iterator[None]:
    """Enter the mode unless this thread is inside it already (nested modules, recompute)."""
    if getattr(_mode_depth, "n", 0) > 0:
        yield
        return
    _mode_depth.n = 1
    try:
        tile_rows = patch.tile_rows if patch is not None else None
        strict = patch.strict if patch is not None else False
        with TileMode(tile_rows, strict, head, fp32):
            yield
    finally:
        _mode_depth.n = 0


def _configs(model: nn.Module) -> list[Any]:
    """Every HF config object the model's modules (and their sub-configs) hold, once each."""
    found: dict[int, Any] = {}

    def add(cfg: Any) -> None:
        if cfg is None or id(cfg) in found or not hasattr(cfg, "_attn_implementation"):
            return
        found[id(cfg)] = cfg
        for name in getattr(cfg, "sub_configs", {}) or {}:
            add(getattr(cfg, name, None))

    for module in model.modules():
        add(getattr(module, "config", None))
    return list(found.values())


@dataclass
class NumericsPatch:
    """A model under the invariant numerics; ``restore()`` undoes everything."""

    model: nn.Module
    tile_rows: int
    lm_head_fp32: bool
    strict: bool
    _restore: list[Callable[[], None]] = field(default_factory=list)
    _plain_attention: list[tuple[Any, Any]] = field(default_factory=list)  # (config, original)

    @contextmanager
    def plain(self) -> Iterator[None]:
        """The model's own attention implementation for the duration (generation)."""
        swapped = [(cfg, cfg._attn_implementation_internal) for cfg, _ in self._plain_attention]
        for cfg, original in self._plain_attention:
            cfg._attn_implementation_internal = original
        try:
            yield
        finally:
            for cfg, current in swapped:
                cfg._attn_implementation_internal = current

    @property
    def spec(self) -> NumericsSpec:
        return local_spec(
            self.model,
            profile="invariant",
            tile_rows=self.tile_rows,
            lm_head_fp32=self.lm_head_fp32,
        )

    def restore(self) -> None:
        while self._restore:
            self._restore.pop()()


def active_patch(model: nn.Module) -> NumericsPatch | None:
    """The patch ``model`` is under, if any."""
    patch = getattr(unwrap_model(model), _PATCH_ATTR, None)
    return patch if isinstance(patch, NumericsPatch) else None


def head_fp32_override(value: bool | None) -> contextvars.Token[bool | None]:
    return _HEAD_FP32.set(value)


def run_plain(model: nn.Module, fp32_head: bool, call: Callable[[], Any]) -> Any:
    """Run ``call`` (a forward of an unpatched model), casting the head to float32 if asked."""
    if not fp32_head:
        return call()
    head = unwrap_model(model).get_output_embeddings()  # type: ignore[operator]
    with _tile_mode(None, head, True):
        return call()


def local_spec(
    model: nn.Module,
    *,
    profile: str,
    tile_rows: int | None,
    lm_head_fp32: bool,
) -> NumericsSpec:
    """The numerics ``model`` runs with in this process (dtype and device of its head)."""
    core = unwrap_model(model)
    head = core.get_output_embeddings()  # type: ignore[operator]
    weight = head.weight
    device_kind = weight.device.type if weight.device.type != "meta" else "cpu"
    config = getattr(core, "config", None)
    attn = (
        ATTENTION_NAME
        if profile == "invariant"
        else str(getattr(config, "_attn_implementation", "eager"))
    )
    return NumericsSpec(
        profile=profile,  # type: ignore[arg-type]
        dtype=str(weight.dtype).removeprefix("torch."),
        device_kind=device_kind,
        tile_rows=tile_rows if profile == "invariant" else None,
        threads=torch.get_num_threads() if device_kind == "cpu" else 0,
        lm_head_fp32=lm_head_fp32,
        attention=attn,
        torch_version=str(torch.__version__),
    )


def patch_numerics(
    model: nn.Module,
    *,
    tile_rows: int = DEFAULT_TILE_ROWS,
    lm_head_fp32: bool = False,
    strict: bool = True,
    like: NumericsSpec | None = None,
) -> NumericsPatch:
    """Put ``model`` under the invariant numerics until ``restore()``; see the module docstring.

    ``like``: the numerics of the other side (e.g. ``Client.info().numerics_spec``): its tile
    rows and head setting are adopted, and a dtype, device kind or CPU thread count that differs
    from this process is refused with ``NumericsMismatch`` naming it.
    """
    core = unwrap_model(model)
    if not callable(getattr(core, "get_output_embeddings", None)):
        raise TypeError(f"{type(core).__name__} is not a transformers causal LM")
    if active_patch(core) is not None:
        raise RuntimeError("this model is already under trainer_numerics")
    if like is not None:
        if like.profile != "invariant" or like.tile_rows is None:
            raise NumericsMismatch(
                f"the other side runs the {like.profile!r} profile: only 'invariant' can be "
                "matched by patching a trainer"
            )
        tile_rows, lm_head_fp32 = like.tile_rows, like.lm_head_fp32
        mine = local_spec(core, profile="invariant", tile_rows=tile_rows, lm_head_fp32=lm_head_fp32)
        problems = mine.mismatches(like)
        if problems:
            raise NumericsMismatch(
                "the trainer's numerics differ from the service's: " + "; ".join(problems)
            )
    if tile_rows <= 0:
        raise ValueError(f"tile_rows must be positive, got {tile_rows}")
    attention.register()
    patch = NumericsPatch(core, tile_rows, lm_head_fp32, strict)

    for cfg in _configs(core):
        old = cfg._attn_implementation_internal
        cfg._attn_implementation_internal = ATTENTION_NAME
        patch._plain_attention.append((cfg, old))
        patch._restore.append(functools.partial(setattr, cfg, "_attn_implementation_internal", old))
        if hasattr(cfg, "_experts_implementation_internal"):
            # Experts: one F.linear per expert (tiled); grouped/batched kernels are not.
            old_experts = cfg._experts_implementation_internal
            cfg._experts_implementation_internal = EAGER_EXPERTS
            patch._restore.append(
                functools.partial(setattr, cfg, "_experts_implementation_internal", old_experts)
            )

    def _set_forward(module: nn.Module, new: Callable[..., Any]) -> None:
        had = "forward" in module.__dict__
        old = module.__dict__.get("forward")
        module.__dict__["forward"] = new  # an instance attribute shadows the class's forward

        def undo() -> None:
            if had:
                module.__dict__["forward"] = old
            else:
                del module.__dict__["forward"]

        patch._restore.append(undo)

    original = core.forward

    @functools.wraps(original)
    def forward(*args: Any, **kwargs: Any) -> Any:
        return _invariant_call(patch, original, args, kwargs)

    _set_forward(core, forward)
    # Activation checkpointing recomputes decoder layers in the backward, outside the model's
    # forward: the function a layer hands to its checkpoint function re-enters the mode.
    head: nn.Module | None = core.get_output_embeddings()  # type: ignore[operator]
    for module in core.modules():
        if module is core or not _is_checkpoint_layer(module):
            continue

        def layer(
            *a: Any, _f: Callable[..., Any] = module.forward, _m: nn.Module = module, **k: Any
        ) -> Any:
            ckpt: Callable[..., Any] | None = _m.__dict__.get("_gradient_checkpointing_func")
            if ckpt is None:
                return _f(*a, **k)

            def under_numerics(fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
                def run(*ra: Any, **rk: Any) -> Any:
                    with _tile_mode(patch, head, patch.lm_head_fp32):
                        return fn(*ra, **rk)

                return ckpt(run, *args, **kw)

            _m.__dict__["_gradient_checkpointing_func"] = under_numerics
            try:
                return _f(*a, **k)
            finally:
                _m.__dict__["_gradient_checkpointing_func"] = ckpt

        _set_forward(module, layer)
    setattr(core, _PATCH_ATTR, patch)
    patch._restore.append(lambda: delattr(core, _PATCH_ATTR))
    return patch


def _is_checkpoint_layer(module: nn.Module) -> bool:
    return any(c.__name__ == "GradientCheckpointingLayer" for c in type(module).__mro__)


def _invariant_call(
    patch: NumericsPatch,
    original: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    names = ("input_ids", "attention_mask", "position_ids")
    bound = dict(zip(names, args, strict=False))
    if len(args) > len(names):
        raise InvariantNumericsError("pass the model's arguments after position_ids by keyword")
    overlap = set(bound) & set(kwargs)
    if overlap:
        raise TypeError(f"got multiple values for {sorted(overlap)}")
    kwargs = {**kwargs, **bound}
    if kwargs.get("past_key_values") is not None:
        # Generation (a KV cache): sampling is the inference engine's business, not scoring;
        # it runs the model's own forward so a patched trainer can still generate.
        with patch.plain():
            return original(**kwargs)
    ids = kwargs.get("input_ids")
    ref = ids if ids is not None else kwargs.get("inputs_embeds")
    if ref is None:
        raise InvariantNumericsError("pass input_ids or inputs_embeds")
    batch, length = int(ref.shape[0]), int(ref.shape[1])
    segments, positions = plan_segments(
        batch, length, kwargs.get("attention_mask"), kwargs.get("position_ids")
    )
    kwargs["position_ids"] = positions.to(ref.device)
    kwargs[SEGMENTS_KWARG] = segments
    kwargs["use_cache"] = False
    fp32 = _HEAD_FP32.get()
    head = patch.model.get_output_embeddings()  # type: ignore[operator]
    with _tile_mode(patch, head, patch.lm_head_fp32 if fp32 is None else fp32):
        return original(**kwargs)


@contextmanager
def trainer_numerics(
    model: nn.Module,
    *,
    tile_rows: int = DEFAULT_TILE_ROWS,
    lm_head_fp32: bool = False,
    strict: bool = True,
    like: NumericsSpec | None = None,
) -> Iterator[NumericsPatch]:
    """``patch_numerics`` for the duration of a ``with`` block (also usable as a decorator)."""
    patch = patch_numerics(
        model, tile_rows=tile_rows, lm_head_fp32=lm_head_fp32, strict=strict, like=like
    )
    try:
        yield patch
    finally:
        patch.restore()
