"""Snapshot store: publish/acquire, version rules, checks before data, leases, watermark,
deletion, restart recovery, concurrency of loads."""

from __future__ import annotations

import errno
import json
import os
import struct
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from oldlogit.contract.errors import (
    Conflict,
    InvalidRequest,
    OutOfMemory,
    Overloaded,
    UnknownLease,
    UnknownVersion,
    VersionConflict,
    VersionEvicted,
    VersionNotIncreasing,
    WeightsMismatch,
)
from oldlogit.contract.weights import read_safetensors_header, weight_sha256
from oldlogit_service.snapshots import SnapshotStore, ingest, persist

SPECS: dict[str, tuple[str, tuple[int, ...]]] = {
    "embed.weight": ("BF16", (16, 8)),
    "layers.0.w": ("F32", (8, 8)),
    "layers.0.b": ("F32", (8,)),
    "odd": ("BF16", (3,)),  # odd byte count: the next tensor is misaligned in naive layouts
    "step": ("I64", ()),
}
SNAP = ingest.specs_nbytes(SPECS)


def make_sd(v: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + v)
    return {
        "embed.weight": torch.randn(16, 8, generator=g).bfloat16(),
        "layers.0.w": torch.randn(8, 8, generator=g),
        "layers.0.b": torch.randn(8, generator=g),
        "odd": torch.randn(3, generator=g).bfloat16(),
        "step": torch.tensor(v, dtype=torch.int64),
    }


class FakeClock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def open_store(root: Path, **kw: Any) -> SnapshotStore:
    args: dict[str, Any] = {
        "param_specs": SPECS,
        "device": "cpu",
        "device_budget_bytes": 4 * SNAP,
        "host_budget_bytes": 0,
        "disk_budget_bytes": 1000 * SNAP,
        "max_versions": 100,
    }
    args.update(kw)
    return SnapshotStore(root, **args)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[SnapshotStore]:
    s = open_store(tmp_path / "snap")
    yield s
    s.close()


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return bool(torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))


def assert_served(s: SnapshotStore, v: int) -> None:
    with s.acquire(v) as w:
        ref = make_sd(v)
        assert set(w) == set(ref)
        for k in ref:
            assert bits_equal(w[k], ref[k]), k
            assert w[k].device.type == "cpu"
        assert weight_sha256(dict(w)) == s.sha256(v) == weight_sha256(ref)


def weight_files(s: SnapshotStore) -> list[str]:
    return sorted(os.listdir(Path(s._root) / "weights"))


# -- publish / acquire ----------------------------------------------------------------------


def test_round_trip_bitwise(store: SnapshotStore) -> None:
    for v in (0, 3, 7):
        out = store.publish(v, make_sd(v))
        assert out.created and out.version == v and out.nbytes == SNAP
        assert out.sha256 == weight_sha256(make_sd(v))
    for v in (7, 0, 3, 0):
        assert_served(store, v)
    assert [r.version for r in store.versions()] == [0, 3, 7]
    assert store.newest == 7 and store.retained_range() == (0, 7)
    info = store.info(3)
    assert info.kind == "keyframe" and info.parent is None and "disk" in info.tiers


def test_publish_from_file_dir_and_move(store: SnapshotStore, tmp_path: Path) -> None:
    f = tmp_path / "v1.safetensors"
    save_file(make_sd(1), str(f))
    assert store.publish(1, f).created
    shards = tmp_path / "shards"
    shards.mkdir()
    sd = make_sd(2)
    save_file({k: sd[k] for k in ("embed.weight", "step")}, str(shards / "model-1.safetensors"))
    save_file(
        {k: sd[k] for k in ("layers.0.w", "layers.0.b", "odd")}, str(shards / "m-2.safetensors")
    )
    assert store.publish(2, shards).created
    up = store.staging_dir / "upload.part"
    save_file(make_sd(3), str(up))
    out = store.publish_file(3, up, expected_sha256=weight_sha256(make_sd(3)), move=True)
    assert out.created and not up.exists()
    assert f.exists() and len(list(shards.iterdir())) == 2  # copies leave sources alone
    for v in (1, 2, 3):
        assert_served(store, v)


def test_republish_is_idempotent_or_conflict(store: SnapshotStore, tmp_path: Path) -> None:
    first = store.publish(4, make_sd(4))
    files = weight_files(store)
    again = store.publish(4, make_sd(4))
    assert not again.created and again.sha256 == first.sha256
    f = tmp_path / "v4.safetensors"
    save_file(make_sd(4), str(f))
    assert not store.publish_file(4, f, move=True).created
    assert f.exists()  # an idempotent re-publish consumes nothing
    assert weight_files(store) == files
    with pytest.raises(VersionConflict) as ei:
        store.publish(4, make_sd(5))
    assert ei.value.parameter == "policy_version"
    assert weight_files(store) == files
    assert_served(store, 4)


def test_versions_must_increase(store: SnapshotStore) -> None:
    store.publish(5, make_sd(5))
    for bad in (3, 0):
        with pytest.raises(VersionNotIncreasing):
            store.publish(bad, make_sd(bad))
    store.publish(6, make_sd(6))
    store.delete(6)
    with pytest.raises(VersionNotIncreasing):  # deleted versions still count
        store.publish(6, make_sd(6))
    for bad_version in (-1, True, 1.5, "7"):
        with pytest.raises(InvalidRequest) as ei:
            store.publish(bad_version, make_sd(0))  # type: ignore[arg-type]
        assert ei.value.parameter == "policy_version"
    store.publish(8, make_sd(8))


@pytest.mark.parametrize(
    ("mutate", "tensor"),
    [
        (lambda sd: sd.update({"layers.0.b": torch.zeros(9)}), "layers.0.b"),  # shape
        (lambda sd: sd.update({"embed.weight": sd["embed.weight"].float()}), "embed.weight"),
        (lambda sd: sd.pop("odd"), "odd"),  # missing
        (lambda sd: sd.update({"extra": torch.zeros(1)}), "extra"),  # unexpected
    ],
)
def test_state_dict_mismatch_refused(
    store: SnapshotStore, mutate: Callable[[dict[str, torch.Tensor]], object], tensor: str
) -> None:
    sd = make_sd(0)
    mutate(sd)
    with pytest.raises(WeightsMismatch) as ei:
        store.publish(0, sd)
    assert ei.value.parameter == "weights"
    assert ei.value.details["tensor"] == tensor and tensor in ei.value.message
    assert weight_files(store) == [] and store.versions() == [] and store.newest is None


def test_cast_option(store: SnapshotStore) -> None:
    sd = make_sd(0)
    sd["embed.weight"] = sd["embed.weight"].float()  # exactly representable in bf16
    out = store.publish(0, sd, cast=True)
    assert out.sha256 == weight_sha256(make_sd(0))


def _forged_file(path: Path, shape: list[int]) -> Path:
    """A file whose header says layers.0.b has ``shape``; the rest is consistent."""
    save_file(make_sd(0), str(path))
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8 : 8 + n])
    data = raw[8 + n :]
    header["layers.0.b"]["shape"] = shape
    hj = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(hj)) + hj + data)
    return path


def test_file_mismatch_refused_before_reading_data(
    store: SnapshotStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    f = _forged_file(tmp_path / "bad.safetensors", [2, 4])  # same bytes, wrong shape

    def no_data_reads(*a: object, **k: object) -> Any:
        raise AssertionError("tensor data was read before the header check")

    monkeypatch.setattr(ingest, "read_entry_chunks", no_data_reads)
    monkeypatch.setattr(persist, "write_keyframe", no_data_reads)
    for move in (False, True):
        with pytest.raises(WeightsMismatch) as ei:
            store.publish_file(0, f, move=move)
        assert ei.value.details["tensor"] == "layers.0.b" and "[2, 4]" in ei.value.message
    assert f.exists() and weight_files(store) == [] and store.versions() == []


def test_expected_sha_mismatch_leaves_nothing(store: SnapshotStore, tmp_path: Path) -> None:
    wrong = "0" * 64
    with pytest.raises(WeightsMismatch) as ei:
        store.publish(0, make_sd(0), expected_sha256=wrong)
    assert ei.value.parameter == "sha256"
    up = store.staging_dir / "u.part"
    save_file(make_sd(0), str(up))
    with pytest.raises(WeightsMismatch):
        store.publish_file(0, up, expected_sha256=wrong, move=True)
    assert up.exists()  # left for the caller to clean up
    assert weight_files(store) == [] and store.versions() == [] and store.newest is None
    with pytest.raises(UnknownVersion):
        store.sha256(0)
    with pytest.raises(InvalidRequest):
        store.publish(0, make_sd(0), expected_sha256="xyz")
    # The version was not burned: the right weights publish under it.
    good = weight_sha256(make_sd(0))
    assert store.publish(0, make_sd(0), expected_sha256=good.upper()).created


# -- leases, watermark, delete --------------------------------------------------------------


def test_leases(tmp_path: Path) -> None:
    clock = FakeClock()
    with open_store(tmp_path / "s", clock=clock) as s:
        s.publish(0, make_sd(0))
        with pytest.raises(UnknownVersion):
            s.lease(9, "w", 10)
        with pytest.raises(InvalidRequest) as ei:
            s.lease(0, "w", 0)
        assert ei.value.parameter == "ttl_s"
        rec = s.lease(0, "worker-1", 10)
        assert rec.version == 0 and rec.expires_at == clock.t + 10
        assert s.info(0).leases == 1
        clock.t += 9
        s.sweep()  # not expired yet
        assert s.info(0).leases == 1
        clock.t += 2
        assert s.info(0).leases == 1  # reads have no side effects: expiry is the sweep's
        s.sweep()
        assert s.info(0).leases == 0
        with pytest.raises(UnknownLease) as el:
            s.release(rec.lease_id)
        assert el.value.parameter == "lease_id"
        rec3 = s.lease(0, "w", 5)
        assert s.release(rec3.lease_id).lease_id == rec3.lease_id
        with pytest.raises(UnknownLease):
            s.release(rec3.lease_id)


def test_watermark_and_leases(tmp_path: Path) -> None:
    clock = FakeClock()
    with open_store(tmp_path / "s", clock=clock) as s:
        for v in range(5):
            s.publish(v, make_sd(v))
        lease = s.lease(1, "rollout", 30)
        assert s.set_watermark(3) == 3
        assert [r.version for r in s.versions()] == [1, 3, 4]  # 1 is leased
        assert_served(s, 1)  # still retained, still served
        with pytest.raises(VersionEvicted) as ei:
            s.info(2)
        assert ei.value.details == {"retained": [1, 4]} and ei.value.parameter == "policy_version"
        s.release(lease.lease_id)
        assert [r.version for r in s.versions()] == [3, 4]
        with pytest.raises(InvalidRequest):
            s.set_watermark(2)  # monotonic
        assert s.set_watermark(3) == 3  # equal: a no-op
        s.lease(3, "rollout", 5)
        s.set_watermark(4)
        clock.t += 6  # the lease expires: its version goes on the next sweep
        assert [r.version for r in s.versions()] == [3, 4]  # a read changes nothing
        s.sweep()
        assert [r.version for r in s.versions()] == [4]
        with pytest.raises(VersionEvicted) as ei, s.acquire(3):
            pass
        assert ei.value.details == {"retained": [4, 4]}
        s.set_watermark(10)  # above everything: the trainer needs none of it
        assert s.versions() == [] and s.retained_range() is None
        with pytest.raises(InvalidRequest):
            s.publish(6, make_sd(6))  # above the newest, but below the watermark
        assert s.publish(10, make_sd(10)).created


def test_delete(store: SnapshotStore) -> None:
    for v in range(3):
        store.publish(v, make_sd(v))
    lease = store.lease(1, "w", 60)
    with pytest.raises(Conflict):
        store.delete(1)
    store.release(lease.lease_id)
    assert store.delete(1) is True
    assert store.delete(1) is False
    with pytest.raises(UnknownVersion):
        store.delete(7)
    with pytest.raises(VersionEvicted):
        store.sha256(1)
    assert len(weight_files(store)) == 2
    # A version in use can be deleted; the running request finishes with its weights.
    with store.acquire(2) as w:
        store.delete(2)
        assert bits_equal(w["layers.0.w"], make_sd(2)["layers.0.w"])
    assert store.stats().tiers["device"].bytes == 0  # its memory went with the pin
    with pytest.raises(VersionEvicted):
        store.info(2)


# -- memory tiers ---------------------------------------------------------------------------


def _resident(s: SnapshotStore) -> list[int]:
    return [r.version for r in s.versions() if "device" in r.tiers]


def test_device_lru_and_transparent_reload(tmp_path: Path) -> None:
    with open_store(tmp_path / "s", device_budget_bytes=2 * SNAP) as s:
        for v in range(4):
            s.publish(v, make_sd(v))
        assert _resident(s) == []  # lazily loaded
        for v in (0, 1, 2):
            assert_served(s, v)
        assert _resident(s) == [1, 2]
        assert_served(s, 1)
        assert_served(s, 3)  # evicts 2, the least recently used
        assert _resident(s) == [1, 3]
        assert_served(s, 0)  # evicted from memory earlier: reloaded from disk
        st = s.stats()
        assert st.tiers["device"].evictions == 3 and st.loads_disk == 5
        assert st.tiers["device"].peak_bytes <= 3 * SNAP


def test_pinned_overflow_is_bounded(tmp_path: Path) -> None:
    with open_store(tmp_path / "s", device_budget_bytes=SNAP, admission_timeout_s=0.2) as s:
        for v in range(3):
            s.publish(v, make_sd(v))
        with s.acquire(0), s.acquire(1):  # budget + one: allowed
            assert s.stats().tiers["device"].bytes == 2 * SNAP
            with pytest.raises(Overloaded), s.acquire(2):  # budget + two would break the bound
                pass
        assert s.stats().tiers["device"].bytes <= SNAP  # eviction caught up
        assert_served(s, 2)


def test_concurrent_cold_acquires_load_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []
    gate = threading.Event()
    real = persist.read_keyframe

    def slow_read(*a: Any, **k: Any) -> Any:
        calls.append(1)
        gate.wait(5)
        return real(*a, **k)

    with open_store(tmp_path / "s") as s:
        s.publish(0, make_sd(0))
        s.publish(1, make_sd(1))
        assert_served(s, 0)
        monkeypatch.setattr(persist, "read_keyframe", slow_read)
        errors: list[BaseException] = []

        def worker() -> None:
            try:
                assert_served(s, 1)
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=worker) for _ in range(6)]
        for t in threads:
            t.start()
        while not calls:
            time.sleep(0.01)
        # While version 1 is being read, the resident version 0 is still served.
        t0 = time.monotonic()
        with s.acquire(0) as w:
            assert bits_equal(w["step"], torch.tensor(0))
        assert time.monotonic() - t0 < 1.0
        gate.set()
        for t in threads:
            t.join(10)
        assert not errors and len(calls) == 1
        assert s.stats().loads_disk == 2


# -- restart --------------------------------------------------------------------------------


def test_restart_recovers_everything(tmp_path: Path) -> None:
    root = tmp_path / "s"
    clock = FakeClock()
    with open_store(root, clock=clock) as s:
        hashes = {v: s.publish(v, make_sd(v)).sha256 for v in range(6)}
        lease = s.lease(1, "w", 100)
        s.set_watermark(3)
        s.delete(4)
        with pytest.raises(Conflict):  # one open store per directory
            open_store(root)
    with open_store(root, clock=clock) as s:
        assert [r.version for r in s.versions()] == [1, 3, 5]
        for v in (1, 3, 5):
            assert s.sha256(v) == hashes[v]
            assert_served(s, v)
        assert s.stats().verified_loads == 3  # first loads after restart are hash-checked
        assert s.watermark == 3 and s.newest == 5
        for gone in (0, 2, 4):
            with pytest.raises(VersionEvicted):
                s.info(gone)
        assert [r.lease_id for r in s.leases()] == [lease.lease_id]
        with pytest.raises(VersionConflict):
            s.publish(5, make_sd(6))
        assert not s.publish(5, make_sd(5)).created
        with pytest.raises(VersionNotIncreasing):
            s.publish(4, make_sd(4))
        s.release(lease.lease_id)
        assert [r.version for r in s.versions()] == [3, 5]


def test_restart_clears_orphans_and_quarantines_corruption(tmp_path: Path) -> None:
    root = tmp_path / "s"
    with open_store(root) as s:
        s.publish(0, make_sd(0))
        s.publish(1, make_sd(1))
        files = weight_files(s)
    (root / "weights" / ".tmp-123.safetensors").write_bytes(b"partial")
    save_file(make_sd(9), str(root / "weights" / "v000000000009.abc.safetensors"))
    (root / ".tmp-registry.json-1").write_bytes(b"{")
    (root / "incoming").mkdir()
    (root / "incoming" / "upload.part").write_bytes(b"x")
    # Flip one data byte of version 1 (its header stays valid).
    victim = next(f for f in files if f.startswith("v000000000001"))
    p = root / "weights" / victim
    raw = bytearray(p.read_bytes())
    raw[-1] ^= 0xFF
    p.write_bytes(bytes(raw))
    with open_store(root) as s:
        assert weight_files(s) == files
        assert not list((root / "incoming").iterdir())
        assert not [x for x in os.listdir(root) if x.startswith(".tmp-")]
        assert_served(s, 0)
        with pytest.raises(VersionEvicted), s.acquire(1):
            pass
        assert (root / "quarantine" / victim).exists()
        assert [r.version for r in s.versions()] == [0]
    with open_store(root) as s, pytest.raises(VersionEvicted):  # the loss is durable
        s.info(1)


def test_other_model_refused(tmp_path: Path) -> None:
    root = tmp_path / "s"
    with open_store(root) as s:
        s.publish(0, make_sd(0))
    other = dict(SPECS)
    other["layers.0.b"] = ("F32", (9,))
    with pytest.raises(WeightsMismatch) as ei:
        open_store(root, param_specs=other)
    assert ei.value.parameter == "snapshot_dir"
    with open_store(root) as s:  # the refused open left the lock free
        assert_served(s, 0)


def test_crash_between_file_and_registry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "s"
    s = open_store(root)
    s.publish(0, make_sd(0))

    def crash(*a: object, **k: object) -> None:
        raise OSError(5, "simulated crash before the registry write")

    monkeypatch.setattr(persist, "write_registry", crash)
    with pytest.raises(OSError):
        s.publish(1, make_sd(1))
    assert [r.version for r in s.versions()] == [0] and s.newest == 0
    monkeypatch.undo()
    s.close()
    # A real crash leaves the renamed file behind: recovery removes it, nothing is visible.
    save_file(make_sd(1), str(root / "weights" / "v000000000001.deadbeef0000.safetensors"))
    with open_store(root) as s2:
        assert [r.version for r in s2.versions()] == [0]
        assert len(weight_files(s2)) == 1
        assert s2.publish(1, make_sd(1)).created


def _name_ordered_file(path: Path, sd: dict[str, torch.Tensor]) -> Path:
    """A safetensors file laid out in name order, as a streaming client may write it."""
    header: dict[str, Any] = {}
    chunks: list[bytes] = []
    offset = 0
    for name in sorted(sd):
        t = sd[name].contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes()
        dtype = {torch.bfloat16: "BF16", torch.float32: "F32", torch.int64: "I64"}[t.dtype]
        header[name] = {
            "dtype": dtype,
            "shape": list(t.shape),
            "data_offsets": [offset, offset + len(raw)],
        }
        chunks.append(raw)
        offset += len(raw)
    hj = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(hj)) + hj + b"".join(chunks))
    return path


def test_misaligned_upload_is_rewritten_aligned(store: SnapshotStore) -> None:
    up = _name_ordered_file(store.staging_dir / "u.part", make_sd(0))
    header = read_safetensors_header(up)
    assert not persist.aligned(header)  # "step" (I64) follows the 6-byte "odd"
    buf, _ = persist.read_keyframe(up, pin=False, expect_sha256=weight_sha256(make_sd(0)))
    views = persist.tensor_views(buf, header.tensors.values())  # the copy fallback
    assert all(bits_equal(views[k], v) for k, v in make_sd(0).items())
    assert store.publish_file(0, up, move=True).created
    assert up.exists()  # rewritten, not moved: the caller removes its upload
    (stored,) = weight_files(store)
    assert persist.aligned(read_safetensors_header(Path(store._root) / "weights" / stored))
    assert_served(store, 0)


def _host_tier_flow(s: SnapshotStore, device_type: str) -> None:
    for v in range(4):
        s.publish(v, make_sd(v))

    def tiers(v: int) -> set[str]:
        return set(s.info(v).tiers)

    def served(v: int) -> None:
        with s.acquire(v) as w:
            ref = make_sd(v)
            for k in ref:
                assert w[k].device.type == device_type
                assert bits_equal(w[k].cpu(), ref[k]), k

    served(0)
    assert tiers(0) == {"device", "host", "disk"}
    served(1)  # device budget: one version; host budget: two
    assert tiers(0) == {"host", "disk"} and tiers(1) == {"device", "host", "disk"}
    served(0)  # back from the host tier, no disk read
    st = s.stats()
    assert (st.loads_disk, st.loads_host) == (2, 1)
    served(2)  # the host tier evicts its least recently used copy (1)
    assert tiers(1) == {"disk"} and tiers(0) == {"host", "disk"}
    st = s.stats()
    assert st.tiers["host"].bytes <= 2 * SNAP and st.tiers["host"].evictions == 1
    assert st.tiers["device"].peak_bytes <= 2 * SNAP


def test_host_tier_logic_simulated_on_cpu(tmp_path: Path) -> None:
    # The host tier exists in front of a GPU only; its bookkeeping is the same on any device,
    # so enable it here to test it where no GPU is (the gpu test below runs the real thing).
    with open_store(tmp_path / "s", device_budget_bytes=SNAP) as s:
        s.residency.host_enabled = True
        s.residency.host_tier.budget = 2 * SNAP
        _host_tier_flow(s, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_host_tier_on_gpu(tmp_path: Path) -> None:
    with open_store(
        tmp_path / "s", device="cuda", device_budget_bytes=SNAP, host_budget_bytes=2 * SNAP
    ) as s:
        _host_tier_flow(s, "cuda")
        host = s.residency.cpu_copy(0)  # the host tier's copy of version 0
        assert host is not None and host.buffer is not None
        assert host.buffer.is_pinned()


@pytest.mark.parametrize("same", [True, False])
def test_racing_publishes_of_one_version(store: SnapshotStore, same: bool) -> None:
    results: list[object] = []
    barrier = threading.Barrier(4)

    def go(i: int) -> None:
        barrier.wait()
        try:
            results.append(store.publish(1, make_sd(1 if same or i == 0 else 100 + i)))
        except VersionConflict as exc:
            results.append(exc)

    threads = [threading.Thread(target=go, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    created = [r for r in results if getattr(r, "created", False)]
    assert len(created) == 1 and len(results) == 4
    if same:
        assert all(getattr(r, "sha256", None) == created[0].sha256 for r in results)  # type: ignore[attr-defined]
    else:
        assert sum(isinstance(r, VersionConflict) for r in results) == 3
    assert len(weight_files(store)) == 1  # the losers left no file behind
    winner = store.sha256(1)
    with store.acquire(1) as w:
        assert weight_sha256(dict(w)) == winner


def test_full_disk_is_out_of_memory(store: SnapshotStore, monkeypatch: pytest.MonkeyPatch) -> None:
    def full(*a: object, **k: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(persist, "_pwrite_all", full)
    with pytest.raises(OutOfMemory) as ei:
        store.publish(0, make_sd(0))
    assert ei.value.parameter == "weights"
    monkeypatch.undo()
    assert weight_files(store) == [] and store.newest is None
    assert store.publish(0, make_sd(0)).created


def test_every_error_names_its_parameter(store: SnapshotStore, tmp_path: Path) -> None:
    store.publish(2, make_sd(2))
    lease = store.lease(2, "w", 60)
    bad_file = _forged_file(tmp_path / "bad.safetensors", [2, 4])
    calls: list[Callable[[], object]] = [
        lambda: store.publish(1, make_sd(1)),  # not increasing
        lambda: store.publish(2, make_sd(3)),  # conflict
        lambda: store.publish(3, make_sd(3), expected_sha256="0" * 64),
        lambda: store.publish(3, {**make_sd(3), "layers.0.b": torch.zeros(2)}),
        lambda: store.publish_file(3, bad_file),
        lambda: store.publish_file(3, tmp_path / "missing.safetensors"),
        lambda: store.info(99),
        lambda: store.lease(2, "w", -1),
        lambda: store.release("nope"),
        lambda: store.delete(2),  # leased
        lambda: store.set_watermark(-3),
    ]
    for call in calls:
        with pytest.raises(Exception) as ei:
            call()
        err = ei.value
        assert getattr(err, "parameter", None), repr(err)
        assert err.parameter in err.message, (err.parameter, err.message)  # type: ignore[attr-defined]
    store.release(lease.lease_id)
