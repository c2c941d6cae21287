"""The snapshot store: every acknowledged policy version's weights, tiered and retained.

``SnapshotStore`` is the one entry point (publish, acquire, leases, watermark, introspection);
the modules split it by concern: ``ingest`` (publish inputs checked against the model),
``persist`` and ``buffers`` (disk layout, crash-safe writes, in-memory bytes), ``codec``
(patches), ``chains`` (rebuilds, keyframe policy, rewrites), ``deltas`` (delta publishes),
``lagging`` (the lagging model), ``residency`` and ``tiers`` (memory tiers, LRU), ``leases``,
``records`` (what it answers with), ``store`` (the orchestration).
"""

from oldlogit_service.snapshots.leases import LeaseRecord
from oldlogit_service.snapshots.records import PublishOutcome, VersionRecord
from oldlogit_service.snapshots.store import SnapshotStore

__all__ = ["LeaseRecord", "PublishOutcome", "SnapshotStore", "VersionRecord"]
