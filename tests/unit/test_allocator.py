"""The serving process's allocator settings (model/allocator.py). Their effect — a forward on
a worker thread no longer re-faulting the memory the previous one freed — depends on the whole
forward's allocation sequence and is measured at real size (docs/performance.md); here: that
glibc takes the settings, once per process."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from oldlogit_service.model import allocator


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: Linux only")
def test_glibc_takes_the_settings_once_per_process() -> None:
    probe = textwrap.dedent(
        """
        import ctypes
        from oldlogit_service.model import allocator
        calls = []
        real = ctypes.CDLL

        class Counting:
            def __init__(self, name):
                self._lib = real(name)
                self.gnu_get_libc_version = self._lib.gnu_get_libc_version
                fn = self._lib.mallopt

                class Mallopt:
                    argtypes = restype = None

                    def __call__(self, param, value):
                        calls.append((param, value))
                        return fn(param, value)

                self.mallopt = Mallopt()

        allocator.ctypes.CDLL = Counting
        first = allocator.tune_allocator()
        second = allocator.tune_allocator()
        print(first, second, calls)
        """
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "GLIBC_"))}
    out = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
        env=env,
    ).stdout.split(maxsplit=2)
    assert out[0] == "True" and out[1] == "True"  # glibc took all three; the second call is free
    assert out[2].strip() == str(
        [
            (-1, allocator.TRIM_THRESHOLD_BYTES),
            (-3, allocator.MMAP_THRESHOLD_BYTES),
            (-8, allocator.ARENA_MAX),
        ]
    )
    # Above a thread heap's 64 MiB (its top is then never trimmed); glibc's mmap ceiling.
    assert allocator.TRIM_THRESHOLD_BYTES > 64 * 1024**2
    assert allocator.MMAP_THRESHOLD_BYTES == 32 * 1024**2
    assert allocator.ARENA_MAX == 1  # every thread's frees serve the compute thread


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: Linux only")
def test_what_the_environment_sets_is_left_alone() -> None:
    probe = textwrap.dedent(
        """
        import ctypes
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
                        calls.append(param)
                        return lib.mallopt(param, value)

                self.mallopt = Mallopt()

        allocator.ctypes.CDLL = Counting
        print(allocator.tune_allocator(), calls)
        """
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "GLIBC_"))}
    env["MALLOC_ARENA_MAX"] = "4"
    env["GLIBC_TUNABLES"] = "glibc.malloc.trim_threshold=1048576"
    out = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
        env=env,
    ).stdout.strip()
    assert out == "True [-3]"  # only the mmap threshold, which the environment left unset
