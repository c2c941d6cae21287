"""The patch codec: gap-coded positions, diff/compose/rebuild bitwise over random change
patterns and dtypes, the file format shared by the client's delta stream and the service."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from oldlogit.contract.delta import (
    FORMAT,
    bits_view,
    decode_positions,
    diff_positions,
    encode_positions,
    split_name,
)
from oldlogit.contract.errors import InvalidRequest, WeightsMismatch
from oldlogit.contract.weights import TensorEntry, read_safetensors_header
from oldlogit.publishing.streams import WeightsCopy
from oldlogit_service.snapshots import buffers, codec, persist

PATTERNS = {"none": 0.0, "sparse": 0.01, "dense": 0.6, "all": 1.0}
DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


def changed(t: torch.Tensor, frac: float, g: torch.Generator) -> torch.Tensor:
    """``t`` with ``frac`` of its elements replaced (bitwise different), as a training step."""
    out = t.clone()
    flat = out.reshape(-1)
    n = flat.numel()
    k = n if frac >= 1.0 else round(frac * n)
    if k == 0:
        return out
    idx = torch.randperm(n, generator=g)[:k]
    bits = flat.view({2: torch.int16, 4: torch.int32}[flat.element_size()])
    bits[idx] ^= 1  # flip the last mantissa bit: the smallest change a step can make
    return out


def bits(t: torch.Tensor) -> np.ndarray:
    return bits_view(t.contiguous().reshape(-1).view(torch.uint8).numpy(), t.element_size())


@pytest.mark.parametrize("n", [0, 1, 7, 300, 70_000])
def test_gap_coding_round_trip(n: int) -> None:
    rng = np.random.default_rng(n)
    numel = max(1, n) * 50 + 100_000
    for _ in range(5):
        pos = np.sort(rng.choice(numel, size=n, replace=False)).astype(np.int64)
        coded = encode_positions(pos)
        assert coded.dtype == np.uint8
        assert np.array_equal(decode_positions(coded, n, numel, "t"), pos)
    # Extremes: position 0, a gap of exactly 255 and 256, the last element.
    pos = np.array([0, 255, 511, numel - 1], dtype=np.int64)
    assert np.array_equal(decode_positions(encode_positions(pos), 4, numel, "t"), pos)


def test_gap_coding_is_compact_and_rejects_malformed() -> None:
    rng = np.random.default_rng(0)
    numel = 1_000_000
    pos = np.flatnonzero(rng.random(numel) < 0.02)
    # About one byte per changed element at training-step densities (vs 4 for int32).
    assert encode_positions(pos).size < 1.05 * pos.size
    coded = encode_positions(np.array([3, 10], dtype=np.int64))
    with pytest.raises(InvalidRequest, match="'w'"):
        decode_positions(coded, 3, 100, "w")  # count does not match the values
    with pytest.raises(InvalidRequest, match="outside"):
        decode_positions(coded, 2, 10, "w")  # position 10 of 10 elements
    with pytest.raises(InvalidRequest, match="ends inside"):
        decode_positions(np.array([4, 0], dtype=np.uint8), 1, 1000, "w")
    with pytest.raises(InvalidRequest):
        decode_positions(np.array([1, 2], dtype=np.int32), 2, 1000, "w")  # type: ignore[arg-type]
    assert split_name("a.b::idx") == ("a.b", "::idx") and split_name("::val") is None


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_diff_rebuild_compose_bitwise(dtype: str, pattern: str) -> None:
    g = torch.Generator().manual_seed(hash((dtype, pattern)) & 0xFFFF)
    tdt = DTYPES[dtype]
    shapes = {"w": (300, 97), "b": (97,), "s": (1,)}
    v0 = {k: torch.randn(s, generator=g).to(tdt) for k, s in shapes.items()}
    v0["w"].reshape(-1)[:4] = torch.tensor([0.0, -0.0, float("nan"), float("inf")]).to(tdt)
    v1 = {k: changed(t, PATTERNS[pattern], g) for k, t in v0.items()}
    if pattern == "sparse":
        v1["w"].reshape(-1)[1] = 0.0  # -0.0 -> 0.0 is a bitwise change
    v2 = {k: changed(t, 0.05, g) for k, t in v1.items()}
    p1 = codec.diff({k: bits(t) for k, t in v0.items()}, {k: bits(t) for k, t in v1.items()})
    p2 = codec.diff({k: bits(t) for k, t in v1.items()}, {k: bits(t) for k, t in v2.items()})
    if pattern == "all":
        assert all(tp.positions is None for tp in p1.tensors.values())
    if pattern == "none":
        assert not p1.tensors and p1.changed == 0
    if pattern == "sparse":
        assert 1 in p1.tensors["w"].positions.tolist()  # type: ignore[union-attr]
    layout, buf0 = _pack(v0)
    _, buf1 = _pack(v1)
    _, buf2 = _pack(v2)
    for block in (64, 1 << 19):  # blocks much smaller than a tensor, and larger
        codec.BLOCK_BYTES, saved = block, codec.BLOCK_BYTES
        try:
            out = np.empty_like(buf0)
            codec.rebuild(out, layout, [p1, p2], base=buf0)
            assert np.array_equal(out, buf2)
            inplace = buf0.copy()
            codec.rebuild(inplace, layout, [p1])
            assert np.array_equal(inplace, buf1)
        finally:
            codec.BLOCK_BYTES = saved
    merged = codec.compose(p1, p2)
    out = np.empty_like(buf0)
    codec.rebuild(out, layout, [merged], base=buf0)
    assert np.array_equal(out, buf2)
    typed = {k: t.clone() for k, t in v0.items()}
    codec.apply_torch(typed, [p1, p2])
    assert all(torch.equal(typed[k].view(torch.uint8), v2[k].view(torch.uint8)) for k in v2)


def _pack(sd: dict[str, torch.Tensor]) -> tuple[tuple[TensorEntry, ...], np.ndarray]:
    sources = {
        k: persist.TensorSource(
            k,
            {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}[t.dtype],
            tuple(t.shape),
            functools.partial(lambda t: [t.reshape(-1).view(torch.uint8).numpy().data], t),
        )
        for k, t in sd.items()
    }
    buf, layout, _ = buffers.buffer_from_sources(sources, pin=False)
    return layout, buf.numpy()


def _specs(sd: dict[str, Any]) -> dict[str, tuple[str, tuple[int, ...]]]:
    names = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}
    return {k: (names[t.dtype], tuple(t.shape)) for k, t in sd.items()}


@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_client_delta_stream_is_what_the_service_parses(tmp_path: Path, pattern: str) -> None:
    g = torch.Generator().manual_seed(5)
    v0 = {
        "a.weight": torch.randn(64, 33, generator=g).bfloat16(),
        "b": torch.randn(5, generator=g),
        "c": torch.randn(4, 4, generator=g).half(),
        "scalar": torch.tensor(1.5),
        "empty": torch.zeros(0, 3).bfloat16(),
    }
    v1 = {k: changed(t, PATTERNS[pattern], g) for k, t in v0.items()}
    parent = WeightsCopy.read(v0).published(3)
    full = tmp_path / "full.safetensors"
    full.write_bytes(b"".join(WeightsCopy.read(v0).full_stream().chunks()))
    assert read_safetensors_header(full).tensors.keys() == v0.keys()
    new = WeightsCopy.read(v1)
    stream = new.delta_stream(parent)
    path = tmp_path / "delta.safetensors"
    path.write_bytes(b"".join(stream.chunks(chunk_bytes=1000)))
    header = read_safetensors_header(path)
    assert header.metadata["format"] == FORMAT and header.metadata["parent"] == "3"
    assert header.metadata["sha256"] == new.sha256 == stream.sha256()
    buf, _ = persist.read_keyframe(path, pin=False, expect_sha256=None)
    patch = codec.parse_patch(header, buf.numpy(), _specs(v0))
    n_changed = sum(int(diff_positions(bits(v0[k]), bits(v1[k])).size) for k in v0)
    assert patch.changed == n_changed
    layout, b0 = _pack(v0)
    _, b1 = _pack(v1)
    out = np.empty_like(b0)
    codec.rebuild(out, layout, [patch], base=b0)
    assert np.array_equal(out, b1)
    assert buffers.hash_buffer(out, layout) == new.sha256


def test_patch_file_table_is_checked(tmp_path: Path) -> None:
    specs = {"w": ("BF16", (10,)), "b": ("F32", (3,))}

    def write(tensors: dict[str, tuple[str, np.ndarray]]) -> Path:
        path = tmp_path / f"p{len(list(tmp_path.iterdir()))}.safetensors"
        sources = {
            k: persist.TensorSource(
                k, dt, (a.size,), functools.partial(lambda a: [a.view(np.uint8).data], a)
            )
            for k, (dt, a) in tensors.items()
        }
        persist.write_keyframe(path, sources, {"format": FORMAT})
        return path

    def parse(path: Path) -> codec.Patch:
        buf, header = persist.read_keyframe(path, pin=False, expect_sha256=None)
        return codec.parse_patch(header, buf.numpy(), specs)

    vals = np.arange(2, dtype=np.uint16)
    idx = encode_positions(np.array([1, 4], dtype=np.int64))
    ok = parse(write({"w::val": ("BF16", vals), "w::idx": ("U8", idx)}))
    assert np.array_equal(ok.tensors["w"].positions, [1, 4])  # type: ignore[arg-type]
    bad_cases = [
        ({"x::val": ("BF16", vals), "x::idx": ("U8", idx)}, "names no parameter"),
        ({"w::val": ("F16", vals), "w::idx": ("U8", idx)}, "F16"),
        ({"w::val": ("BF16", vals)}, "positions"),
        ({"w::idx": ("U8", idx)}, "without"),
        ({"w::val": ("BF16", np.arange(10, dtype=np.uint16)), "w::idx": ("U8", idx)}, "every"),
        ({"w::val": ("BF16", vals), "w::idx": ("I32", idx.astype(np.int32))}, "U8"),
    ]
    for tensors, why in bad_cases:
        with pytest.raises(WeightsMismatch, match=why) as info:
            parse(write(tensors))
        assert info.value.parameter == "weights"
    with pytest.raises(InvalidRequest, match=r"count|positions for"):
        parse(write({"w::val": ("BF16", vals), "w::idx": ("U8", idx[:1])}))


def test_a_keyframe_header_is_parsed_once_per_file(tmp_path: Path, monkeypatch) -> None:
    """Rebuilds re-read the same keyframes: the header is parsed on a file's first read; a
    file replaced under the same name (a new file) is parsed again, and a file whose header is
    broken is refused as before."""
    parsed: list[str] = []
    real = persist.read_safetensors_header

    def counting(path: Any) -> Any:
        parsed.append(Path(path).name)
        return real(path)

    monkeypatch.setattr(persist, "read_safetensors_header", counting)

    def write(path: Path, values: np.ndarray) -> None:
        tmp = path.with_suffix(".tmp")
        source = persist.TensorSource(
            "w", "F32", (values.size,), functools.partial(lambda a: [a.view(np.uint8).data], values)
        )
        persist.write_keyframe(tmp, {"w": source}, {"format": "pt"})
        tmp.replace(path)

    path = tmp_path / "k.safetensors"
    write(path, np.arange(6, dtype=np.float32))
    for _ in range(3):
        buf, header = persist.read_keyframe(path, pin=False, expect_sha256=None)
        assert np.array_equal(buf.numpy().view(np.float32), np.arange(6, dtype=np.float32))
    assert parsed == ["k.safetensors"]
    write(path, np.arange(10, dtype=np.float32) * 2)  # a new file, the same name
    buf, header = persist.read_keyframe(path, pin=False, expect_sha256=None)
    assert header.tensors["w"].shape == (10,)
    assert np.array_equal(buf.numpy().view(np.float32), np.arange(10, dtype=np.float32) * 2)
    assert parsed == ["k.safetensors"] * 2
    broken = tmp_path / "broken.safetensors"
    broken.write_bytes(b"\xff" * 8 + b"{}")
    with pytest.raises(persist.CorruptSnapshot, match=r"broken\.safetensors"):
        persist.read_keyframe(broken, pin=False, expect_sha256=None)
    with pytest.raises(persist.CorruptSnapshot, match="missing"):
        persist.read_keyframe(tmp_path / "gone.safetensors", pin=False, expect_sha256=None)
