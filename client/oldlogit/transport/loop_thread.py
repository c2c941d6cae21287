"""A private asyncio event loop on a daemon thread: how the sync ``Client`` reuses ``AsyncClient``.

In: coroutines from the calling thread; out: their results (or exceptions), blocking. Works
even when the caller already runs an event loop (Jupyter, async frameworks), because the
client's loop is its own. Holds no client logic.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

__all__ = ["LoopThread"]

T = TypeVar("T")


class LoopThread:
    """One event loop running forever on its own thread until ``stop()``."""

    def __init__(self, name: str = "oldlogit-client") -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the loop and wait for it; Ctrl-C cancels it there too."""
        if self._loop.is_closed():
            coro.close()
            raise RuntimeError("the client is closed")
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result()
        except BaseException:
            future.cancel()  # e.g. KeyboardInterrupt: stop the call in the loop too
            raise

    def stop(self) -> None:
        """Stop the loop and its thread (idempotent)."""
        if self._loop.is_closed():
            return
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self._loop.close()
