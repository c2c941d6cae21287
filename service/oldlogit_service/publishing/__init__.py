"""Getting a version in: uploads, publish-by-path roots and multi-rank publish sessions.

Owns ``uploads`` (streaming an upload body to a staging file within the limits; the roots a
publish by path may read from, and the check that a path stays inside them), ``sessions``
(multi-rank sessions: N parts staged, checked, committed, then one version) and ``parts``
(what a session's part may hold, its hash, merging the parts' deltas). Every path ends in the
snapshot store's public publish calls, so a version is verified, persisted and registered the
same way however it arrived.

May import ``snapshots``, the model zone's checkpoint layouts (``model.checkpoints``,
``model.loaded``), ``cluster.control`` and the client's contract; never the runtime, the
scheduler or a transport.
"""
