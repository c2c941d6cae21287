"""The lagging-model route: the version-order policy (pure), the loop serving in version order,
the lagging model advancing by patches (passed versions from the snapshot path or refused), and
a runtime with ``strategy="lagging"`` answering bitwise equal to the reference."""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from oldlogit.contract.errors import VersionEvicted
from oldlogit.contract.types import LogprobsRequest, Sequence
from oldlogit_service.config import Settings
from oldlogit_service.demo.deployment import demo_versions
from oldlogit_service.model.checkpoints import load_weights
from oldlogit_service.model.numerics import SamplingParams
from oldlogit_service.model.reference import reference_logprobs_versions
from oldlogit_service.scheduler import (
    BatchPolicy,
    Scheduler,
    WeightsRef,
    WorkItem,
    pick_batch_lagging,
)
from oldlogit_service.server import build_runtime

from .test_scheduler_loop import FakeEngine, job
from .test_store_delta import assert_all_served, open_store, same, trace


def item(version: int, t: float, ntokens: int = 10) -> WorkItem:
    return WorkItem(
        weights=WeightsRef.stored(version),
        job=Any,  # type: ignore[arg-type]
        future=Future(),
        enqueued_at=t,
        ntokens=ntokens,
    )


def test_pick_batch_lagging_is_version_order_fifo_within() -> None:
    policy = BatchPolicy(max_batch_tokens=25, max_wait_s=0.0)
    q: dict[WeightsRef, deque[WorkItem]] = {}
    for it in (item(7, 0.0), item(3, 0.1), item(5, 0.2), item(3, 0.3), item(3, 0.4)):
        q.setdefault(it.weights, deque()).append(it)
    order = []
    current = WeightsRef.stored(7)
    while (picked := pick_batch_lagging(q, current=current, now=9.0, policy=policy)) is not None:
        w, batch = picked
        assert all(it.weights == w for it in batch) and sum(it.ntokens for it in batch) <= 25
        order.append((w.version, [it.enqueued_at for it in batch]))
    # The oldest item (version 7) waits: the lagging model only moves forward.
    assert order == [(3, [0.1, 0.3]), (3, [0.4]), (5, [0.2]), (7, [0.0])]
    assert pick_batch_lagging({}, current=None, now=0.0, policy=policy) is None


class LaggingStore:
    def __init__(self) -> None:
        self.acquired: list[int] = []

    @contextmanager
    def acquire_lagging(self, version: int) -> Iterator[Mapping[str, Any]]:
        self.acquired.append(version)
        yield {"version": version}


def test_loop_serves_queued_requests_in_version_order() -> None:
    engine = FakeEngine()
    store = LaggingStore()
    sched = Scheduler(
        engine,  # type: ignore[arg-type]
        store,  # type: ignore[arg-type]
        policy=BatchPolicy(max_batch_tokens=64, max_wait_s=0.0),
        max_queue=100,
        strategy="lagging",
    )
    try:
        engine.gate.clear()  # hold the first batch so the rest queue up
        first = sched.submit(WeightsRef.stored(0), job(0))
        deadline = time.monotonic() + 10
        while sched.depth and time.monotonic() < deadline:  # the loop took it
            time.sleep(0.001)
        versions = [6, 2, 9, 4, 2, 8, 1, 4]
        futs = [sched.submit(WeightsRef.stored(v), job(i + 1)) for i, v in enumerate(versions)]
        engine.gate.set()
        first.result(10)
        for i, (v, f) in enumerate(zip(versions, futs, strict=True)):
            assert f.result(10).tolist() == [float(v * 1000 + i + 1)] * 3
        served = [v for v, _ in engine.calls]
        assert served[0] == 0 and served[1:] == sorted(set(versions))
        assert store.acquired == served
    finally:
        sched.close()


def test_lagging_model_advances_by_patches(tmp_path: Path) -> None:
    ws = trace(10, 11, fractions=[0.0, 0.01, 0.05])
    with open_store(tmp_path / "s", keyframe_every=4, device_budget_bytes=4 * 10**6) as s:
        for v, w in enumerate(ws):
            s.publish(v, w)
        kinds = [r.kind for r in s.versions()]
        assert kinds.count("keyframe") == 3  # 0, 4, 8
        for v in (1, 2, 3, 3, 5, 7, 8, 9):
            with s.acquire_lagging(v) as got:
                assert all(same(got[k], ws[v][k]) for k in ws[v]), v
        lag = s.stats().lagging
        # Loaded once at 1 and once at 5 (4 is a keyframe: no patch leads there from 3),
        # then advanced patch by patch: 1->2->3, 5->6->7, 7->8 (a keyframe: a reload), 8->9.
        assert lag.reloads == 3 and lag.patches_applied == 2 + 2 + 1
        assert s._lagging is not None and s._lagging.version == 9
        # A version it has passed comes from the snapshot path...
        with s.acquire_lagging(2) as got:
            assert all(same(got[k], ws[2][k]) for k in ws[2])
        assert s.stats().lagging.passed == 1
        # ... and is refused once the store no longer retains it.
        s.set_watermark(4)
        with pytest.raises(VersionEvicted, match="policy_version 2"), s.acquire_lagging(2):
            pass
        assert_all_served(s, {v: ws[v] for v in range(4, 10)})
        st = s.stats().tiers["device"]
        assert st.peak_bytes <= 4 * 10**6 + s.snapshot_nbytes


def test_lagging_runtime_bitwise_equal_to_reference(
    tiny_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    model_dir = tiny_model_factory(vocab_size=320)
    rt = build_runtime(
        Settings(
            model=model_dir,
            snapshot_dir=tmp_path / "snap",
            strategy="lagging",
            keyframe_every=3,
            max_wait_ms=5.0,
            dtype="bfloat16",
        )
    )
    try:
        w0 = load_weights(model_dir, rt.model)
        assert w0 is not None
        weights = dict(enumerate(demo_versions(w0, 7, changed_fraction=0.05)))
        for v, w in weights.items():
            rt.store.publish(v, w)
        rng = random.Random(2)
        cases = []
        for _ in range(24):
            n = rng.randint(2, 60)
            ids = [rng.randrange(320) for _ in range(n)]
            cases.append(Sequence(token_ids=ids, policy_version=rng.randrange(7), score_from=1))
        cases.sort(key=lambda c: c.policy_version or 0)  # a pipeline whose requests come in order

        async def ask() -> list[np.ndarray]:
            out = []
            for c in cases:
                resp = await rt.logprobs(LogprobsRequest(sequences=[c], use_cache=False))
                out.append(resp.results[0].logprobs)
            return out

        got = asyncio.run(ask())
        lag = rt.store.stats().lagging
        assert lag.patches_applied > 0 and lag.passed == 0
        late = asyncio.run(  # a version the lagging model has passed: snapshot path
            rt.logprobs(LogprobsRequest(sequences=[cases[0]], use_cache=False))
        )
        assert np.array_equal(late.results[0].logprobs, got[0], equal_nan=True)
        assert rt.store.stats().lagging.passed == 1
    finally:
        rt.close()
        rt.store.close()
    for c, lp in zip(cases, got, strict=True):
        ref = reference_logprobs_versions(
            rt.model, weights, c.token_ids, c.per_token_versions(), SamplingParams()
        )
        assert np.array_equal(lp, ref, equal_nan=True)


def test_lagging_loop_with_real_store_concurrent_clients(tmp_path: Path) -> None:
    """Many threads submitting out of order; each result is from its own version."""
    ws = trace(8, 12, fractions=[0.02])
    with open_store(tmp_path / "s", keyframe_every=4) as s:
        for v, w in enumerate(ws):
            s.publish(v, w)

        class Echo:
            def run(self, weights: Mapping[str, Any], jobs: list[Any]) -> list[Any]:
                import torch

                tag = float(weights["w"].view(torch.int32).to(torch.int64).sum())
                return [torch.full((len(j.positions),), tag, dtype=torch.float64) for j in jobs]

        sched = Scheduler(
            Echo(),  # type: ignore[arg-type]
            s,
            policy=BatchPolicy(max_batch_tokens=64, max_wait_s=0.002),
            max_queue=1000,
            strategy="lagging",
        )
        results: list[tuple[int, float]] = []
        lock = threading.Lock()

        def worker(seed: int) -> None:
            rng = random.Random(seed)
            for _ in range(10):
                v = rng.randrange(8)
                out = sched.submit(WeightsRef.stored(v), job(1)).result(30)
                with lock:
                    results.append((v, float(out[0])))

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
        try:
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
        finally:
            sched.close()
        assert len(results) == 60
        import torch

        for v, tag in results:
            assert tag == float(ws[v]["w"].view(torch.int32).to(torch.int64).sum())
        assert s.stats().lagging.patches_applied > 0


def test_strategy_and_keyframe_settings_from_flags_and_env(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from oldlogit_service.cli import _parser

    args = _parser().parse_args(
        ["serve", "--demo", "--strategy", "lagging", "--keyframe-every", "8"]
    )
    assert args.strategy == "lagging" and args.keyframe_every == 8
    assert Settings(demo=True).strategy == "snapshot"
    monkeypatch.setenv("OLDLOGIT_STRATEGY", "lagging")
    monkeypatch.setenv("OLDLOGIT_KEYFRAME_CHAIN_FRACTION", "0.25")
    s = Settings(demo=True)
    assert s.strategy == "lagging" and s.keyframe_chain_fraction == 0.25
    with pytest.raises(ValueError, match="strategy"):
        Settings(demo=True, strategy="sideways")  # type: ignore[arg-type]
