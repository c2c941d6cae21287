"""The EWMA proxy policy (after PPO-EWMA): the approximate answer when exact old logits are gone.

In: every acknowledged version's weights, folded in version order after each publish
(W ← βW + 1; θ̄ ← (1 − 1/W)·θ̄ + θ/W, float32 accumulators, so the first θ̄ is θ itself).
Out: θ̄ cast to the serving dtype, its weight hash, and logprobs of engine jobs under it, run on
an engine of its own. Never exact. The state survives a restart in SNAPSHOT_DIR/ewma/.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import threading
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from oldlogit.contract.errors import UnknownVersion, VersionEvicted
from oldlogit.contract.weights import weight_sha256
from oldlogit_service.model.loaded import LoadedModel

if TYPE_CHECKING:
    from oldlogit_service.snapshots import SnapshotStore

logger = logging.getLogger(__name__)

__all__ = ["EwmaProxy", "EwmaSnapshot", "resolve_hashes"]

STATE_FILE = "state.safetensors"
_TMP_PREFIX = ".tmp-"
_FORMAT = "1"


@dataclass(frozen=True)
class EwmaSnapshot:
    """One consistent view: the weights served, their hash, and the newest version folded in."""

    weights: Mapping[str, torch.Tensor]  # serving dtype, on the serving device
    sha256: str
    last_version: int
    count: int  # versions folded in so far


class EwmaProxy:
    """Folds published versions into a bias-corrected EMA and answers jobs under it.

    ``fold``/``catch_up`` are serialised by one lock; readers take ``snapshot()`` once per
    request, so a concurrent publish never mixes two averages in one answer. Jobs under a
    snapshot run through the scheduler like every other job (same queue limit, deadlines,
    overload behaviour), under the snapshot's weights held by reference and named by their hash
    (``scheduler.WeightsRef.proxy``).
    """

    def __init__(
        self,
        model: LoadedModel,
        *,
        beta: float,
        state_dir: Path | None = None,
    ) -> None:
        if not (isinstance(beta, float | int) and 0.0 < beta < 1.0):
            raise ValueError(f"ewma beta must be in (0, 1), got {beta!r}")
        self.model = model
        self.beta = float(beta)
        self.state_dir = state_dir
        self._lock = threading.Lock()
        self._acc: dict[str, torch.Tensor] = {}  # float32, CPU: the average being accumulated
        self._w = 0.0  # W of the bias correction
        self._count = 0
        self._last = -1
        self._snapshot: EwmaSnapshot | None = None
        if state_dir is not None:
            self._load()

    # -- state -------------------------------------------------------------------------------
    @property
    def last_version(self) -> int:
        """The newest version folded in; −1 before the first."""
        return self._last

    @property
    def count(self) -> int:
        return self._count

    @property
    def weight(self) -> float:
        """W: Σ_{i<k} β^i after k folds."""
        return self._w

    def snapshot(self) -> EwmaSnapshot | None:
        return self._snapshot

    def accumulators(self) -> dict[str, torch.Tensor]:
        """A copy of the float32 average (for tests and inspection)."""
        with self._lock:
            return {k: v.clone() for k, v in self._acc.items()}

    # -- updates -----------------------------------------------------------------------------
    def fold(self, version: int, weights: Mapping[str, torch.Tensor]) -> None:
        """Fold one version (strictly newer than the last) in, then persist and publish."""
        with self._lock:
            self._fold_locked(version, weights)
            self._refresh_locked()

    def catch_up(self, store: SnapshotStore) -> list[int]:
        """Fold every retained version newer than the last folded, ascending; returns them.

        Called after each publish and at start-up. A version deleted before it could be read
        is skipped: the average then misses it, which only makes the approximation coarser.
        """
        with self._lock:
            todo = sorted(  # an adapter version has no weights of its own to fold
                int(r.version)
                for r in store.versions()
                if r.version > self._last and r.kind != "adapter"
            )
            done: list[int] = []
            for v in todo:
                try:
                    with store.acquire(v) as weights:
                        self._fold_locked(v, weights)
                    done.append(v)
                except (UnknownVersion, VersionEvicted):
                    logger.warning("ewma: version %d vanished before it was folded in", v)
            if done:
                self._refresh_locked()
                logger.info(
                    "ewma: folded version(s) %s; %d so far, beta=%g", done, self._count, self.beta
                )
            return done

    def _fold_locked(self, version: int, weights: Mapping[str, torch.Tensor]) -> None:
        if version <= self._last:
            raise ValueError(f"ewma: version {version} is not newer than {self._last}")
        missing = set(self.model.param_specs) - set(weights)
        if missing:
            raise ValueError(f"ewma: version {version} lacks {sorted(missing)[:3]}")
        w_new = self.beta * self._w + 1.0
        a = 1.0 / w_new
        with torch.no_grad():
            for name in self.model.param_specs:
                theta = weights[name].detach().to(device="cpu", dtype=torch.float32)
                if self._count == 0:
                    self._acc[name] = theta.clone()  # W = 1: θ̄ = θ exactly
                else:
                    self._acc[name].mul_(1.0 - a).add_(theta, alpha=a)
        self._w = w_new
        self._count += 1
        self._last = version

    def _refresh_locked(self) -> None:
        """Cast to the serving dtype, hash, move to the device, persist, then swap in."""
        cpu = {k: v.to(self.model.weight_dtype(k)).contiguous() for k, v in self._acc.items()}
        sha = weight_sha256(cpu)
        device = self.model.device
        served = cpu if device.type == "cpu" else {k: v.to(device) for k, v in cpu.items()}
        self._save_locked()
        self._snapshot = EwmaSnapshot(served, sha, self._last, self._count)

    # -- persistence -------------------------------------------------------------------------
    def _save_locked(self) -> None:
        if self.state_dir is None:
            return
        d = self.state_dir
        d.mkdir(parents=True, exist_ok=True)
        meta = {
            "format": _FORMAT,
            "beta": repr(self.beta),
            "weight": repr(self._w),
            "count": str(self._count),
            "last_version": str(self._last),
        }
        tmp = d / f"{_TMP_PREFIX}{uuid.uuid4().hex}-{STATE_FILE}"
        try:
            save_file(self._acc, str(tmp), metadata=meta)
            fd = os.open(tmp, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, d / STATE_FILE)  # a crash leaves the old state or the new one
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
            raise
        dir_fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)

    def _load(self) -> None:
        assert self.state_dir is not None
        d = self.state_dir
        if not d.is_dir():
            return
        for stale in d.glob(f"{_TMP_PREFIX}*"):  # an interrupted save
            with contextlib.suppress(OSError):
                stale.unlink()
        path = d / STATE_FILE
        if not path.is_file():
            return
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
                acc = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - not a dict
        except Exception as exc:
            logger.warning("ewma: ignoring unreadable state %s (%s); rebuilding", path, exc)
            return
        specs = self.model.param_specs
        shapes_ok = set(acc) == set(specs) and all(
            tuple(acc[k].shape) == tuple(specs[k][1]) and acc[k].dtype == torch.float32 for k in acc
        )
        if meta.get("format") != _FORMAT or not shapes_ok:
            logger.warning("ewma: state in %s does not match this model; rebuilding", path)
            return
        if meta.get("beta") != repr(self.beta):
            logger.warning(
                "ewma: state in %s was built with beta=%s, configured %r; rebuilding",
                path,
                meta.get("beta"),
                self.beta,
            )
            return
        weight = float(meta["weight"])
        if not (math.isfinite(weight) and weight >= 1.0):
            logger.warning("ewma: state in %s has W=%r; rebuilding", path, weight)
            return
        with self._lock:
            self._acc = acc
            self._w = weight
            self._count = int(meta["count"])
            self._last = int(meta["last_version"])
            cpu = {k: v.to(self.model.weight_dtype(k)).contiguous() for k, v in acc.items()}
            device = self.model.device
            served = cpu if device.type == "cpu" else {k: v.to(device) for k, v in cpu.items()}
            self._snapshot = EwmaSnapshot(served, weight_sha256(cpu), self._last, self._count)
        logger.info("ewma: restored %d folded version(s) up to %d", self._count, self._last)


def resolve_hashes(
    versions: Iterable[int],
    sha256: Callable[[int], str],
    snapshot: EwmaSnapshot | None,
    *,
    proxy: str | None,
    allow_inexact: bool,
) -> tuple[dict[int, str], set[int]]:
    """Each requested version's weight hash, and which versions the proxy answers instead.

    ``proxy="ewma"``: every version, up to the newest folded in. ``allow_inexact``: only the
    versions ``sha256`` reports gone (``UnknownVersion``/``VersionEvicted``) and the proxy
    covers; otherwise its error stands — exact or nothing, unless the request opted in. A
    proxied version maps to the hash of the EWMA weights used (never that version's hash), and
    its sequences are answered ``exact=false``; a version never published is never invented.
    """
    hashes: dict[int, str] = {}
    proxied: set[int] = set()
    for v in versions:
        if proxy is None:
            try:
                hashes[v] = sha256(v)
                continue
            except (UnknownVersion, VersionEvicted):
                if not allow_inexact or snapshot is None or not 0 <= v <= snapshot.last_version:
                    raise
        elif snapshot is None or v > snapshot.last_version:
            raise UnknownVersion(
                f"policy_version {v} is newer than the EWMA proxy "
                f"(last folded: {snapshot.last_version if snapshot else 'none'})",
                parameter="policy_version",
            )
        hashes[v] = snapshot.sha256
        proxied.add(v)
    return hashes, proxied
