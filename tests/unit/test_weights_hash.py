"""The weight hash is a public format: known answers, invariances, and the safetensors header."""

from __future__ import annotations

import hashlib
import json
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from oldlogit.contract.errors import InvalidRequest
from oldlogit.contract.weights import (
    WeightHasher,
    dtype_name,
    read_safetensors_header,
    safetensors_sha256,
    torch_dtype,
    weight_sha256,
)


def _reference(entries: list[tuple[str, str, tuple[int, ...], bytes]]) -> str:
    """The documented format, spelled out with hashlib only."""
    h = hashlib.sha256()
    for name, dtype, shape, raw in sorted(entries):
        h.update(name.encode())
        h.update(b"\0")
        h.update(dtype.encode())
        h.update(b"\0")
        h.update(",".join(map(str, shape)).encode())
        h.update(b"\0")
        h.update(raw)
    return h.hexdigest()


def test_known_answer() -> None:
    weights = {
        "b.bias": np.array([1, -2, 3], dtype=np.int32),
        "a.weight": np.array([[1.5, -0.25]], dtype=np.float32),
        "scale": np.array(2.0, dtype=np.float64),  # a scalar: empty shape string
    }
    expected = _reference(
        [
            ("a.weight", "F32", (1, 2), struct.pack("<2f", 1.5, -0.25)),
            ("b.bias", "I32", (3,), struct.pack("<3i", 1, -2, 3)),
            ("scale", "F64", (), struct.pack("<d", 2.0)),
        ]
    )
    assert weight_sha256(weights) == expected
    # Pinned: a change to this literal is a breaking change of the public format.
    assert expected == "eefeb4224cd39e109492003c325df343828ebe6c99d0fa1f4e6e28d823e4a6cd"
    torch_weights = {k: torch.from_numpy(v.copy()) for k, v in weights.items()}
    assert weight_sha256(torch_weights) == expected


def test_order_independent() -> None:
    a = {"x": np.arange(4, dtype=np.float32), "y": np.ones((2, 2), dtype=np.float16)}
    b = {"y": a["y"], "x": a["x"]}
    assert weight_sha256(a) == weight_sha256(b)


def test_bf16_torch_equals_numpy_uint16_view() -> None:
    t = torch.randn(3, 5, generator=torch.Generator().manual_seed(0)).bfloat16()
    bits = t.view(torch.int16).numpy().view(np.uint16)
    via_torch = weight_sha256({"w": t})
    via_numpy = weight_sha256({"w": bits}, dtypes={"w": "BF16"})
    assert via_torch == via_numpy
    assert via_numpy == _reference([("w", "BF16", (3, 5), bits.astype("<u2").tobytes())])
    # Without the declaration the dtype differs, so the hash does too.
    assert weight_sha256({"w": bits}) != via_torch


def test_declared_dtype_must_match_item_size() -> None:
    with pytest.raises(InvalidRequest):
        weight_sha256({"w": np.zeros(3, dtype=np.float32)}, dtypes={"w": "BF16"})


def test_any_change_changes_the_hash() -> None:
    base = {"w": np.arange(6, dtype=np.float32).reshape(2, 3)}
    h = weight_sha256(base)
    assert weight_sha256({"w": base["w"].astype(np.int32)}) != h  # dtype
    assert weight_sha256({"w": base["w"].reshape(3, 2)}) != h  # shape, same bytes
    assert weight_sha256({"v": base["w"]}) != h  # name
    changed = base["w"].copy()
    changed[1, 2] = np.nextafter(changed[1, 2], np.float32(np.inf))
    assert weight_sha256({"w": changed}) != h  # one ulp
    # Framing: moving bytes between name and shape never collides.
    assert weight_sha256({"a1": np.zeros(1, np.uint8)}) != weight_sha256(
        {"a": np.zeros(1, np.uint8)}
    )


def test_layout_and_byte_order_do_not_matter() -> None:
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    h = weight_sha256({"w": a})
    assert weight_sha256({"w": np.asfortranarray(a)}) == h
    assert weight_sha256({"w": a.astype(">f4")}) == h
    t = torch.from_numpy(a.T.copy()).T  # non-contiguous torch view
    assert weight_sha256({"w": t}) == h
    assert weight_sha256({"w": torch.from_numpy(a).requires_grad_()}) == h


def test_dtype_names_round_trip() -> None:
    for name in ["BOOL", "U8", "I8", "I16", "F16", "BF16", "I32", "F32", "I64", "F64"]:
        dt = torch_dtype(name)
        assert dtype_name(torch.zeros(1, dtype=dt)) == name
    assert dtype_name(np.zeros(1, dtype=np.float16)) == "F16"
    assert dtype_name(np.dtype(bool)) == "BOOL"
    with pytest.raises(InvalidRequest):
        dtype_name(np.zeros(1, dtype=np.complex64))


def test_hasher_enforces_sorted_names_and_sizes() -> None:
    h = WeightHasher()
    h.begin("b", "F32", (2,))
    h.update(b"\0" * 8)
    with pytest.raises(ValueError):
        h.begin("a", "F32", (1,))
    h2 = WeightHasher()
    h2.begin("a", "F32", (2,))
    h2.update(b"\0" * 4)
    with pytest.raises(ValueError):
        h2.hexdigest()
    with pytest.raises(ValueError):
        h2.update(b"\0" * 8)


def test_file_hash_equals_tensor_hash(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(1)
    tensors = {
        "emb": torch.randn(7, 3, generator=g).bfloat16(),
        "bias": torch.randn(5, generator=g),
        "count": torch.tensor(3, dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
    }
    save_file(tensors, str(tmp_path / "one.safetensors"))
    assert safetensors_sha256(tmp_path / "one.safetensors") == weight_sha256(tensors)
    shards = tmp_path / "shards"
    shards.mkdir()
    save_file({k: tensors[k] for k in ("emb", "mask")}, str(shards / "a.safetensors"))
    save_file({k: tensors[k] for k in ("bias", "count")}, str(shards / "b.safetensors"))
    assert safetensors_sha256(shards) == weight_sha256(tensors)
    header = read_safetensors_header(tmp_path / "one.safetensors")
    assert {n: (e.dtype, e.shape) for n, e in header.tensors.items()} == {
        "emb": ("BF16", (7, 3)),
        "bias": ("F32", (5,)),
        "count": ("I64", ()),
        "mask": ("BOOL", (3,)),
    }


def _write_raw(path: Path, header: object, data: bytes, *, length: int | None = None) -> Path:
    raw = json.dumps(header).encode() if not isinstance(header, bytes) else header
    n = len(raw) if length is None else length
    path.write_bytes(struct.pack("<Q", n) + raw + data)
    return path


@pytest.mark.parametrize(
    ("header", "data", "length"),
    [
        ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 4, None),  # short
        ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 9, None),  # long
        ({"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"\0" * 8, None),
        ({"w": {"dtype": "Q4", "shape": [2], "data_offsets": [0, 2]}}, b"\0" * 2, None),
        ({"w": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, b"\0" * 4, None),
        (
            {  # overlap
                "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                "b": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]},
            },
            b"\0" * 8,
            None,
        ),
        (
            {  # hole
                "a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
                "b": {"dtype": "F32", "shape": [1], "data_offsets": [8, 12]},
            },
            b"\0" * 12,
            None,
        ),
        (b"[1, 2]", b"", None),
        (b"{not json", b"", None),
        (b'{"a": {"dtype": "U8", "shape": [0], "data_offsets": [0, 0]}, "a": {}}', b"", None),
        ({"w": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}, b"\0", 1 << 40),
    ],
)
def test_malformed_headers_are_refused(
    tmp_path: Path, header: object, data: bytes, length: int | None
) -> None:
    p = _write_raw(tmp_path / "bad.safetensors", header, data, length=length)
    with pytest.raises(InvalidRequest) as ei:
        read_safetensors_header(p)
    assert ei.value.parameter == "weights"


def test_client_module_does_not_import_torch() -> None:
    code = (
        "import sys, numpy as np, oldlogit.contract.weights as w;"
        "w.weight_sha256({'a': np.zeros(2, np.float32)});"
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
