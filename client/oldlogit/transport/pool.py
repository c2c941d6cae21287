"""The replicas of one deployment as the client calls them: one transport each, one way to call.

In: the replica URLs, a function that opens a transport for a URL, the retry policy and the
client's deadline; out: ``call(op)``, which runs ``op(transport, remaining_s)`` on the replica
``retry.ReplicaSet`` ranks first, failing over and retrying through ``retry.call_with_retries``
only. Knows no operation: the client and the publisher hand it theirs. Transports open on first
use, inside the running loop (grpc.aio channels are bound to it), and close with ``aclose``.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Literal, TypeVar

from oldlogit.transport.base import Transport
from oldlogit.transport.retry import ReplicaSet, RetryPolicy, call_with_retries

__all__ = ["TransportPool"]

logger = logging.getLogger(__name__)

T = TypeVar("T")


class TransportPool:
    """The open transports of a deployment's replicas, and every call made through them."""

    def __init__(
        self,
        urls: list[str],
        open_transport: Callable[[str], Transport],
        policy: RetryPolicy,
        *,
        timeout_s: float | None,
    ) -> None:
        self._replicas: ReplicaSet[str] = ReplicaSet(urls)
        self._open = open_transport
        self._policy = policy
        self._timeout_s = timeout_s
        self._transports: dict[str, Transport] = {}

    @property
    def urls(self) -> list[str]:
        return self._replicas.replicas

    def update(self, urls: list[str]) -> None:
        """Replace the replicas (discovery); an empty list keeps the current ones."""
        self._replicas.update(urls)

    def transport(self, url: str) -> Transport:
        transport = self._transports.get(url)
        if transport is None:
            transport = self._open(url)
            self._transports[url] = transport
        return transport

    async def call(
        self,
        op: Callable[[Transport, float | None], Awaitable[T]],
        *,
        timeout_s: float | Literal["client"] | None = "client",
        key: int | None = None,
        retry: bool = True,
    ) -> T:
        """Every operation goes through here: replica choice, retries, the deadline.

        ``timeout_s`` is the whole call's budget ("client": the client's ``timeout_s``; None:
        none). ``key``: the policy version the call is routed by. ``retry=False``: one round
        over the replicas (a stream that cannot be replayed).
        """
        return await call_with_retries(
            lambda url, remaining: op(self.transport(url), remaining),
            self._replicas,
            self._policy if retry else RetryPolicy(retries=0),
            timeout_s=self._timeout_s if timeout_s == "client" else timeout_s,
            key=key,
        )

    async def aclose(self) -> None:
        transports, self._transports = list(self._transports.values()), {}
        for t in transports:
            try:
                await t.aclose()
            except Exception:  # closing must not hide the caller's own exception
                logger.debug("closing %s failed", t.url, exc_info=True)
