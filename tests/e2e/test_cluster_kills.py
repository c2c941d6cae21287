"""kill -9 of a replica of a shared-chain deployment during a publish, a re-key and an adoption
(real ``oldlogit serve`` processes, one shared directory, a real redis-server).

Each kill lands where it is meant to by construction: the replica is started with
``OLDLOGIT_TEST_PAUSE_AT`` (``snapshots/crashpoints.py``), stops at that point, says so in a
file, and is killed there. Afterwards (the killed replica restarted, as an orchestrator
would): nothing unacknowledged is visible, every acknowledged version is served bitwise by
every live replica, and the volume holds only what the retained chain needs.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from oldlogit.contract import errors
from oldlogit_service.model.checkpoints import load_weights

from .cluster_chain import ChainCluster, publish_in_turn, rl_like, start_cluster

pytestmark = [pytest.mark.e2e, pytest.mark.redis, pytest.mark.slow]


def _paused(c: ChainCluster, rid: str, point: str, pause: Path) -> None:
    """Restart ``rid`` so that it stops at ``point`` (``<name>:<version>``)."""
    c.start(rid, env={"OLDLOGIT_TEST_PAUSE_AT": point, "OLDLOGIT_TEST_PAUSE_DIR": str(pause)})


def _wait_for(marker: Path, timeout_s: float = 60.0) -> None:
    end = time.monotonic() + timeout_s
    while not marker.exists():
        assert time.monotonic() < end, f"{marker.name} was never reached"
        time.sleep(0.05)


def _in_thread(fn: Callable[[], object]) -> threading.Thread:
    def run() -> None:
        try:
            fn()
        except errors.OldLogitError:
            pass  # the replica was killed under the call: nothing was acknowledged

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_kill_during_publish_rekey_and_adoption(tmp_path: Path) -> None:
    pause = tmp_path / "pause"
    pause.mkdir()
    c = start_cluster(tmp_path, ["r0", "r1"])
    try:
        base = load_weights(c.model_dir, c.model)
        assert base is not None
        steps = rl_like(base, 6, seed=2)
        v = publish_in_turn(c, ["r0", "r1"], (next(steps) for _ in range(3)))  # 1..3

        # -- a publish: r2 links its file on the shared volume, then dies before the claim.
        _paused(c, "r2", f"claim:{v}", pause)
        w = next(steps)
        with c.client("r2", retries=0, timeout_s=120) as cl:
            t = _in_thread(lambda: cl.publish(v, w))
            _wait_for(pause / f"claim-{v}")
            c.kill("r2")
            t.join(timeout=60)
        with c.client("r0") as cl:
            assert v not in [x.policy_version for x in cl.versions()]
        c.start("r2")
        c.check_bitwise()
        c.no_orphans()  # the announced file is collected once r2's old heartbeat is gone
        with c.client("r2") as cl:  # the same version again, now acknowledged
            assert cl.publish(v, w).created
        with c.client("r2") as cl:
            c.record(v, w, cl.version(v).weight_sha256)

        # -- a re-key: deleting version 0 (every chain's keyframe) makes r2 rewrite version 1
        # as a keyframe; it dies with the rewrite linked, before the swap.
        c.kill("r2")
        _paused(c, "r2", "swap:0", pause)
        with c.client("r2", retries=0, timeout_s=120) as cl:
            t = _in_thread(lambda: cl.delete_version(0))
            _wait_for(pause / "swap-0")
            c.kill("r2")
            t.join(timeout=60)
        c.start("r2")
        c.check_bitwise()  # version 0 too: its deletion was never acknowledged
        c.no_orphans()
        with c.client("r1", retries=8) as cl:  # the lease r2 held is void: r1 re-keys
            cl.delete_version(0)
        del c.refs[0]
        for rid in c.replicas:
            with c.client(rid, retries=0) as cl, pytest.raises(errors.VersionEvicted):
                cl.logprobs([1, 2, 3], policy_version=0, use_cache=False)

        # -- an adoption: a new replica links the chain of the newest version into its
        # store and dies before recording it.
        _paused(c, "r3", f"adopt:{v}", pause)
        with c.client("r3", retries=0, timeout_s=120) as cl:
            t = _in_thread(lambda: cl.logprobs([1, 2, 3], policy_version=v, use_cache=False))
            _wait_for(pause / f"adopt-{v}")
            c.kill("r3")
            t.join(timeout=60)
        c.start("r3")
        c.check_bitwise()
        c.no_orphans()
    finally:
        c.stop()
