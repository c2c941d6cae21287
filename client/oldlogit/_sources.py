"""The tensors a publish sends: a trainer's state dict or checkpoint, under canonical names.

In: ``{name: tensor | ndarray}`` (torch tensors on any device, DTensors of a one-rank mesh) or
safetensors files, and optionally the service's ``WeightLayout`` (``Info.weight_layout``).
Out: ``TensorSource``s — canonical name, dtype, shape, size and a ``read`` that yields the raw
bytes when asked — checked against the layout before anything is read. A source reads its
input tensors one at a time (off-CPU tensors copied one at a time, casts made one at a time),
so a publish holds a few tensors, never a second copy of the weights. Torch is imported only
when the inputs are torch tensors or a file needs a cast.

With a layout: tied duplicates, wrapper prefixes and per-expert checkpoint tensors are mapped
onto the canonical names (``oldlogit.layout``), each tensor's dtype and shape are checked, and
``cast=True`` casts a floating tensor to its serving dtype (else a dtype difference is refused,
naming the tensor). Without one (an older service) names are sent as they are.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from oldlogit.errors import InvalidRequest, WeightsMismatch
from oldlogit.layout import WeightLayout
from oldlogit.weights import (
    DTYPE_ITEMSIZE,
    SafetensorsHeader,
    TensorEntry,
    WeightHasher,
    dtype_name,
    numpy_dtype,
    read_entry_chunks,
    shard_headers,
    tensor_raw_bytes,
)

__all__ = ["TensorSource", "file_sources", "hash_sources", "state_dict_sources"]

# Reads one tensor's bytes given the open shard files (unused for in-memory tensors).
Reader = Callable[[Mapping[Path, BinaryIO]], Iterable[bytes | memoryview]]
_FLOATS = {"F16", "BF16", "F32", "F64"}


@dataclass(frozen=True)
class TensorSource:
    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    read: Reader


def hash_sources(
    sources: Iterable[TensorSource], files: Iterable[Path] = (), bar: Any = None
) -> str:
    """The weight hash (``oldlogit.weights.weight_sha256``) of the sources' bytes."""
    hasher = WeightHasher()
    handles = {p: open(p, "rb") for p in files}  # noqa: SIM115 - closed below
    try:
        for s in sorted(sources, key=lambda s: s.name):
            hasher.begin(s.name, s.dtype, s.shape)
            for chunk in s.read(handles):
                hasher.update(chunk)
                if bar is not None:
                    bar.update(memoryview(chunk).nbytes)
    finally:
        for f in handles.values():
            f.close()
    return hasher.hexdigest()


def is_dtensor(x: Any) -> bool:
    """A torch DTensor (FSDP2/TP shards), told without importing torch."""
    return type(x).__name__ == "DTensor" and hasattr(x, "full_tensor")


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
        from oldlogit.weights import torch_dtype

        return x.detach().to(torch_dtype(cast_to))
    return np.asarray(x).astype(numpy_dtype(cast_to))


def check_dtype(
    layout: WeightLayout, canonical: str, dtype: str, cast: bool, parameter: str
) -> str | None:
    """The dtype to cast to (None: none), or ``WeightsMismatch`` naming the tensor."""
    want = layout.specs[canonical][0]
    if dtype == want:
        return None
    if cast and dtype in _FLOATS and want in _FLOATS:
        return want
    hint = "" if cast else " (publish in the serving dtype, or pass cast=True)"
    raise WeightsMismatch(
        f"the weights' tensor {canonical!r} is {dtype}, the model serves {want}{hint}",
        parameter=parameter,
        details={"tensor": canonical},
    )


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
        return [_single(name, name, weights[name], None) for name in weights]
    assembly = layout.assemble(weights, partial=partial)
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
            out.append(_single(canonical, parts[0], tensors[0], cast_to, layout))
        else:
            out.append(_joined(canonical, tensors, cast_to, layout))
    return out


def _shape(x: Any) -> tuple[int, ...]:
    return tuple(int(d) for d in x.shape)


def _single(
    canonical: str, given: str, x: Any, cast_to: str | None, layout: WeightLayout | None = None
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


def file_sources(
    path: str | os.PathLike[str], layout: WeightLayout | None = None, *, cast: bool = False
) -> tuple[list[TensorSource], list[Path]]:
    """A safetensors file or shard directory as canonical sources, from its headers alone."""
    where, headers = shard_headers(path)
    files = [h.path for h in headers]
    if layout is None or not layout.specs:
        if cast:
            raise InvalidRequest(
                "cast=True needs the service's weight layout (an older service has none)",
                parameter="cast",
            )
        return [_file_source(n, n, where[n], None) for n in where], files
    assembly = layout.assemble(where)
    out = []
    for canonical, parts in assembly.parts.items():
        entries = [(where[p], where[p].tensors[p]) for p in parts]
        dtypes = {e.dtype for _, e in entries}
        if len(dtypes) > 1:
            raise WeightsMismatch(
                f"the weights' parts of {canonical!r} mix dtypes {sorted(dtypes)}",
                parameter="weights",
                details={"tensor": canonical},
            )
        layout.check_parts(canonical, [e.shape for _, e in entries], "weights")
        cast_to = check_dtype(layout, canonical, dtypes.pop(), cast, "weights")
        dtype = cast_to or entries[0][1].dtype
        shape = layout.specs[canonical][1]
        nbytes = math.prod(shape) * DTYPE_ITEMSIZE[dtype]
        out.append(TensorSource(canonical, dtype, shape, nbytes, _file_reader(entries, cast_to)))
    return out, files


def _file_source(
    canonical: str, given: str, header: SafetensorsHeader, cast_to: str | None
) -> TensorSource:
    entry = header.tensors[given]
    return TensorSource(
        canonical, entry.dtype, entry.shape, entry.nbytes, _file_reader([(header, entry)], None)
    )


def _file_reader(
    entries: list[tuple[SafetensorsHeader, TensorEntry]], cast_to: str | None
) -> Reader:
    def read(handles: Mapping[Path, BinaryIO]) -> Iterator[bytes | memoryview]:
        for header, entry in entries:
            if cast_to is None:
                yield from read_entry_chunks(handles[header.path], header, entry)
                continue
            raw = b"".join(read_entry_chunks(handles[header.path], header, entry))
            yield tensor_raw_bytes(_cast_raw(raw, entry, cast_to))

    return read


def _cast_raw(raw: bytes, entry: TensorEntry, cast_to: str) -> Any:
    """One file tensor's bytes cast to ``cast_to`` (torch when a dtype needs it, e.g. BF16)."""
    try:
        import torch

        from oldlogit.weights import torch_dtype

        flat = torch.frombuffer(bytearray(raw), dtype=torch_dtype(entry.dtype))
        return flat.to(torch_dtype(cast_to))
    except ImportError:
        arr = np.frombuffer(raw, dtype=numpy_dtype(entry.dtype))
        return arr.astype(numpy_dtype(cast_to))
