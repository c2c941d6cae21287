"""Loading into device memory: staging-buffer reuse and an out-of-memory device.

The GPU-only parts (page-locked buffers, the copy stream) run under the ``gpu`` marker; their
bookkeeping is device-independent and is exercised here with the host tier simulated on CPU.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from oldlogit.contract.errors import Overloaded
from oldlogit_service.snapshots.buffers import BufferPool
from tests.unit.test_store import SNAP, assert_served, make_sd, open_store


def test_buffer_pool_reuses_by_size_within_its_limit() -> None:
    made: list[int] = []

    def alloc(n: int) -> torch.Tensor:
        made.append(n)
        return torch.empty(n, dtype=torch.uint8)

    pool = BufferPool(alloc, max_bytes=0)
    a = pool.take(100)
    pool.give(a)  # no room: dropped
    assert pool.take(100) is not a and made == [100, 100]
    pool.set_limit(250)
    b, c = pool.take(100), pool.take(100)
    pool.give(b)
    pool.give(c)
    pool.give(torch.empty(100, dtype=torch.uint8))  # over the limit: dropped
    assert {id(pool.take(100)), id(pool.take(100))} == {id(b), id(c)}
    assert pool.reused == 2 and pool.take(50) is not None and made[-1] == 50


def _gpu_like(tmp_path: Path, **kw: Any) -> Any:
    s = open_store(tmp_path / "s", device_budget_bytes=2 * SNAP, **kw)
    s.residency.host_enabled = True  # device copies are transfers from host copies
    s.residency.host_tier.budget = 4 * SNAP
    return s


def test_out_of_memory_while_loading_evicts_and_retries(tmp_path: Path, monkeypatch) -> None:
    with _gpu_like(tmp_path) as s:
        for v in range(3):
            s.publish(v, make_sd(v))
        assert_served(s, 0)
        assert_served(s, 1)
        real = s.residency.to_device
        calls = {"n": 0}

        def oom_once(host: Any) -> Any:
            calls["n"] += 1
            if calls["n"] == 1:
                raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
            return real(host)

        monkeypatch.setattr(s.residency, "to_device", oom_once)
        before = s.stats().tiers["device"].evictions
        assert_served(s, 2)  # the first copy fails, resident copies go, the retry succeeds
        assert calls["n"] == 2
        assert s.stats().tiers["device"].evictions >= before + 2
        assert [r.version for r in s.versions() if "device" in r.tiers] == [2]


def test_out_of_memory_twice_is_overloaded_not_a_500(tmp_path: Path, monkeypatch) -> None:
    with _gpu_like(tmp_path) as s:
        s.publish(0, make_sd(0))

        def oom(host: Any) -> Any:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

        monkeypatch.setattr(s.residency, "to_device", oom)
        with pytest.raises(Overloaded) as ei:
            with s.acquire(0):
                pass
        assert ei.value.parameter == "policy_version" and ei.value.retry_after_s > 0
        monkeypatch.undo()
        assert_served(s, 0)  # nothing was left pinned or reserved
        assert s.stats().tiers["device"].bytes == SNAP


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_staging_buffers_are_pinned_and_reused_on_gpu(tmp_path: Path) -> None:
    from oldlogit_service.snapshots import buffers

    with open_store(
        tmp_path / "s", device="cuda", device_budget_bytes=SNAP, host_budget_bytes=0
    ) as s:
        for v in range(4):
            s.publish(v, make_sd(v))
        before = buffers.PINNED_POOL.reused
        for v in (0, 1, 2, 3, 0, 1):
            with s.acquire(v) as w:
                assert all(t.device.type == "cuda" for t in w.values())
        assert buffers.PINNED_POOL.reused > before  # no host tier: every load stages
