"""The snapshot store: every acknowledged policy version's weights, in tiers, within budgets.

In: publishes (state dict, safetensors, delta), acquires, leases, the watermark. Out: a
version's tensors on the serving device, pinned while a request uses them. A thin facade over
parts that each own one thing — ``Registry`` (durable records, retention), ``Residency``
(memory tiers), ``Rebuilder`` (keyframe + patch chains), ``Publisher`` (ingest → verify →
persist → register) — and the ``LaggingModel``. Thread-safe and model-agnostic
(``param_specs`` is all it knows of the model); no asyncio, HTTP or Redis. Reads have no side
effects: lease expiry and retention run in ``sweep``, which the service calls periodically.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from collections.abc import Set as AbstractSet
from pathlib import Path
from types import MappingProxyType
from typing import TypeVar

import torch

from oldlogit.contract.errors import (
    Conflict,
    InvalidRequest,
    OldLogitError,
    Unavailable,
    error_from_payload,
)
from oldlogit.contract.weights import read_safetensors_header
from oldlogit_service.snapshots import buffers, codec, crashpoints, ingest, persist
from oldlogit_service.snapshots.adapters import Adapters, StoredAdapter
from oldlogit_service.snapshots.lagging import LaggingModel
from oldlogit_service.snapshots.leases import LeaseRecord
from oldlogit_service.snapshots.publish import Claim, Publisher, check_sha
from oldlogit_service.snapshots.rebuild import Rebuilder
from oldlogit_service.snapshots.records import (
    LaggingStats,
    PublishOutcome,
    StoreStats,
    TierStats,
    VersionRecord,
)
from oldlogit_service.snapshots.registry import Registry, check_version
from oldlogit_service.snapshots.residency import Residency, Resident
from oldlogit_service.snapshots.shared import (
    SharedChain,
    adopt_chain,
    follow_records,
    link_shared,
)
from oldlogit_service.snapshots.tiers import DISK, TierAccount
from oldlogit_service.snapshots.yielding import Foreground

logger = logging.getLogger(__name__)

__all__ = ["SnapshotStore"]

# Linux nice of the thread that writes a moved keyframe's files (beside the forwards).
MOVE_NICE = 10
T = TypeVar("T")


def _at_low_priority(fn: Callable[[], T]) -> T:
    """``fn()`` on a thread of its own at ``MOVE_NICE`` (a thread's nice cannot be raised back
    once lowered, so not the caller's), waited for."""
    out: list[T] = []
    err: list[BaseException] = []

    def run() -> None:
        with contextlib.suppress(OSError, AttributeError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), MOVE_NICE)
        try:
            out.append(fn())
        except BaseException as exc:
            err.append(exc)

    t = threading.Thread(target=run, name="oldlogit-keyframe-move", daemon=True)
    t.start()
    t.join()
    if err:
        raise err[0]
    return out[0]


class SnapshotStore:
    """Every acknowledged version's weights, served from the fastest tier that holds them.

    Decisions:
    - Memory tiers evict LRU among unpinned versions (ties: a copy one tier down first, then
      the smaller), credited with rebuild cost; an adapter version's LoRA tensors are an entry
      like a version's weights (``pin_adapter``), its base one of its own. Device bytes stay
      <= budget + one snapshot: a load that would go further (everything resident in use)
      waits for a release, up to ``admission_timeout_s``, then raises ``Overloaded``.
    - Disk: below the watermark first, then LRU while over ``max_versions`` or the byte budget;
      never a leased or in-use version, never the newest for budget reasons. Deleted versions
      are tombstoned (``VersionEvicted`` with the retained range), durably.
    - The watermark only moves up; lowering it is refused (``InvalidRequest``).
    - Leases are persisted with wall-clock expiry, so they survive a restart.
    - Versions are keyframes or patches; deleting a version others are rebuilt from rewrites
      them first, so no retained chain loses its keyframe.
    """

    def __init__(
        self,
        root: Path | str,
        *,
        param_specs: Mapping[str, tuple[str, tuple[int, ...]]],
        device: torch.device | str,
        device_budget_bytes: int,
        host_budget_bytes: int,
        disk_budget_bytes: int,
        max_versions: int,
        pin_host: bool | None = None,
        clock: Callable[[], float] = time.time,
        verify_first_load: bool = True,
        admission_timeout_s: float = 60.0,
        keyframe_every: int = 1,
        keyframe_chain_fraction: float = 1.0,
        claim: Claim | None = None,
        pinned_elsewhere: Callable[[], set[int]] | None = None,
        keyframes_follow_access: bool = True,
        shared: SharedChain | None = None,
    ) -> None:
        """``verify_first_load``: a version recovered from an earlier process has its weight
        hash recomputed on its first load (one more pass over memory per version per process;
        disk rot or tampering then fails loudly instead of answering with wrong weights).

        Keyframe policy: a new version is stored as a patch against its parent unless that
        would make its chain ``keyframe_every`` versions long (1: every version a keyframe) or
        its chain's patches larger than ``keyframe_chain_fraction`` of one keyframe.

        ``keyframes_follow_access``: ``sweep`` moves a keyframe down its chain to where the
        rebuilds lately asked for would apply the fewest patches (``rebuild.py``; never in
        scale-out, where another replica may still adopt a keyframe's file).

        Scale-out: ``shared`` (``shared.py``) puts this store's chain files on the shared
        volume, one chain for every replica: publishes are claimed there, versions published
        elsewhere adopted with their chain, and this store's chains rewritten (retention,
        deletes, keyframe moves) only when the deployment's control asks, under its re-key
        lease — retention and keyframe moves are not this store's own decisions then.
        ``claim`` alone (no shared chain): the shared registry's claim; ``pinned_elsewhere``
        the versions leased on other replicas.
        """
        if max_versions < 1:
            raise ValueError("max_versions must be >= 1")
        if keyframe_every < 1 or not keyframe_chain_fraction > 0:
            raise ValueError("keyframe_every must be >= 1 and keyframe_chain_fraction > 0")
        dev = torch.device(device)
        self._root = Path(root)
        self._specs = ingest.normalize_specs(param_specs)
        self._snapshot_nbytes = ingest.specs_nbytes(self._specs)
        if shared is not None:
            claim, pinned_elsewhere = shared.claim, shared.pinned_elsewhere
        self._shared = shared
        self._pinned_elsewhere = pinned_elsewhere
        self.keyframes_follow_access = keyframes_follow_access
        self._follow_access = keyframes_follow_access and claim is None
        self._closed = False
        self._retention_due = False
        self._root.mkdir(parents=True, exist_ok=True)
        (self._root / persist.WEIGHTS).mkdir(exist_ok=True)
        self.registry = Registry(
            self._root,
            specs_sha256=ingest.specs_sha256(self._specs),
            max_versions=int(max_versions),
            disk_budget_bytes=int(disk_budget_bytes),
            clock=clock,
        )
        self.residency = Residency(
            device=dev,
            device_budget_bytes=device_budget_bytes,
            host_budget_bytes=host_budget_bytes,
            pin_host=bool(dev.type == "cuda" if pin_host is None else pin_host),
            clock=clock,
            admission_timeout_s=admission_timeout_s,
            materialize=self._materialize_any,
            rebuild_cost=self._rebuild_cost,
            patch_cost=lambda v: self.rebuilder.patch_cost(v),
            gone=self.registry.missing_error,
        )
        self.rebuilder = Rebuilder(
            registry=self.registry,
            residency=self.residency,
            weights_dir=self._root / persist.WEIGHTS,
            specs=self._specs,
            snapshot_nbytes=self._snapshot_nbytes,
            keyframe_every=int(keyframe_every),
            keyframe_chain_fraction=float(keyframe_chain_fraction),
            clock=clock,
        )
        self._publisher = Publisher(
            registry=self.registry,
            residency=self.residency,
            rebuilder=self.rebuilder,
            specs=self._specs,
            snapshot_nbytes=self._snapshot_nbytes,
            clock=clock,
            claim=claim,
            fetch=shared.fetch if shared is not None else None,
        )
        self._adapters = Adapters(
            registry=self.registry, specs=self._specs, clock=clock, clustered=claim is not None
        )
        try:
            self._lockfile = persist.lock_root(self._root)
        except BlockingIOError as exc:
            raise Conflict(str(exc), parameter="snapshot_dir") from exc
        try:
            self.registry.recover(self._file_ok)
        except BaseException:
            self._lockfile.close()
            raise
        if not verify_first_load:
            for sv in self.registry.records().values():
                self.rebuilder.mark_verified(sv)
        self._lagging = LaggingModel(self)
        if self.residency.pin_host:  # staging buffers: a load in flight and the next one
            buffers.PINNED_POOL.set_limit(2 * self._snapshot_nbytes)
        else:  # an evicted version's memory, for the load that made room by evicting it
            buffers.HOST_POOL.keep(self._snapshot_nbytes, 1)
        if self.residency.device_tier.budget < self._snapshot_nbytes:
            logger.warning(
                "device budget %d B is below one version (%d B): every request reloads",
                self.residency.device_tier.budget,
                self._snapshot_nbytes,
            )
        self._retain()

    def _materialize_any(self, version: int) -> Resident:
        """A version's weights, or an adapter version's LoRA tensors, in a fresh CPU buffer."""
        sv = self.registry.get(version)
        if sv.kind == "adapter":
            # Pageable: an adapter's copy is small, and its sizes would crowd the page-locked
            # pool kept for snapshot-sized staging buffers (``buffers.PINNED_POOL``).
            return self._adapters.read(sv, pin=False)
        return self.rebuilder.materialize(version)

    def _rebuild_cost(self, version: int) -> float:
        """Snapshot loads to bring a copy back: an adapter's is its file's share of one."""
        try:
            sv = self.registry.get(version)
        except OldLogitError:
            return 1.0
        if sv.kind == "adapter":
            return sv.file_nbytes / max(1, self._snapshot_nbytes)
        return self.rebuilder.rebuild_cost(version)

    def _file_ok(self, sv: persist.StoredVersion) -> bool:
        """The file's table matches the model (a patch's bytes are checked when read)."""
        try:
            header = read_safetensors_header(self._root / persist.WEIGHTS / sv.file)
        except OldLogitError:
            return False
        if sv.kind == "adapter":
            return self._adapters.file_ok(sv)
        if sv.kind == "patch":
            return header.file_size == sv.file_nbytes and sv.parent is not None
        found = {n: (e.dtype, e.shape) for n, e in header.tensors.items()}
        return found == self._specs and header.nbytes == sv.nbytes

    def _check_open(self) -> None:
        if self._closed:
            raise Unavailable("the snapshot store is closed")

    # -- acquire ----------------------------------------------------------------------------
    @contextlib.contextmanager
    def acquire(self, version: int, uses: int = 1) -> Iterator[Mapping[str, torch.Tensor]]:
        """Pin ``version`` while the block runs and yield its tensors on the serving device;
        ``uses``: the requests it serves (they count for eviction, ``tiers.reuse_factor``).

        The mapping and tensors must not be modified or kept after the block: once unpinned
        the version may be evicted and its memory reused.
        """
        version = check_version(version)
        self._check_open()
        res = self.pin(version, uses=uses)
        try:
            yield MappingProxyType(res.tensors)
        finally:
            self.residency.unpin(version)

    def pin(
        self, version: int, wanted: AbstractSet[int] | None = None, *, uses: int = 1
    ) -> Resident:
        """Pin a retained version in device memory (``residency.unpin`` it after use);
        ``wanted`` and ``uses`` as in ``Residency.pin``."""
        sv = self.registry.get(version)  # UnknownVersion / VersionEvicted
        if sv.kind == "adapter":
            raise InvalidRequest(
                f"policy_version {version} is an adapter version: its base {sv.base} is pinned "
                "and the adapter applied (SnapshotStore.adapter)",
                parameter="policy_version",
            )
        if self.retired_here(version):
            raise self.registry.missing_error(
                version, f"it is below the watermark {self.watermark}"
            )
        self.registry.touch(version)
        try:
            return self.residency.pin(version, sv.nbytes, wanted, uses=uses)
        except persist.CorruptSnapshot as exc:
            raise self.quarantine(version, exc) from exc
        except OldLogitError as exc:
            # A load's followers re-raise a copy, so threads do not share one traceback.
            raise error_from_payload(exc.to_payload()) from exc

    def retired_here(self, version: int) -> bool:
        """On a shared chain: below the watermark and leased nowhere — kept only until the
        deployment's retention removes it (a chain may still run through it), never served."""
        wm = self.registry.watermark
        if self._shared is None or wm is None or version >= wm:
            return False
        return version not in self._shared.pinned_elsewhere()

    def hold(self, version: int, wanted: AbstractSet[int] = frozenset()) -> None:
        """Make ``version`` device-resident and keep it so until ``unhold`` (the scheduler's
        load stage, ahead of the batches that need it). ``wanted``: the versions with queued
        work; if room must be made, the copies nobody waits for go first."""
        self._check_open()
        self.pin(check_version(version), wanted, uses=0)

    def unhold(self, version: int) -> None:
        self.residency.unpin(version)

    def resident(self, version: int) -> bool:
        """Device-resident right now: an acquire would not load."""
        return "device" in self.residency.tiers(version)

    def pin_resident(self, version: int) -> bool:
        """Pin ``version`` if it is device-resident now, loading nothing; True when pinned
        (``unhold`` it after use)."""
        if self._closed:
            return False
        return self.residency.pin_resident(check_version(version))

    def has_room(self) -> bool:
        """A load now would evict nothing: the device budget has a version's room free."""
        return self.residency.has_room(self._snapshot_nbytes)

    def cold_room(self) -> tuple[int, frozenset[int]]:
        """(Versions' weights the device budget holds beside the hot versions' copies and
        the decoded patches, the hot versions): the scheduler's load stage holds no more
        versions that are not hot than fit there (``Residency.cold_room``)."""
        return self.residency.cold_room(self._snapshot_nbytes)

    def acquire_lagging(
        self, version: int
    ) -> contextlib.AbstractContextManager[Mapping[str, torch.Tensor]]:
        """Like ``acquire``, through the lagging model (``--strategy lagging``): one resident
        copy advanced by patches; a version it has passed comes from ``acquire``."""
        self._check_open()
        return self._lagging.acquire(version)

    def quarantine(self, version: int, exc: persist.CorruptSnapshot) -> OldLogitError:
        """A file failed verification: its version goes (quarantined), with every version
        rebuilt through it; returns the error for the request that found it."""
        logger.error("version %d failed verification: %s", version, exc)
        bad = exc.version if exc.version is not None else version
        with self.registry.persist_lock:
            try:
                sv = self.registry.get(bad)
            except OldLogitError:
                sv = None
            if sv is not None:
                gone = (bad, *sorted(self.registry.descendants({bad})))
                files = self.registry.remove(gone, replace={}, evicted=True)
                for v in gone:
                    self.residency.retire(v)
                    self._adapters.forget(v)
                persist.quarantine(self._root, sv.file)
                persist.remove_files(
                    self._root / persist.WEIGHTS, [f for f in files if f != sv.file]
                )
                if len(gone) > 1:
                    logger.error(
                        "versions %s were rebuilt through version %d: gone too", gone[1:], bad
                    )
                if self._shared is not None:
                    try:  # the file is the deployment's: every replica reads the same bytes
                        self._shared.quarantined(gone)
                    except Exception:
                        logger.exception("could not drop versions %s from the deployment", gone)
        return self.registry.missing_error(
            version,
            "its file (or one of the files it is rebuilt from) failed verification and was "
            "quarantined",
        )

    # -- publish ----------------------------------------------------------------------------
    def publish(
        self,
        version: int,
        weights: Mapping[str, torch.Tensor] | Path | str,
        *,
        expected_sha256: str | None = None,
        cast: bool = False,
    ) -> PublishOutcome:
        """Publish a version from a state dict or a safetensors file/shard directory; visible
        only once its file and registry record are durable. ``cast`` (state dicts only) casts
        floating tensors to the serving dtype instead of refusing them."""
        version = check_version(version)
        expected = check_sha(expected_sha256)
        self._check_open()
        if isinstance(weights, (str, Path)):
            if cast:
                raise InvalidRequest("cast applies to state dicts only", parameter="cast")
            out = self._publisher.publish_file(version, Path(weights), expected, move=False)
        else:
            out = self._publisher.publish_weights(version, weights, expected, cast)
        self._retain()
        return out

    def publish_file(
        self,
        version: int,
        path: Path | str,
        *,
        expected_sha256: str | None = None,
        move: bool = False,
    ) -> PublishOutcome:
        """Publish from a safetensors file or shard directory; ``move``: an upload streamed
        to ``staging_dir`` is renamed into the store instead of copied."""
        version = check_version(version)
        expected = check_sha(expected_sha256)
        self._check_open()
        out = self._publisher.publish_file(version, Path(path), expected, move=move)
        self._retain()
        return out

    def publish_delta(
        self,
        version: int,
        path: Path | str,
        *,
        parent: int | None = None,
        expected_sha256: str | None = None,
    ) -> PublishOutcome:
        """Publish from a delta file (``oldlogit.contract.delta`` format) against a retained parent;
        ``ParentMissing`` when this store does not hold it with the weights the delta was
        made against."""
        version = check_version(version)
        expected = check_sha(expected_sha256)
        if parent is not None:
            parent = check_version(parent, "parent")
        self._check_open()
        out = self._publisher.publish_delta(version, Path(path), parent, expected)
        self._retain()
        return out

    def publish_adapter(
        self,
        version: int,
        path: Path | str,
        *,
        base_version: int,
        expected_sha256: str | None = None,
    ) -> PublishOutcome:
        """Publish an adapter version from a safetensors file of LoRA tensors (its config in
        the metadata, ``oldlogit.contract.adapters``) over the retained ``base_version``."""
        version = check_version(version)
        base_version = check_version(base_version, "base_version")
        expected = check_sha(expected_sha256)
        self._check_open()
        out = self._adapters.publish(version, Path(path), base_version, expected)
        self._retain()
        return out

    def adapter_base(self, version: int) -> int | None:
        """An adapter version's base version; None for full weights (errors if not retained)."""
        return self.registry.get(check_version(version)).base

    @contextlib.contextmanager
    def adapter(self, version: int, uses: int = 1) -> Iterator[StoredAdapter]:
        """An adapter version's config and tensors on the serving device, pinned while the
        block runs (``pin_adapter``; the tensors must not be kept after it)."""
        got = self.pin_adapter(version, uses=uses)
        try:
            yield got
        finally:
            self.residency.unpin(got.version)

    def pin_adapter(self, version: int, *, uses: int = 1) -> StoredAdapter:
        """Pin an adapter version's LoRA tensors in device memory (``residency.unpin`` it
        after use): read once from its file (hash-checked), then held in the host and device
        tiers like a version's weights — their bytes counted in the budgets, evicted LRU when
        unpinned, retired with the version. Its base is pinned apart (``pin``)."""
        version = check_version(version)
        self._check_open()
        sv = self.registry.get(version)  # UnknownVersion / VersionEvicted
        if sv.kind != "adapter":
            raise InvalidRequest(
                f"policy_version {version} is not an adapter version", parameter="policy_version"
            )
        self.registry.touch(version)
        try:
            res = self.residency.pin(version, sv.nbytes, uses=uses)
        except persist.CorruptSnapshot as exc:
            raise self.quarantine(version, exc) from exc
        except OldLogitError as exc:
            raise error_from_payload(exc.to_payload()) from exc
        try:
            return self._adapters.stored(sv, MappingProxyType(res.tensors))
        except BaseException:
            self.residency.unpin(version)
            raise

    def adopt(self, version: int, path: Path, expected_sha256: str) -> PublishOutcome:
        """Take in a version another replica published to the shared volume (scale-out)."""
        version = check_version(version)
        self._check_open()
        return self._publisher.adopt(version, Path(path), expected_sha256)

    # -- a shared chain (scale-out: ``shared.py``) ------------------------------------------
    def _shared_chain(self) -> SharedChain:
        if self._shared is None:
            raise InvalidRequest("this store is not on a shared chain", parameter="shared")
        return self._shared

    def adopt_chain(self, chain: list[persist.StoredVersion]) -> None:
        """Take in a version with its chain ([version, parent, ..., keyframe], the deployment's
        records): linked from the shared directory, every step rebuilt and hash-checked."""
        self._check_open()
        adopt_chain(
            chain,
            shared=self._shared_chain().directory,
            registry=self.registry,
            residency=self.residency,
            rebuilder=self.rebuilder,
        )

    def follow(
        self, records: Mapping[int, persist.StoredVersion], removed: set[int]
    ) -> tuple[list[int], list[int]]:
        """Switch to the deployment's records (``records``: all it retains; ``removed``: the
        held versions it deleted): those go here, re-keyed ones get their new file. Returns
        (removed, switched)."""
        self._check_open()
        return follow_records(
            records,
            removed,
            shared=self._shared_chain().directory,
            registry=self.registry,
            residency=self.residency,
            rebuilder=self.rebuilder,
            in_use=self.residency.in_use,
        )

    def remove_versions(self, versions: set[int]) -> list[int]:
        """Remove these held versions (the deployment's retention chose them; the caller
        holds the re-key lease): dependents re-keyed or rebased, the rewrite swapped into
        the deployment first. Returns what was removed."""
        self._check_open()
        with self.registry.persist_lock:
            held = tuple(sorted(v for v in versions if self.registry.has(v)))
            if held:
                self._remove(held, evicted=True)
        return list(held)

    def _share_rewrite(
        self,
        remove: tuple[int, ...],
        replace: Mapping[int, persist.StoredVersion],
        expect: Mapping[int, persist.StoredVersion],
    ) -> None:
        """Link rewritten files into the shared directory and swap the records there (the
        deployment's records must still be ``expect``); raises ``ChainMoved`` otherwise, with
        the shared links removed again. Call before this store's own records change."""
        shared = self._shared_chain()
        linked: list[str] = []
        try:
            for sv in replace.values():
                link_shared(self._root / persist.WEIGHTS / sv.file, shared.directory, sv.file)
                linked.append(sv.file)
            crashpoints.reached("swap", min((*remove, *replace), default=-1))
            shared.swap(remove, replace, expect)
        except BaseException:
            persist.remove_files(shared.directory, linked)
            raise

    @property
    def staging_dir(self) -> Path:
        """Where uploads are streamed before ``publish_file(..., move=True)`` (same
        filesystem, so the move is a rename; leftovers are cleared when the store opens)."""
        d = self._root / persist.INCOMING
        d.mkdir(exist_ok=True)
        return d

    # -- retention --------------------------------------------------------------------------
    def set_watermark(self, version: int) -> int:
        """The trainer will never ask below ``version``: unleased versions below it are deleted.

        Monotonic: an equal value is a no-op, a lower one is refused (its versions may already
        be gone, so lowering could not bring them back). Returns the watermark.
        """
        version = check_version(version)
        self._check_open()
        if self.registry.set_watermark(version):
            logger.info("watermark set to %d", version)
            self._retain()
        return version

    def delete(self, version: int) -> bool:
        """Delete a version (tombstoned: requests get VersionEvicted). Refused while leased;
        requests already holding it finish. Versions rebuilt through it are rewritten first.
        False when it was already gone."""
        version = check_version(version)
        self._check_open()
        with self.registry.persist_lock:
            if not self.registry.check_deletable(version):
                return False
            self._remove((version,), evicted=False)
        logger.info("deleted version %d on request", version)
        return True

    def _remove(self, versions: tuple[int, ...], *, evicted: bool) -> None:
        """Delete versions durably, rewriting the versions that depend on them first. Call with
        the registry's ``persist_lock`` held."""
        rewrites = self.rebuilder.rewrites_for_removal(set(versions))
        try:
            if self._shared is not None:
                records = self.registry.records()
                expect = {v: records[v] for v in (*versions, *rewrites) if v in records}
                self._share_rewrite(versions, rewrites, expect)
            files = self.registry.remove(versions, replace=rewrites, evicted=evicted)
        except BaseException:
            persist.remove_files(
                self._root / persist.WEIGHTS, [sv.file for sv in rewrites.values()]
            )
            raise
        for v in versions:
            self.residency.retire(v)
            self._adapters.forget(v)
        for v in rewrites:
            self.residency.forget_patch(v)  # it was against the old parent
        persist.remove_files(self._root / persist.WEIGHTS, files)

    def sweep(self) -> None:
        """Expire leases, apply the disk retention rules and move a keyframe to where rebuilds
        are asked for, if one pays (the service calls this periodically; writes apply
        retention themselves). Failures are logged, not raised."""
        if self._closed:
            return
        if self.registry.expire_leases():
            self._retention_due = True
        self._retain()
        if self._follow_access:
            self.move_keyframe()

    def move_keyframe(self) -> bool:
        """Move the keyframe whose move saves the most rebuild work (``Rebuilder.keyframe_move``)
        down its chain: its files are written and checked at a low CPU priority (a thread of
        its own, waited for), then the records swapped durably. True if one moved. Every
        version's bytes stay what was published (each is rebuilt and hashed before the swap).
        """
        try:
            move = self.rebuilder.keyframe_move()
            if move is None:
                return False
            moved = _at_low_priority(lambda: self.rebuilder.rewrites_for_move(move))
        except Exception:
            logger.exception("moving a keyframe failed; the chains stay as they were")
            return False
        new_files = [sv.file for sv in moved.records.values()]
        with self.registry.persist_lock:
            records = self.registry.records()
            if any(records.get(sv.version) is not sv for sv in moved.path):
                # A publish or removal rewrote the path meanwhile: leave it as it is now.
                persist.remove_files(self._root / persist.WEIGHTS, new_files)
                return False
            try:
                if self._shared is not None:
                    expect = {sv.version: sv for sv in moved.path}
                    self._share_rewrite((), moved.records, expect)
                old = self.registry.remove((), replace=moved.records, evicted=False)
            except BaseException:
                persist.remove_files(self._root / persist.WEIGHTS, new_files)
                raise
            for v, sv in moved.records.items():
                self.residency.forget_patch(v)  # against its old parent
                patch = moved.patches.get(v)
                if patch is not None:
                    self.residency.offer(v, patch, patch_key=sv.file_sha256 or sv.file)
        self.rebuilder.retire_files(old)
        path = [sv.version for sv in moved.path]
        logger.info(
            "keyframe of versions %d..%d moved from version %d to %d (rebuilds asked for "
            "apply %.0f %% fewer patch bytes)",
            min(path),
            max(path),
            path[0],
            path[-1],
            100 * move.gain,
        )
        return True

    def _retain(self) -> None:
        """Apply the disk rules after an operation that already succeeded: a failure here (a
        full or read-only disk) is logged and retried by the next sweep, never reported as the
        failure of that operation (a durable publish must not look failed). On a shared
        chain the deployment's control applies the rules to every replica's versions at once
        (``remove_versions``), not each store to its own."""
        if self._shared is not None:
            return
        try:
            with self.registry.persist_lock:
                self._retention_due = False
                # A removal can rewrite a dependent version as a keyframe (more bytes): apply
                # the rules again until they pick nothing; each round removes a version.
                for _ in range(len(self.registry.records()) + 1):
                    elsewhere = self._pinned_elsewhere() if self._pinned_elsewhere else set()
                    victims, held = self.registry.retention_victims(
                        self.residency.in_use(), elsewhere
                    )
                    self._retention_due = held  # retry once the request holding it lets go
                    if not victims:
                        return
                    self._remove(tuple(v for v, _ in victims), evicted=True)
                    for v, why in victims:
                        logger.info("deleted version %d from disk (%s)", v, why)
        except Exception:
            logger.exception("disk retention failed; the next sweep retries it")
            self._retention_due = True

    def evict(self, version: int) -> bool:
        """Drop a version's weights from the memory tiers now (its decoded patch stays); the
        next acquire rebuilds it. For operators and benchmarks; False if it was not resident
        or is in use."""
        version = check_version(version)
        self.registry.get(version)
        return self.residency.evict(version)

    # -- leases -----------------------------------------------------------------------------
    def lease(self, version: int, holder: str, ttl_s: float) -> LeaseRecord:
        """Keep ``version`` on disk until the lease is released or ``ttl_s`` passes."""
        version = check_version(version)
        self._check_open()
        return self.registry.lease(version, holder, ttl_s)

    def release(self, lease_id: str) -> LeaseRecord:
        """End a lease; versions it alone kept (below the watermark) are deleted now."""
        self._check_open()
        rec = self.registry.release(lease_id)
        self._retain()
        return rec

    def leases(self) -> list[LeaseRecord]:
        return self.registry.leases()

    # -- introspection ----------------------------------------------------------------------
    def _record(self, sv: persist.StoredVersion) -> VersionRecord:
        v = sv.version
        return VersionRecord(
            version=v,
            sha256=sv.sha256,
            nbytes=sv.nbytes,
            tiers=self.residency.tiers(v) | {DISK},
            kind=sv.kind,
            parent=sv.parent,
            stored_nbytes=sv.disk_nbytes,
            leases=self.registry.lease_count(v),
            created_at=sv.created_at,
            last_used=self.registry.last_used(v),
            in_use=self.residency.pins(v),
            file=sv.file,
            patch_cached=self.residency.has_patch(v),
            base=sv.base,
        )

    def versions(self) -> list[VersionRecord]:
        """Every retained version, ascending."""
        records = self.registry.records()
        return [self._record(records[v]) for v in sorted(records)]

    def info(self, version: int) -> VersionRecord:
        return self._record(self.registry.get(check_version(version)))

    def sha256(self, version: int) -> str:
        return self.registry.get(check_version(version)).sha256

    def has(self, version: int) -> bool:
        """Whether this store retains ``version`` (no error for unknown ones)."""
        return self.registry.has(version)

    @property
    def watermark(self) -> int | None:
        return self.registry.watermark

    @property
    def newest(self) -> int | None:
        """The newest version ever acknowledged (it may since have been deleted)."""
        return self.registry.newest

    @property
    def snapshot_nbytes(self) -> int:
        return self._snapshot_nbytes

    @property
    def device(self) -> torch.device:
        return self.residency.device

    @property
    def foreground(self) -> Foreground:
        """Forwards first: the scheduler's batches run in its ``forward()``; loads, rebuilds
        and rewrites yield to them (``yielding.py``)."""
        return self.residency.foreground

    def retained_range(self) -> tuple[int, int] | None:
        return self.registry.retained_range()

    def stats(self) -> StoreStats:
        """Live numbers for metrics: bytes/budget/versions per tier, evictions, loads."""

        def tier(t: TierAccount) -> TierStats:
            return TierStats(t.resident, t.budget, t.versions, t.evictions, t.peak)

        r, m, b = self.registry, self.residency, self.rebuilder
        lag = self._lagging.counters
        fg = m.foreground.counters()
        return StoreStats(
            tiers={"device": tier(m.device_tier), "host": tier(m.host_tier), DISK: tier(r.disk)},
            versions=len(r.records()),
            newest=r.newest,
            watermark=r.watermark,
            leases=r.lease_total(),
            tombstones=r.tombstone_count,
            in_use=len(m.in_use()),
            publishes=r.publishes,
            snapshot_bytes=self._snapshot_nbytes,
            patch_bytes=m.patch_bytes(),
            load_seconds=m.load_seconds,
            device_hits=m.counters["device_hits"],
            loads_disk=m.counters["loads_disk"],
            loads_host=m.counters["loads_host"],
            load_waits=m.counters["load_waits"],
            bytes_read=b.counters["bytes_read"],
            verified_loads=b.counters["verified_loads"],
            rebuilds=b.counters["rebuilds"],
            patches_applied=b.counters["patches_applied"],
            lagging=LaggingStats(**lag),
            background_paused_s=fg.paused_s,
            background_turns=fg.turns,
            forward_turn_wait_s=fg.forward_wait_s,
        )

    # -- the lagging model's view (``lagging.ChainSource``) -----------------------------------
    def chain(self, version: int) -> list[persist.StoredVersion]:
        return self.registry.chain(version)

    def load_patch(self, sv: persist.StoredVersion) -> codec.Patch:
        return self.rebuilder.load_patch(sv)

    def reading(self) -> contextlib.AbstractContextManager[None]:
        return self.rebuilder.reading()

    def materialize(self, version: int) -> Resident:
        return self.rebuilder.materialize(version)

    def to_device(self, res: Resident) -> Resident:
        return self.residency.to_device(res)

    def hold_device(self, nbytes: int, version: int) -> None:
        self.residency.hold_device(nbytes, version)

    def release_device(self, nbytes: int) -> None:
        self.residency.release_device(nbytes)

    def is_verified(self, sv: persist.StoredVersion) -> bool:
        return self.rebuilder.is_verified(sv)

    def mark_verified(self, sv: persist.StoredVersion) -> None:
        self.rebuilder.mark_verified(sv)

    # -- lifecycle --------------------------------------------------------------------------
    def close(self) -> None:
        """Drop memory copies and free the directory for another process."""
        if self._closed:
            return
        self._closed = True
        self._lagging.close()
        self.residency.close()
        self._lockfile.close()

    def __enter__(self) -> SnapshotStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
