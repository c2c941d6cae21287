"""The parts of a publish session: what a part may hold, its hash, and one delta of many.

In: a staged part file (safetensors: full tensors, or a delta with ``__metadata__['owned']``),
the model's weight table and, for deltas, the parent held by the store (``acquire``). Out: the
tensor names the part owns and its hash — the weight hash of the rank's tensors (for a delta:
rebuilt on the parent, so the rank's own hash of what it holds can be checked) — or an error
naming the tensor; and ``merge_delta``: the parts' deltas as one delta file for the store.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from oldlogit.contract.delta import FORMAT, IDX, VAL, bits_view, decode_positions, split_name
from oldlogit.contract.errors import InvalidRequest, WeightsMismatch
from oldlogit.contract.weights import (
    DTYPE_ITEMSIZE,
    SafetensorsHeader,
    WeightHasher,
    read_entry_chunks,
    read_safetensors_header,
    safetensors_sha256,
    tensor_raw_bytes,
)

__all__ = ["check_part", "merge_delta"]

Specs = Mapping[str, tuple[str, tuple[int, ...]]]


def check_part(
    path: Path, specs: Specs, store: Any, parent: int | None
) -> tuple[frozenset[str], str]:
    """The names a part owns and its hash (``parent``: a delta part against that version);
    refuses what cannot be a part of this model."""
    header = read_safetensors_header(path)
    if parent is None:
        for name, e in header.tensors.items():
            _check_tensor(specs, name, e.dtype, e.shape)
        return frozenset(header.tensors), safetensors_sha256(path)
    if header.metadata.get("format") != FORMAT:
        raise InvalidRequest(f"a delta part must say format {FORMAT!r}", parameter="body")
    try:
        owned = json.loads(header.metadata.get("owned", ""))
        assert isinstance(owned, list) and all(isinstance(n, str) for n in owned)
    except (ValueError, AssertionError) as exc:
        raise InvalidRequest(
            "a delta part lists its tensors in __metadata__['owned'] (a JSON list)",
            parameter="body",
        ) from exc
    for name in header.tensors:
        split = split_name(name)
        if split is None or split[0] not in owned:
            raise WeightsMismatch(
                f"the delta part's tensor {name!r} is not NAME::val/NAME::idx of a tensor it owns",
                parameter="weights",
                details={"tensor": name},
            )
    for name in owned:
        dt, shape = specs.get(name, ("", ()))
        _check_tensor(specs, name, dt, shape)
    return frozenset(owned), _delta_part_hash(header, sorted(owned), specs, store, parent)


def _check_tensor(specs: Specs, name: str, dtype: str, shape: tuple[int, ...]) -> None:
    spec = specs.get(name)
    if spec is None:
        raise WeightsMismatch(
            f"the part holds tensor {name!r}, which the model does not have",
            parameter="weights",
            details={"tensor": name},
        )
    if (dtype, tuple(shape)) != (spec[0], tuple(spec[1])):
        raise WeightsMismatch(
            f"the part's tensor {name!r} is {dtype} {list(shape)}, the model serves "
            f"{spec[0]} {list(spec[1])}",
            parameter="weights",
            details={"tensor": name},
        )


def _delta_part_hash(
    header: SafetensorsHeader, owned: list[str], specs: Specs, store: Any, parent: int
) -> str:
    """The weight hash of the rank's tensors rebuilt on the parent: what the rank holds."""
    hasher = WeightHasher()
    with open(header.path, "rb") as f, store.acquire(parent) as base:

        def raw(key: str) -> bytes:
            return b"".join(read_entry_chunks(f, header, header.tensors[key]))

        for name in owned:
            dt, shape = specs[name]
            numel = math.prod(shape)
            parent_raw = np.frombuffer(tensor_raw_bytes(base[name]), np.uint8).copy()
            bits = bits_view(parent_raw, DTYPE_ITEMSIZE[dt])  # the rank's tensor, rebuilt
            if name + VAL in header.tensors:
                values = bits_view(np.frombuffer(raw(name + VAL), np.uint8), bits.itemsize)
                if name + IDX in header.tensors:
                    coded = np.frombuffer(raw(name + IDX), np.uint8)
                    bits[decode_positions(coded, values.size, numel, name)] = values
                elif values.size == numel:
                    bits[:] = values
                else:
                    raise WeightsMismatch(
                        f"the delta part's {name!r} has {values.size} values for {numel}",
                        parameter="weights",
                        details={"tensor": name},
                    )
            hasher.begin(name, dt, shape)
            hasher.update(bits.view(np.uint8).data)
    return hasher.hexdigest()


def merge_delta(parts: list[Path], directory: Path, parent: int, parent_sha256: str) -> Path:
    """One delta file of every part's entries (disjoint by the commit checks)."""
    entries: list[tuple[str, str, list[int], Path, SafetensorsHeader]] = []
    for path in parts:
        header = read_safetensors_header(path)
        for name, e in header.tensors.items():
            entries.append((name, e.dtype, list(e.shape), path, header))
    entries.sort(key=lambda e: e[0])
    table: dict[str, Any] = {
        "__metadata__": {"format": FORMAT, "parent": str(parent), "parent_sha256": parent_sha256}
    }
    offset = 0
    for name, dtype, shape, _, header in entries:
        n = header.tensors[name].nbytes
        table[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(table, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    merged = directory / "merged.delta.safetensors"
    with open(merged, "wb") as out:
        out.write(struct.pack("<Q", len(raw)) + raw)
        for name, _, _, path, header in entries:
            with open(path, "rb") as f:
                for chunk in read_entry_chunks(f, header, header.tensors[name]):
                    out.write(chunk)
    return merged
