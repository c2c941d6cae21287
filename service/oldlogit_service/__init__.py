"""oldlogit_service: the old-logit server.

One package per responsibility, layered top to bottom (``make lint`` checks it with
import-linter; the contracts are in ``pyproject.toml``):

- ``cli``, ``server``: the command, and the one place the parts are built and wired;
- ``api/``: the transports (HTTP, gRPC, auth, TLS, the status page);
- ``runtime``: the data plane both transports call (logprobs, traces, plain delegation);
- ``publishing/``, ``scheduler``: getting versions in; version-aware batches;
- ``model/``, ``cluster/``, ``snapshots/``: the torch zone; shared state; the store;
- leaves any layer may use: ``config``, ``validate``, ``cache``, ``metrics``, ``history``;
  ``demo/`` holds the offline tiny models and the demo deployment.

ARCHITECTURE.md walks a request and a publish through these files.
"""

__version__ = "0.1.0"
