"""The snapshot store: every acknowledged policy version's weights, tiered and retained.

``SnapshotStore`` (``store``) is the one entry point, a thin facade over parts that each own
one thing: ``registry`` (durable records, ordering, watermark, leases, disk retention),
``residency`` (memory tiers, loads, LRU), ``rebuild`` (keyframe + patch chains, the keyframe
policy, rewrites), ``publish`` (ingest → verify → persist → register), ``adapters`` (adapter
versions over a retained base; their tensors live in ``residency``'s tiers) and ``lagging``
(the lagging model), ``shared`` (scale-out: versions adopted with their chain from the
shared volume, records following the deployment's). Leaves that import nothing above them:
``ingest``, ``persist``, ``buffers``, ``codec``, ``tiers``, ``leases``, ``records``,
``crashpoints`` (named points where a test kills a replica), ``yielding`` (background work —
loads, rebuilds, rewrites — yields to the scheduler's forwards between chunks, in bounded
turns).

May import torch, safetensors and the client's contract; nothing else of the service (it is
the bottom layer: the model zone, the cluster and the publishing parts build on it).
"""

from oldlogit_service.snapshots.leases import LeaseRecord
from oldlogit_service.snapshots.records import PublishOutcome, StoreStats, VersionRecord
from oldlogit_service.snapshots.registry import check_version
from oldlogit_service.snapshots.store import SnapshotStore

__all__ = [
    "LeaseRecord",
    "PublishOutcome",
    "SnapshotStore",
    "StoreStats",
    "VersionRecord",
    "check_version",
]
