"""Publish payloads: a state dict, a safetensors file or a shard directory as one stream.

In: ``{name: tensor | ndarray}`` or a path; out: a ``SafetensorsStream`` that yields the bytes of
one safetensors file in chunks (re-iterable, for retries), its size, and the weight sha256.
Never builds the file in memory: tensors are read one at a time (off-CPU tensors copied one at a
time), shards are read in chunks and merged by rewriting only the header. Delta publishing
keeps a ``WeightsCopy`` of the last published weights (CPU, raw bits) and streams only the
changed elements (``oldlogit._delta`` format). Also the progress bar and the async adaptor.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import struct
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import numpy.typing as npt

from oldlogit._delta import FORMAT, IDX, VAL, bits_view, diff_positions, encode_positions
from oldlogit.errors import InvalidRequest
from oldlogit.weights import (
    DTYPE_ITEMSIZE,
    SafetensorsHeader,
    TensorEntry,
    WeightHasher,
    dtype_name,
    read_entry_chunks,
    read_safetensors_header,
    safetensors_files,
    safetensors_sha256,
    tensor_raw_bytes,
    weight_sha256,
)

__all__ = [
    "CHUNK_BYTES",
    "SafetensorsStream",
    "WeightsCopy",
    "aiter_in_thread",
    "coalesce",
    "progress_bar",
]

logger = logging.getLogger(__name__)

CHUNK_BYTES = 4 * 1024 * 1024

# Reads one tensor's bytes given the open shard files (unused for in-memory tensors).
_Reader = Callable[[Mapping[Path, BinaryIO]], Iterable[bytes | memoryview]]


@dataclass(frozen=True)
class _Tensor:
    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    read: _Reader


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


class SafetensorsStream:
    """The bytes of one safetensors file, produced lazily; iterate ``chunks()`` once per attempt."""

    def __init__(
        self,
        tensors: list[_Tensor],
        hasher: Callable[[], str],
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
        self._tensors = tensors
        self._hasher = hasher
        self._files = files or []

    def sha256(self) -> str:
        """The weight hash (``oldlogit.weights.weight_sha256``): reads every tensor once."""
        return self._hasher()

    def chunks(self, chunk_bytes: int | None = None) -> Iterator[bytes]:
        size = chunk_bytes or CHUNK_BYTES
        with contextlib.ExitStack() as stack:
            handles = {p: stack.enter_context(open(p, "rb")) for p in self._files}

            def pieces() -> Iterator[bytes | memoryview]:
                yield self.header
                for t in self._tensors:
                    yield from t.read(handles)

            yield from coalesce(pieces(), size)

    @classmethod
    def from_state_dict(cls, weights: Mapping[str, Any]) -> SafetensorsStream:
        """A ``{name: torch tensor | numpy array}``; torch is never imported unless given."""
        if not isinstance(weights, Mapping) or not weights:
            raise InvalidRequest(
                "weights must be a non-empty {name: tensor} mapping", parameter="weights"
            )
        tensors = []
        for name, x in weights.items():
            if not isinstance(name, str) or not hasattr(x, "shape"):
                raise InvalidRequest(
                    f"weights[{name!r}] must be a tensor or array keyed by name",
                    parameter="weights",
                )
            shape = tuple(int(d) for d in x.shape)
            nbytes = int(x.nbytes) if hasattr(x, "nbytes") else int(x.numel() * x.element_size())

            def read(_: Mapping[Path, BinaryIO], x: Any = x) -> list[memoryview]:
                return [tensor_raw_bytes(x)]

            tensors.append(_Tensor(name, dtype_name(x), shape, nbytes, read))
        return cls(tensors, lambda: weight_sha256(weights))

    @classmethod
    def from_path(cls, path: str | os.PathLike[str]) -> SafetensorsStream:
        """A safetensors file, or a directory of shards merged into one file."""
        files = safetensors_files(path)
        owner: dict[str, SafetensorsHeader] = {}
        tensors = []
        for f in files:
            header = read_safetensors_header(f)
            for name, entry in header.tensors.items():
                if name in owner:
                    raise InvalidRequest(
                        f"tensor {name!r} appears in both {owner[name].path.name} and {f.name}",
                        parameter="weights",
                    )
                owner[name] = header

                def read(
                    handles: Mapping[Path, BinaryIO],
                    h: SafetensorsHeader = header,
                    e: TensorEntry = entry,
                ) -> Iterator[bytes]:
                    return read_entry_chunks(handles[h.path], h, e, CHUNK_BYTES)

                tensors.append(_Tensor(name, entry.dtype, entry.shape, entry.nbytes, read))
        return cls(tensors, lambda: safetensors_sha256(path), files)


def _array_tensor(name: str, dtype: str, arr: npt.NDArray[Any]) -> _Tensor:
    def read(_: Mapping[Path, BinaryIO], a: npt.NDArray[Any] = arr) -> list[memoryview]:
        if a.size == 0:  # a memoryview of an empty array cannot be cast to bytes
            return [memoryview(b"")]
        return [np.ascontiguousarray(a).reshape(-1).view(np.uint8).data]

    return _Tensor(name, dtype, tuple(int(d) for d in arr.shape), int(arr.nbytes), read)


@dataclass(frozen=True)
class WeightsCopy:
    """A version's weights as the client last published them: raw bits on the CPU, per tensor
    ``(dtype, shape, flat uint view)``, so the next publish can send only what changed."""

    policy_version: int
    sha256: str
    tensors: Mapping[str, tuple[str, tuple[int, ...], npt.NDArray[Any]]]

    @classmethod
    def read(cls, weights: Mapping[str, Any] | str | os.PathLike[str]) -> WeightsCopy:
        """Copy a state dict (torch tensors on any device, numpy arrays) or a safetensors
        file/shard directory into CPU memory, and hash it. ``policy_version`` is -1 until
        ``published`` sets it."""
        out: dict[str, tuple[str, tuple[int, ...], npt.NDArray[Any]]] = {}
        if isinstance(weights, Mapping):
            if not weights:
                raise InvalidRequest(
                    "weights must be a non-empty {name: tensor} mapping", parameter="weights"
                )
            for name, x in weights.items():
                if not isinstance(name, str) or not hasattr(x, "shape"):
                    raise InvalidRequest(
                        f"weights[{name!r}] must be a tensor or array keyed by name",
                        parameter="weights",
                    )
                dt = dtype_name(x)
                raw = np.frombuffer(tensor_raw_bytes(x), dtype=np.uint8).copy()
                out[name] = (dt, tuple(int(d) for d in x.shape), bits_view(raw, DTYPE_ITEMSIZE[dt]))
        else:
            stream = SafetensorsStream.from_path(weights)
            handles = {p: open(p, "rb") for p in stream._files}  # noqa: SIM115 - closed below
            try:
                for t in stream._tensors:
                    raw = np.empty(t.nbytes, dtype=np.uint8)
                    pos = 0
                    for chunk in t.read(handles):
                        n = memoryview(chunk).nbytes
                        raw[pos : pos + n] = np.frombuffer(chunk, dtype=np.uint8)
                        pos += n
                    out[t.name] = (t.dtype, t.shape, bits_view(raw, DTYPE_ITEMSIZE[t.dtype]))
            finally:
                for f in handles.values():
                    f.close()
        hasher = WeightHasher()
        for name in sorted(out):
            dt, shape, bits = out[name]
            hasher.begin(name, dt, shape)
            hasher.update(np.ascontiguousarray(bits).view(np.uint8).data)
        return cls(-1, hasher.hexdigest(), out)

    def published(self, policy_version: int) -> WeightsCopy:
        return WeightsCopy(policy_version, self.sha256, self.tensors)

    def matches(self, other: WeightsCopy) -> bool:
        """Same names, dtypes and shapes: a delta between them is defined."""
        return {k: v[:2] for k, v in self.tensors.items()} == {
            k: v[:2] for k, v in other.tensors.items()
        }

    def full_stream(self) -> SafetensorsStream:
        tensors = [
            _array_tensor(name, dt, bits.reshape(shape))
            for name, (dt, shape, bits) in self.tensors.items()
        ]
        return SafetensorsStream(tensors, lambda: self.sha256)

    def delta_stream(self, parent: WeightsCopy) -> SafetensorsStream:
        """Only the elements that differ (bitwise) from ``parent``: see ``oldlogit._delta``."""
        tensors: list[_Tensor] = []
        for name, (dt, _, bits) in self.tensors.items():
            pos = diff_positions(parent.tensors[name][2], bits)
            if pos.size == bits.size and bits.size:
                tensors.append(_array_tensor(name + VAL, dt, bits))
            elif pos.size:
                tensors.append(_array_tensor(name + VAL, dt, bits[pos]))
                tensors.append(_array_tensor(name + IDX, "U8", encode_positions(pos)))
        meta = {
            "format": FORMAT,
            "parent": str(parent.policy_version),
            "parent_sha256": parent.sha256,
            "sha256": self.sha256,
        }
        return SafetensorsStream(tensors, lambda: self.sha256, metadata=meta)


def progress_bar(enabled: bool, total: int, desc: str) -> Any:
    """A tqdm bar over the upload's bytes when asked for and tqdm is installed, else None."""
    if not enabled:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        logger.info("progress=True needs tqdm; uploading without a progress bar")
        return None
    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc)


async def aiter_in_thread(chunks: Iterator[bytes], bar: Any) -> AsyncIterator[bytes]:
    """Pull a blocking chunk iterator (file reads, device copies) on a worker thread."""
    try:
        while True:
            chunk = await asyncio.to_thread(next, chunks, None)
            if chunk is None:
                return
            if bar is not None:
                bar.update(len(chunk))
            yield chunk
    finally:
        close = getattr(chunks, "close", None)
        if close is not None:
            close()
