"""One safetensors file as a stream of bytes, from tensor sources: the writer both sides use.

In: ``TensorSource``s — a name, dtype, shape, size and a ``read`` that yields the raw bytes when
asked — from safetensors files (``file_sources``: a file or a shard directory, mapped onto the
canonical names of a ``WeightLayout``) or, on the trainer side, from a state dict
(``oldlogit.publishing.sources``). Out: a ``SafetensorsStream``: its header, its bytes in chunks
(re-iterable, for retries), its size and its weight hash. The client uploads such streams; the
service rewrites a hub checkpoint under canonical names with one. Never builds the file in
memory: tensors are read one at a time, shards in chunks, merged by rewriting only the header.
Torch is imported only to cast a file's tensor to a dtype numpy lacks (BF16).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import struct
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

import numpy as np

from oldlogit.contract.errors import InvalidRequest, WeightsMismatch
from oldlogit.contract.layout import WeightLayout, check_tied
from oldlogit.contract.weights import (
    DTYPE_ITEMSIZE,
    SafetensorsHeader,
    TensorEntry,
    WeightHasher,
    numpy_dtype,
    read_entry_chunks,
    shard_headers,
    tensor_raw_bytes,
    torch_dtype,
)

__all__ = [
    "CHUNK_BYTES",
    "SafetensorsStream",
    "TensorSource",
    "check_dtype",
    "coalesce",
    "file_sources",
    "hash_sources",
]

CHUNK_BYTES = 4 * 1024 * 1024

# Reads one tensor's bytes given the open shard files (unused for in-memory tensors).
Reader = Callable[[Mapping[Path, BinaryIO]], Iterable[bytes | memoryview]]
_FLOATS = {"F16", "BF16", "F32", "F64"}
S = TypeVar("S", bound="SafetensorsStream")


@dataclass(frozen=True)
class TensorSource:
    """One tensor of a stream: what its header entry says, and how to read its bytes."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    read: Reader


def coalesce(pieces: Iterable[bytes | memoryview], size: int) -> Iterator[bytes]:
    """Re-cut a stream of byte pieces into chunks of exactly ``size`` (the last may be short).

    Small tensors (biases, norms) are packed together instead of each costing a message.
    """
    buf = bytearray()
    for piece in pieces:
        mv = memoryview(piece).cast("B")
        while len(mv):
            if not buf and len(mv) >= size:  # whole chunks straight from the source
                yield bytes(mv[:size])
                mv = mv[size:]
                continue
            take = min(size - len(buf), len(mv))
            buf += mv[:take]
            mv = mv[take:]
            if len(buf) == size:
                yield bytes(buf)
                buf = bytearray()
    if buf:
        yield bytes(buf)


def hash_sources(
    sources: Iterable[TensorSource],
    files: Iterable[Path] = (),
    bar: Any = None,
    *,
    prefix: bytes = b"",
) -> str:
    """The weight hash (``oldlogit.contract.weights.weight_sha256``) of the sources' bytes;
    with an adapter's ``prefix`` (``weights.adapter_hash_prefix``), its ``adapter_sha256``."""
    hasher = WeightHasher(prefix)
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


class SafetensorsStream:
    """The bytes of one safetensors file, produced lazily; iterate ``chunks()`` once per attempt.

    ``tensors`` (sorted by name) and ``files`` (the shard files their readers read from) are
    what the stream is made of; ``hasher`` replaces reading them for ``sha256`` when the hash
    is known already.
    """

    def __init__(
        self,
        tensors: list[TensorSource],
        hasher: Callable[[Any], str] | None = None,
        files: list[Path] | None = None,
        metadata: Mapping[str, str] | None = None,
    ) -> None:
        tensors = sorted(tensors, key=lambda t: t.name)
        # "format": "pt" is what transformers checks before loading a safetensors file.
        header: dict[str, Any] = {"__metadata__": dict(metadata or {"format": "pt"})}
        offset = 0
        for t in tensors:
            header[t.name] = {
                "dtype": t.dtype,
                "shape": list(t.shape),
                "data_offsets": [offset, offset + t.nbytes],
            }
            offset += t.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the format pads the header so the data is 8-aligned
        self.header = struct.pack("<Q", len(raw)) + raw
        self.total_bytes = len(self.header) + offset
        self.data_bytes = offset
        self.tensors = tensors
        self.files = files or []
        self._hasher = hasher

    def sha256(self, bar: Any = None) -> str:
        """The weight hash (``oldlogit.contract.weights.weight_sha256``) of the tensors as
        streamed: reads every tensor once (``bar``: a progress bar over the bytes read)."""
        if self._hasher is not None:
            return self._hasher(bar)
        return hash_sources(self.tensors, self.files, bar)

    def chunks(self, chunk_bytes: int | None = None) -> Iterator[bytes]:
        size = chunk_bytes or CHUNK_BYTES
        with contextlib.ExitStack() as stack:
            handles = {p: stack.enter_context(open(p, "rb")) for p in self.files}

            def pieces() -> Iterator[bytes | memoryview]:
                yield self.header
                for t in self.tensors:
                    yield from t.read(handles)

            yield from coalesce(pieces(), size)

    @classmethod
    def from_path(
        cls: type[S],
        path: str | os.PathLike[str],
        layout: WeightLayout | None = None,
        *,
        cast: bool = False,
    ) -> S:
        """A safetensors file, or a directory of shards merged into one file."""
        sources, files = file_sources(path, layout, cast=cast)
        return cls(sources, files=files)


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


def file_sources(
    path: str | os.PathLike[str], layout: WeightLayout | None = None, *, cast: bool = False
) -> tuple[list[TensorSource], list[Path]]:
    """A safetensors file or shard directory as canonical sources, from its headers alone.

    With a layout, names map onto the canonical ones (``oldlogit.contract.layout``), each
    tensor's dtype and shape are checked, and ``cast=True`` casts a floating tensor to its
    serving dtype; without one (an older service) names are kept as they are.
    """
    where, headers = shard_headers(path)
    files = [h.path for h in headers]
    if layout is None or not layout.specs:
        if cast:
            raise InvalidRequest(
                "cast=True needs the service's weight layout (an older service has none)",
                parameter="cast",
            )
        return [_file_source(n, where[n]) for n in where], files
    assembly = layout.assemble(where)
    check_tied(assembly, lambda a, b: _same_entries(where[a], a, where[b], b))
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


def _same_entries(ha: SafetensorsHeader, a: str, hb: SafetensorsHeader, b: str) -> bool:
    """Whether two tensors of a checkpoint (its shards' headers) hold the same dtype, shape
    and bytes (their SHA-256, each read in chunks: never a whole tensor in memory)."""
    ea, eb = ha.tensors[a], hb.tensors[b]
    if (ea.dtype, tuple(ea.shape)) != (eb.dtype, tuple(eb.shape)):
        return False

    def digest(header: SafetensorsHeader, entry: TensorEntry) -> bytes:
        h = hashlib.sha256()
        with open(header.path, "rb") as f:
            for chunk in read_entry_chunks(f, header, entry):
                h.update(chunk)
        return h.digest()

    return digest(ha, ea) == digest(hb, eb)


def _file_source(name: str, header: SafetensorsHeader) -> TensorSource:
    entry = header.tensors[name]
    return TensorSource(
        name, entry.dtype, entry.shape, entry.nbytes, _file_reader([(header, entry)], None)
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

        flat = torch.frombuffer(bytearray(raw), dtype=torch_dtype(entry.dtype))
        return flat.to(torch_dtype(cast_to))
    except ImportError:
        arr = np.frombuffer(raw, dtype=numpy_dtype(entry.dtype))
        return arr.astype(numpy_dtype(cast_to))
