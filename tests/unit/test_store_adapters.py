"""Adapter versions in the snapshot store: hash, refusals by name, base pinning, retention,
restart; and the contract's config and checks."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from oldlogit.contract.adapters import (
    ADAPTER_CONFIG_KEY,
    AdapterConfig,
    check_adapter_tensors,
    peft_tensor_name,
)
from oldlogit.contract.errors import (
    Conflict,
    InvalidRequest,
    UnknownVersion,
    VersionConflict,
    VersionEvicted,
    WeightsMismatch,
)
from oldlogit.contract.weights import adapter_sha256, weight_sha256
from oldlogit.publishing.adapters import AdapterUpload
from oldlogit_service.snapshots import SnapshotStore

SPECS: dict[str, tuple[str, tuple[int, ...]]] = {
    "model.embed.weight": ("F32", (16, 8)),
    "model.layers.0.q_proj.weight": ("F32", (12, 8)),
    "model.layers.0.v_proj.weight": ("F32", (4, 8)),
}
MODULES = ("model.layers.0.q_proj", "model.layers.0.v_proj")
CONFIG = AdapterConfig(2, 16.0, False, MODULES, "float32")


def make_sd(v: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(v)
    return {n: torch.randn(shape, generator=g) for n, (_, shape) in SPECS.items()}


def make_lora(seed: int, rank: int = 2) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + seed)
    out = {}
    for m, n_out in (("model.layers.0.q_proj", 12), ("model.layers.0.v_proj", 4)):
        out[f"{m}.lora_A"] = torch.randn(rank, 8, generator=g)
        out[f"{m}.lora_B"] = torch.randn(n_out, rank, generator=g)
    return out


def adapter_file(tmp: Path, tensors: dict[str, torch.Tensor], config: AdapterConfig) -> Path:
    path = tmp / f"adapter-{len(list(tmp.iterdir()))}.safetensors"
    save_file(tensors, str(path), metadata={ADAPTER_CONFIG_KEY: config.to_json()})
    return path


def open_store(root: Path, **kw: object) -> SnapshotStore:
    args: dict[str, object] = dict(
        param_specs=SPECS,
        device="cpu",
        device_budget_bytes=1 << 30,
        host_budget_bytes=0,
        disk_budget_bytes=1 << 30,
        max_versions=100,
    )
    args.update(kw)
    return SnapshotStore(root, **args)  # type: ignore[arg-type]


@pytest.fixture
def files(tmp_path: Path) -> Path:
    d = tmp_path / "files"
    d.mkdir()
    return d


def test_config_is_canonical_and_checks_name_the_tensor() -> None:
    a = AdapterConfig(2, 16, False, list(reversed(MODULES)), "F32")  # type: ignore[arg-type]
    assert a == CONFIG and a.to_json() == CONFIG.to_json()
    assert json.loads(a.to_json())["dtype"] == "float32" and a.scaling == 8.0
    assert AdapterConfig(4, 8.0, True, MODULES, "torch.float32").scaling == 4.0
    assert AdapterConfig.from_json(a.to_json()) == a
    table = {n: ("F32", tuple(t.shape)) for n, t in make_lora(0).items()}
    assert check_adapter_tensors(CONFIG, table, SPECS) == [
        "model.layers.0.q_proj",
        "model.layers.0.v_proj",
    ]
    with pytest.raises(WeightsMismatch, match="rank 3"):
        rank3 = {n: ("F32", tuple(t.shape)) for n, t in make_lora(0, rank=3).items()}
        check_adapter_tensors(CONFIG, rank3, SPECS)
    with pytest.raises(WeightsMismatch, match="is BF16"):
        check_adapter_tensors(CONFIG, {n: ("BF16", s) for n, (_, s) in table.items()}, SPECS)
    bad = dict(table, **{"model.layers.0.q_proj.lora_B": ("F32", (5, 2))})
    with pytest.raises(WeightsMismatch, match=r"\[12, 8\]"):
        check_adapter_tensors(CONFIG, bad, SPECS)
    elsewhere = {
        "model.x.q_proj.lora_A": ("F32", (2, 8)),
        "model.x.q_proj.lora_B": ("F32", (12, 2)),
    }
    with pytest.raises(WeightsMismatch, match="no tensors for"):
        check_adapter_tensors(CONFIG, elsewhere, SPECS)
    x_proj = AdapterConfig(2, 16.0, False, ("model.x.q_proj",), "float32")
    with pytest.raises(WeightsMismatch, match="no weight of"):
        check_adapter_tensors(x_proj, elsewhere, SPECS)
    assert peft_tensor_name("base_model.model.model.layers.0.q_proj.lora_A.weight") == (
        "model.layers.0.q_proj.lora_A"
    )
    with pytest.raises(WeightsMismatch, match="not a LoRA"):
        peft_tensor_name("base_model.model.lm_head.weight")
    with pytest.raises(InvalidRequest, match="DoRA"):
        AdapterConfig.from_peft({"r": 2, "lora_alpha": 4, "use_dora": True}, table)


def test_hash_covers_config_base_and_tensors(files: Path) -> None:
    lora = make_lora(0)
    base = weight_sha256(make_sd(0))
    h = adapter_sha256(CONFIG.to_json(), base, lora)
    assert h != adapter_sha256(CONFIG.to_json(), weight_sha256(make_sd(1)), lora)
    other = AdapterConfig(2, 8.0, False, MODULES, "F32")
    assert h != adapter_sha256(other.to_json(), base, lora)
    assert h != adapter_sha256(CONFIG.to_json(), base, make_lora(1))
    # The client's torch-free hash of a PEFT directory equals the contract's.
    peft = files / "peft"
    peft.mkdir()
    save_file(
        {f"base_model.model.{k.replace('.lora_', '.lora_')}.weight": v for k, v in lora.items()},
        str(peft / "adapter_model.safetensors"),
    )
    (peft / "adapter_config.json").write_text(
        json.dumps(
            {
                "r": 2,
                "lora_alpha": 16,
                "target_modules": ["q_proj", "v_proj"],
                "peft_type": "LORA",
                "bias": "none",
            }
        )
    )
    up = AdapterUpload.from_directory(peft)
    assert up.config == CONFIG and up.sha256(base) == h
    arrays = {k: v.numpy() for k, v in lora.items()}
    assert AdapterUpload.from_tensors(CONFIG, arrays).sha256(base) == h


def test_publish_refusals_pinning_retention_and_restart(tmp_path: Path, files: Path) -> None:
    root = tmp_path / "snap"
    store = open_store(root)
    store.publish(0, make_sd(0))
    lora = make_lora(0)
    path = adapter_file(files, lora, CONFIG)
    expected = adapter_sha256(CONFIG.to_json(), store.sha256(0), lora)
    out = store.publish_adapter(1, path, base_version=0, expected_sha256=expected)
    assert (out.created, out.kind, out.sha256) == (True, "adapter", expected)
    again = store.publish_adapter(1, path, base_version=0)
    assert again.created is False and again.sha256 == expected
    with pytest.raises(VersionConflict):
        store.publish_adapter(1, adapter_file(files, make_lora(1), CONFIG), base_version=0)
    rec = store.info(1)
    assert (rec.kind, rec.base, rec.parent) == ("adapter", 0, None)
    assert 0 < rec.stored_nbytes < store.snapshot_nbytes
    with store.adapter(1) as got:
        assert got.base == 0 and got.config == CONFIG
        assert all(torch.equal(got.tensors[k], v) for k, v in lora.items())

    # Refusals, by name.
    with pytest.raises(UnknownVersion) as unknown:
        store.publish_adapter(2, path, base_version=7)
    assert unknown.value.parameter == "base_version"
    with pytest.raises(InvalidRequest, match="itself an adapter"):
        store.publish_adapter(2, path, base_version=1)
    with pytest.raises(WeightsMismatch, match="rank 3"):
        store.publish_adapter(2, adapter_file(files, make_lora(0, rank=3), CONFIG), base_version=0)
    with pytest.raises(WeightsMismatch, match="sha256"):
        store.publish_adapter(2, path, base_version=0, expected_sha256="0" * 64)
    with pytest.raises(InvalidRequest, match="adapter version"):
        with store.acquire(1):
            pass

    # The base is pinned: not deletable, not retired by the watermark, while the adapter stays.
    with pytest.raises(Conflict, match=r"base of adapter version\(s\) \[1\]"):
        store.delete(0)
    store.publish(2, make_sd(2))
    store.publish_adapter(3, adapter_file(files, make_lora(3), CONFIG), base_version=2)
    store.set_watermark(1)
    assert [r.version for r in store.versions()] == [0, 1, 2, 3]
    store.close()

    # A restart serves the adapter again, bytes checked.
    store = open_store(root)
    assert store.adapter_base(3) == 2 and store.info(1).kind == "adapter"
    with store.adapter(1) as got:
        assert all(torch.equal(got.tensors[k], v) for k, v in lora.items())
    store.set_watermark(2)  # adapter 1 goes, then its base 0 with it
    assert [r.version for r in store.versions()] == [2, 3]
    with pytest.raises(VersionEvicted), store.adapter(1):
        pass
    store.delete(3)
    store.delete(2)  # no adapter over it any more
    store.close()


def test_max_versions_counts_adapters_and_keeps_their_base(tmp_path: Path, files: Path) -> None:
    store = open_store(tmp_path / "snap", max_versions=3)
    store.publish(0, make_sd(0))
    for v in (1, 2, 3):
        store.publish_adapter(v, adapter_file(files, make_lora(v), CONFIG), base_version=0)
    # Four versions over max_versions=3: the least recently used adapter goes, never the base.
    kept = [r.version for r in store.versions()]
    assert len(kept) == 3 and 0 in kept
    assert np.all(np.diff(kept) > 0)
    store.close()


def test_scale_out_refuses_adapters_by_name(tmp_path: Path, files: Path) -> None:
    store = open_store(tmp_path / "snap", claim=lambda *a: True)
    store.publish(0, make_sd(0))
    with pytest.raises(InvalidRequest, match="scale-out"):
        store.publish_adapter(1, adapter_file(files, make_lora(0), CONFIG), base_version=0)
    store.close()


def test_a_lost_base_or_a_corrupt_adapter_file_retires_the_adapter(
    tmp_path: Path, files: Path
) -> None:
    root = tmp_path / "snap"
    store = open_store(root)
    store.publish(0, make_sd(0))
    store.publish_adapter(1, adapter_file(files, make_lora(1), CONFIG), base_version=0)
    store.publish(2, make_sd(2))
    store.publish_adapter(3, adapter_file(files, make_lora(3), CONFIG), base_version=2)
    base_file, adapter3 = store.info(0).file, store.info(3).file
    store.close()
    (root / "weights" / base_file).unlink()  # the base's file is gone: its adapter goes too
    raw = bytearray((root / "weights" / adapter3).read_bytes())
    raw[-1] ^= 0xFF  # a flipped bit in adapter 3's data: found when read, quarantined
    (root / "weights" / adapter3).write_bytes(bytes(raw))
    store = open_store(root)
    assert [r.version for r in store.versions()] == [2, 3]
    for v in (0, 1):
        with pytest.raises(VersionEvicted):
            store.info(v)
    with pytest.raises(VersionEvicted, match="failed verification"), store.adapter(3):
        pass
    assert [r.version for r in store.versions()] == [2]
    store.delete(2)  # its adapter is gone: deletable
    store.close()


def test_adapters_in_the_memory_tiers_budget_lru_pins_and_leases(
    tmp_path: Path, files: Path
) -> None:
    """An adapter's tensors sit in the device tier (process memory on CPU) under its byte
    budget: counted, evicted LRU among unpinned copies, never while pinned; the base pinned
    apart; the same bytes after every reload."""
    now = [0.0]

    def clock() -> float:  # 100 s between uses: the LRU order is the use order, by construction
        now[0] += 100.0
        return now[0]

    base_nbytes = sum(4 * int(np.prod(shape)) for _, shape in SPECS.values())
    loras = {v: make_lora(v) for v in (1, 2, 3, 4)}
    a_nbytes = sum(t.numel() * 4 for t in loras[1].values())
    # The base and three adapters fit; a fourth does not.
    store = open_store(
        tmp_path / "snap", device_budget_bytes=base_nbytes + 3 * a_nbytes, clock=clock
    )
    store.publish(0, make_sd(0))
    for v, lora in loras.items():
        store.publish_adapter(v, adapter_file(files, lora, CONFIG), base_version=0)
    assert store.info(1).nbytes == a_nbytes and store.info(1).tiers == {"disk"}

    def device() -> tuple[int, int]:
        t = store.stats().tiers["device"]
        return t.bytes, t.evictions

    def resident() -> set[int]:
        return {r.version for r in store.versions() if "device" in r.tiers}

    def use(v: int) -> None:
        with store.adapter(v) as got:
            assert got.config == CONFIG
            assert all(torch.equal(got.tensors[k], t) for k, t in loras[v].items())

    store.hold(0)  # the base pinned: the adapters compete among themselves
    for v in (1, 2, 3):
        use(v)
    assert resident() == {0, 1, 2, 3} and device() == (base_nbytes + 3 * a_nbytes, 0)
    use(1)  # LRU order now 2, 3, 1
    use(4)  # the least recently used adapter (2) goes
    assert resident() == {0, 1, 3, 4} and device() == (base_nbytes + 3 * a_nbytes, 1)
    with store.adapter(3):  # pinned while in use: 3 is the LRU one, yet 1 goes
        use(4)
        use(2)
        assert resident() == {0, 2, 3, 4}
    assert device() == (base_nbytes + 3 * a_nbytes, 2)
    store.unhold(0)

    # A resident adapter whose base left memory: the base loads again, the adapter is served.
    assert store.evict(0) and resident() == {2, 3, 4}
    with store.acquire(0), store.adapter(3) as got:
        assert all(torch.equal(got.tensors[k], t) for k, t in loras[3].items())
    assert 0 in resident()

    # A leased adapter stays on disk below the watermark; the others go (and leave memory).
    lease = store.lease(3, "trainer", 60.0)
    store.set_watermark(4)
    assert [r.version for r in store.versions()] == [0, 3, 4]
    assert resident() <= {0, 3, 4}
    use(3)
    store.release(lease.lease_id)
    assert [r.version for r in store.versions()] == [0, 4]
    assert device()[0] == sum(
        r.nbytes for r in store.versions() if "device" in r.tiers
    )  # the tier's bytes are the resident copies'
    store.close()


class _Ranks:
    """What ``FrontStore`` asks of ``ranks.front.Front``, without rank processes: every part
    placed at once."""

    def __init__(self) -> None:
        self.held: set[int] = set()

    def place(self, version: int, weights: object) -> list[str]:
        self.held.add(version)
        return ["0" * 64]

    def versions(self) -> set[int]:
        return set(self.held)

    def retain(self, keep: set[int]) -> None:
        self.held &= keep


def test_tensor_parallel_refuses_adapters_and_says_what_to_change(
    tmp_path: Path, files: Path
) -> None:
    from oldlogit_service.ranks.store import FrontStore

    def front_store(root: Path) -> FrontStore:
        return FrontStore(
            root,
            front=_Ranks(),  # type: ignore[arg-type]
            param_specs=SPECS,
            device="cpu",
            device_budget_bytes=1 << 30,
            host_budget_bytes=0,
            disk_budget_bytes=1 << 30,
            max_versions=100,
        )

    store = front_store(tmp_path / "tp")
    store.place_all()
    store.publish(0, make_sd(0))
    with pytest.raises(InvalidRequest, match=r"--tensor-parallel 1 \(") as refused:
        store.publish_adapter(1, adapter_file(files, make_lora(1), CONFIG), base_version=0)
    assert refused.value.parameter == "base_version"
    assert not store.has(1) and store.has(0)
    store.close()

    # A directory a --tensor-parallel 1 replica left adapters in: the start is refused, by name.
    root = tmp_path / "one"
    single = open_store(root)
    single.publish(0, make_sd(0))
    single.publish_adapter(1, adapter_file(files, make_lora(1), CONFIG), base_version=0)
    single.close()
    store = front_store(root)
    with pytest.raises(InvalidRequest, match=r"adapter versions \[1\].*--tensor-parallel 1"):
        store.place_all()
    store.close()
