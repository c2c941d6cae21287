"""oldlogit_service: the old-logit server (engine, snapshot store, scheduler, transports)."""

__version__ = "0.1.0"
