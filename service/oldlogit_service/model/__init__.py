"""The torch zone: a model skeleton, a version's weights on it, and the forwards that score.

Owns the parameter-free skeleton built from a model directory (``loaded``: ``LoadedModel``,
``load_model``), how a skeleton runs with a weights dict (``backends``), checkpoint layouts and
weight loading (``checkpoints``), the batched engine (``engine``), the one-sequence reference
it is tested against (``reference``), the service's side of the logprob pipeline
(``numerics``), the EWMA proxy's weights and forwards (``ewma``) and the C allocator's
settings for a serving process (``allocator``).

May import torch, safetensors, transformers, the client's contract and ``oldlogit.parity``;
``snapshots`` for annotations only. Never asyncio, pydantic, HTTP, gRPC or Redis, and nothing
above it in the service (runtime, scheduler, transports). Tensor shapes are written in
comments.
"""
