"""On-disk layout of the snapshot store: keyframe files, the registry, crash-safe writes.

In: tensor sources to write, or a keyframe file to read back into one (pinned) byte buffer.
Out: durable files (temp → fsync → rename → fsync dir) and the registry document. Knows
nothing of tiers, budgets or locks; callers order the steps (file first, registry last).

    ROOT/
      LOCK               flock'd by the process that has the store open
      registry.json      every acknowledged version, tombstones, watermark, leases
      weights/           v<version>.<token>.safetensors keyframes, v<version>.<token>.patch
                         patches (``codec``); .tmp-* are in-flight writes
      incoming/          uploads being streamed in by the HTTP layer (stale ones cleared on open)
      quarantine/        files that failed their sha256 check, kept for inspection
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import errno
import fcntl
import json
import logging
import os
import threading
import uuid
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import torch

from oldlogit.contract.weights import (
    DTYPE_ITEMSIZE,
    SafetensorsHeader,
    TensorEntry,
    WeightHasher,
    read_safetensors_header,
    torch_dtype,
)
from oldlogit_service.snapshots import buffers, yielding
from oldlogit_service.snapshots.buffers import TensorSource
from oldlogit_service.snapshots.leases import LeaseRecord

logger = logging.getLogger(__name__)

REGISTRY = "registry.json"
WEIGHTS = "weights"
INCOMING = "incoming"
QUARANTINE = "quarantine"
LOCK = "LOCK"
TMP_PREFIX = ".tmp-"
REGISTRY_FORMAT = 1
_CHUNK = 16 * 1024 * 1024


class CorruptSnapshot(Exception):
    """A keyframe or patch file that is missing, malformed, or whose bytes fail their hash.

    ``version`` names the version whose file is bad, when known (a rebuild reads several)."""

    def __init__(self, message: str, version: int | None = None) -> None:
        super().__init__(message)
        self.version = version


# -- durable writes ---------------------------------------------------------------------


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _pwrite_all(fd: int, data: bytes | memoryview, pos: int) -> None:
    view = memoryview(data).cast("B")
    while view.nbytes:
        n = os.pwrite(fd, view, pos)
        view = view[n:]
        pos += n


def atomic_write(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` so that a crash leaves the old or the new content."""
    tmp = path.with_name(f"{TMP_PREFIX}{path.name}-{uuid.uuid4().hex}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        try:
            _pwrite_all(fd, data, 0)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)


def lock_root(root: Path) -> IO[bytes]:
    """Hold the directory for this process: two stores on one dir would delete each other's
    in-flight files as orphans. The kernel drops the lock when the process dies."""
    f = open(root / LOCK, "a+b")  # noqa: SIM115 - held open for the store's lifetime
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        f.close()
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise BlockingIOError(f"snapshot_dir {root} is in use by another store") from exc
        raise
    return f


# -- the registry -----------------------------------------------------------------------


class VersionRanges:
    """A set of versions kept as sorted disjoint [lo, hi] ranges: tombstones of a long run
    stay one range, so the registry does not grow with every version ever published."""

    def __init__(self, ranges: Iterable[tuple[int, int]] = ()) -> None:
        self._lo: list[int] = []
        self._hi: list[int] = []
        for lo, hi in sorted((int(a), int(b)) for a, b in ranges):
            if hi < lo:
                continue
            if self._hi and lo <= self._hi[-1] + 1:
                self._hi[-1] = max(self._hi[-1], hi)
            else:
                self._lo.append(lo)
                self._hi.append(hi)

    def add(self, v: int) -> None:
        i = bisect.bisect_right(self._lo, v) - 1
        if i >= 0 and self._lo[i] <= v <= self._hi[i]:
            return
        joins_left = i >= 0 and self._hi[i] == v - 1
        joins_right = i + 1 < len(self._lo) and self._lo[i + 1] == v + 1
        if joins_left and joins_right:
            self._hi[i] = self._hi[i + 1]
            del self._lo[i + 1], self._hi[i + 1]
        elif joins_left:
            self._hi[i] = v
        elif joins_right:
            self._lo[i + 1] = v
        else:
            self._lo.insert(i + 1, v)
            self._hi.insert(i + 1, v)

    def __contains__(self, v: object) -> bool:
        if not isinstance(v, int):
            return False
        i = bisect.bisect_right(self._lo, v) - 1
        return i >= 0 and v <= self._hi[i]

    def ranges(self) -> list[tuple[int, int]]:
        return list(zip(self._lo, self._hi, strict=True))

    def __len__(self) -> int:
        return sum(h - lo + 1 for lo, h in zip(self._lo, self._hi, strict=True))

    def copy(self) -> VersionRanges:
        out = VersionRanges()
        out._lo, out._hi = list(self._lo), list(self._hi)
        return out


@dataclass(frozen=True)
class StoredVersion:
    """One acknowledged version as the registry records it."""

    version: int
    sha256: str
    nbytes: int
    file: str  # name under weights/
    created_at: float
    kind: str = "keyframe"  # or "patch" (the changed elements against ``parent``) or "adapter"
    parent: int | None = None
    file_nbytes: int = 0  # a patch's or adapter's file size (a keyframe's is its data, ``nbytes``)
    file_sha256: str | None = None  # a patch's or adapter's tensor hash, checked on every read
    base: int | None = None  # an adapter's base version (kept while the adapter is)

    @property
    def disk_nbytes(self) -> int:
        """What this version costs the disk tier."""
        return self.nbytes if self.kind == "keyframe" else self.file_nbytes

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "version": self.version,
            "sha256": self.sha256,
            "nbytes": self.nbytes,
            "file": self.file,
            "created_at": self.created_at,
            "kind": self.kind,
            "parent": self.parent,
        }
        if self.kind != "keyframe":
            d["file_nbytes"] = self.file_nbytes
            d["file_sha256"] = self.file_sha256
        if self.base is not None:
            d["base"] = self.base
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> StoredVersion:
        parent = d.get("parent")
        return cls(
            version=int(d["version"]),
            sha256=str(d["sha256"]),
            nbytes=int(d["nbytes"]),
            file=str(d["file"]),
            created_at=float(d["created_at"]),
            kind=str(d.get("kind", "keyframe")),
            parent=None if parent is None else int(parent),
            file_nbytes=int(d.get("file_nbytes", 0)),
            file_sha256=d.get("file_sha256"),
            base=None if d.get("base") is None else int(d["base"]),
        )


@dataclass
class RegistryDoc:
    specs_sha256: str
    newest: int | None = None  # newest version ever acknowledged
    watermark: int | None = None
    versions: dict[int, StoredVersion] = field(default_factory=dict)
    tombstones: VersionRanges = field(default_factory=VersionRanges)
    leases: list[LeaseRecord] = field(default_factory=list)

    def to_bytes(self) -> bytes:
        doc = {
            "format": REGISTRY_FORMAT,
            "param_specs_sha256": self.specs_sha256,
            "newest_acknowledged": self.newest,
            "watermark": self.watermark,
            "versions": [self.versions[v].to_json() for v in sorted(self.versions)],
            "tombstones": [list(r) for r in self.tombstones.ranges()],
            "leases": [r.to_json() for r in self.leases],
        }
        return json.dumps(doc, indent=1).encode()

    @classmethod
    def from_bytes(cls, raw: bytes) -> RegistryDoc:
        d = json.loads(raw)
        if d.get("format") != REGISTRY_FORMAT:
            raise ValueError(f"unsupported registry format {d.get('format')!r}")
        versions = [StoredVersion.from_json(x) for x in d["versions"]]
        return cls(
            specs_sha256=str(d["param_specs_sha256"]),
            newest=d.get("newest_acknowledged"),
            watermark=d.get("watermark"),
            versions={sv.version: sv for sv in versions},
            tombstones=VersionRanges((int(lo), int(hi)) for lo, hi in d.get("tombstones", [])),
            leases=[LeaseRecord.from_json(x) for x in d.get("leases", [])],
        )


def read_registry(root: Path) -> RegistryDoc | None:
    try:
        raw = (root / REGISTRY).read_bytes()
    except FileNotFoundError:
        return None
    return RegistryDoc.from_bytes(raw)


def write_registry(root: Path, doc: RegistryDoc) -> None:
    atomic_write(root / REGISTRY, doc.to_bytes())


def clear_stale(root: Path, live_files: set[str]) -> list[Path]:
    """Delete what no acknowledged version owns: temp files, weight files without a registry
    record (a publish that crashed before its record), stale uploads. Returns what it removed."""
    removed: list[Path] = []
    candidates = [p for p in root.iterdir() if p.name.startswith(TMP_PREFIX)]
    candidates += [p for p in (root / WEIGHTS).iterdir() if p.name not in live_files]
    if (root / INCOMING).is_dir():
        candidates += list((root / INCOMING).iterdir())
    for p in candidates:
        if p.is_file() or p.is_symlink():
            p.unlink(missing_ok=True)
            removed.append(p)
    return removed


# -- keyframe files ---------------------------------------------------------------------


def keyframe_name(version: int) -> str:
    # The token keeps two racing publishes of one version from renaming onto each other.
    return f"v{version:012d}.{uuid.uuid4().hex[:12]}.safetensors"


def patch_name(version: int) -> str:
    return f"v{version:012d}.{uuid.uuid4().hex[:12]}.patch"


def adapter_name(version: int) -> str:
    return f"v{version:012d}.{uuid.uuid4().hex[:12]}.adapter"


def temp_path(directory: Path) -> Path:
    return directory / f"{TMP_PREFIX}{uuid.uuid4().hex}.safetensors"


def write_keyframe(
    path: Path, sources: Mapping[str, TensorSource], metadata: Mapping[str, str] | None = None
) -> str:
    """Write a safetensors file at ``path`` (new, fsynced) and return the weight hash.

    One pass: each tensor is read once, hashed in name order and written to its place.
    Larger item sizes come first so every tensor is aligned for a zero-copy dtype view.
    Patch files are written the same way (their tensors are ``codec.file_tensors``).
    """
    layout = sorted(sources.values(), key=lambda s: (-DTYPE_ITEMSIZE[s.dtype], s.name))
    header: dict[str, Any] = {"__metadata__": dict(metadata or {"format": "pt"})}
    offsets: dict[str, int] = {}
    cursor = 0
    for s in layout:
        offsets[s.name] = cursor
        header[s.name] = {
            "dtype": s.dtype,
            "shape": list(s.shape),
            "data_offsets": [cursor, cursor + s.nbytes],
        }
        cursor += s.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    data_start = 8 + len(raw)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        _pwrite_all(fd, len(raw).to_bytes(8, "little") + raw, 0)
        hasher = WeightHasher()
        for name in sorted(sources):
            s = sources[name]
            hasher.begin(name, s.dtype, s.shape)
            pos = data_start + offsets[name]
            for chunk in s.chunks():
                yielding.point()  # a rewrite yields to forwards between chunks
                hasher.update(chunk)
                _pwrite_all(fd, chunk, pos)
                pos += memoryview(chunk).nbytes
        sha = hasher.hexdigest()  # also checks every tensor delivered exactly its bytes
        os.fsync(fd)
    finally:
        os.close(fd)
    return sha


def durable_rename(src: Path, dst: Path) -> None:
    os.rename(src, dst)
    fsync_dir(dst.parent)
    if src.parent != dst.parent:
        fsync_dir(src.parent)


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# Parsed headers of the files ``read_keyframe`` reads (keyframes and patch files), by file
# identity (device, inode, size, mtime): such a file is written once under a fresh name and
# never changed, and rebuilds re-read the same few; the header (JSON of every tensor, checked)
# is parsed on a file's first read, not on every load. The most recently read 64 are kept (a
# header of a thousand tensors holds 0.42 MB, measured with tracemalloc).
_HEADERS: collections.OrderedDict[tuple[int, int, int, int], SafetensorsHeader] = (
    collections.OrderedDict()
)
_HEADERS_KEPT = 64
_headers_lock = threading.Lock()


def _header_of(path: Path, fd: int, version: int | None) -> SafetensorsHeader:
    st = os.fstat(fd)
    key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    with _headers_lock:
        header = _HEADERS.get(key)
        if header is not None:
            _HEADERS.move_to_end(key)
            return header
    try:
        header = read_safetensors_header(path)
    except Exception as exc:  # InvalidRequest for malformed files: here it means corruption
        raise CorruptSnapshot(f"{path.name}: {exc}", version) from exc
    if header.file_size != st.st_size:  # replaced between the open and the parse
        raise CorruptSnapshot(f"{path.name} changed while it was read", version)
    with _headers_lock:
        _HEADERS[key] = header
        while len(_HEADERS) > _HEADERS_KEPT:
            _HEADERS.popitem(last=False)
    return header


def read_keyframe(
    path: Path, *, pin: bool, expect_sha256: str | None, version: int | None = None
) -> tuple[torch.Tensor, SafetensorsHeader]:
    """Read a keyframe's data region into one CPU uint8 buffer (page-locked with ``pin``).

    With ``expect_sha256`` the weight hash is recomputed from the buffer (no second read) and
    a mismatch raises ``CorruptSnapshot``, as does a missing or malformed file.
    """
    try:
        with open(path, "rb", buffering=0) as f:
            header = _header_of(path, f.fileno(), version)
            buf = buffers.alloc_buffer(header.nbytes, pin=pin)  # [nbytes]
            view = buf.numpy().data.cast("B")
            f.seek(header.data_start)
            pos = 0
            while pos < header.nbytes:
                yielding.point()  # a load yields to forwards between chunks
                n = f.readinto(view[pos : pos + _CHUNK])
                if not n:
                    raise CorruptSnapshot(f"{path.name} was truncated", version)
                pos += n
    except FileNotFoundError as exc:
        raise CorruptSnapshot(f"{path.name} is missing", version) from exc
    if expect_sha256 is not None:
        got = buffers.hash_buffer(view, header.tensors.values())
        if got != expect_sha256:
            raise CorruptSnapshot(
                f"{path.name} hashes to {got}, the registry says {expect_sha256}", version
            )
    return buf, header


def aligned(header: SafetensorsHeader) -> bool:
    """Whether every tensor starts at a multiple of its item size (zero-copy dtype views)."""
    return all(e.begin % DTYPE_ITEMSIZE[e.dtype] == 0 for e in header.tensors.values())


def tensor_views(buf: torch.Tensor, entries: Iterable[TensorEntry]) -> dict[str, torch.Tensor]:
    """Typed views into one uint8 buffer (any device), one per tensor, without copies.

    A tensor whose offset is not a multiple of its item size (files written by other tools)
    is copied into its own storage, since a dtype view needs an aligned offset.
    """
    out: dict[str, torch.Tensor] = {}
    dtypes: dict[str, torch.dtype] = {}  # looked up once per call (on every load)
    for e in entries:
        raw = buf[e.begin : e.end]  # [nbytes]
        if e.begin % DTYPE_ITEMSIZE[e.dtype]:
            raw = raw.clone()
        dt = dtypes.get(e.dtype) or dtypes.setdefault(e.dtype, torch_dtype(e.dtype))
        out[e.name] = raw.view(dt).reshape(e.shape)
    return out


def quarantine(root: Path, name: str) -> None:
    qdir = root / QUARANTINE
    qdir.mkdir(exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        os.replace(root / WEIGHTS / name, qdir / name)


def remove_files(directory: Path, names: Iterator[str] | Iterable[str]) -> None:
    for name in names:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(directory / name)
