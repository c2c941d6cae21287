"""The demo deployment: a tiny seeded random causal LM and a few published versions.

``oldlogit serve --demo`` uses it so a new user sees the service work with no model at hand and
no network. Versions 1.. are the base weights nudged the way an optimizer step nudges them: a
small random subset of elements changes each step (seeded, so restarts agree).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from oldlogit_service.model.checkpoints import load_weights
from oldlogit_service.model.loaded import LoadedModel
from oldlogit_service.snapshots import SnapshotStore

logger = logging.getLogger(__name__)

DEMO_MODEL_KWARGS: dict[str, Any] = {
    "arch": "qwen2",
    "seed": 0,
    "vocab_size": 512,
    "hidden_size": 64,
    "num_layers": 2,
    "num_heads": 4,
    "num_kv_heads": 2,
    "intermediate_size": 128,
    "max_positions": 2048,
}
DEMO_VERSIONS = 4


def demo_versions(
    base: dict[str, torch.Tensor], n: int = DEMO_VERSIONS, *, changed_fraction: float = 0.03
) -> list[dict[str, torch.Tensor]]:
    """``n`` versions: version 0 is ``base``; each next one changes ~3% of elements."""
    gen = torch.Generator().manual_seed(1234)
    out = [base]
    cur = base
    for _ in range(1, n):
        nxt: dict[str, torch.Tensor] = {}
        for name in sorted(cur):
            t = cur[name]
            mask = torch.rand(t.shape, generator=gen) < changed_fraction
            step = torch.randn(t.shape, generator=gen) * 0.05
            nxt[name] = torch.where(mask, t.float() + step, t.float()).to(t.dtype)
        out.append(nxt)
        cur = nxt
    return out


def publish_demo_versions(store: SnapshotStore, model_dir: Path, model: LoadedModel) -> None:
    base = load_weights(model_dir, model)
    assert base is not None, "the demo model directory holds its weights"
    for v, weights in enumerate(demo_versions(base)):
        store.publish(v, weights)
    logger.info("demo: published versions 0..%d", DEMO_VERSIONS - 1)
