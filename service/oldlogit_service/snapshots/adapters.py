"""Adapter versions in the store: LoRA tensors over a retained base, checked, kept, read back.

In: a safetensors file of LoRA tensors (config in its metadata), the base version, the expected
hash. Out: a durable record of kind "adapter" (temp → fsync → rename → registry, which keeps the
base while the adapter is retained), and the adapter's file read back hash-checked into one CPU
buffer (``read``), which ``residency.py`` keeps in the memory tiers like a version's weights.
Stored whole, never rebuilt.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from oldlogit.contract.adapters import ADAPTER_CONFIG_KEY, AdapterConfig, check_adapter_tensors
from oldlogit.contract.errors import (
    InvalidRequest,
    UnknownVersion,
    VersionConflict,
    VersionEvicted,
    WeightsMismatch,
)
from oldlogit.contract.weights import (
    SafetensorsHeader,
    TensorEntry,
    adapter_hash_prefix,
    read_entry_chunks,
    read_safetensors_header,
    safetensors_sha256,
)
from oldlogit_service.snapshots import persist
from oldlogit_service.snapshots.buffers import TensorSource
from oldlogit_service.snapshots.records import PublishOutcome
from oldlogit_service.snapshots.registry import Registry
from oldlogit_service.snapshots.residency import Resident

logger = logging.getLogger(__name__)

__all__ = ["Adapters", "StoredAdapter"]

ADAPTER_FORMAT = "oldlogit-adapter"


@dataclass(frozen=True)
class StoredAdapter:
    """An adapter version as served: its config, base and tensors (CPU, read-only)."""

    version: int
    sha256: str
    base: int
    config: AdapterConfig
    # "<module>.lora_A" [r, in], "<module>.lora_B" [out, r]: on the serving device while pinned
    tensors: Mapping[str, torch.Tensor]


class Adapters:
    """Publishes and reads adapter versions; ``clustered``: refuse them (scale-out)."""

    def __init__(
        self,
        *,
        registry: Registry,
        specs: Mapping[str, tuple[str, tuple[int, ...]]],
        clock: Callable[[], float],
        clustered: bool,
    ) -> None:
        self._registry = registry
        self._specs = specs
        self._clock = clock
        self._clustered = clustered
        self._dir = registry.root / persist.WEIGHTS
        # Each adapter's config, by (version, file), parsed when its file was read: a few
        # hundred bytes per retained adapter, dropped with it (``forget``).
        self._configs: dict[tuple[int, str], AdapterConfig] = {}
        self._lock = threading.Lock()

    def publish(self, version: int, path: Path, base: int, expected: str | None) -> PublishOutcome:
        """Check the file against its config and the base model, hash it over the base's hash,
        store it durably; the same hash again is a no-op, another a ``VersionConflict``."""
        if self._clustered:
            raise InvalidRequest(
                "adapter versions are not served in scale-out (--redis-url) yet: publish them "
                "to a single-replica deployment",
                parameter="base_version",
            )
        header = read_safetensors_header(path)
        raw = header.metadata.get(ADAPTER_CONFIG_KEY)
        if raw is None:
            raise InvalidRequest(
                f"an adapter upload carries its config in the safetensors metadata "
                f"{ADAPTER_CONFIG_KEY!r} (Client.publish_adapter writes it)",
                parameter="adapter_config",
            )
        config = AdapterConfig.from_json(raw)
        entries = {n: (e.dtype, e.shape) for n, e in header.tensors.items()}
        check_adapter_tensors(config, entries, self._specs)
        base_sv = self._base(version, base)
        existing = self._registry.precheck(version)
        prefix = adapter_hash_prefix(config.to_json(), base_sv.sha256)
        sha = safetensors_sha256(path, prefix=prefix)
        if expected is not None and sha != expected:
            raise WeightsMismatch(
                f"the adapter's sha256 is {sha}, not the expected sha256 {expected}",
                parameter="sha256",
                details={"expected": expected, "actual": sha},
            )
        if existing is not None:
            return self._same_or_conflict(version, sha, existing)
        stored = self._write(version, header, config, base, sha)
        final = self._dir / stored.file
        try:
            with self._registry.persist_lock:
                existing = self._registry.precheck(version)  # a racer may have won
                if existing is None:
                    self._registry.commit(stored)
        except BaseException:
            final.unlink(missing_ok=True)
            raise
        if existing is not None:
            final.unlink(missing_ok=True)
            return self._same_or_conflict(version, sha, existing)
        logger.info(
            "published version %d as an adapter over version %d (sha256 %s, rank %d, %d bytes)",
            version,
            base,
            sha,
            config.rank,
            stored.file_nbytes,
        )
        return PublishOutcome(version, sha, True, stored.nbytes, "adapter")

    def _base(self, version: int, base: int) -> persist.StoredVersion:
        try:
            sv = self._registry.get(base)
        except (UnknownVersion, VersionEvicted) as exc:
            raise type(exc)(
                f"base_version {base} of adapter version {version}: {exc.message}",
                parameter="base_version",
                details=exc.details,
            ) from exc
        if sv.kind == "adapter":
            raise InvalidRequest(
                f"base_version {base} is itself an adapter version (over {sv.base}); an adapter "
                "applies to full weights",
                parameter="base_version",
            )
        return sv

    def _write(
        self, version: int, header: SafetensorsHeader, config: AdapterConfig, base: int, sha: str
    ) -> persist.StoredVersion:
        sources = {
            e.name: TensorSource(e.name, e.dtype, e.shape, functools.partial(_chunks, header, e))
            for e in header.tensors.values()
        }
        meta = {
            "format": ADAPTER_FORMAT,
            ADAPTER_CONFIG_KEY: config.to_json(),
            "base": str(base),
            "sha256": sha,
        }
        tmp = persist.temp_path(self._dir)
        name = persist.adapter_name(version)
        try:
            file_sha = persist.write_keyframe(tmp, sources, meta)
            size = tmp.stat().st_size
            persist.durable_rename(tmp, self._dir / name)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return persist.StoredVersion(
            version,
            sha,
            header.nbytes,
            name,
            self._clock(),
            kind="adapter",
            file_nbytes=size,
            file_sha256=file_sha,
            base=base,
        )

    def _same_or_conflict(self, version: int, sha: str, existing: str) -> PublishOutcome:
        if sha == existing:
            return PublishOutcome(
                version, sha, False, self._registry.get(version).nbytes, "adapter"
            )
        raise VersionConflict(
            f"policy_version {version} is already published with weight sha256 {existing}; "
            f"this adapter hashes to {sha}",
            parameter="policy_version",
            details={"existing_sha256": existing, "sha256": sha},
        )

    # -- reading ----------------------------------------------------------------------------
    def read(self, sv: persist.StoredVersion, *, pin: bool) -> Resident:
        """The adapter of record ``sv`` read from its file into one CPU buffer (page-locked
        with ``pin``), hash-checked (``CorruptSnapshot`` if it fails); the residency keeps it
        in the memory tiers, under their budgets, like a version's weights."""
        buf, header = persist.read_keyframe(
            self._dir / sv.file, pin=pin, expect_sha256=sv.file_sha256, version=sv.version
        )
        try:
            config = AdapterConfig.from_json(header.metadata[ADAPTER_CONFIG_KEY])
        except (KeyError, InvalidRequest) as exc:
            raise persist.CorruptSnapshot(f"{sv.file}: no adapter config", sv.version) from exc
        with self._lock:
            self._configs[(sv.version, sv.file)] = config
        layout = tuple(header.tensors.values())
        return Resident(buf, layout, persist.tensor_views(buf, layout), header.nbytes)

    def stored(
        self, sv: persist.StoredVersion, tensors: Mapping[str, torch.Tensor]
    ) -> StoredAdapter:
        """The adapter of record ``sv`` with ``tensors`` (its resident copy's)."""
        key = (sv.version, sv.file)
        with self._lock:
            config = self._configs.get(key)
        if config is None:  # resident from before a config was parsed: read the header alone
            header = read_safetensors_header(self._dir / sv.file)
            try:
                config = AdapterConfig.from_json(header.metadata[ADAPTER_CONFIG_KEY])
            except (KeyError, InvalidRequest) as exc:
                raise persist.CorruptSnapshot(f"{sv.file}: no adapter config", sv.version) from exc
            with self._lock:
                self._configs[key] = config
        assert sv.base is not None
        return StoredAdapter(sv.version, sv.sha256, sv.base, config, tensors)

    def forget(self, version: int) -> None:
        with self._lock:
            for key in [k for k in self._configs if k[0] == version]:
                del self._configs[key]

    def file_ok(self, sv: persist.StoredVersion) -> bool:
        """Its file is there with the size recorded (the bytes are checked when read)."""
        try:
            header = read_safetensors_header(self._dir / sv.file)
        except Exception:
            return False
        return header.file_size == sv.file_nbytes and sv.base is not None


def _chunks(header: SafetensorsHeader, entry: TensorEntry) -> Iterator[bytes]:
    with open(header.path, "rb") as f:
        yield from read_entry_chunks(f, header, entry)
