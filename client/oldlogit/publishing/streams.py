"""Publish streams on the trainer side: a state dict as one safetensors stream, deltas, progress.

In: ``{name: tensor | ndarray}`` or a path, and the service's ``WeightLayout`` when known; out:
a ``SafetensorsStream`` (the contract's writer, ``oldlogit.contract.safetensors``, plus a
constructor from a state dict under canonical names, ``sources``). Delta publishing keeps a
``WeightsCopy`` of the last published weights (CPU, raw bits) and streams only the changed
elements (``oldlogit.contract.delta`` format). Also the progress bar and the adaptor
that pulls a blocking chunk iterator from async code. Never imports torch itself.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import numpy.typing as npt

from oldlogit.contract import safetensors
from oldlogit.contract.delta import FORMAT, IDX, VAL, bits_view, diff_positions, encode_positions
from oldlogit.contract.layout import WeightLayout
from oldlogit.contract.safetensors import TensorSource
from oldlogit.contract.weights import DTYPE_ITEMSIZE, WeightHasher
from oldlogit.publishing.sources import state_dict_sources

__all__ = ["SafetensorsStream", "WeightsCopy", "aiter_in_thread", "progress_bar"]

logger = logging.getLogger(__name__)


class SafetensorsStream(safetensors.SafetensorsStream):
    """The contract's stream writer, built from a trainer's state dict too (the service never
    holds one)."""

    @classmethod
    def from_state_dict(
        cls,
        weights: Mapping[str, Any],
        layout: WeightLayout | None = None,
        *,
        cast: bool = False,
        partial: bool = False,
    ) -> SafetensorsStream:
        """A ``{name: torch tensor | numpy array}``; torch is never imported unless given.
        With ``layout``, under the canonical names (``sources``); ``partial``: one
        rank's share."""
        return cls(state_dict_sources(weights, layout, cast=cast, partial=partial))


def _array_source(name: str, dtype: str, arr: npt.NDArray[Any]) -> TensorSource:
    def read(_: Mapping[Path, BinaryIO], a: npt.NDArray[Any] = arr) -> list[memoryview]:
        if a.size == 0:  # a memoryview of an empty array cannot be cast to bytes
            return [memoryview(b"")]
        return [np.ascontiguousarray(a).reshape(-1).view(np.uint8).data]

    return TensorSource(name, dtype, tuple(int(d) for d in arr.shape), int(arr.nbytes), read)


@dataclass(frozen=True)
class WeightsCopy:
    """A version's weights as the client last published them: raw bits on the CPU, per tensor
    ``(dtype, shape, flat uint view)``, so the next publish can send only what changed."""

    policy_version: int
    sha256: str
    tensors: Mapping[str, tuple[str, tuple[int, ...], npt.NDArray[Any]]]

    @classmethod
    def read(
        cls,
        weights: Mapping[str, Any] | str | os.PathLike[str],
        layout: WeightLayout | None = None,
        *,
        cast: bool = False,
        partial: bool = False,
    ) -> WeightsCopy:
        """Copy a state dict (torch tensors on any device, numpy arrays) or a safetensors
        file/shard directory into CPU memory under the canonical names, and hash it.
        ``policy_version`` is -1 until ``published`` sets it; ``partial``: one rank's share."""
        if isinstance(weights, Mapping):
            stream = SafetensorsStream.from_state_dict(weights, layout, cast=cast, partial=partial)
        else:
            stream = SafetensorsStream.from_path(weights, layout, cast=cast)
        out: dict[str, tuple[str, tuple[int, ...], npt.NDArray[Any]]] = {}
        handles = {p: open(p, "rb") for p in stream.files}  # noqa: SIM115 - closed below
        try:
            for t in stream.tensors:
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
            _array_source(name, dt, bits.reshape(shape))
            for name, (dt, shape, bits) in self.tensors.items()
        ]
        return SafetensorsStream(tensors, lambda _bar: self.sha256)

    def delta_stream(
        self, parent: WeightsCopy, metadata: Mapping[str, str] | None = None
    ) -> SafetensorsStream:
        """Only the elements that differ (bitwise) from ``parent``: see ``oldlogit.contract.delta``.
        ``metadata`` replaces the header's (a session part's: ``format`` and ``owned``)."""
        tensors: list[TensorSource] = []
        for name, (dt, _, bits) in self.tensors.items():
            pos = diff_positions(parent.tensors[name][2], bits)
            if pos.size == bits.size and bits.size:
                tensors.append(_array_source(name + VAL, dt, bits))
            elif pos.size:
                tensors.append(_array_source(name + VAL, dt, bits[pos]))
                tensors.append(_array_source(name + IDX, "U8", encode_positions(pos)))
        meta = {
            "format": FORMAT,
            "parent": str(parent.policy_version),
            "parent_sha256": parent.sha256,
            "sha256": self.sha256,
        }
        return SafetensorsStream(tensors, lambda _bar: self.sha256, metadata=metadata or meta)


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
