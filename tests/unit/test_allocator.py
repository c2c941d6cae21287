"""The serving process's allocator settings (model/allocator.py). Their effect — a forward on
a worker thread no longer re-faulting the memory the previous one freed — depends on the whole
forward's allocation sequence and is measured at real size (docs/performance.md); here: that
glibc takes the settings, once per process, and that what the environment sets is kept."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from oldlogit_service.model import allocator

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="glibc's mallopt: Linux only"
)

# A fresh process (the settings are process-wide): tune twice, recording every mallopt call.
_PROBE = textwrap.dedent(
    """
    import ctypes, json
    from oldlogit_service.model import allocator
    calls = []
    real = ctypes.CDLL

    class Counting:
        def __init__(self, name):
            lib = real(name)
            self.gnu_get_libc_version = lib.gnu_get_libc_version

            class Mallopt:
                argtypes = restype = None

                def __call__(self, param, value):
                    calls.append([param, value])
                    return lib.mallopt(param, value)

            self.mallopt = Mallopt()

    allocator.ctypes.CDLL = Counting
    first = allocator.tune_allocator()
    second = allocator.tune_allocator()
    print(json.dumps([first, second, calls]))
    """
)


def _tune_in_a_fresh_process(**env: str) -> tuple[bool, bool, list[list[int]]]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "GLIBC_"))}
    out = subprocess.run(
        [sys.executable, "-c", _PROBE],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
        env={**clean, **env},
    )
    first, second, calls = json.loads(out.stdout.strip().splitlines()[-1])
    return first, second, calls


def test_glibc_takes_the_settings_once_per_process() -> None:
    first, second, calls = _tune_in_a_fresh_process()
    assert first is True and second is True  # glibc took all three; the second call is free
    assert calls == [
        [-1, allocator.TRIM_THRESHOLD_BYTES],
        [-3, allocator.MMAP_THRESHOLD_BYTES],
        [-8, allocator.ARENA_MAX],
    ]
    # Above a thread heap's 64 MiB (its top is then never trimmed); glibc's mmap ceiling.
    assert allocator.TRIM_THRESHOLD_BYTES > 64 * 1024**2
    assert allocator.MMAP_THRESHOLD_BYTES == 32 * 1024**2
    assert allocator.ARENA_MAX == 1  # every thread's frees serve the compute thread


def test_what_the_environment_sets_is_left_alone() -> None:
    first, _, calls = _tune_in_a_fresh_process(
        MALLOC_ARENA_MAX="4", GLIBC_TUNABLES="glibc.malloc.trim_threshold=1048576"
    )
    assert first is True
    assert calls == [[-3, allocator.MMAP_THRESHOLD_BYTES]]  # only what the environment left unset
