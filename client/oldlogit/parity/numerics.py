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

What the forward computes in is judged from the live setup (``setups.compute_dtype``): FSDP's
``param_dtype``, ``torch.autocast`` around the call, or the parameters. Under autocast over
float32 parameters the patch computes as FSDP mixed precision does — the parameters cast to the
autocast dtype for the forward (gradients flow back to them), autocast itself off inside, so
the forward is the service's model at that dtype. The floating buffers the forward reads that
are not weights (rotary ``inv_freq``, embedding scales) are, while patched, the values a model
built from the config at that dtype holds (``skeleton.reference_buffers``: what the service
runs; a ``model.to(torch.bfloat16)`` had cast them), and a weight held in another dtype than
that model holds it (a tensor transformers keeps in float32, cast by a module cast) is cast to
it for the forward, as the service holds it once published. A module whose forward is neither
transformers' nor torch's (liger-kernel, PEFT other than the LoRA layers ``lora_trainer``
vouches for, a hand-written forward) is refused by name in strict mode. Under
``torch.compile`` the patched forward runs eagerly (compiled code fuses ops and would change
bits). MoE routing can be replayed (``routing``: given experts per token,
the combine weights from the version's own router) and recorded. On exit (``restore``) the
model is exactly as before.
"""

from __future__ import annotations

import collections
import contextvars
import copy
import dataclasses
import functools
import logging
import os
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils.stateless import _reparametrize_module

from oldlogit.contract.numerics import (
    DEFAULT_TILE_ROWS,
    NumericsMismatch,
    NumericsSpec,
    config_fields,
)

from . import attention, lora_trainer, regions, routing, tensor_parallel
from .attention import (
    ATTENTION_NAME,
    SEGMENTS_KWARG,
    InvariantNumericsError,
    config_attention_name,
    expecting_windows,
    plan_for,
)
from .kernels import for_device, kernel_set
from .ops import ActiveDropout, RandomForward, TileMode, UncoveredMatmul, stable_topk
from .settings import default_kernel_settings
from .setups import ComputeDtype, clean_name, compute_dtype, foreign_code, sharded_precision
from .skeleton import buffer_digests, build_skeleton, reference_buffers

logger = logging.getLogger(__name__)

__all__ = [
    "EAGER_EXPERTS",
    "ActiveDropout",
    "NumericsPatch",
    "RandomForward",
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
_ = (
    ActiveDropout,
    RandomForward,
    UncoveredMatmul,
    stable_topk,
)  # re-exported: part of this module's public names

_PATCH_ATTR = "_oldlogit_numerics_patch"

# token_logprobs(..., lm_head_fp32=…) overrides the patch's default for one call.
_HEAD_FP32: contextvars.ContextVar[bool | None] = contextvars.ContextVar(
    "oldlogit_head_fp32", default=None
)


# Wrappers that hold the model as ``.module`` (FSDP1 and DeepSpeed forward unknown attributes
# to it, so ``get_output_embeddings`` alone cannot tell them from the model).
_WRAPPERS = frozenset(
    {"DistributedDataParallel", "DataParallel", "FullyShardedDataParallel", "DeepSpeedEngine"}
)


def unwrap_model(model: nn.Module) -> nn.Module:
    """The HF model inside DDP/FSDP1/DeepSpeed-style wrappers (``.module``), ``torch.compile``
    and PEFT's ``PeftModel`` / ``LoraModel`` (``.base_model``, ``.model``)."""
    seen = 0
    while seen < 8:
        seen += 1
        peft_inner = _peft_inner(model)
        if peft_inner is not None:
            model = peft_inner
            continue
        compiled = getattr(model, "_orig_mod", None)
        wrapped = getattr(model, "module", None)
        if isinstance(compiled, nn.Module):
            model = compiled
        elif isinstance(wrapped, nn.Module) and (
            type(model).__name__ in _WRAPPERS or not hasattr(model, "get_output_embeddings")
        ):
            model = wrapped
        else:
            break
    return model


def _peft_inner(model: nn.Module) -> nn.Module | None:
    """The model a PEFT ``PeftModel`` (its ``base_model``) or tuner (``model``) wraps."""
    if not any(c.__name__ in ("PeftModel", "BaseTuner") for c in type(model).__mro__):
        return None
    for attr in ("base_model", "model"):
        inner = model.__dict__.get("_modules", {}).get(attr)
        if isinstance(inner, nn.Module):
            return inner
    return None


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
        tp_chunks = patch.tp_chunks if patch is not None else 0
        tied = patch.tied_head if patch is not None else False
        device_type = "cuda" if patch is None else patch.device_type
        cuda = for_device(torch.device(device_type)) == "cuda"
        gpu = device_type != "cpu" or cuda
        with (
            TileMode(tile_rows, strict, head, fp32, tp_chunks, tied, gpu=gpu, cuda=cuda),
            attention.thread_count_free(tp_chunks > 0),
            default_kernel_settings(cuda=device_type == "cuda")
            if patch is not None
            else nullcontext(),
        ):
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
class _Reference:
    """What a model built from the config at one dtype holds: its non-weight floating buffers
    (on CPU) and each weight's dtype (parameters and persistent buffers; float32 where the
    model keeps a tensor in float32)."""

    buffers: dict[str, Tensor]
    param_dtypes: dict[str, torch.dtype]


@dataclass
class NumericsPatch:
    """A model under the invariant numerics; ``restore()`` undoes everything."""

    model: nn.Module
    tile_rows: int
    lm_head_fp32: bool
    strict: bool
    wrapper: nn.Module | None = None  # what the trainer passed (DDP, FSDP1) around ``model``
    like: NumericsSpec | None = None
    _restore: list[Callable[[], None]] = field(default_factory=list)
    _plain_attention: list[tuple[Any, Any]] = field(default_factory=list)  # (config, original)
    _refs: dict[torch.dtype, _Reference] = field(default_factory=dict)
    # The trainer's non-weight floating buffers: clean name → (owner module, attribute).
    _buffer_slots: dict[str, tuple[nn.Module, str]] = field(default_factory=dict)
    # The installed buffers: (dtype, name → tensor, name → its storage address when installed).
    _installed: tuple[torch.dtype, dict[str, Tensor], dict[str, int]] | None = None
    _compute: ComputeDtype | None = None
    _sharded: tuple[bool, torch.dtype | None, str] = (False, None, "")
    _differs: dict[torch.dtype, bool] = field(default_factory=dict)
    # (module, its path + ".", attribute) of every checkpoint function slot of the model.
    _checkpointed: list[tuple[nn.Module, str, str]] = field(default_factory=list)
    device_type: str = "cpu"  # of the last call (autocast is per device type)
    moe: routing.MoeLayout | None = None  # the model's MoE blocks (None: dense)
    tp_chunks: int = 0  # the tensor-parallel definition's chunk count (0: off)
    tied_head: bool = False  # the head's weight is the input embedding's (tied)

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
    def compute(self) -> ComputeDtype:
        """What the forward computes in, as last judged (at the patch, then at each call)."""
        assert self._compute is not None
        return self._compute

    @property
    def spec(self) -> NumericsSpec:
        return local_spec(
            self.model,
            profile="invariant",
            tile_rows=self.tile_rows,
            lm_head_fp32=self.lm_head_fp32,
            dtype=self.compute.dtype,
            buffers=self._installed[1] if self._installed else None,
            tp_chunks=self.tp_chunks,
        )

    def restore(self) -> None:
        while self._restore:
            self._restore.pop()()

    def wrap_checkpointing(self) -> None:
        """Wrap every checkpoint function the model holds now (see ``patch_numerics``);
        checkpointing switched on after the patch is wrapped at the next call."""
        for module, prefix, attr in self._checkpointed:
            ckpt = module.__dict__.get(attr)
            if ckpt is None or hasattr(ckpt, "_oldlogit_inner"):
                continue
            module.__dict__[attr] = _under_numerics(self, ckpt, module, prefix)

    def unwrap_checkpointing(self) -> None:
        for module, _prefix, attr in self._checkpointed:
            ckpt = module.__dict__.get(attr)
            if ckpt is not None and hasattr(ckpt, "_oldlogit_inner"):
                module.__dict__[attr] = ckpt._oldlogit_inner

    # -- what a model built from the config holds --------------------------------------------

    def reference(self, dtype: torch.dtype) -> _Reference:
        """What the skeleton at ``dtype`` holds (parameters on meta): built once per model
        class, config and dtype in this process (``_shared_reference``), then kept here."""
        ref = self._refs.get(dtype)
        if ref is None:
            ref = self._refs[dtype] = _shared_reference(self.model, dtype)
        return ref

    def install_buffers(self, dtype: torch.dtype) -> None:
        """Put the reference buffers for ``dtype`` in the trainer's modules (idempotent; a
        wrapper that re-cast them since, e.g. FSDP1's ``buffer_dtype``, is overridden)."""
        if self._installed is None or self._installed[0] != dtype:
            ref = self.reference(dtype)
            mine, theirs = set(self._buffer_slots), set(ref.buffers)
            if mine != theirs:
                extra = sorted(mine - theirs)
                missing = sorted(theirs - mine)
                raise InvariantNumericsError(
                    "the model's non-weight buffers are not those of a model built from its "
                    f"config (only here: {extra or 'none'}; only in the config's model: "
                    f"{missing or 'none'}): oldlogit cannot know what the service reads for them"
                )
            values = {}
            for name, (owner, attr) in self._buffer_slots.items():
                current = owner._buffers[attr]
                assert current is not None
                value = ref.buffers[name]
                if tuple(value.shape) != tuple(current.shape):
                    raise InvariantNumericsError(
                        f"buffer {name}: shape {list(current.shape)} here, "
                        f"{list(value.shape)} in a model built from the config"
                    )
                values[name] = value.to(current.device, copy=True)
            self._installed = (dtype, values, {n: v.data_ptr() for n, v in values.items()})
        _, values, pointers = self._installed
        ref = self.reference(dtype)
        for name, (owner, attr) in self._buffer_slots.items():
            value = values[name]
            intact = value.dtype == ref.buffers[name].dtype and value.data_ptr() == pointers[name]
            if not intact:
                # Changed in place (FSDP1's buffer_dtype assigns ``.data``): a fresh copy.
                value = ref.buffers[name].to(value.device, copy=True)
                values[name], pointers[name] = value, value.data_ptr()
            if owner._buffers[attr] is not value:
                owner._buffers[attr] = value

    def judge(self, device_type: str | None) -> ComputeDtype:
        """The compute dtype of a call on ``device_type`` (None: outside a call), checked
        against ``like`` and with the matching buffers installed."""
        compute = compute_dtype(self.model, device_type, sharded=self._sharded)
        like = self.like
        if like is not None and compute.name != like.dtype:
            if device_type is None and _autocast_may_fix(compute, like):
                # Judged again at each call: the forward may run inside torch.autocast.
                self._compute = compute
                self.install_buffers(_dtype(like.dtype))
                return compute
            raise NumericsMismatch(
                f"the trainer's numerics differ from the service's: compute dtype "
                f"{compute.name!r} here (from {compute.source}), {like.dtype!r} there. "
                + _dtype_fix(like.dtype, compute.sharded)
            )
        if not compute.sharded and not compute.cast_params and self._params_differ(compute.dtype):
            # Tensors in another dtype than the service's model holds (float32-kept ones after a
            # module cast, a module left in float32): cast for the forward, as the service holds
            # them once published.
            compute = dataclasses.replace(compute, cast_params=True)
        self._compute = compute
        self.install_buffers(compute.dtype)
        if like is not None and device_type is None:
            problems = self.spec.mismatches(like)
            if problems:
                raise NumericsMismatch(
                    "the trainer's numerics differ from the service's: " + "; ".join(problems)
                )
        return compute

    def _params_differ(self, dtype: torch.dtype) -> bool:
        """Whether a floating parameter's dtype is not the skeleton's at ``dtype`` (cached)."""
        found = self._differs.get(dtype)
        if found is None:
            want = self.reference(dtype).param_dtypes
            found = any(
                t.is_floating_point() and t.dtype != want.get(clean_name(n), dtype)
                for n, t in _weights_of(self.model)
            )
            self._differs[dtype] = found
        return found

    @contextmanager
    def cast_parameters(self, module: nn.Module, prefix: str = "") -> Iterator[None]:
        """``module``'s parameters cast to the reference dtypes for the duration (autocast
        over float32 masters, tensors a module cast moved off their kept dtype;
        differentiable: gradients reach the trainer's tensors)."""
        ref = self.reference(self.compute.dtype)
        casts: dict[str, Tensor] = {}
        for name, tensor in _weights_of(module):
            want = ref.param_dtypes.get(clean_name(prefix + name), self.compute.dtype)
            if tensor.is_floating_point() and tensor.dtype != want:
                casts[name] = tensor.to(want)
        if not casts:
            yield
            return
        with _reparametrize_module(module, casts, tie_weights=True):
            yield


def _weights_of(module: nn.Module) -> Iterator[tuple[str, Tensor]]:
    """What a version's weights hold of ``module``: its parameters and persistent buffers
    (DeepSeek-V3's routing bias), by name."""
    for name, param in module.named_parameters():
        if not lora_trainer.adapter_tensor(name):  # a LoRA adapter's: computes in its own dtype
            yield name, param
    for prefix, sub in module.named_modules():
        for name, buf in sub._buffers.items():
            if buf is not None and name not in sub._non_persistent_buffers_set:
                yield (f"{prefix}.{name}" if prefix else name), buf


def _dtype(name: str) -> torch.dtype:
    value = getattr(torch, name, None)
    if not isinstance(value, torch.dtype):
        raise NumericsMismatch(f"unknown dtype {name!r}")
    return value


def _autocast_may_fix(compute: ComputeDtype, like: NumericsSpec) -> bool:
    """Float32 parameters, not held by FSDP: a torch.autocast around the call may give the
    service's dtype, so the judgement waits for the call."""
    return compute.dtype == torch.float32 and not compute.sharded and like.dtype != "float32"


def _dtype_fix(dtype: str, sharded: bool) -> str:
    if sharded:
        return (
            f"Shard with fully_shard(..., mp_policy=MixedPrecisionPolicy(param_dtype=torch."
            f"{dtype})) (FSDP1: MixedPrecision(param_dtype=...)); torch.autocast cannot make "
            "FSDP's float32 shards a model of another dtype — or serve with --dtype matching "
            "the trainer"
        )
    return (
        f"Load the model in {dtype} (from_pretrained(dtype=torch.{dtype}) or "
        f"model.to(torch.{dtype})), run the forward inside torch.autocast(device_type, "
        f"dtype=torch.{dtype}), or shard with FSDP MixedPrecisionPolicy(param_dtype=torch."
        f"{dtype}) — or serve with --dtype matching the trainer"
    )


# Built references, by (model class, config as JSON, dtype), most recently used last: a
# trainer that enters ``trainer_numerics`` around every step builds its skeleton once, not once
# per step (building one runs the model class's whole constructor: 17 ms for 4 small layers).
# A reference is read-only once built: buffers are copied out of it, never written. At most
# ``_REFERENCES_KEPT`` of them, and the older ones only while all together hold at most
# ``_REFERENCES_BYTES`` of buffers (a model may keep rotary tables of its whole context).
_REFERENCES: collections.OrderedDict[tuple[Any, ...], _Reference] = collections.OrderedDict()
_REFERENCES_KEPT = 8
_REFERENCES_BYTES = 256 * 2**20
_references_lock = threading.Lock()


def _reference_bytes(ref: _Reference) -> int:
    return sum(t.numel() * t.element_size() for t in ref.buffers.values())


def _shared_reference(model: nn.Module, dtype: torch.dtype) -> _Reference:
    """The reference of ``model``'s class and config at ``dtype``, from the process's cache
    when a model of that class with an equal config was patched before."""
    config = getattr(model, "config", None)
    try:
        text = config.to_json_string(use_diff=False) if config is not None else None
    except (TypeError, ValueError, AttributeError):  # a config JSON cannot hold: no sharing
        text = None
    key = None if text is None else (type(model), text, dtype)
    if key is not None:
        with _references_lock:
            ref = _REFERENCES.get(key)
            if ref is not None:
                _REFERENCES.move_to_end(key)
                return ref
    skeleton = _skeleton_of(model, dtype)
    ref = _Reference(
        buffers={n: b.detach().to("cpu") for n, b in reference_buffers(skeleton).items()},
        param_dtypes={n: t.dtype for n, t in _weights_of(skeleton)},
    )
    if key is not None:
        with _references_lock:
            _REFERENCES[key] = ref
            held = sum(_reference_bytes(r) for r in _REFERENCES.values())
            while len(_REFERENCES) > 1 and (
                len(_REFERENCES) > _REFERENCES_KEPT or held > _REFERENCES_BYTES
            ):
                _, dropped = _REFERENCES.popitem(last=False)
                held -= _reference_bytes(dropped)
    return ref


def _skeleton_of(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """The trainer's model class built from its config at ``dtype`` (parameters on meta)."""
    cls = next(
        (c for c in type(model).__mro__ if c.__module__.startswith("transformers.")),
        None,
    )
    if cls is None or not hasattr(cls, "_from_config"):
        raise InvariantNumericsError(
            f"{type(model).__name__} is not a transformers model class: oldlogit cannot build "
            "it from its config to know the buffers the service computes"
        )
    config = copy.deepcopy(model.config)
    return build_skeleton(config, dtype, attn_implementation="eager", model_class=cls)


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
    dtype: torch.dtype | None = None,
    buffers: Mapping[str, Tensor] | None = None,
    tp_chunks: int = 0,
) -> NumericsSpec:
    """The numerics ``model`` runs with in this process: ``dtype`` (default: what its forward
    computes in, ``setups.compute_dtype``), the device of its head, ``buffers`` (default: its
    own non-weight floating buffers)."""
    core = unwrap_model(model)
    head = core.get_output_embeddings()  # type: ignore[operator]
    weight = head.weight
    device_kind = weight.device.type if weight.device.type != "meta" else "cpu"
    config = getattr(core, "config", None)
    if dtype is None:
        dtype = compute_dtype(core, None, sharded=sharded_precision(model)).dtype
    attn = (
        config_attention_name(config, dtype, weight.device)
        if profile == "invariant" and weight.device.type == "cuda"
        else ATTENTION_NAME
        if profile == "invariant"
        else str(getattr(config, "_attn_implementation", "eager"))
    )
    if buffers is None:
        buffers = {clean_name(n): b for n, b in reference_buffers(core).items()}
    return NumericsSpec(
        profile=profile,  # type: ignore[arg-type]
        dtype=str(dtype).removeprefix("torch."),
        device_kind=device_kind,
        tile_rows=tile_rows if profile == "invariant" else None,
        threads=torch.get_num_threads() if device_kind == "cpu" else 0,
        lm_head_fp32=lm_head_fp32,
        attention=attn,
        torch_version=str(torch.__version__),
        buffers=buffer_digests(buffers),
        transformers_version=transformers_version(),
        tp_chunks=tp_chunks,
        config=config_fields(config),
        hardware=hardware_name(weight.device if weight.device.type != "meta" else "cpu"),
        kernels=kernel_set(weight.device if weight.device.type != "meta" else "cpu"),
    )


def hardware_name(device: torch.device | str) -> str:
    """The processor ``device``'s kernels are picked for (``NumericsSpec.hardware``): on CPU the
    instruction set of ATen's kernels (``ATEN_CPU_CAPABILITY`` lowers it), on CUDA the GPU's
    name and compute capability."""
    device = torch.device(device)
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        major, minor = torch.cuda.get_device_capability(index)
        return f"cuda {torch.cuda.get_device_name(index)} sm_{major}{minor}"
    if device.type == "cpu":
        return f"cpu {torch.backends.cpu.get_cpu_capability()}"
    return device.type


def transformers_version() -> str:
    """The transformers release computing the forward ('': not installed)."""
    try:
        import transformers
    except ImportError:  # pragma: no cover - the trainer extra installs it
        return ""
    return str(transformers.__version__)


def patch_numerics(
    model: nn.Module,
    *,
    tile_rows: int = DEFAULT_TILE_ROWS,
    lm_head_fp32: bool = False,
    strict: bool = True,
    like: NumericsSpec | None = None,
    tp_chunks: int = 0,
) -> NumericsPatch:
    """Put ``model`` under the invariant numerics until ``restore()``; see the module docstring.

    ``like``: the numerics of the other side (e.g. ``Client.info().numerics_spec()``): its tile
    rows and head setting are adopted, and a compute dtype, device kind, CPU thread count or
    non-weight buffer that differs from this process is refused with ``NumericsMismatch``
    naming it — here, or at the first call when only a ``torch.autocast`` around it can decide
    the dtype. ``strict=False`` runs modules and matmuls oldlogit cannot vouch for, without
    the guarantee. ``tp_chunks`` > 0 selects the tensor-parallel definition
    (``tensor_parallel``: the same bits at any tensor-parallel degree dividing it; a model
    split by torch's ``parallelize_module`` over a 1-D mesh, or the service's ranks); ``like``
    sets it to the other side's.
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
        tp_chunks = like.tp_chunks
    if tile_rows <= 0:
        raise ValueError(f"tile_rows must be positive, got {tile_rows}")
    tensor_parallel.refuse_transformers_tp(core)  # silently other bits, strict or not
    vouched = _refuse_foreign_code(core, model) if strict else set()
    if _compiled(model) or _compiled(core):
        logger.warning(
            "torch.compile: under trainer_numerics the model's forward runs eagerly (compiled "
            "code fuses ops and would change bits); the rest of the step stays compiled"
        )
    attention.register()
    wrapper = model if model is not core else None
    patch = NumericsPatch(core, tile_rows, lm_head_fp32, strict, wrapper=wrapper, like=like)
    patch.tp_chunks = int(tp_chunks)
    if tp_chunks:
        degree = _tp_degree(core)
        tensor_parallel.check_degree(core.config, degree, int(tp_chunks))
        rowwise = tensor_parallel.rowwise_modules(core)
        embedding = core.get_input_embeddings()  # type: ignore[operator]
        head_module = core.get_output_embeddings()  # type: ignore[operator]
        patch.tied_head = getattr(embedding, "weight", None) is getattr(head_module, "weight", 0)
    patch._sharded = sharded_precision(model)
    non_weight = {clean_name(n) for n in reference_buffers(core)}
    for name, module in core.named_modules():
        for attr, buf in module._buffers.items():
            full = clean_name(f"{name}.{attr}" if name else attr)
            if buf is not None and full in non_weight and full not in patch._buffer_slots:
                patch._buffer_slots[full] = (module, attr)
                patch._restore.append(functools.partial(module._buffers.__setitem__, attr, buf))
    try:
        patch.judge(None)
    except BaseException:
        patch.restore()
        raise

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

    _set_forward(core, _eager(forward))
    # The decoder called on its own (``model.model(...)``, then the head over its hidden states:
    # a trainer's chunked loss) plans its batch and computes as inside the model's forward;
    # inside that forward (the plan passed by keyword, or held by the context where the causal
    # LM's code does not pass keywords on) it runs as it is: the batch is planned once.
    get_decoder = getattr(core, "get_decoder", None)
    decoder = get_decoder() if callable(get_decoder) else None
    if isinstance(decoder, nn.Module) and decoder is not core:
        decoder_call = decoder.forward

        @functools.wraps(decoder_call)
        def decoder_forward(*args: Any, **kwargs: Any) -> Any:
            if SEGMENTS_KWARG in kwargs or attention.plan_in_context() is not None:
                return decoder_call(*args, **kwargs)
            return _invariant_call(patch, decoder_call, args, kwargs)

        _set_forward(decoder, _eager(decoder_forward))
    # The head called on its own, outside the model's forward — a trainer's chunked loss over
    # the hidden states (``output_hidden_states``, then ``model.lm_head(h)`` chunk by chunk) —
    # computes as it does inside: through the tiles, in the head's dtype. Inside the forward
    # the mode is already on and this adds nothing.
    head_out = core.get_output_embeddings()  # type: ignore[operator]
    if isinstance(head_out, nn.Module):
        head_call = head_out.forward

        def head_forward(*args: Any, **kwargs: Any) -> Any:
            fp32 = _HEAD_FP32.get()
            with _tile_mode(patch, head_out, patch.lm_head_fp32 if fp32 is None else fp32):
                return head_call(*args, **kwargs)

        _set_forward(head_out, _eager(head_forward))
    if tp_chunks:
        for module in rowwise.values():
            _set_forward(module, functools.partial(_row_parallel_forward, module))
    # Activation checkpointing recomputes layers in the backward, outside the model's forward:
    # every checkpoint function the model holds (transformers' per-layer
    # ``_gradient_checkpointing_func``, called from the layer's ``__call__`` or ``forward``
    # depending on the release; torch's ``CheckpointWrapper.checkpoint_fn``) is wrapped at each
    # call so its recompute re-enters the numerics (``wrap_checkpointing``).
    for name, module in core.named_modules():
        if module is not core and _is_checkpoint_layer(module):
            patch._checkpointed.append((module, f"{name}.", "_gradient_checkpointing_func"))
        if type(module).__name__ == "CheckpointWrapper":
            patch._checkpointed.append((module, f"{name}.", "checkpoint_fn"))
    patch._restore.append(patch.unwrap_checkpointing)
    # Known modeling code (the Llama family's RMSNorm and rotary embedding) runs outside the
    # mode with its bits (``regions``).
    patch._restore.append(regions.install(core, _set_forward))
    # PEFT LoRA layers vouched for re-check at each call what can change after the patch.
    lora_trainer.install(core, vouched, _set_forward)
    # MoE blocks say which layer routes, for a replayed or recorded routing (``routing``).
    patch.moe = routing.moe_layout(core)
    patch._restore.append(routing.install(patch.moe))
    setattr(core, _PATCH_ATTR, patch)
    patch._restore.append(lambda: delattr(core, _PATCH_ATTR))
    return patch


def _tp_degree(core: nn.Module) -> int:
    """The tensor-parallel degree the model's weights are split at (1: none, or the service's
    ranks, whose plain shard tensors are bound at each call)."""
    return max((tensor_parallel.degree_at_rest(p) for p in core.parameters()), default=1)


def _row_parallel_forward(module: nn.Linear, x: Any) -> Any:
    """A row-parallel linear's forward: ``F.linear`` marked row-parallel, so the numerics'
    torch-function mode computes it by the tensor-parallel definition."""
    with tensor_parallel.row_parallel():
        return F.linear(x, module.weight, module.bias)


def _is_checkpoint_layer(module: nn.Module) -> bool:
    return any(c.__name__ == "GradientCheckpointingLayer" for c in type(module).__mro__)


def _under_numerics(
    patch: NumericsPatch, ckpt: Callable[..., Any], module: nn.Module, prefix: str
) -> Callable[..., Any]:
    """``ckpt`` (a checkpoint function: ``ckpt(fn, *args)``) whose ``fn`` runs under the
    patch's numerics at the forward and at the backward's recompute: the tiles, autocast off
    and, for an autocast trainer, ``module``'s parameters cast again (the forward's cast has
    ended by the time the recompute runs)."""
    head: nn.Module | None = patch.model.get_output_embeddings()  # type: ignore[operator]

    def under_numerics(fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        replay = routing.current()  # the forward's routing: the recompute replays it too
        plan = attention.plan_in_context()  # and its segment plan

        def run(*ra: Any, **rk: Any) -> Any:
            cast = patch.compute.cast_params
            with (
                _tile_mode(patch, head, patch.lm_head_fp32),
                torch.autocast(patch.device_type, enabled=False),
                patch.cast_parameters(module, prefix) if cast else nullcontext(),
                routing.use(replay),
                attention.current_plan(plan),
            ):
                return fn(*ra, **rk)

        return ckpt(run, *args, **kw)

    under_numerics._oldlogit_inner = ckpt  # type: ignore[attr-defined]
    return under_numerics


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
    cache = kwargs.get("past_key_values")
    if cache is not None and (not _empty_cache(cache) or _generating()):
        # Generation (a KV cache): sampling is the inference engine's business, not scoring;
        # it runs the model's own forward so a patched trainer can still generate. An empty
        # cache outside transformers' generation code is a scoring call that also fills the
        # cache: it runs the invariant forward, whose keys and values the cache receives.
        with patch.plain():
            return original(**kwargs)
    ids = kwargs.get("input_ids")
    ref = ids if ids is not None else kwargs.get("inputs_embeds")
    if ref is None:
        raise InvariantNumericsError("pass input_ids or inputs_embeds")
    batch, length = int(ref.shape[0]), int(ref.shape[1])
    segments, positions = plan_for(
        batch, length, kwargs.get("attention_mask"), kwargs.get("position_ids")
    )
    if segments.continued and patch.strict:
        b, s, p = segments.continued[0]
        raise InvariantNumericsError(
            f"position_ids start a sequence at position {p} (batch row {b}, token {s}; "
            f"{len(segments.continued)} such): the rest of a sequence whose beginning is not in "
            "this forward — a slice from sequence or context parallelism (verl's Ulysses, "
            "torch's context_parallel) or a chunked forward — or position ids that count a "
            "row's left padding (arange over the padded row). oldlogit's attention sees only "
            "this forward's tokens and the service scores whole sequences from position 0, "
            "so these logprobs cannot be the service's: give each sequence whole, positions "
            "restarting at 0 (strict=False runs it anyway, without the guarantee)"
        )
    kwargs["position_ids"] = positions.to(ref.device)
    kwargs[SEGMENTS_KWARG] = segments
    kwargs["use_cache"] = False
    fp32 = _HEAD_FP32.get()
    head = patch.model.get_output_embeddings()  # type: ignore[operator]
    patch.device_type = ref.device.type
    compute = patch.judge(patch.device_type)
    patch.wrap_checkpointing()
    # Inside, the model computes as the service's model at the compute dtype: autocast's
    # per-op casts (float32 softmax, norms) would make it another function.
    # With the service's numerics (``like``): each layer's sliding window must be the one the
    # service's model computes with, wherever the two would differ for this forward's lengths.
    windows = dict(patch.like.windows) if patch.like is not None and patch.like.windows else None
    with (
        torch.autocast(patch.device_type, enabled=False),
        patch.cast_parameters(patch.model) if compute.cast_params else nullcontext(),
        _tile_mode(patch, head, patch.lm_head_fp32 if fp32 is None else fp32),
        expecting_windows(windows) if windows is not None else nullcontext(),
        attention.current_plan(segments),
    ):
        return original(**kwargs)


def _empty_cache(cache: Any) -> bool:
    """A transformers ``Cache`` that holds no token yet (anything else counts as filled)."""
    length = getattr(cache, "get_seq_length", None)
    return callable(length) and int(length()) == 0


@functools.cache
def _generation_code() -> str:
    """The directory of transformers' generation code (``generate``, its decoding loops,
    continuous batching)."""
    import transformers.generation

    return os.path.dirname(transformers.generation.__file__) + os.sep


def _generating() -> bool:
    """Whether transformers' generation code is on this call's stack (its prefill passes an
    empty cache, as a scoring call that fills one does)."""
    root = _generation_code()
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_filename.startswith(root):
            return True
        frame = frame.f_back
    return False


def _eager(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` run eagerly even inside ``torch.compile`` (see the module docstring)."""
    disable = getattr(torch.compiler, "disable", None)
    return disable(fn) if disable is not None else fn


def _compiled(module: nn.Module) -> bool:
    """``torch.compile(model)`` or ``model.compile()`` (the model or any submodule)."""
    if isinstance(getattr(module, "_orig_mod", None), nn.Module):
        return True
    return any(getattr(m, "_compiled_call_impl", None) is not None for m in module.modules())


def _refuse_foreign_code(core: nn.Module, model: nn.Module) -> set[str]:
    """Refuse by name what the strict patch cannot vouch for; returns the PEFT LoRA layers it
    vouches for (``lora_trainer``)."""
    lora_trainer.check_wrapper(model)
    vouched = lora_trainer.check_model(core)
    mine = {clean_name(n) for n in vouched}
    found = [(n, fn) for n, fn in foreign_code(core, set()) if n not in mine]
    if not found:
        return vouched
    where = ", ".join(f"{name} runs {fn}" for name, fn in found[:4])
    more = f" and {len(found) - 4} more" if len(found) > 4 else ""
    origins = {fn.split(".")[0] for _, fn in found}
    if "liger_kernel" in origins:
        fix = (
            "liger-kernel's patches replace transformers' modules and the logprob path with "
            "fused kernels the service does not run: load the model without "
            "apply_liger_kernel_to_* (TRL: use_liger_kernel=False; verl: use_fused_kernels=False)"
        )
    elif "peft" in origins:
        fix = (
            "oldlogit vouches for PEFT's LoRA Linear layers only (docs/exactness.md, LoRA "
            "adapters): use LoRA on nn.Linear, or publish and score merged weights "
            "(model.merge_and_unload())"
        )
    else:
        fix = (
            "the service runs transformers' own forward of the published weights; run the "
            "model's transformers classes unmodified"
        )
    raise InvariantNumericsError(
        f"modules whose forward is not transformers' or torch's: {where}{more}. {fix} "
        "(strict=False runs them anyway, without the guarantee; oldlogit.parity.verify "
        "then says whether the bits hold)"
    )


@contextmanager
def trainer_numerics(
    model: nn.Module,
    *,
    tile_rows: int = DEFAULT_TILE_ROWS,
    lm_head_fp32: bool = False,
    strict: bool = True,
    like: NumericsSpec | None = None,
    tp_chunks: int = 0,
) -> Iterator[NumericsPatch]:
    """``patch_numerics`` for the duration of a ``with`` block (also usable as a decorator)."""
    patch = patch_numerics(
        model,
        tile_rows=tile_rows,
        lm_head_fp32=lm_head_fp32,
        strict=strict,
        like=like,
        tp_chunks=tp_chunks,
    )
    try:
        yield patch
    finally:
        patch.restore()
