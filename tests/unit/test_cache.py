"""The in-process result cache: keys, LRU by bytes, the disabled mode, thread safety."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest

from oldlogit_service.cache import CacheStats, ResultCache, ResultCacheBackend, make_key

SHA = "ab" * 32


def key(**over: Any) -> bytes:
    args: dict[str, Any] = {
        "weight_sha256": SHA,
        "numerics": "bfloat16/sdpa/head=fp32/deterministic",
        "sampling": (1.0, 0, 1.0),
        "token_ids": np.array([1, 2, 3, 4], dtype=np.int64),
        "positions": np.array([2, 3], dtype=np.int64),
    }
    args.update(over)
    return make_key(**args)


def arr(n: int, fill: float = 0.0) -> np.ndarray:
    return np.full(n, fill, dtype=np.float32)


def test_keys_differ_when_any_component_differs() -> None:
    base = key()
    assert len(base) == 32 and key() == base
    variants = [
        key(weight_sha256="cd" * 32),
        key(numerics="bfloat16/sdpa/head=bf16/deterministic"),
        key(sampling=(0.7, 0, 1.0)),
        key(sampling=(1.0, 50, 1.0)),
        key(sampling=(1.0, 0, 0.9)),
        key(sampling=(np.nextafter(1.0, 2.0), 0, 1.0)),  # one ulp of temperature
        key(token_ids=np.array([1, 2, 3, 5])),
        key(token_ids=np.array([1, 2, 3, 4, 0])),
        key(positions=np.array([1, 2, 3])),
        key(positions=np.array([3])),
        # Framing: the same integers split differently between the arrays.
        key(token_ids=np.array([1, 2, 3, 4, 2]), positions=np.array([3])),
    ]
    assert len({base, *variants}) == len(variants) + 1
    # Values, not dtypes, identify the tokens; the sha is case-insensitive.
    assert key(token_ids=np.array([1, 2, 3, 4], dtype=np.int32)) == base
    assert key(token_ids=[1, 2, 3, 4]) == base
    assert key(weight_sha256=SHA.upper()) == base
    with pytest.raises(TypeError):
        key(token_ids=np.array([1.0, 2.0]))
    assert (
        ResultCache(10).make_key(
            weight_sha256=SHA,
            numerics="bfloat16/sdpa/head=fp32/deterministic",
            sampling=(1.0, 0, 1.0),
            token_ids=np.array([1, 2, 3, 4]),
            positions=np.array([2, 3]),
        )
        == base
    )


def test_lru_bounded_by_bytes() -> None:
    cost = 100 * 4 + 32  # an entry: its float32 values plus its key
    c = ResultCache(3 * cost)
    keys = [key(positions=np.array([i])) for i in range(5)]
    for i in range(3):
        c.put(keys[i], arr(100, i))
    assert c.stats().bytes == 3 * cost and len(c) == 3
    assert c.get(keys[0]) is not None  # 0 becomes most recently used
    c.put(keys[3], arr(100, 3))  # evicts 1, the least recently used
    assert c.get(keys[1]) is None
    got = c.get(keys[0])
    assert got is not None and got[0] == 0
    c.put(keys[4], arr(150, 4))  # needs about two slots: evicts 2 and 3
    assert [c.get(k) is not None for k in keys] == [True, False, False, False, True]
    st = c.stats()
    assert st.bytes <= 3 * cost and st.entries == 2 and st.evictions == 3
    c.put(keys[0], arr(2000))  # larger than the whole cache: not stored, nothing evicted
    assert c.get(keys[4]) is not None and c.stats().bytes <= 3 * cost
    c.put(keys[4], arr(10, 9))  # replacing an entry re-accounts its bytes
    assert c.stats().bytes == cost + 10 * 4 + 32 and c.stats().entries == 2


def test_values_are_private_and_read_only() -> None:
    c = ResultCache(1 << 20)
    k = key()
    v = np.array([-1.5, -np.inf, np.nan], dtype=np.float32)
    c.put(k, v)
    v[0] = 0.0  # the caller's array is not the cached one
    got = c.get(k)
    assert got is not None and got[0] == -1.5 and np.isneginf(got[1]) and np.isnan(got[2])
    with pytest.raises(ValueError):
        got[0] = 1.0


def test_disabled_at_zero() -> None:
    c = ResultCache(0)
    assert not c.enabled
    c.put(key(), arr(4))
    assert c.get(key()) is None
    assert c.stats() == CacheStats(hits=0, misses=1, bytes=0, max_bytes=0, entries=0, evictions=0)
    with pytest.raises(ValueError):
        ResultCache(-1)


def test_stats_and_protocol() -> None:
    c = ResultCache(1 << 20)
    assert isinstance(c, ResultCacheBackend)
    c.get(key())
    c.put(key(), arr(3))
    c.get(key())
    c.get(key())
    st = c.stats()
    assert (st.hits, st.misses, st.entries) == (2, 1, 1)
    c.clear()
    assert c.stats().bytes == 0 and c.get(key()) is None


def test_thread_safety_smoke() -> None:
    cost = 16 * 4 + 32
    c = ResultCache(20 * cost)
    errors: list[BaseException] = []

    def worker(t: int) -> None:
        try:
            for i in range(400):
                k = key(positions=np.array([(t * 7 + i) % 50]))
                hit = c.get(k)
                if hit is None:
                    c.put(k, arr(16, float((t * 7 + i) % 50)))
                else:
                    assert hit[0] == float((t * 7 + i) % 50)
                assert c.stats().bytes <= 20 * cost
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors
    st = c.stats()
    assert st.entries <= 20 and st.bytes == st.entries * cost
    assert st.hits + st.misses == 8 * 400
