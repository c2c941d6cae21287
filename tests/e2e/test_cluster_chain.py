"""Scale-out keeps its deltas: three ``oldlogit serve`` replicas on one shared snapshot
directory and a real redis-server hold one chain of keyframes and patches (docs/operations.md,
"Scale-out"; docs/delta-snapshots.md).

All ``slow`` (each starts a cluster of its own; the default run's check of the same path is
``tests/e2e/test_cluster.py::test_deltas_through_each_replica_share_one_chain``): a handful of
small bf16 versions, each published (``delta=True``) through the next replica, every replica
answering every version bitwise as one replica would and the volume holding one chain's bytes;
32 RL-like versions (AdamW at lr 1e-6 over float32
masters, as ``benchmarks/delta_trace.py``) at <= 3x one snapshot; the kill -9 tests are in
``test_cluster_kills.py``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from oldlogit_service.model.checkpoints import load_weights

from .cluster_chain import publish_in_turn, rl_like, start_cluster, volume_bytes

pytestmark = [pytest.mark.e2e, pytest.mark.redis]

RIDS = ["r0", "r1", "r2"]


@pytest.mark.slow
def test_three_replicas_one_chain_bitwise_and_bytes(tmp_path: Path) -> None:
    c = start_cluster(tmp_path, RIDS)
    try:
        base = load_weights(c.model_dir, c.model)
        assert base is not None
        publish_in_turn(c, RIDS, rl_like(base, 5, seed=1))
        c.check_bitwise()
        snap = c.snapshot_nbytes()
        held = volume_bytes(c.shared)
        # One chain: version 0's keyframe and five patches; the replicas hold links only.
        assert held == volume_bytes(c.shared / "chain")
        assert held < 1.6 * snap, (held, snap)
        with c.client("r1") as cl:
            kinds = {v.policy_version: v.kind for v in cl.versions()}
        assert kinds[0] == "keyframe" and all(kinds[v] == "patch" for v in range(1, 6)), kinds
        c.no_orphans()
    finally:
        c.stop()


@pytest.mark.slow
def test_32_rl_versions_three_replicas_under_three_snapshots(tmp_path: Path) -> None:
    from benchmarks import delta_trace

    p = argparse.ArgumentParser()
    delta_trace.add_args(p)
    args = p.parse_args([])
    args.trace_hidden, args.trace_layers, args.trace_vocab = 128, 2, 2048
    args.trace_versions = 32  # the initial weights (version 0), then 31 steps: as the bench
    versions = delta_trace._train_versions(args, 1e-6, tmp_path / "trace")
    next(versions)  # (model dir, the initial weights): the model directory's, version 0
    c = start_cluster(tmp_path, RIDS, model_dir=tmp_path / "trace" / "model")
    try:
        publish_in_turn(c, RIDS, (w for _, w in versions))
        c.check_bitwise()
        snap = c.snapshot_nbytes()
        held = volume_bytes(c.shared)
        assert held == volume_bytes(c.shared / "chain")
        assert held <= 3 * snap, (held / snap, held, snap)
        c.no_orphans()
    finally:
        c.stop()
