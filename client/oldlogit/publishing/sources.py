"""A trainer's state dict as the tensors a publish sends, under canonical names.

In: ``{name: tensor | ndarray}`` (torch tensors on any device, DTensors of a one-rank mesh) and
optionally the service's ``WeightLayout`` (``Info.weight_layout``). Out: ``TensorSource``s
(``oldlogit.contract.safetensors``) — canonical name, dtype, shape, size and a ``read`` that
yields the raw bytes when asked — checked against the layout before anything is read. A source
reads its input tensors one at a time (off-CPU tensors copied one at a time, casts made one at a
time), so a publish holds a few tensors, never a second copy of the weights. Torch tensors are
duck-typed: this module imports torch only to cast one, when torch is loaded already.

With a layout: tied duplicates, wrapper prefixes and per-expert checkpoint tensors are mapped
onto the canonical names (``oldlogit.contract.layout``), each tensor's dtype and shape are
checked, and ``cast=True`` casts a floating tensor to its serving dtype (else a dtype difference
is refused, naming the tensor). Without one (an older service) names are sent as they are.
Safetensors files become sources in the contract (``file_sources``): the service reads them too.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from oldlogit.contract.errors import InvalidRequest, WeightsMismatch
from oldlogit.contract.layout import WeightLayout, check_tied
from oldlogit.contract.safetensors import TensorSource, check_dtype
from oldlogit.contract.weights import (
    DTYPE_ITEMSIZE,
    dtype_name,
    numpy_dtype,
    same_values,
    tensor_raw_bytes,
    torch_dtype,
)

__all__ = ["is_dtensor", "same_state_tensors", "state_dict_sources"]


def is_dtensor(x: Any) -> bool:
    """A torch DTensor (FSDP2/TP shards), told without importing torch."""
    return type(x).__name__ == "DTensor" and hasattr(x, "full_tensor")


def state_dict_sources(
    weights: Mapping[str, Any],
    layout: WeightLayout | None = None,
    *,
    cast: bool = False,
    partial: bool = False,
) -> list[TensorSource]:
    """A state dict's tensors as canonical ``TensorSource``s (see the module docstring).
    ``partial``: one rank's share of the weights (an empty share is allowed)."""
    if partial and isinstance(weights, Mapping) and not weights:
        return []
    if not isinstance(weights, Mapping) or not weights:
        raise InvalidRequest(
            "weights must be a non-empty {name: tensor} mapping", parameter="weights"
        )
    for name, x in weights.items():
        if not isinstance(name, str) or not hasattr(x, "shape"):
            raise InvalidRequest(
                f"weights[{name!r}] must be a tensor or array keyed by name", parameter="weights"
            )
    if layout is None or not layout.specs:
        if cast:
            raise InvalidRequest(
                "cast=True needs the service's weight layout (an older service has none)",
                parameter="cast",
            )
        return [_single(name, weights[name], None) for name in weights]
    assembly = layout.assemble(weights, partial=partial)
    check_tied(assembly, lambda a, b: same_state_tensors(weights[a], weights[b]))
    out = []
    for canonical, parts in assembly.parts.items():
        tensors = [weights[p] for p in parts]
        dtypes = {dtype_name(t) for t in tensors}
        if len(dtypes) > 1:
            raise WeightsMismatch(
                f"the weights' parts of {canonical!r} mix dtypes {sorted(dtypes)}",
                parameter="weights",
                details={"tensor": canonical},
            )
        layout.check_parts(canonical, [_shape(t) for t in tensors], "weights")
        cast_to = check_dtype(layout, canonical, dtypes.pop(), cast, "weights")
        if len(tensors) == 1:
            out.append(_single(canonical, tensors[0], cast_to, layout))
        else:
            out.append(_joined(canonical, tensors, cast_to, layout))
    return out


def same_state_tensors(a: Any, b: Any, *, gather: bool = False) -> bool:
    """``same_values`` on two state-dict tensors, DTensors compared whole. A DTensor over
    several ranks is gathered only with ``gather`` (every rank calls it alike: the sharded
    publisher); without, it passes — ``Client.publish`` refuses it when read
    (``_materialize``), naming the call to make instead. One tensor is never read."""
    if a is b:
        return True
    if is_dtensor(a) or is_dtensor(b):
        if not gather and any(is_dtensor(x) and x.device_mesh.size() > 1 for x in (a, b)):
            return True
        a, b = (x.full_tensor() if is_dtensor(x) else x for x in (a, b))  # collectives
    return same_values(a, b)


def _materialize(x: Any, cast_to: str | None) -> Any:
    """The whole tensor on the CPU side of ``tensor_raw_bytes``, cast if asked."""
    if is_dtensor(x):
        mesh = x.device_mesh
        if mesh.size() > 1:
            raise InvalidRequest(
                "the weights are DTensors sharded over several ranks: call "
                "oldlogit.integrations.publish_sharded(...) on every rank (it gathers them "
                "shard by shard)",
                parameter="weights",
            )
        x = x.full_tensor()
    if cast_to is None:
        return x
    if type(x).__module__.split(".")[0] == "torch":
        return x.detach().to(torch_dtype(cast_to))
    return np.asarray(x).astype(numpy_dtype(cast_to))


def _shape(x: Any) -> tuple[int, ...]:
    return tuple(int(d) for d in x.shape)


def _single(
    canonical: str, x: Any, cast_to: str | None, layout: WeightLayout | None = None
) -> TensorSource:
    dtype = cast_to or dtype_name(x)
    shape = layout.specs[canonical][1] if layout is not None else _shape(x)
    nbytes = math.prod(shape) * DTYPE_ITEMSIZE[dtype]

    def read(_: Mapping[Path, BinaryIO], x: Any = x) -> list[memoryview]:
        return [tensor_raw_bytes(_materialize(x, cast_to))]

    return TensorSource(canonical, dtype, shape, nbytes, read)


def _joined(
    canonical: str, tensors: list[Any], cast_to: str | None, layout: WeightLayout
) -> TensorSource:
    """Per-expert tensors whose bytes, back to back, are the canonical (fused) tensor."""
    dtype = cast_to or dtype_name(tensors[0])
    shape = layout.specs[canonical][1]
    nbytes = math.prod(shape) * DTYPE_ITEMSIZE[dtype]

    def read(_: Mapping[Path, BinaryIO]) -> Iterator[memoryview]:
        for t in tensors:
            yield tensor_raw_bytes(_materialize(t, cast_to))

    return TensorSource(canonical, dtype, shape, nbytes, read)
