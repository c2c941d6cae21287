"""The delta (patch) format shared by the client and the service: diff, position coding, names.

In: two versions of a tensor as raw bit patterns (unsigned-int numpy views), or a coded patch.
Out: the changed positions and new values, or positions decoded back. numpy only (no torch), so
the trainer-side client can build deltas; the service reuses the same functions to read them.

A delta upload is one safetensors file. Per tensor NAME with at least one changed element:
``NAME::val`` [k] in NAME's dtype (the new values, ascending flat C-order position) and, unless
every element changed (k == numel), ``NAME::idx`` [m] U8 (the positions, gap-coded below).
Unchanged tensors are absent. ``__metadata__`` holds ``format`` (``FORMAT``), ``parent``,
``parent_sha256`` and ``sha256`` (the weight hash of the rebuilt version).

Gap coding ("gap8"): with p_-1 = -1, each gap g = p_i - p_(i-1) >= 1 is written as
(g - 1) // 255 zero bytes followed by one byte g - 255 * ((g - 1) // 255), in [1, 255].
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from oldlogit.contract.errors import InvalidRequest

__all__ = [
    "FORMAT",
    "IDX",
    "VAL",
    "bits_view",
    "decode_positions",
    "diff_positions",
    "encode_positions",
    "split_name",
]

FORMAT = "oldlogit.delta/1"
IDX = "::idx"
VAL = "::val"

# Little-endian unsigned views by item size (built once: a dtype per call costs microseconds).
_UINT = {n: np.dtype(t).newbyteorder("<") for n, t in ((1, "u1"), (2, "u2"), (4, "u4"), (8, "u8"))}
Positions = npt.NDArray[np.int64]


def bits_view(raw: Any, itemsize: int) -> npt.NDArray[Any]:
    """A flat unsigned-int view of raw little-endian tensor bytes: equality is bitwise, so
    -0.0 vs 0.0 counts as a change and NaN payloads compare as bits."""
    arr = np.frombuffer(raw, dtype=np.uint8) if not isinstance(raw, np.ndarray) else raw
    return arr.reshape(-1).view(_UINT[itemsize])


def diff_positions(old: npt.NDArray[Any], new: npt.NDArray[Any]) -> Positions:
    """Flat positions where two same-shape bit views differ, ascending."""
    return np.flatnonzero(old != new).astype(np.int64, copy=False)


def encode_positions(positions: Positions) -> npt.NDArray[np.uint8]:
    """Gap-code strictly increasing non-negative positions (see the module docstring)."""
    if positions.size == 0:
        return np.zeros(0, np.uint8)
    gaps = np.diff(positions, prepend=np.int64(-1))
    escapes = (gaps - 1) // 255
    out = np.zeros(int(escapes.sum()) + positions.size, np.uint8)
    out[np.cumsum(escapes + 1) - 1] = (gaps - 255 * escapes).astype(np.uint8)
    return out


def decode_positions(coded: npt.NDArray[np.uint8], count: int, numel: int, name: str) -> Positions:
    """Decode gap-coded positions, checking they are exactly ``count``, in [0, numel).

    Strictly increasing holds by construction (every gap is >= 1). A malformed stream (trailing
    escapes, wrong count, out of range) raises ``InvalidRequest`` naming the tensor.
    """

    def bad(why: str) -> InvalidRequest:
        return InvalidRequest(f"the delta's tensor {name!r}: {why}", parameter="weights")

    if coded.ndim != 1 or coded.dtype != np.uint8:
        raise bad("the positions must be a 1-D U8 array")
    if coded.size and coded[-1] == 0:
        raise bad("the position stream ends inside a gap")
    steps = coded.astype(np.int64)
    zero = coded == 0
    steps[zero] = 255
    ends = np.cumsum(steps)
    positions: Positions = ends[~zero] - 1
    if positions.size != count:
        raise bad(f"{positions.size} positions for {count} values")
    if count and positions[-1] >= numel:
        raise bad(f"position {int(positions[-1])} is outside its {numel} elements")
    return positions


def split_name(key: str) -> tuple[str, str] | None:
    """``("NAME", "::idx" | "::val")`` for a delta tensor key, else None."""
    for suffix in (IDX, VAL):
        if key.endswith(suffix) and len(key) > len(suffix):
            return key[: -len(suffix)], suffix
    return None
