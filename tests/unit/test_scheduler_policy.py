"""pick_batch: the pure batching policy, tested with plain deques."""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future
from typing import Any

import pytest

from oldlogit_service.scheduler import (
    BatchPolicy,
    WeightsRef,
    WorkItem,
    _State,
    pick_batch,
    pick_load,
)


def item(version: int, t: float, ntokens: int = 10) -> WorkItem:
    return WorkItem(
        weights=WeightsRef.stored(version),
        job=Any,
        future=Future(),
        enqueued_at=t,  # type: ignore[arg-type]
        ntokens=ntokens,
    )


def queues(*items: WorkItem) -> dict[int, deque[WorkItem]]:
    q: dict[int, deque[WorkItem]] = {}
    for it in items:
        q.setdefault(it.weights.store_version, deque()).append(it)
    return q


POLICY = BatchPolicy(max_batch_tokens=25, max_wait_s=0.0, max_switch_delay_s=1.0)


def test_empty() -> None:
    assert pick_batch({}, current=None, now=0.0, policy=POLICY) is None


def test_never_mixes_versions_and_respects_token_budget() -> None:
    q = queues(item(1, 0.0), item(2, 0.1), item(1, 0.2), item(1, 0.3))
    v, batch = pick_batch(q, current=None, now=0.5, policy=POLICY)  # type: ignore[misc]
    assert v == 1
    assert [b.weights.version for b in batch] == [1, 1]  # 10 + 10 <= 25 < 30
    assert [b.enqueued_at for b in batch] == [0.0, 0.2]  # FIFO within a version


def test_a_single_item_over_budget_still_runs() -> None:
    q = queues(item(3, 0.0, ntokens=1000))
    v, batch = pick_batch(q, current=None, now=0.0, policy=POLICY)  # type: ignore[misc]
    assert v == 3 and len(batch) == 1 and q == {}


def test_stays_on_current_version_to_save_switches() -> None:
    q = queues(item(1, 0.0), item(2, 0.1))
    v, _ = pick_batch(q, current=2, now=0.5, policy=POLICY)  # type: ignore[misc]
    assert v == 2


def test_starving_version_wins_over_current() -> None:
    q = queues(item(1, 0.0), item(2, 0.1))
    v, _ = pick_batch(q, current=2, now=1.5, policy=POLICY)  # type: ignore[misc]
    assert v == 1


def test_no_version_starves_under_a_stream_of_current_work() -> None:
    q = queues(item(7, 0.0))
    served: list[int] = []
    now = 0.0
    current = 5
    steps = 0
    for _ in range(50):
        steps += 1
        q.setdefault(5, deque()).append(item(5, now))  # endless work for the current version
        now += 0.1
        picked = pick_batch(q, current=current, now=now, policy=POLICY)
        assert picked is not None
        current = picked[0]
        served.append(current)
        if 7 in served:
            break
    assert 7 in served
    assert steps <= 12  # served within max_switch_delay_s (+ one batch)


@pytest.mark.parametrize("seed", range(20))
def test_every_item_is_served_exactly_once(seed: int) -> None:
    import random

    rng = random.Random(seed)
    items = [item(rng.randrange(4), rng.random(), rng.randrange(1, 30)) for _ in range(60)]
    items.sort(key=lambda i: i.enqueued_at)
    q = queues(*items)
    seen: list[WorkItem] = []
    current = None
    while True:
        picked = pick_batch(q, current=current, now=2.0, policy=POLICY)
        if picked is None:
            break
        current, batch = picked
        assert all(b.weights.version == current for b in batch)
        assert len(batch) == 1 or sum(b.ntokens for b in batch) <= POLICY.max_batch_tokens
        seen.extend(batch)
    assert sorted(map(id, seen)) == sorted(map(id, items))


def test_load_policy_oldest_first_within_the_limit() -> None:
    q = queues(item(3, 0.2), item(2, 0.1), item(1, 0.0))
    pol = POLICY
    assert pick_load(q, held=set(), running=None, now=0.3, policy=pol, limit=2) == (1, None)
    assert pick_load(q, held={1}, running=None, now=0.3, policy=pol, limit=2) == (2, None)
    # At the limit: wait until the next one has waited max_switch_delay_s ...
    assert pick_load(q, held={1, 2}, running=1, now=0.3, policy=pol, limit=2) == (None, None)
    # ... then let go of a held version other than the running one for it.
    assert pick_load(q, held={1, 2}, running=1, now=1.5, policy=pol, limit=2) == (3, 2)
    assert pick_load(q, held={1}, running=1, now=1.5, policy=pol, limit=1) == (None, None)
    # A proxy's weights are resident already: the scheduler hands the policy only the queues
    # of store versions, so a queued proxy alone leaves nothing to load.
    proxied = _State(queues={WeightsRef.proxy("ewma", {}): deque([item(1, 0.0)])})
    assert pick_load(proxied.loadable(), held=set(), running=None, now=9, policy=pol, limit=2) == (
        None,
        None,
    )


def test_ready_restricts_the_batch_policy() -> None:
    q = queues(item(1, 0.0), item(2, 0.1))
    assert pick_batch(q, current=None, now=0.5, policy=POLICY, ready={3}) is None
    v, _ = pick_batch(q, current=None, now=0.5, policy=POLICY, ready={2})  # type: ignore[misc]
    assert v == 2


def test_a_held_version_is_not_let_go_before_its_queued_work_ran() -> None:
    # Under a saturated queue every item has waited past max_switch_delay_s: without this rule
    # each load would let go of the previous one before its batch ran, and loads would replace
    # each other unused.
    pol = BatchPolicy(max_batch_tokens=25, max_wait_s=0.0, max_switch_delay_s=1.0)
    q = queues(item(1, 0.0), item(2, 0.1), item(3, 0.2))
    kw: dict[str, Any] = dict(running=1, now=5.0, policy=pol, limit=2)
    assert pick_load(q, held={1, 2}, served=set(), **kw) == (None, None)  # 2 has not run yet
    assert pick_load(q, held={1, 2}, served={2}, **kw) == (3, 2)  # it has: it may go
    assert pick_load(q, held={1, 2}, **kw) == (3, 2)  # no record: any held version but the running
