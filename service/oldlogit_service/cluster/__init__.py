"""The deployment's shared state: one interface, an embedded default and a Redis scale-out.

Owns ``control`` (the ``Control`` interface the runtime calls for versions, leases, watermark
and visibility; ``LocalControl``, the one-replica default over the local store), ``replicas``
(``ClusterControl``: N replicas agreeing through Redis on a shared snapshot volume, membership,
adoption of a version published elsewhere) and ``redis_adapters`` (the one module that imports
redis: registry, leases, membership, events, the shared result cache).

May import ``snapshots``, ``cache`` and ``config``, and the client's contract; never the
runtime, the scheduler, the model zone or a transport.
"""
