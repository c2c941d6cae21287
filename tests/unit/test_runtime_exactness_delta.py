"""Logprobs served from delta-rebuilt versions are bitwise equal to the reference: versions
published as client-made deltas, stored as keyframes + patches, rebuilt through a device
budget of ~1.5 versions (most requests rebuild), after a keyframe a chain needed is deleted,
and after a restart. The property test of ``test_runtime_exactness`` on the delta path."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from oldlogit.publishing.streams import WeightsCopy
from oldlogit_service.config import Settings
from oldlogit_service.demo.deployment import demo_versions
from oldlogit_service.model.checkpoints import load_weights
from oldlogit_service.model.reference import reference_logprobs_versions
from oldlogit_service.runtime import Runtime
from oldlogit_service.server import build_runtime

from .test_runtime_exactness import N_VERSIONS, VOCAB, _cases, _serve_all

CASES = 60


def _publish_deltas(rt: Runtime, tmp: Path, weights: dict[int, dict[str, torch.Tensor]]) -> None:
    """Version 0 is the model directory's; every later one arrives as a delta upload."""
    parent = WeightsCopy.read(weights[0]).published(0)
    for v in range(1, len(weights)):
        new = WeightsCopy.read(weights[v])
        path = tmp / f"delta-{v}.safetensors"
        path.write_bytes(b"".join(new.delta_stream(parent).chunks()))
        out = rt.store.publish_delta(v, path, expected_sha256=new.sha256)
        assert out.created and out.sha256 == new.sha256
        parent = new.published(v)


def _runtime(model_dir: Path, snap: Path, dtype: str, budget_gib: float) -> Runtime:
    return build_runtime(
        Settings(
            model=model_dir,
            snapshot_dir=snap,
            max_wait_ms=1.0,
            dtype=dtype,  # type: ignore[arg-type]
            device_budget_gib=budget_gib,
            keyframe_every=3,
        )
    )


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_delta_rebuilt_versions_bitwise(
    tiny_model_factory: Callable[..., Path], tmp_path: Path, dtype: str
) -> None:
    model_dir = tiny_model_factory(vocab_size=VOCAB)
    probe = _runtime(model_dir, tmp_path / "probe", dtype, 1.0)
    one = probe.store.snapshot_nbytes
    w0 = load_weights(model_dir, probe.model)
    probe.close()
    probe.store.close()
    assert w0 is not None
    weights = dict(enumerate(demo_versions(w0, N_VERSIONS, changed_fraction=0.05)))
    budget_gib = 1.5 * one / 1024**3
    snap = tmp_path / "snap"
    ups = tmp_path / "up"
    ups.mkdir()
    rt = _runtime(model_dir, snap, dtype, budget_gib)
    rng = random.Random(7 if dtype == "float32" else 8)
    cases = _cases(rng, CASES)
    try:
        _publish_deltas(rt, ups, weights)
        kinds = [r.kind for r in rt.store.versions()]
        assert kinds == ["keyframe", "patch", "patch", "keyframe", "patch", "patch"]
        got = asyncio.run(_serve_all(rt, cases, rng))
        st = rt.store.stats()
        assert st.rebuilds > 0 and st.tiers["device"].evictions > 0
        assert st.tiers["device"].peak_bytes <= budget_gib * 1024**3 + one
    finally:
        rt.close()
        rt.store.close()
    mismatches = []
    for (seq, sp), lp in zip(cases, got, strict=True):
        ref = reference_logprobs_versions(
            rt.model, weights, seq.token_ids, seq.per_token_versions(), sp
        )
        if not np.array_equal(lp, ref, equal_nan=True):
            mismatches.append(float(np.nanmax(np.abs(lp - ref))))
    assert not mismatches, f"{len(mismatches)} of {len(cases)} differ, max {max(mismatches)}"

    # Restart: chains rebuilt from disk (hash-checked once each); then delete the keyframe
    # versions 1-2 are rebuilt from (1 is re-keyframed): same answers, bitwise.
    rt2 = _runtime(model_dir, snap, dtype, budget_gib)
    try:
        again = asyncio.run(_serve_all(rt2, cases[:15], random.Random(5)))
        for a, b in zip(again, got[:15], strict=True):
            assert np.array_equal(a, b, equal_nan=True)
        assert rt2.store.stats().verified_loads > 0
        asyncio.run(rt2.delete_version(0))
        assert rt2.store.info(1).kind == "keyframe" and rt2.store.info(2).parent == 1
        keep = [
            i for i, (seq, _) in enumerate(cases) if 0 not in set(seq.per_token_versions().tolist())
        ][:15]
        later = asyncio.run(_serve_all(rt2, [cases[i] for i in keep], random.Random(6)))
        for i, lp in zip(keep, later, strict=True):
            assert np.array_equal(lp, got[i], equal_nan=True)
    finally:
        rt2.close()
        rt2.store.close()
