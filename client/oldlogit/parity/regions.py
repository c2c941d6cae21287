"""Known transformers code run outside the numerics' torch-function mode, with the mode's bits.

In: a patched model's modules and the modeling functions they call. Where a function's source
is one this file was written against (``fingerprint``: a hash of its source text), its torch
calls run with torch functions' Python layer off, and each call the active ``ops.TileMode``
could rule is handed to that mode's rule directly (``TileMode.call``): the same calls in the
same order as on the mode's path, so the same bits, without the mode's per-call Python (~2 µs
a call on CPU). A 4-layer Qwen2's fp32 1 × 128 forward goes through the mode 99 times instead
of 260 (an RMSNorm makes 7 calls, a layer's rotary embedding ~20): 0.24 ms of 13 ms, measured
paired in one process.

Two regions, the code shared by the Llama family (Llama, Qwen2/3, Mistral, Mixtral, Qwen-MoE,
DeepSeek-V3, Granite, SmolLM3, ...):
- ``RMSNorm.forward``: float32 → mean of squares → × rsqrt(· + eps) → input dtype → × weight;
  its ``pow``, ``mean`` and ``rsqrt`` go through the mode's rules (blockwise on CPU), the rest
  are exact ops no rule touches; under the CUDA definition the whole norm is one call of the
  Triton kernel (kernels/cuda/rms_norm.py), that order in one row per program; the Gemma
  family's RMSNorm (× (1 + weight) in float32, then the cast) likewise under the CUDA
  definition, and as it is, through the mode, otherwise;
- ``apply_rotary_pos_emb`` (with its module's ``rotate_half``): views, products, sums, a
  negation and a concatenation, none of which any rule touches (``UNRULED``), so it runs as
  it is. It is a module-level function: while a model is patched its module's global is a
  wrapper that takes this path only on a thread inside a patched forward.
A region applies only while a ``TileMode`` is this thread's innermost torch-function mode and
the tensors are plain tensors (a subclass keeps its ``__torch_function__`` on the mode's path);
otherwise the original runs. Any other source (another release's, a patched one) runs as it is,
through the mode. Must not change what any call computes.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import textwrap
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from .ops import RULED_ANYWHERE, TileMode

__all__ = ["RMS_NORM_SOURCES", "ROTARY_SOURCES", "UNRULED", "fingerprint", "install"]

# Sources the regions were written against (``fingerprint``): transformers 5.23's.
RMS_NORM_SOURCES = frozenset({"d676bfe9af0e524d"})
ROTARY_SOURCES = frozenset({"ea234325c15de475"})
ROTATE_HALF_SOURCES = frozenset({"f714a4b1160c694e"})
# Gemma, Gemma 2 and Gemma 3's RMSNorm (their ``forward`` differs in a comment) and its
# ``_norm``: taken by the CUDA definition only (``_gemma_norm``).
GEMMA_NORM_SOURCES = frozenset({"78445ea3d6353b4d", "3aaaf6c3a56c829e", "3a8c77aca757e0bd"})
GEMMA_NORM_HELPER_SOURCES = frozenset({"cc4f84a7b2b99617"})

# Every torch function the regions call as they are; none may be one a rule could apply to
# (tests/unit/test_parity_regions.py holds the list to what the original code calls).
UNRULED: frozenset[Callable[..., Any]] = frozenset(
    {
        Tensor.to,
        Tensor.mul,  # ``a * b`` reaches torch functions as ``Tensor.mul``
        Tensor.add,
        Tensor.neg,
        Tensor.__getitem__,
        Tensor.unsqueeze,
        torch.cat,
        Tensor.dtype.__get__,  # type: ignore[attr-defined]
        Tensor.shape.__get__,  # type: ignore[attr-defined]
    }
)
assert not UNRULED & RULED_ANYWHERE, "a region calls as it is a function a rule applies to"

_PLAIN = (Tensor, nn.Parameter)


def fingerprint(fn: Any) -> str:
    """A hash of ``fn``'s source text (dedented); "" where the source cannot be read. Read once
    per code object (``trainer_numerics`` is entered per step; reading source is slow)."""
    code = getattr(getattr(fn, "__func__", fn), "__code__", None)
    if code is None:
        return _fingerprint(fn)
    found = _FINGERPRINTS.get(code)
    if found is None:
        found = _FINGERPRINTS[code] = _fingerprint(fn)
    return found


_FINGERPRINTS: dict[Any, str] = {}


def _fingerprint(fn: Any) -> str:
    try:
        source = inspect.getsource(fn)
    except (OSError, TypeError):
        return ""
    return hashlib.sha256(textwrap.dedent(source).encode()).hexdigest()[:16]


def _active_mode() -> TileMode | None:
    """The ``TileMode`` that is this thread's innermost torch-function mode, if any."""
    if not torch._C._is_torch_function_mode_enabled():
        return None
    n = torch._C._len_torch_function_stack()
    mode = torch._C._get_function_stack_at(n - 1) if n else None
    return mode if isinstance(mode, TileMode) else None


def _rms_norm(module: nn.Module, original: Callable[[Tensor], Tensor], hidden: Tensor) -> Tensor:
    """The Llama family's ``RMSNorm.forward``, op for op (``RMS_NORM_SOURCES``)."""
    mode = _active_mode()
    weight: Any = module.weight
    if mode is None or type(hidden) is not Tensor or type(weight) not in _PLAIN:
        return original(hidden)
    if mode.cuda:  # the CUDA definition: one Triton call per norm (kernels/cuda/rms_norm.py)
        from .kernels.cuda.differentiable import rms_norm

        with torch._C.DisableTorchFunction():
            eps: Any = module.variance_epsilon
            return rms_norm(hidden, weight, float(eps))
    call = mode.call
    with torch._C.DisableTorchFunction():
        input_dtype = hidden.dtype
        hidden = hidden.to(torch.float32)
        variance = call(Tensor.mean, call(Tensor.pow, hidden, 2), -1, keepdim=True)
        hidden = hidden * call(torch.rsqrt, variance + module.variance_epsilon)
        out: Tensor = weight * hidden.to(input_dtype)
    return out


def _gemma_norm(module: nn.Module, original: Callable[[Tensor], Tensor], hidden: Tensor) -> Tensor:
    """The Gemma family's RMSNorm (``GEMMA_NORM_SOURCES``: float32 → × rsqrt(mean of squares +
    eps) → × (1 + weight in float32) → input dtype) as one call of the Triton kernel under the
    CUDA definition; the original, through the mode, otherwise (CPU: as before)."""
    mode = _active_mode()
    weight: Any = module.weight
    if mode is None or not mode.cuda or type(hidden) is not Tensor or type(weight) not in _PLAIN:
        return original(hidden)
    from .kernels.cuda.differentiable import rms_norm

    eps: Any = module.eps
    with torch._C.DisableTorchFunction():
        return rms_norm(hidden, weight, float(eps), offset=1.0, cast_before_weight=False)


def _rotary(
    original: Callable[..., Any], rotate_half: Callable[..., Any], space: dict[str, Any]
) -> Any:
    @functools.wraps(original)
    def apply_rotary_pos_emb(q: Any, k: Any, cos: Any, sin: Any, *args: Any, **kwargs: Any) -> Any:
        if (
            space.get("rotate_half") is rotate_half
            and type(q) is Tensor
            and type(k) is Tensor
            and type(cos) is Tensor
            and type(sin) is Tensor
            and _active_mode() is not None
        ):
            with torch._C.DisableTorchFunction():
                return original(q, k, cos, sin, *args, **kwargs)
        return original(q, k, cos, sin, *args, **kwargs)

    apply_rotary_pos_emb._oldlogit_original = original  # type: ignore[attr-defined]
    return apply_rotary_pos_emb


# id of a modeling module's namespace → (the namespace, its own apply_rotary_pos_emb, the
# wrapper, patches that use it).
_wrapped: dict[int, tuple[dict[str, Any], Any, Any, int]] = {}
_wrapped_lock = threading.Lock()


def _wrap_rotary(space: dict[str, Any]) -> Callable[[], None] | None:
    """Put the rotary region in a modeling module's namespace (``space``: its globals, where
    its attention looks the function up; counted: several patched models may share it);
    returns its undo, or None where the module's code is not the known one."""
    key = id(space)
    with _wrapped_lock:
        held = _wrapped.get(key)
        if held is not None and space.get("apply_rotary_pos_emb") is held[2]:
            _wrapped[key] = (space, held[1], held[2], held[3] + 1)
        else:
            fn, half = space.get("apply_rotary_pos_emb"), space.get("rotate_half")
            if (
                fingerprint(fn) not in ROTARY_SOURCES
                or fingerprint(half) not in ROTATE_HALF_SOURCES
            ):
                return None
            wrapper = _rotary(fn, half, space)  # type: ignore[arg-type]
            space["apply_rotary_pos_emb"] = wrapper
            _wrapped[key] = (space, fn, wrapper, 1)

    def undo() -> None:
        with _wrapped_lock:
            _, original, wrapper, count = _wrapped[key]
            if count > 1:
                _wrapped[key] = (space, original, wrapper, count - 1)
                return
            del _wrapped[key]
            if space.get("apply_rotary_pos_emb") is wrapper:
                space["apply_rotary_pos_emb"] = original

    return undo


_known_norms: dict[type, bool] = {}


def _is_known_norm(cls: type) -> bool:
    known = _known_norms.get(cls)
    if known is None:
        known = _known_norms[cls] = fingerprint(getattr(cls, "forward", None)) in RMS_NORM_SOURCES
    return known


_gemma_norms: dict[type, bool] = {}


def _is_gemma_norm(cls: type) -> bool:
    known = _gemma_norms.get(cls)
    if known is None:
        known = _gemma_norms[cls] = (
            fingerprint(getattr(cls, "forward", None)) in GEMMA_NORM_SOURCES
            and fingerprint(getattr(cls, "_norm", None)) in GEMMA_NORM_HELPER_SOURCES
        )
    return known


def install(
    model: nn.Module, set_forward: Callable[[nn.Module, Callable[..., Any]], None]
) -> Callable[[], None]:
    """Put ``model``'s known code under the regions (``set_forward`` installs an instance
    forward and records its undo); returns the undo of the rotary wrappers."""
    undos: list[Callable[[], None]] = []
    spaces: dict[int, dict[str, Any]] = {}
    for module in model.modules():
        cls = type(module)
        if cls.__module__.startswith("transformers.models."):
            space = getattr(cls.forward, "__globals__", None)
            if isinstance(space, dict):
                spaces[id(space)] = space
        if "forward" not in module.__dict__ and _is_known_norm(cls):
            set_forward(module, functools.partial(_rms_norm, module, module.forward))
        elif "forward" not in module.__dict__ and _is_gemma_norm(cls):
            set_forward(module, functools.partial(_gemma_norm, module, module.forward))
    for space in spaces.values():
        undo = _wrap_rotary(space)
        if undo is not None:
            undos.append(undo)

    def restore() -> None:
        while undos:
            undos.pop()()

    return restore
