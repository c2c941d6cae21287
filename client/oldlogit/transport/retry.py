"""The client's one retry mechanism and its replica-choice policy, for both transports.

In: an operation ``op(replica, remaining_s)`` and the replicas; out: its result or the last error.
Only ``Overloaded``/``Unavailable`` (which the transports also raise for connection failures)
are retried; every other error goes straight to the caller — ``TlsError`` among them: a failed
TLS handshake is the certificates' fault, shared by every replica, not a replica that is down.
No I/O or transport knowledge here, so the policy is tested with fakes.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import random
import time
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass
from typing import Generic, TypeVar

from oldlogit.contract.errors import DeadlineExceeded, OldLogitError, Overloaded, Unavailable

__all__ = ["ReplicaSet", "RetryPolicy", "call_with_retries"]

logger = logging.getLogger(__name__)

R = TypeVar("R")
K = TypeVar("K", bound=Hashable)


@dataclass(frozen=True)
class RetryPolicy:
    """How many rounds over the replicas, and how long to wait between rounds.

    Round ``k`` waits ``min(max_backoff_s, backoff_s * 2**k)`` scaled by a jitter in [0.5, 1)
    (so clients that failed together do not retry together), but never less than the server's
    ``retry_after_s``.
    """

    retries: int = 3
    backoff_s: float = 0.1
    max_backoff_s: float = 10.0

    def delay(self, attempt: int, err: OldLogitError, rng: random.Random) -> float:
        base = min(self.max_backoff_s, self.backoff_s * (2.0**attempt))
        jittered = base * (0.5 + 0.5 * rng.random())
        hint = err.retry_after_s if isinstance(err, Overloaded) else 0.0
        return max(jittered, hint)


def _rendezvous_score(replica: Hashable, key: int) -> int:
    # Highest-random-weight hashing: every client ranks replicas the same way for a version,
    # and removing a replica only moves the versions it owned.
    digest = hashlib.sha256(f"{replica}\x00{key}".encode()).digest()
    return int.from_bytes(digest[:8], "big")


class ReplicaSet(Generic[K]):
    """The single place that decides which replica a call tries first and where it fails over.

    With a ``key`` (the call's policy version) replicas are ranked by rendezvous hashing, so a
    version stays hot on one replica and fails over down the same order on every client; without
    one, the configured order. Replicas that recently failed to answer (``Unavailable``) go to
    the back for ``cooldown_s`` (still tried, last). ``update`` replaces the membership (from
    discovery) and keeps the down marks of replicas that stay.
    """

    def __init__(
        self,
        replicas: list[K],
        *,
        cooldown_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not replicas:
            raise ValueError("at least one replica is needed")
        self._replicas = list(dict.fromkeys(replicas))  # de-duplicated, order kept
        self._cooldown_s = cooldown_s
        self._clock = clock
        self._down_until: dict[K, float] = {}

    @property
    def replicas(self) -> list[K]:
        return list(self._replicas)

    def order(self, key: int | None = None) -> list[K]:
        """Every replica, in the order to try them (down ones last, but still tried)."""
        ranked = list(self._replicas)
        if key is not None:
            ranked.sort(key=lambda r: _rendezvous_score(r, key), reverse=True)
        now = self._clock()
        up = [r for r in ranked if self._down_until.get(r, 0.0) <= now]
        down = [r for r in ranked if self._down_until.get(r, 0.0) > now]
        return up + down

    def update(self, replicas: list[K]) -> None:
        """Replace the members (discovery); an empty list keeps the current ones."""
        if not replicas:
            return
        self._replicas = list(dict.fromkeys(replicas))
        self._down_until = {r: t for r, t in self._down_until.items() if r in self._replicas}

    def mark_down(self, replica: K) -> None:
        self._down_until[replica] = self._clock() + self._cooldown_s

    def mark_up(self, replica: K) -> None:
        self._down_until.pop(replica, None)


async def call_with_retries(
    op: Callable[[K, float | None], Awaitable[R]],
    replicas: ReplicaSet[K],
    policy: RetryPolicy,
    *,
    timeout_s: float | None,
    key: int | None = None,
    sleep: Callable[[float], Awaitable[object]] = asyncio.sleep,
    clock: Callable[[], float] = time.monotonic,
    rng: random.Random | None = None,
) -> R:
    """Run ``op(replica, remaining_s)`` until it succeeds, within ``timeout_s`` overall.

    ``Unavailable`` (replica down or unreachable) fails over to the next replica at once;
    ``Overloaded`` (a live replica shedding load) ends the round. Between rounds the policy's
    backoff applies; after ``policy.retries`` extra rounds, or when the next wait would pass the
    deadline, the last error is raised. ``remaining_s`` is what is left of ``timeout_s`` (None
    without one): the transports use it as the call's deadline and tell the server.
    """
    rng = rng or random.Random()
    deadline = None if timeout_s is None else clock() + timeout_s
    attempt = 0
    while True:
        last: OldLogitError | None = None
        for replica in replicas.order(key):
            remaining = None if deadline is None else deadline - clock()
            if remaining is not None and remaining <= 0:
                if last is not None:
                    raise last
                raise DeadlineExceeded(
                    f"no time left of the {timeout_s}s timeout", parameter="timeout_s"
                )
            try:
                result = await op(replica, remaining)
            except Unavailable as exc:
                logger.info("replica %s unavailable: %s", replica, exc)
                replicas.mark_down(replica)
                last = exc
                continue
            except Overloaded as exc:
                logger.info("replica %s overloaded: %s", replica, exc)
                last = exc
                break
            replicas.mark_up(replica)
            return result
        assert last is not None  # the loop returns or records an error for each replica
        if attempt >= policy.retries:
            raise last
        wait = policy.delay(attempt, last, rng)
        if deadline is not None and clock() + wait >= deadline:
            raise last
        attempt += 1
        logger.info("retry %d/%d in %.2fs after: %s", attempt, policy.retries, wait, last)
        await sleep(wait)
