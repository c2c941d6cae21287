"""The C allocator's settings for a serving process: freed activations stay mapped, one arena.

A forward allocates and frees the same activation sizes layer after layer. The service runs its
forwards on the scheduler's compute thread, not the main thread, and glibc gives such a thread
its own arena: heaps of at most 64 MiB whose free top is handed back to the kernel
(``madvise``) as soon as it passes the trim threshold — which starts at 128 KiB. The next layer
then faults the same pages in again. Measured at Qwen2.5-0.5B's shapes (24 layers, bf16, 4 × 128
tokens): one engine call took 150,000–230,000 minor page faults and about 10 % more time on a
worker thread than on the main thread (no faults). With the trim threshold above a heap's size
and the mmap threshold fixed at its dynamic maximum (32 MiB), a worker thread's call faults
only the one allocation above 32 MiB (the head's logits chunk).

After a publish the compute thread faulted more again (78,000–96,000 pages per call in a
server that had taken one publish, 38,000 before it, whichever version it scored) until every
thread shared one arena: then 28,500 per call, publishes or not. Per-thread arenas exist to
spare threads the arena lock; here the threads that allocate large blocks are few (the compute
thread, the load stage, publishes) and each allocation is a tensor, not a Python object.

``tune_allocator`` sets all three, once per process, before the serving threads start
(``oldlogit serve`` and each tensor-parallel rank process). Memory kept this way is what
forwards freed and will allocate again (the main arena keeps at most 128 MiB of free top).
A setting the environment gives (``MALLOC_ARENA_MAX``, ``MALLOC_TRIM_THRESHOLD_``,
``MALLOC_MMAP_THRESHOLD_``, or ``GLIBC_TUNABLES``) is left as the operator set it. No effect
(False) where the C library is not glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import threading

logger = logging.getLogger(__name__)

__all__ = ["ARENA_MAX", "MMAP_THRESHOLD_BYTES", "TRIM_THRESHOLD_BYTES", "tune_allocator"]

# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8

# Above a thread arena's heap size (64 MiB), so a heap's free top is never trimmed.
TRIM_THRESHOLD_BYTES = 128 * 1024**2
# glibc's own ceiling for the dynamic mmap threshold: allocations below it come from the heaps.
MMAP_THRESHOLD_BYTES = 32 * 1024**2
# One arena for every thread: the compute thread reuses what any thread freed.
ARENA_MAX = 1

# (mallopt parameter, value, the environment variable and glibc tunable that set it instead).
_SETTINGS = (
    (
        _M_TRIM_THRESHOLD,
        TRIM_THRESHOLD_BYTES,
        "MALLOC_TRIM_THRESHOLD_",
        "glibc.malloc.trim_threshold",
    ),
    (
        _M_MMAP_THRESHOLD,
        MMAP_THRESHOLD_BYTES,
        "MALLOC_MMAP_THRESHOLD_",
        "glibc.malloc.mmap_threshold",
    ),
    (_M_ARENA_MAX, ARENA_MAX, "MALLOC_ARENA_MAX", "glibc.malloc.arena_max"),
)

_lock = threading.Lock()
_tuned: bool | None = None


def tune_allocator() -> bool:
    """Set the trim and mmap thresholds and the arena count (see the module docstring); True
    when every setting the environment left to it was taken. Idempotent."""
    global _tuned
    with _lock:
        if _tuned is not None:
            return _tuned
        _tuned = False
        name = ctypes.util.find_library("c")
        if name is None:
            return False
        try:
            libc = ctypes.CDLL(name)
            mallopt = libc.mallopt
            # gnu_get_libc_version exists only in glibc: other C libraries keep their defaults.
            libc.gnu_get_libc_version  # noqa: B018
        except (OSError, AttributeError):
            return False
        mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        mallopt.restype = ctypes.c_int
        # Each setting tried on its own (one refused leaves the others); what the operator set
        # in the environment stays.
        refused = [
            env
            for param, value, env, tunable in _SETTINGS
            if env not in os.environ
            and tunable not in os.environ.get("GLIBC_TUNABLES", "")
            and not mallopt(param, value)
        ]
        if refused:
            logger.warning("mallopt refused %s; glibc's defaults kept for it", ", ".join(refused))
        _tuned = not refused
        return _tuned
