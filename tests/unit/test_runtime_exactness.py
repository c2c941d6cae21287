"""The whole in-process path (validate → cache → scheduler → store tiers → engine → stitch) is
bitwise equal to the reference, for weights from every tier, after eviction + reload, after a
restart, whatever else is batched with a request. Fast mode stays within its documented bound.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from oldlogit.contract.types import LogprobsRequest, Sampling, Sequence
from oldlogit_service.config import Settings
from oldlogit_service.demo.deployment import demo_versions
from oldlogit_service.model.numerics import SamplingParams
from oldlogit_service.model.reference import reference_logprobs_versions
from oldlogit_service.runtime import Runtime
from oldlogit_service.server import build_runtime

VOCAB = 320
N_VERSIONS = 6
# x 4 configs = 120 sequences per run; 240 under the `slow` marker (~6 s more on 2 cores).
CASES_PER_CONFIG = 30
CASES_PER_CONFIG_SLOW = 60


def _runtime(
    model_dir: Path, snap: Path, **kw: Any
) -> tuple[Runtime, dict[int, dict[str, torch.Tensor]]]:
    from oldlogit_service.model.checkpoints import load_weights

    rt = build_runtime(Settings(model=model_dir, snapshot_dir=snap, max_wait_ms=1.0, **kw))

    w0 = load_weights(model_dir, rt.model)
    assert w0 is not None
    weights = dict(enumerate(demo_versions(w0, N_VERSIONS, changed_fraction=0.2)))
    for v, w in weights.items():
        rt.store.publish(v, w)
    return rt, weights


def _cases(rng: random.Random, n: int) -> list[tuple[Sequence, SamplingParams]]:
    out = []
    for _ in range(n):
        length = rng.randint(2, 140)
        ids = [rng.randrange(VOCAB) for _ in range(length)]
        if rng.random() < 0.4:
            seq = Sequence(
                token_ids=ids,
                policy_version=rng.randrange(N_VERSIONS),
                score_from=rng.randint(0, length),
            )
        else:
            pool = [*rng.sample(range(N_VERSIONS), rng.randint(1, 3)), -1]
            seq = Sequence(token_ids=ids, versions=[rng.choice(pool) for _ in range(length)])
        sp = SamplingParams(
            temperature=rng.choice([1.0, 0.6, 1.7]),
            top_k=rng.choice([0, 0, 3, 40]),
            top_p=rng.choice([1.0, 0.95, 0.6]),
        )
        out.append((seq, sp))
    return out


async def _serve_all(
    rt: Runtime, cases: list[tuple[Sequence, SamplingParams]], rng: random.Random
) -> list[np.ndarray]:
    """Requests of 1-4 sequences, several in flight at once: batches mix freely."""
    out: list[np.ndarray | None] = [None] * len(cases)
    idx = list(range(len(cases)))
    groups: list[list[int]] = []
    while idx:
        k = rng.randint(1, 4)
        groups.append(idx[:k])
        idx = idx[k:]

    async def one(group: list[int]) -> None:
        # Each task sends its sequences one by one; the tasks overlap, so batches mix.
        for i in group:
            seq, sp = cases[i]
            req = LogprobsRequest(
                sequences=[seq],
                sampling=Sampling(temperature=sp.temperature, top_k=sp.top_k, top_p=sp.top_p),
                use_cache=rng.random() < 0.5,
            )
            resp = await rt.logprobs(req)
            out[i] = resp.results[0].logprobs

    await asyncio.gather(*(one(g) for g in groups))
    return [o for o in out if o is not None]


@pytest.mark.parametrize(
    "n_cases",
    [CASES_PER_CONFIG, pytest.param(CASES_PER_CONFIG_SLOW, marks=pytest.mark.slow)],
    ids=[f"{CASES_PER_CONFIG}cases", f"{CASES_PER_CONFIG_SLOW}cases"],
)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("lm_head_fp32", [False, True])
def test_deterministic_mode_bitwise_through_every_tier(
    tiny_model_factory: Callable[..., Path],
    tmp_path: Path,
    dtype: str,
    lm_head_fp32: bool,
    n_cases: int,
) -> None:
    model_dir = tiny_model_factory(
        vocab_size=VOCAB,
        arch="llama" if lm_head_fp32 else "qwen2",
        tie_word_embeddings=lm_head_fp32,
    )
    # A device budget of ~1.5 versions: most requests evict and reload from disk.
    probe = build_runtime(Settings(model=model_dir, snapshot_dir=tmp_path / "probe"))
    one = sum(int(np.prod(shape)) for _, shape in probe.model.param_specs.values())
    probe.close()
    itemsize = 4 if dtype == "float32" else 2
    budget_gib = 1.5 * one * itemsize / 1024**3
    snap = tmp_path / "snap"
    rt, weights = _runtime(
        model_dir, snap, dtype=dtype, lm_head_fp32=lm_head_fp32, device_budget_gib=budget_gib
    )
    rng = random.Random(hash((dtype, lm_head_fp32)) & 0xFFFF)
    cases = _cases(rng, n_cases)
    try:
        got = asyncio.run(_serve_all(rt, cases, rng))
        stats = rt.store.stats()
        assert stats.tiers["device"].evictions > 0, stats  # weights came back from disk
        assert stats.tiers["device"].peak_bytes <= budget_gib * 1024**3 + one * itemsize
    finally:
        rt.close()
        rt.store.close()
    mismatches = []
    for (seq, sp), lp in zip(cases, got, strict=True):
        ref = reference_logprobs_versions(
            rt.model,
            weights,
            seq.token_ids,
            seq.per_token_versions(),
            sp,
            lm_head_fp32=lm_head_fp32,
        )
        if not np.array_equal(lp, ref, equal_nan=True):
            mismatches.append(float(np.nanmax(np.abs(lp - ref))))
    assert not mismatches, f"{len(mismatches)} of {len(cases)} differ, max {max(mismatches)}"

    # A restart on the same snapshot dir serves every acknowledged version, bitwise the same.
    rt2, _ = _runtime(
        model_dir, snap, dtype=dtype, lm_head_fp32=lm_head_fp32, device_budget_gib=budget_gib
    )
    try:
        assert {r.version: r.sha256 for r in rt2.store.versions()} == {
            r.version: r.sha256 for r in rt.store.versions()
        }
        again = asyncio.run(_serve_all(rt2, cases[:10], random.Random(5)))
        for a, b in zip(again, got[:10], strict=True):
            assert np.array_equal(a, b, equal_nan=True)
    finally:
        rt2.close()
        rt2.store.close()


@pytest.mark.parametrize(("dtype", "bound"), [("float32", 1e-4), ("bfloat16", 0.25)])
def test_fast_mode_within_documented_bound(
    tiny_model_factory: Callable[..., Path], tmp_path: Path, dtype: str, bound: float
) -> None:
    model_dir = tiny_model_factory(vocab_size=VOCAB)
    # Under the invariant numerics fast mode is deterministic mode; the plain numerics pad.
    rt, weights = _runtime(model_dir, tmp_path / "snap", dtype=dtype, mode="fast", numerics="hf")
    assert rt.mode == "fast"
    rng = random.Random(11)
    cases = [(s, SamplingParams()) for s, _ in _cases(rng, 40)]
    try:
        got = asyncio.run(_serve_all(rt, cases, rng))
    finally:
        rt.close()
        rt.store.close()
    worst = 0.0
    for (seq, sp), lp in zip(cases, got, strict=True):
        ref = reference_logprobs_versions(
            rt.model, weights, seq.token_ids, seq.per_token_versions(), sp
        )
        assert np.array_equal(np.isnan(lp), np.isnan(ref))
        fin = np.isfinite(ref)
        worst = max(worst, float(np.max(np.abs(lp[fin] - ref[fin]), initial=0.0)))
    assert worst <= bound


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_cuda_deterministic_bitwise_with_host_tier(
    tiny_model_factory: Callable[..., Path], tmp_path: Path, dtype: str
) -> None:
    """On CUDA: device tier on the GPU, pinned host tier, same bitwise contract."""
    model_dir = tiny_model_factory(vocab_size=VOCAB)
    probe = build_runtime(
        Settings(model=model_dir, snapshot_dir=tmp_path / "probe", device="cuda", dtype=dtype)
    )
    one = sum(int(np.prod(shape)) for _, shape in probe.model.param_specs.values())
    probe.close()
    probe.store.close()
    itemsize = 4 if dtype == "float32" else 2
    rt, weights = _runtime(
        model_dir,
        tmp_path / "snap",
        device="cuda",
        dtype=dtype,
        device_budget_gib=1.5 * one * itemsize / 1024**3,
        host_budget_gib=3.5 * one * itemsize / 1024**3,
    )
    assert rt.model.device.type == "cuda"
    rng = random.Random(3)
    cases = _cases(rng, 40)
    try:
        got = asyncio.run(_serve_all(rt, cases, rng))
        stats = rt.store.stats()
        assert stats.tiers["device"].evictions > 0
        # Evicted device copies came back from the pinned host tier, not only from disk. (What
        # the host tier holds at the end is the eviction policy's: decoded patches share it,
        # and in bfloat16 they filled it at the end of a run on an H100.)
        assert stats.loads_host > 0, stats
        assert stats.tiers["host"].peak_bytes > 0, stats
    finally:
        rt.close()
        rt.store.close()
    for (seq, sp), lp in zip(cases, got, strict=True):
        ref = reference_logprobs_versions(
            rt.model, weights, seq.token_ids, seq.per_token_versions(), sp
        )
        assert np.array_equal(lp, ref, equal_nan=True)
