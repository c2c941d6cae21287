"""The weight hash and the safetensors header, shared by the trainer-side client and the service.

In: a flat ``{name: tensor}`` (torch tensors, duck-typed, or numpy arrays) or safetensors files.
Out: the version's weight sha256 (hex, see ``weight_sha256``) and a file's tensor table. Torch is
never imported at module level (the client stays torch-free), tensor data is streamed tensor by
tensor and never concatenated, and headers are read without touching the data.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import struct
import sys
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from oldlogit.contract.errors import InvalidRequest

if TYPE_CHECKING:
    import torch

__all__ = [
    "DTYPE_ITEMSIZE",
    "SafetensorsHeader",
    "TensorEntry",
    "WeightHasher",
    "adapter_hash_prefix",
    "adapter_sha256",
    "dtype_name",
    "numpy_dtype",
    "read_entry_chunks",
    "read_safetensors_header",
    "safetensors_files",
    "safetensors_sha256",
    "same_values",
    "tensor_raw_bytes",
    "torch_dtype",
    "weight_sha256",
]

# Bytes per element of every safetensors dtype name.
DTYPE_ITEMSIZE: Mapping[str, int] = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}

# str(torch dtype) -> safetensors name; keyed by string so no torch import is needed.
_TORCH_NAMES: Mapping[str, str] = {
    "torch.bool": "BOOL",
    "torch.uint8": "U8",
    "torch.int8": "I8",
    "torch.float8_e4m3fn": "F8_E4M3",
    "torch.float8_e5m2": "F8_E5M2",
    "torch.int16": "I16",
    "torch.uint16": "U16",
    "torch.float16": "F16",
    "torch.bfloat16": "BF16",
    "torch.int32": "I32",
    "torch.uint32": "U32",
    "torch.float32": "F32",
    "torch.int64": "I64",
    "torch.uint64": "U64",
    "torch.float64": "F64",
}

# numpy dtype name -> safetensors name ("bfloat16"/"float8_*" are ml_dtypes' names).
_NUMPY_NAMES: Mapping[str, str] = {
    "bool": "BOOL",
    "uint8": "U8",
    "int8": "I8",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
    "int16": "I16",
    "uint16": "U16",
    "float16": "F16",
    "bfloat16": "BF16",
    "int32": "I32",
    "uint32": "U32",
    "float32": "F32",
    "int64": "I64",
    "uint64": "U64",
    "float64": "F64",
}

# The safetensors reference implementation refuses headers above 100 MB; so do we, before
# allocating anything for a hostile length field.
MAX_HEADER_BYTES = 100 * 1024 * 1024
_CHUNK = 16 * 1024 * 1024


def _is_torch(x: Any) -> bool:
    return type(x).__module__.split(".")[0] == "torch" and hasattr(x, "dtype")


def dtype_name(x: Any) -> str:
    """The safetensors dtype name of a torch tensor/dtype or a numpy array/dtype."""
    dt = x.dtype if hasattr(x, "dtype") else x
    key = str(dt)
    if key in _TORCH_NAMES:
        return _TORCH_NAMES[key]
    try:
        np_name = np.dtype(dt).name
    except TypeError:
        np_name = key
    if np_name in _NUMPY_NAMES:
        return _NUMPY_NAMES[np_name]
    raise InvalidRequest(f"the weights' dtype {key} has no safetensors name", parameter="weights")


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype for a safetensors dtype name (imports torch)."""
    import torch

    for torch_name, st_name in _TORCH_NAMES.items():
        if st_name == name:
            dt = getattr(torch, torch_name.removeprefix("torch."), None)
            if isinstance(dt, torch.dtype):
                return dt
    raise InvalidRequest(
        f"the weights' dtype {name!r} is not supported by torch here", parameter="weights"
    )


def numpy_dtype(name: str) -> np.dtype[Any]:
    """The little-endian numpy dtype for a safetensors name (BF16/F8 need ml_dtypes)."""
    for np_name, st_name in _NUMPY_NAMES.items():
        if st_name == name:
            try:
                return np.dtype(np_name).newbyteorder("<")
            except TypeError as exc:
                raise InvalidRequest(
                    f"the weights' dtype {name!r} has no numpy equivalent (install ml_dtypes)",
                    parameter="weights",
                ) from exc
    raise InvalidRequest(f"the weights' dtype {name!r} is unknown", parameter="weights")


def tensor_raw_bytes(x: Any) -> memoryview:
    """Raw little-endian C-order bytes of one tensor, as a flat byte view (no copy on CPU).

    Torch tensors off the CPU are copied to the CPU (one tensor at a time); non-contiguous
    inputs are made contiguous. The view keeps its buffer alive.
    """
    if _is_torch(x):
        import torch

        if sys.byteorder != "little":  # pragma: no cover - no big-endian torch hosts in sight
            raise InvalidRequest(
                "the weights (torch tensors) are hashed on little-endian hosts only",
                parameter="weights",
            )
        t = x.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        flat = t.contiguous().reshape(-1)  # reshape: view(uint8) needs >= 1 dimension
        raw: memoryview = flat.view(torch.uint8).numpy().data
        return raw.cast("B")
    arr = np.asarray(x)
    if arr.dtype.byteorder == ">" or (arr.dtype.byteorder == "=" and sys.byteorder == "big"):
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    arr = np.ascontiguousarray(arr).reshape(-1)
    return arr.view(np.uint8).data.cast("B")


def _shape_of(x: Any) -> tuple[int, ...]:
    return tuple(int(d) for d in x.shape)


def same_values(a: Any, b: Any) -> bool:
    """Whether two tensors (torch or array-like, one process's whole tensors) hold the same
    dtype, shape and bits — NaN payloads and signed zeros included. One tensor, or two views
    of the same memory, answer without reading it; two torch tensors on one device compare
    there."""
    if a is b:
        return True
    if dtype_name(a) != dtype_name(b) or _shape_of(a) != _shape_of(b):
        return False
    if _is_torch(a) and _is_torch(b):
        import torch

        ta, tb = a.detach(), b.detach()
        if ta.device == tb.device:
            if ta.data_ptr() == tb.data_ptr() and ta.stride() == tb.stride():
                return True
            flat_a = ta.contiguous().reshape(-1).view(torch.uint8)
            flat_b = tb.contiguous().reshape(-1).view(torch.uint8)
            return bool(torch.equal(flat_a, flat_b))
    return tensor_raw_bytes(a) == tensor_raw_bytes(b)


class WeightHasher:
    """Incremental weight hash: feed tensors in sorted name order, each one's bytes in chunks.

    Checks the promises the format relies on: names strictly increasing, and exactly
    ``prod(shape) * itemsize`` bytes per tensor.
    """

    def __init__(self, prefix: bytes = b"") -> None:
        self._h = hashlib.sha256(prefix)  # ``prefix``: an adapter's (``adapter_hash_prefix``)
        self._last: str | None = None
        self._expected = 0
        self._seen = 0

    def begin(self, name: str, dtype: str, shape: Iterable[int]) -> None:
        self._check_complete()
        if self._last is not None and name <= self._last:
            raise ValueError(
                f"tensor names must be fed in sorted order: {name!r} after {self._last!r}"
            )
        if dtype not in DTYPE_ITEMSIZE:
            raise InvalidRequest(f"the weights' dtype {dtype!r} is unknown", parameter="weights")
        dims = [int(d) for d in shape]
        self._last = name
        self._expected = math.prod(dims) * DTYPE_ITEMSIZE[dtype]
        self._seen = 0
        h = self._h
        h.update(name.encode())
        h.update(b"\0")
        h.update(dtype.encode())
        h.update(b"\0")
        h.update(",".join(map(str, dims)).encode())
        h.update(b"\0")

    def update(self, data: bytes | bytearray | memoryview) -> None:
        n = memoryview(data).nbytes
        self._seen += n
        if self._seen > self._expected:
            raise ValueError(f"tensor {self._last!r}: more bytes than its shape and dtype hold")
        self._h.update(data)

    def _check_complete(self) -> None:
        if self._seen != self._expected:
            raise ValueError(
                f"tensor {self._last!r}: got {self._seen} bytes, expected {self._expected}"
            )

    def hexdigest(self) -> str:
        self._check_complete()
        return self._h.hexdigest()


def weight_sha256(weights: Mapping[str, Any], *, dtypes: Mapping[str, str] | None = None) -> str:
    """The weight hash of one policy version (hex sha256). A public, stable format::

        h = sha256()
        for name in sorted(weights):          # Python str order == UTF-8 byte order
            h.update(name.encode("utf-8")); h.update(b"\\0")
            h.update(DTYPE.encode());       h.update(b"\\0")   # safetensors name: "BF16", "F32"…
            h.update(",".join(str(d) for d in shape).encode()); h.update(b"\\0")  # "" for scalars
            h.update(raw little-endian C-order bytes of the tensor)
        return h.hexdigest()

    ``weights`` values are torch tensors (any device; bf16 hashed through a uint8 view) or
    numpy arrays. numpy has no bfloat16: pass the bits as a ``uint16`` array and declare the
    real dtype with ``dtypes={name: "BF16"}`` (same item size required).
    """
    return _hash_tensors(WeightHasher(), weights, dtypes)


def _hash_tensors(
    hasher: WeightHasher, weights: Mapping[str, Any], dtypes: Mapping[str, str] | None
) -> str:
    for name in sorted(weights):
        x = weights[name]
        dt = dtype_name(x)
        if dtypes is not None and name in dtypes:
            declared = dtypes[name]
            if DTYPE_ITEMSIZE.get(declared) != DTYPE_ITEMSIZE[dt]:
                raise InvalidRequest(
                    f"the weights' tensor {name!r}: declared dtype {declared} does not match "
                    f"the item size of its {dt} data",
                    parameter="weights",
                )
            dt = declared
        hasher.begin(name, dt, _shape_of(x))
        hasher.update(tensor_raw_bytes(x))
    return hasher.hexdigest()


def adapter_hash_prefix(config_json: str, base_sha256: str) -> bytes:
    """What an adapter version's hash opens with (``adapter_sha256``)."""
    return b"oldlogit-adapter\0" + config_json.encode() + b"\0" + base_sha256.encode() + b"\0"


def adapter_sha256(
    config_json: str,
    base_sha256: str,
    tensors: Mapping[str, Any],
    *,
    dtypes: Mapping[str, str] | None = None,
) -> str:
    """The weight hash of an adapter version (hex sha256): one sha256 over ::

        b"oldlogit-adapter\\0" + config_json + b"\\0" + base_sha256 (hex) + b"\\0"
        then every tensor exactly as ``weight_sha256`` feeds it (sorted names; name, dtype,
        shape, raw little-endian bytes)

    ``config_json``: the canonical config (``oldlogit.contract.adapters.AdapterConfig.to_json``:
    sorted keys, no spaces); ``base_sha256``: the base version's weight hash.
    """
    return _hash_tensors(
        WeightHasher(adapter_hash_prefix(config_json, base_sha256)), tensors, dtypes
    )


# -- safetensors files --------------------------------------------------------------------


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a safetensors file; ``begin``/``end`` are offsets into the data region."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class SafetensorsHeader:
    """A checked safetensors header: the tensor table, where data starts, the file size."""

    path: Path
    data_start: int  # absolute file offset of the data region (8 + header length)
    tensors: Mapping[str, TensorEntry]
    metadata: Mapping[str, str]
    file_size: int

    @functools.cached_property
    def nbytes(self) -> int:  # the tensor table never changes: summed once
        return sum(e.nbytes for e in self.tensors.values())


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {k!r}")
        out[k] = v
    return out


def read_safetensors_header(path: str | os.PathLike[str]) -> SafetensorsHeader:
    """Parse and check a safetensors header without reading tensor data.

    Checks: the 8-byte little-endian length, a JSON object, known dtypes, non-negative integer
    shapes, offsets matching ``prod(shape) * itemsize``, and a data region covered exactly once
    with no holes, ending at the end of the file. Raises ``InvalidRequest(parameter="weights")``.
    """
    p = Path(path)

    def bad(why: str) -> InvalidRequest:
        return InvalidRequest(
            f"the weights file {p.name} is not a valid safetensors file: {why}", parameter="weights"
        )

    try:
        with open(p, "rb") as f:
            file_size = os.fstat(f.fileno()).st_size
            raw_len = f.read(8)
            if len(raw_len) != 8:
                raise bad("shorter than its 8-byte header length")
            (header_len,) = struct.unpack("<Q", raw_len)
            if header_len > MAX_HEADER_BYTES or 8 + header_len > file_size:
                raise bad(f"header length {header_len} is out of range")
            raw = f.read(header_len)
    except OSError as exc:
        raise InvalidRequest(
            f"cannot read the weights file {p}: {exc.strerror}", parameter="weights"
        ) from exc
    try:
        doc = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates)
    except (UnicodeDecodeError, ValueError) as exc:
        raise bad(f"header is not JSON ({exc})") from exc
    if not isinstance(doc, dict):
        raise bad("header is not a JSON object")
    metadata: dict[str, str] = {}
    entries: list[TensorEntry] = []
    for name, spec in doc.items():
        if name == "__metadata__":
            if not isinstance(spec, dict) or not all(isinstance(v, str) for v in spec.values()):
                raise bad("__metadata__ must map strings to strings")
            metadata = dict(spec)
            continue
        if not isinstance(spec, dict):
            raise bad(f"entry {name!r} is not an object")
        dtype, shape, offsets = spec.get("dtype"), spec.get("shape"), spec.get("data_offsets")
        if not isinstance(dtype, str) or dtype not in DTYPE_ITEMSIZE:
            raise bad(f"tensor {name!r} has unknown dtype {dtype!r}")
        if not isinstance(shape, list) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
        ):
            raise bad(f"tensor {name!r} has an invalid shape {shape!r}")
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
            or not 0 <= offsets[0] <= offsets[1]
        ):
            raise bad(f"tensor {name!r} has invalid data_offsets {offsets!r}")
        entry = TensorEntry(name, dtype, tuple(shape), offsets[0], offsets[1])
        if entry.nbytes != math.prod(entry.shape) * DTYPE_ITEMSIZE[dtype]:
            raise bad(f"tensor {name!r}: data_offsets do not match its shape and dtype")
        entries.append(entry)
    cursor = 0
    for e in sorted(entries, key=lambda e: (e.begin, e.end)):
        if e.begin != cursor:
            raise bad(f"tensor {e.name!r} overlaps another or leaves a hole before it")
        cursor = e.end
    data_start = 8 + header_len
    if data_start + cursor != file_size:
        raise bad(f"data region is {file_size - data_start} bytes, the header describes {cursor}")
    return SafetensorsHeader(p, data_start, {e.name: e for e in entries}, metadata, file_size)


def safetensors_files(path: str | os.PathLike[str]) -> list[Path]:
    """A safetensors file, or every ``*.safetensors`` in a directory (shards), sorted."""
    p = Path(path)
    if p.is_dir():
        files = sorted(q for q in p.glob("*.safetensors") if q.is_file())
        if not files:
            raise InvalidRequest(
                f"the weights directory {p} holds no *.safetensors file", parameter="weights"
            )
        return files
    if not p.is_file():
        raise InvalidRequest(
            f"the weights path {p} is neither a file nor a directory", parameter="weights"
        )
    return [p]


def read_entry_chunks(
    f: Any, header: SafetensorsHeader, entry: TensorEntry, chunk: int = _CHUNK
) -> Iterator[bytes]:
    """One tensor's bytes from an open binary file, in chunks (positional reads)."""
    pos = header.data_start + entry.begin
    left = entry.nbytes
    fd = f.fileno()
    while left > 0:
        data = os.pread(fd, min(chunk, left), pos)
        if not data:
            raise InvalidRequest(
                f"the weights file {header.path.name} was truncated", parameter="weights"
            )
        pos += len(data)
        left -= len(data)
        yield data


def shard_headers(
    path: str | os.PathLike[str],
) -> tuple[dict[str, SafetensorsHeader], list[SafetensorsHeader]]:
    """The headers of a safetensors file or shard directory, and which header holds each
    tensor; a tensor in two shards is refused (naming both)."""
    headers = [read_safetensors_header(f) for f in safetensors_files(path)]
    where: dict[str, SafetensorsHeader] = {}
    for h in headers:
        for name in h.tensors:
            if name in where:
                raise InvalidRequest(
                    f"the weights' tensor {name!r} appears in both {where[name].path.name} and "
                    f"{h.path.name}",
                    parameter="weights",
                )
            where[name] = h
    return where, headers


def safetensors_sha256(path: str | os.PathLike[str], *, prefix: bytes = b"") -> str:
    """The weight hash of a safetensors file or shard directory, from its raw bytes.

    Equal to ``weight_sha256`` of the loaded tensors, without loading them (no torch needed);
    with an adapter's ``prefix`` (``adapter_hash_prefix``), its ``adapter_sha256``.
    """
    where, headers = shard_headers(path)
    hasher = WeightHasher(prefix)
    handles = {h.path: open(h.path, "rb") for h in headers}  # noqa: SIM115 - closed below
    try:
        for name in sorted(where):
            h = where[name]
            e = h.tensors[name]
            hasher.begin(name, e.dtype, e.shape)
            for data in read_entry_chunks(handles[h.path], h, e):
                hasher.update(data)
    finally:
        for f in handles.values():
            f.close()
    return hasher.hexdigest()
