"""Named points where a test stops a replica on purpose, so that a kill lands there for sure.

``OLDLOGIT_TEST_PAUSE_AT=<point>:<version>`` (set on a test's server process only) makes the
process reach ``<point>`` for ``<version>``, write ``<point>-<version>`` into
``OLDLOGIT_TEST_PAUSE_DIR`` and wait there until it is killed (``tests/e2e/test_cluster_kills.py``
kills it with SIGKILL). Unset, ``reached`` is one dictionary lookup. Points: ``claim`` (a
publish's file linked on the shared volume, not claimed yet), ``swap`` (a chain rewrite's
files linked, not swapped in yet), ``adopt`` (a chain's files linked into a store, not
recorded yet).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

__all__ = ["reached"]


def reached(point: str, version: int) -> None:
    want = os.environ.get("OLDLOGIT_TEST_PAUSE_AT")
    if want is None or want != f"{point}:{version}":
        return
    marker = Path(os.environ.get("OLDLOGIT_TEST_PAUSE_DIR", ".")) / f"{point}-{version}"
    marker.write_text(str(os.getpid()))
    while True:  # until the test kills this process
        time.sleep(3600)
