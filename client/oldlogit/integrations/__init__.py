"""Trainer adapters: oldlogit where TRL, verl and plain PyTorch loops keep their tensors.

- ``Client.logprobs_padded`` (``padded``): π_old for a padded [B, T] batch, aligned with it;
- ``OldLogitGRPOTrainer`` (``trl``): TRL's GRPOTrainer publishing every optimizer step and
  taking π_old of its samples from the service at the version they were generated with;
- ``compute_old_log_prob`` (``verl``): verl's ``compute_log_prob`` shape over a verl batch;
- ``patch_verl_engine`` / ``VerlEnginePatch`` (``verl``): verl's own FSDP actor computes its
  log-probs (compute_log_prob and the policy loss) as the service does, bitwise;
- ``publish_sharded`` / ``ShardedPublisher`` (``distributed``): one version published from every
  rank of a ``torch.distributed`` group (FSDP2/DTensor state dicts or per-rank shares).
Importing this package imports no framework (nor torch); each name imports its own when used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .distributed import ShardedPublisher, publish_sharded
    from .padded import PaddedLogprobs
    from .trl import OldLogitGRPOTrainer
    from .verl import VerlEnginePatch, compute_old_log_prob, patch_verl_engine

__all__ = [
    "OldLogitGRPOTrainer",
    "PaddedLogprobs",
    "ShardedPublisher",
    "VerlEnginePatch",
    "compute_old_log_prob",
    "patch_verl_engine",
    "publish_sharded",
]

_LAZY = {
    "PaddedLogprobs": "padded",
    "OldLogitGRPOTrainer": "trl",
    "compute_old_log_prob": "verl",
    "patch_verl_engine": "verl",
    "VerlEnginePatch": "verl",
    "ShardedPublisher": "distributed",
    "publish_sharded": "distributed",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'oldlogit.integrations' has no attribute {name!r}")
    from importlib import import_module

    value = getattr(import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
