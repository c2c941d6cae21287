"""The store with patches: random chains bitwise (publish full or delta), the keyframe policy,
checks before a delta becomes visible, corruption, deleting what a chain needs, restart, and
memory tiers that hold keyframes + decoded patches."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from oldlogit.contract.errors import (
    InvalidRequest,
    ParentMissing,
    UnknownVersion,
    VersionConflict,
    VersionEvicted,
    WeightsMismatch,
)
from oldlogit.publishing.streams import WeightsCopy
from oldlogit_service.snapshots import SnapshotStore, ingest, persist
from oldlogit_service.snapshots.tiers import MemoryCandidate, memory_victim_parts

from .test_codec import changed

SPECS: dict[str, tuple[str, tuple[int, ...]]] = {
    "emb": ("BF16", (64, 48)),
    "w": ("F32", (40, 40)),
    "h": ("F16", (33,)),
    "n": ("BF16", (7,)),
}
SNAP = ingest.specs_nbytes(SPECS)
_TORCH = {"BF16": torch.bfloat16, "F32": torch.float32, "F16": torch.float16}
FRACTIONS = [0.0, 0.003, 0.02, 0.3, 1.0]


def base(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(s, generator=g).to(_TORCH[dt]) for k, (dt, s) in SPECS.items()}


def trace(n: int, seed: int, fractions: list[float] = FRACTIONS) -> list[dict[str, torch.Tensor]]:
    """``n`` versions; each tensor of each step changes by a random pattern (0 %..100 %)."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    out = [base(seed)]
    for _ in range(n - 1):
        out.append({k: changed(t, rng.choice(fractions), g) for k, t in out[-1].items()})
    return out


def open_store(root: Path, **kw: Any) -> SnapshotStore:
    args: dict[str, Any] = {
        "param_specs": SPECS,
        "device": "cpu",
        "device_budget_bytes": 8 * SNAP,
        "host_budget_bytes": 0,
        "disk_budget_bytes": 1000 * SNAP,
        "max_versions": 1000,
        "keyframe_every": 4,
        "keyframe_chain_fraction": 10.0,
    }
    args.update(kw)
    return SnapshotStore(root, **args)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def assert_all_served(s: SnapshotStore, versions: dict[int, dict[str, torch.Tensor]]) -> None:
    for v, w in versions.items():
        with s.acquire(v) as got:
            assert all(same(got[k], w[k]) for k in w), f"version {v} differs"


def delta_file(
    tmp: Path, parent: dict[str, torch.Tensor], pv: int, new: dict[str, torch.Tensor]
) -> Path:
    """A delta upload as the client makes it."""
    stream = WeightsCopy.read(new).delta_stream(WeightsCopy.read(parent).published(pv))
    path = tmp / f"delta-{pv}-{len(list(tmp.iterdir()))}.safetensors"
    path.write_bytes(b"".join(stream.chunks()))
    return path


@pytest.mark.parametrize("seed", [1, 2])
def test_random_chains_bitwise_through_memory_and_restart(tmp_path: Path, seed: int) -> None:
    ws = trace(14, seed)
    root = tmp_path / "s"
    ups = tmp_path / "up"
    ups.mkdir()
    # A device budget of ~1.6 versions: most acquires rebuild; patches compete for memory.
    with open_store(root, device_budget_bytes=int(1.6 * SNAP)) as s:
        for v, w in enumerate(ws):
            if v and v % 2:
                out = s.publish_delta(v, delta_file(ups, ws[v - 1], v - 1, w))
            else:
                out = s.publish(v, w)
            assert out.created
        kinds = {r.version: (r.kind, r.parent) for r in s.versions()}
        assert kinds[0] == ("keyframe", None)
        assert {k for k, _ in kinds.values()} == {"keyframe", "patch"}
        for v, (kind, parent) in kinds.items():  # every 4th version of a chain is a keyframe
            if kind == "patch":
                assert parent == v - 1
                depth = 1
                while kinds[v - depth][0] == "patch":
                    depth += 1
                assert depth < 4
        order = list(range(14))
        random.Random(seed).shuffle(order)
        assert_all_served(s, {v: ws[v] for v in order})
        st = s.stats()
        assert st.rebuilds > 0 and st.patches_applied > 0
        assert st.tiers["device"].bytes <= int(1.6 * SNAP)
        assert st.tiers["device"].peak_bytes <= int(1.6 * SNAP) + SNAP
        stored = sum(r.stored_nbytes for r in s.versions())
        assert st.tiers["disk"].bytes == stored < 14 * SNAP
    with open_store(root) as s2:  # a restart rebuilds every chain, checking each hash once
        assert {r.version: (r.kind, r.parent) for r in s2.versions()} == kinds
        assert_all_served(s2, {v: ws[v] for v in reversed(range(14))})
        assert s2.stats().verified_loads >= 14


def test_keyframe_policy_chain_fraction(tmp_path: Path) -> None:
    dense = trace(8, 3, fractions=[0.4])  # patches of ~60 % of a keyframe each
    with open_store(tmp_path / "s", keyframe_every=100, keyframe_chain_fraction=1.0) as s:
        for v, w in enumerate(dense):
            s.publish(v, w)
        recs = s.versions()
        # Two patches would pass one keyframe's bytes: every other version is a keyframe.
        assert [r.kind for r in recs] == ["keyframe", "patch"] * 4
        assert_all_served(s, dict(enumerate(dense)))
    with open_store(tmp_path / "k", keyframe_every=1) as s:  # 1: no patches at all
        for v, w in enumerate(dense[:3]):
            s.publish_delta(v, delta_file(tmp_path, dense[v - 1], v - 1, w)) if v else s.publish(
                v, w
            )
        assert [r.kind for r in s.versions()] == ["keyframe"] * 3
        assert_all_served(s, dict(enumerate(dense[:3])))


def test_delta_is_checked_before_it_becomes_visible(tmp_path: Path) -> None:
    ws = trace(3, 4, fractions=[0.02])
    ups = tmp_path / "up"
    ups.mkdir()
    with open_store(tmp_path / "s") as s:
        s.publish(0, ws[0])
        s.publish(1, ws[1])
        files = set((tmp_path / "s" / "weights").iterdir())
        good = delta_file(ups, ws[1], 1, ws[2])
        wrong = "0" * 64
        with pytest.raises(WeightsMismatch, match="sha256") as info:
            s.publish_delta(2, good, expected_sha256=wrong)
        assert info.value.parameter == "sha256"
        # A corrupted patch: values tampered with, the metadata still claims the real hash.
        raw = bytearray(good.read_bytes())
        raw[-1] ^= 0x40
        bad = ups / "tampered.safetensors"
        bad.write_bytes(bytes(raw))
        with pytest.raises((WeightsMismatch, InvalidRequest)):
            s.publish_delta(2, bad)
        # A delta made against other weights than the service's version 1.
        other = delta_file(ups, ws[0], 1, ws[2])
        with pytest.raises(ParentMissing, match="parent") as pm:
            s.publish_delta(2, other)
        assert pm.value.parameter == "parent"
        for v in (2,):
            with pytest.raises(UnknownVersion):
                s.info(v)
        assert set((tmp_path / "s" / "weights").iterdir()) == files  # nothing left behind
        # Never published / not retained parents, and a parent= that contradicts the file.
        with pytest.raises(ParentMissing, match="parent 7"):
            s.publish_delta(8, delta_file(ups, ws[1], 7, ws[2]))
        with pytest.raises(InvalidRequest, match="parent") as ir:
            s.publish_delta(2, good, parent=0)
        assert ir.value.parameter == "parent"
        with pytest.raises(InvalidRequest, match="not an oldlogit delta"):
            plain = ups / "plain.safetensors"
            persist.write_keyframe(plain, {})
            s.publish_delta(2, plain)
        # The good one, then its idempotent retry, then a conflicting one.
        assert s.publish_delta(2, good).created
        assert not s.publish_delta(2, good).created
        with pytest.raises(VersionConflict):
            s.publish_delta(2, delta_file(ups, ws[1], 1, ws[0]))
        assert_all_served(s, dict(enumerate(ws)))


def test_corrupt_patch_file_loses_its_chain_only(tmp_path: Path) -> None:
    ws = trace(6, 5, fractions=[0.05])
    root = tmp_path / "s"
    with open_store(root) as s:
        for v, w in enumerate(ws):
            s.publish(v, w)
        kinds = ["keyframe", "patch", "patch", "patch", "keyframe", "patch"]
        assert [r.kind for r in s.versions()] == kinds
        victim = s.info(2).file
    path = root / "weights" / victim
    raw = bytearray(path.read_bytes())
    raw[-3] ^= 0x01  # one bit of disk rot in version 2's patch
    path.write_bytes(bytes(raw))
    with open_store(root) as s:
        with pytest.raises(VersionEvicted, match="verification"):
            with s.acquire(3):
                pass
        # 2 (the bad file) and 3 (rebuilt through it) are gone; the rest is intact.
        assert [r.version for r in s.versions()] == [0, 1, 4, 5]
        assert (root / "quarantine" / victim).exists()
        assert_all_served(s, {v: ws[v] for v in (0, 1, 4, 5)})


def test_deleting_what_a_chain_needs_rewrites_the_chain(tmp_path: Path) -> None:
    ws = trace(10, 6, fractions=[0.01, 0.05])
    root = tmp_path / "s"
    with open_store(root) as s:
        for v, w in enumerate(ws):
            s.publish(v, w)
        kinds = lambda: {r.version: (r.kind, r.parent) for r in s.versions()}  # noqa: E731
        assert kinds()[1] == ("patch", 0)
        s.delete(0)  # the keyframe of 1..3: 1 is re-keyframed
        assert kinds()[1] == ("keyframe", None) and kinds()[2] == ("patch", 1)
        s.delete(2)  # a patch in the middle: 3 is rebased onto 1
        assert kinds()[3] == ("patch", 1)
        lease = s.lease(5, "worker", 60)
        s.set_watermark(6)  # 1, 3, 4 go; 5 is leased and stays, 6.. need 4 (a keyframe)
        assert [r.version for r in s.versions()] == [5, 6, 7, 8, 9]
        assert kinds()[5] == ("keyframe", None) and kinds()[6] == ("patch", 5)
        s.release(lease.lease_id)  # 5 goes now: 6 becomes the keyframe
        assert kinds()[6] == ("keyframe", None)
        live = {v: ws[v] for v in (6, 7, 8, 9)}
        assert_all_served(s, live)
        on_disk = {p.name for p in (root / "weights").iterdir()}
        assert on_disk == {s.info(v).file for v in live}
    with open_store(root) as s2:
        assert_all_served(s2, live)


def test_max_versions_retention_keeps_chains_whole(tmp_path: Path) -> None:
    ws = trace(12, 7, fractions=[0.02])
    with open_store(tmp_path / "s", max_versions=4) as s:
        for v, w in enumerate(ws):
            s.publish(v, w)
            assert_all_served(s, {r.version: ws[r.version] for r in s.versions()})
        assert len(s.versions()) == 4


def test_memory_holds_keyframe_plus_patches(tmp_path: Path) -> None:
    ws = trace(4, 8, fractions=[0.02])
    with open_store(tmp_path / "s", device_budget_bytes=3 * SNAP) as s:
        for v, w in enumerate(ws):
            s.publish(v, w)
        assert_all_served(s, dict(enumerate(ws)))
        for v in (1, 2, 3):
            s.evict(v)
        assert_all_served(s, {0: ws[0], 3: ws[3]})  # decodes (and keeps) what was not kept
        s.evict(3)
        assert all(s.info(v).patch_cached for v in (1, 2, 3))
        before = s.stats()
        assert "device" not in s.info(3).tiers
        assert_all_served(s, {3: ws[3]})  # keyframe 0 + patches 1..3, all from memory
        after = s.stats()
        assert after.bytes_read == before.bytes_read  # nothing read from disk
        assert after.rebuilds == before.rebuilds + 1
        assert after.patches_applied == before.patches_applied + 3
        resident = sum(SNAP for r in s.versions() if "device" in r.tiers)
        assert after.patch_bytes > 0
        assert after.tiers["device"].bytes == resident + after.patch_bytes <= 3 * SNAP


def test_lru_weighs_rebuild_cost() -> None:
    cands = [
        MemoryCandidate(1, 10, last_used=5.0, tick=1, rebuild_cost=1.0),  # a keyframe copy
        MemoryCandidate(2, 10, last_used=5.0, tick=2, rebuild_cost=4.0),  # a long chain
        MemoryCandidate(3, 10, last_used=4.9, tick=3, rebuild_cost=4.0),  # older, but costly
        MemoryCandidate(4, 2, last_used=5.0, tick=4, rebuild_cost=0.1, part="patch"),
    ]
    order = memory_victim_parts(cands, resident=32, incoming=0, budget=0)
    assert [(c.version, c.part) for c in order] == [
        (4, "patch"),
        (1, "weights"),
        (3, "weights"),
        (2, "weights"),
    ]
    # Much older still goes first, whatever it costs.
    cands.append(MemoryCandidate(5, 10, last_used=1.0, tick=5, rebuild_cost=9.0))
    assert memory_victim_parts(cands, resident=42, incoming=0, budget=32)[0].version == 5


def test_host_tier_holds_patches_simulated_on_cpu(tmp_path: Path) -> None:
    # In front of a GPU the CPU copies (rebuild bases, decoded patches) live in the host tier;
    # its bookkeeping is device-independent, so enable it here (the gpu test runs the real one).
    ws = trace(7, 9, fractions=[0.02, 0.1])
    with open_store(tmp_path / "s", device_budget_bytes=SNAP) as s:
        s.residency.host_enabled = True
        s.residency.host_tier.budget = 3 * SNAP
        for v, w in enumerate(ws):
            s.publish(v, w)
        assert_all_served(s, {v: ws[v] for v in (6, 1, 5, 2, 0, 3, 4)})
        st = s.stats()
        dev, host = st.tiers["device"], st.tiers["host"]
        assert dev.bytes <= SNAP and host.bytes <= 3 * SNAP
        records = s.versions()
        assert dev.bytes == SNAP * sum("device" in r.tiers for r in records)
        # Host copies (rebuild bases) and decoded patches share the host tier.
        assert host.bytes == SNAP * sum("host" in r.tiers for r in records) + st.patch_bytes
        assert s.stats().rebuilds > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_chains_and_lagging_on_gpu(tmp_path: Path) -> None:
    ws = trace(9, 10, fractions=[0.0, 0.02, 1.0])
    with open_store(
        tmp_path / "s", device="cuda", device_budget_bytes=2 * SNAP, host_budget_bytes=3 * SNAP
    ) as s:
        for v, w in enumerate(ws):
            s.publish(v, w)
        for v in (8, 3, 0, 5, 1):
            with s.acquire(v) as got:
                assert all(got[k].device.type == "cuda" for k in got)
                assert all(same(got[k].cpu(), ws[v][k]) for k in ws[v]), v
        for v in range(9):
            with s.acquire_lagging(v) as got:
                assert all(same(got[k].cpu(), ws[v][k]) for k in ws[v]), v
        assert s.stats().lagging.patches_applied > 0
