"""Publish inputs, checked against the model's parameter specs before any data is read.

In: a state dict (tensor metadata) or safetensors file(s) (headers only), and ``param_specs``.
Out: ``TensorSource``s that stream each tensor's raw bytes on demand, or ``WeightsMismatch``
naming the offending tensor. Reads no tensor data itself except in ``hash_sources``.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from oldlogit.contract.errors import InvalidRequest, WeightsMismatch
from oldlogit.contract.weights import (
    DTYPE_ITEMSIZE,
    SafetensorsHeader,
    TensorEntry,
    WeightHasher,
    dtype_name,
    read_entry_chunks,
    shard_headers,
    tensor_raw_bytes,
    torch_dtype,
)
from oldlogit_service.snapshots.buffers import TensorSource

__all__ = [
    "ParamSpecs",
    "file_sources",
    "hash_sources",
    "normalize_specs",
    "specs_nbytes",
    "specs_sha256",
    "state_dict_sources",
]

ParamSpecs = Mapping[str, tuple[str, tuple[int, ...]]]

_FLOATS = {"F16", "BF16", "F32", "F64", "F8_E4M3", "F8_E5M2"}


def normalize_specs(specs: ParamSpecs) -> dict[str, tuple[str, tuple[int, ...]]]:
    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    for name, (dtype, shape) in specs.items():
        if dtype not in DTYPE_ITEMSIZE:
            raise ValueError(f"param_specs[{name!r}]: unknown safetensors dtype {dtype!r}")
        out[str(name)] = (dtype, tuple(int(d) for d in shape))
    return out


def specs_nbytes(specs: ParamSpecs) -> int:
    return sum(math.prod(shape) * DTYPE_ITEMSIZE[dt] for dt, shape in specs.values())


def specs_sha256(specs: ParamSpecs) -> str:
    """A fingerprint of the model's parameter table (a snapshot dir serves one model)."""
    rows = [[name, dt, list(shape)] for name, (dt, shape) in sorted(specs.items())]
    return hashlib.sha256(json.dumps(rows, separators=(",", ":")).encode()).hexdigest()


def _mismatch(message: str, tensor: str) -> WeightsMismatch:
    return WeightsMismatch(message, parameter="weights", details={"tensor": tensor})


def _check_names(names: Iterable[str], specs: ParamSpecs) -> None:
    have = set(names)
    missing = sorted(n for n in specs if n not in have)
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise _mismatch(f"the weights lack tensor {missing[0]!r}{more}", missing[0])
    extra = sorted(n for n in have if n not in specs)
    if extra:
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        raise _mismatch(
            f"the weights hold tensor {extra[0]!r}{more}, which the model does not have",
            extra[0],
        )


def _check_one(
    name: str, dtype: str, shape: tuple[int, ...], specs: ParamSpecs, *, cast_ok: bool
) -> None:
    want_dtype, want_shape = specs[name]
    if shape != want_shape:
        raise _mismatch(
            f"the weights' tensor {name!r} has shape {list(shape)}, the model expects "
            f"{list(want_shape)}",
            name,
        )
    if dtype != want_dtype and not (cast_ok and dtype in _FLOATS and want_dtype in _FLOATS):
        hint = "" if cast_ok else " (publish in the serving dtype, or pass cast=True)"
        raise _mismatch(
            f"the weights' tensor {name!r} is {dtype}, the model serves {want_dtype}{hint}", name
        )


def _tensor_chunks(t: Any, cast_to: str | None) -> Iterator[memoryview]:
    if cast_to is not None:
        t = t.to(torch_dtype(cast_to))
    yield tensor_raw_bytes(t)


def state_dict_sources(
    weights: Mapping[str, Any], specs: ParamSpecs, *, cast: bool = False
) -> dict[str, TensorSource]:
    """Check a state dict's names, shapes and dtypes; its data is read later, tensor by tensor.

    With ``cast`` a floating tensor in another floating dtype is cast to the serving dtype (the
    hash is of the cast tensor); otherwise any dtype difference is refused.
    """
    _check_names(weights, specs)
    out: dict[str, TensorSource] = {}
    for name, t in weights.items():
        if not hasattr(t, "shape") or not hasattr(t, "dtype"):
            raise _mismatch(
                f"the weights' entry {name!r} is a {type(t).__name__}, not a tensor", name
            )
        try:
            dtype = dtype_name(t)
        except InvalidRequest as exc:
            raise _mismatch(f"the weights' tensor {name!r}: {exc}", name) from exc
        shape = tuple(int(d) for d in t.shape)
        is_torch = type(t).__module__.split(".")[0] == "torch"
        _check_one(name, dtype, shape, specs, cast_ok=cast and is_torch)
        want = specs[name][0]
        out[name] = TensorSource(
            name,
            want,
            shape,
            functools.partial(_tensor_chunks, t, want if dtype != want else None),
        )
    return out


def _file_chunks(header: SafetensorsHeader, entry: TensorEntry) -> Iterator[bytes]:
    with open(header.path, "rb") as f:
        yield from read_entry_chunks(f, header, entry)


def file_sources(
    path: Path, specs: ParamSpecs
) -> tuple[dict[str, TensorSource], list[SafetensorsHeader]]:
    """Check a safetensors file (or a directory of shards) from its headers alone."""
    where, headers = shard_headers(path)
    _check_names(where, specs)
    out: dict[str, TensorSource] = {}
    for name, h in where.items():
        e = h.tensors[name]
        _check_one(name, e.dtype, e.shape, specs, cast_ok=False)
        out[name] = TensorSource(name, e.dtype, e.shape, functools.partial(_file_chunks, h, e))
    return out, headers


def hash_sources(sources: Mapping[str, TensorSource]) -> str:
    """The weight hash of checked sources, without writing them anywhere."""
    hasher = WeightHasher()
    for name in sorted(sources):
        s = sources[name]
        hasher.begin(name, s.dtype, s.shape)
        for chunk in s.chunks():
            hasher.update(chunk)
    return hasher.hexdigest()
