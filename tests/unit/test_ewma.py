"""The EWMA proxy policy: the closed-form bias-corrected average, persistence across restarts,
and the runtime's proxy / opt-in fallback paths (never exact; bitwise equal to the reference
forward of the EWMA weights cast to the serving dtype)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from oldlogit.contract.errors import InvalidRequest, UnknownVersion, VersionEvicted
from oldlogit.contract.types import LogprobsRequest, Sampling, Sequence
from oldlogit.contract.weights import weight_sha256
from oldlogit_service.config import Settings
from oldlogit_service.demo.deployment import demo_versions
from oldlogit_service.model.checkpoints import load_weights
from oldlogit_service.model.ewma import STATE_FILE, EwmaProxy
from oldlogit_service.model.loaded import load_model
from oldlogit_service.model.numerics import SamplingParams
from oldlogit_service.model.reference import reference_logprobs
from oldlogit_service.runtime import Runtime
from oldlogit_service.server import Service, build_service

BETA = 0.7


def _versions(
    base: dict[str, torch.Tensor], k: int, seed: int = 0
) -> list[dict[str, torch.Tensor]]:
    """k distinct random versions (every element moves: the average is not trivially any one)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(k):
        out.append(
            {
                n: (t.float() + 0.05 * torch.randn(t.shape, generator=g)).to(t.dtype)
                for n, t in base.items()
            }
        )
    return out


def _closed_form(versions: list[dict[str, torch.Tensor]], beta: float) -> dict[str, torch.Tensor]:
    """θ̄_k = Σ_i β^(k−1−i) θ_i / Σ_i β^(k−1−i), in float64."""
    k = len(versions)
    coef = [beta ** (k - 1 - i) for i in range(k)]
    total = sum(coef)
    return {
        n: torch.stack([c * v[n].double() for c, v in zip(coef, versions, strict=True)]).sum(0)
        / total
        for n in versions[0]
    }


@pytest.fixture(scope="module")
def loaded(tiny_loaded_factory: Callable[..., tuple[Any, Any]]) -> tuple[Any, Any]:
    return tiny_loaded_factory(dtype="float32")


def _proxy(model: Any, state_dir: Path | None, beta: float = BETA) -> EwmaProxy:
    return EwmaProxy(model, beta=beta, state_dir=state_dir)


@pytest.mark.parametrize("k", [1, 2, 5])
def test_fold_equals_closed_form_bias_corrected_average(loaded: Any, k: int) -> None:
    model, base = loaded
    vs = _versions(base, k)
    ewma = _proxy(model, None)
    for i, w in enumerate(vs):
        ewma.fold(i, w)
    assert ewma.count == k and ewma.last_version == k - 1
    assert ewma.weight == pytest.approx(sum(BETA**i for i in range(k)), rel=1e-12)
    want = _closed_form(vs, BETA)
    acc = ewma.accumulators()
    for n, t in acc.items():
        assert t.dtype == torch.float32
        torch.testing.assert_close(t.double(), want[n], rtol=1e-6, atol=1e-6)
    if k == 1:  # W = 1: the first average is the first version, bit for bit
        for n, t in acc.items():
            assert torch.equal(t, vs[0][n].float())
    # The served weights are the float32 average cast to the serving dtype, and so is the hash.
    snap = ewma.snapshot()
    assert snap is not None and snap.last_version == k - 1
    served = {n: acc[n].to(model.dtype) for n in acc}
    assert all(torch.equal(snap.weights[n], served[n]) for n in served)
    assert snap.sha256 == weight_sha256(served)


def test_bf16_serving_keeps_float32_accumulators(
    tiny_loaded_factory: Callable[..., tuple[Any, Any]],
) -> None:
    model, base = tiny_loaded_factory(dtype="bfloat16")
    vs = _versions(base, 4, seed=1)
    ewma = _proxy(model, None)
    for i, w in enumerate(vs):
        ewma.fold(i, w)
    want = _closed_form(vs, BETA)
    for n, t in ewma.accumulators().items():
        assert t.dtype == torch.float32
        torch.testing.assert_close(t.double(), want[n], rtol=1e-6, atol=1e-6)
    snap = ewma.snapshot()
    assert snap is not None
    assert all(t.dtype == torch.bfloat16 for t in snap.weights.values())


def test_fold_refuses_old_versions(loaded: Any) -> None:
    model, base = loaded
    ewma = _proxy(model, None)
    ewma.fold(3, base)
    with pytest.raises(ValueError, match="not newer"):
        ewma.fold(3, base)


@pytest.mark.parametrize("beta", [0.0, 1.0, -0.5, float("nan")])
def test_beta_must_be_in_open_unit_interval(loaded: Any, beta: float) -> None:
    with pytest.raises(ValueError, match="beta"):
        _proxy(loaded[0], None, beta=beta)


def test_state_persists_and_restores_bitwise(loaded: Any, tmp_path: Path) -> None:
    model, base = loaded
    vs = _versions(base, 3, seed=2)
    a = _proxy(model, tmp_path)
    for i, w in enumerate(vs):
        a.fold(10 + i, w)
    assert (tmp_path / STATE_FILE).is_file()
    (tmp_path / ".tmp-leftover").write_bytes(b"x")  # an interrupted save
    b = _proxy(model, tmp_path)
    assert not (tmp_path / ".tmp-leftover").exists()
    assert (b.count, b.last_version, b.weight) == (a.count, a.last_version, a.weight)
    sa, sb = a.snapshot(), b.snapshot()
    assert sa is not None and sb is not None and sa.sha256 == sb.sha256
    acc_a, acc_b = a.accumulators(), b.accumulators()
    assert all(torch.equal(acc_a[n], acc_b[n]) for n in acc_a)
    # Folding on after the restart gives what one uninterrupted run gives.
    a.fold(13, base)
    b.fold(13, base)
    acc_a, acc_b = a.accumulators(), b.accumulators()
    assert all(torch.equal(acc_a[n], acc_b[n]) for n in acc_a)


def test_state_with_other_beta_or_corrupt_is_rebuilt(loaded: Any, tmp_path: Path) -> None:
    model, base = loaded
    a = _proxy(model, tmp_path)
    a.fold(0, base)
    other = _proxy(model, tmp_path, beta=0.9)
    assert other.count == 0 and other.snapshot() is None
    (tmp_path / STATE_FILE).write_bytes(b"not a safetensors file")
    assert _proxy(model, tmp_path).snapshot() is None


# ------------------------------------------------------------------------------ the runtime


def _service(model_dir: Path, snap: Path, **kw: Any) -> Service:
    settings = Settings(model=model_dir, snapshot_dir=snap, max_wait_ms=1.0, dtype="bfloat16", **kw)
    return build_service(settings)


def _runtime(model_dir: Path, snap: Path, **kw: Any) -> Runtime:
    return _service(model_dir, snap, **kw).runtime


def _req(ids: list[int], version: int, **kw: Any) -> LogprobsRequest:
    return LogprobsRequest(
        sequences=[Sequence(token_ids=ids, policy_version=version, score_from=2)],
        sampling=Sampling(temperature=0.8, top_k=20),
        **kw,
    )


def test_runtime_proxy_and_fallback(tiny_model_dir: Path, tmp_path: Path) -> None:
    svc = _service(tiny_model_dir, tmp_path / "snap", ewma_beta=BETA)
    rt = svc.runtime

    async def go() -> str:
        base = load_weights(tiny_model_dir, rt.model)
        assert base is not None
        vs = demo_versions(base, 4)  # vs[0] is version 0, already published at start-up
        for v in range(1, 4):  # each publish folds the version into the average
            await svc.intake.publish_weights(v, vs[v], sha256=None)
        assert rt.ewma is not None and rt.ewma.last_version == 3
        # The EWMA of the four versions (folded in publish order), cast to bfloat16.
        want_acc = _closed_form(vs, BETA)
        acc = rt.ewma.accumulators()
        for n in acc:
            torch.testing.assert_close(acc[n].double(), want_acc[n], rtol=1e-6, atol=1e-6)
        ewma_w = {n: t.to(rt.model.dtype) for n, t in acc.items()}
        sha = weight_sha256(ewma_w)
        ids = [5, 17, 3, 99, 250, 7, 42, 1, 8]
        ref_model = load_model(tiny_model_dir, dtype=rt.model.dtype, device="cpu")
        ref = reference_logprobs(ref_model, ewma_w, ids, SamplingParams(0.8, 20, 1.0))
        ref[:2] = np.nan

        # proxy="ewma": inexact, the EWMA hash under the requested key, bitwise the reference.
        r = (await rt.logprobs(_req(ids, 2, proxy="ewma"))).results[0]
        assert r.exact is False and r.versions == [2] and r.weight_sha256 == {2: sha}
        np.testing.assert_array_equal(r.logprobs, ref)
        again = (await rt.logprobs(_req(ids, 2, proxy="ewma"))).results[0]
        assert again.cached and not again.exact
        np.testing.assert_array_equal(again.logprobs, ref)
        with pytest.raises(UnknownVersion) as ei:  # never published: not approximated either
            await rt.logprobs(_req(ids, 9, proxy="ewma"))
        assert ei.value.parameter == "policy_version"

        # A gone version: refused unless the request opted in; then the proxy answers.
        await rt.delete_version(1)
        with pytest.raises(VersionEvicted):
            await rt.logprobs(_req(ids, 1))
        r = (await rt.logprobs(_req(ids, 1, allow_inexact=True))).results[0]
        assert r.exact is False and r.weight_sha256 == {1: sha}
        np.testing.assert_array_equal(r.logprobs, ref)
        # allow_inexact changes nothing for a version that is still there.
        r = (await rt.logprobs(_req(ids, 2, allow_inexact=True))).results[0]
        assert r.exact is True and r.weight_sha256 == {2: rt.store.sha256(2)}
        # Mixed: the exact part stays exact, the sequence as a whole is marked inexact.
        seq_mixed = Sequence(token_ids=ids, versions=[-1, -1, 1, 1, 2, 2, 3, 3, 3])
        resp = await rt.logprobs(
            LogprobsRequest(
                sequences=[seq_mixed, Sequence(token_ids=ids, policy_version=3, score_from=2)],
                sampling=Sampling(temperature=0.8, top_k=20),
                allow_inexact=True,
            )
        )
        mixed, exact = resp.results
        assert mixed.exact is False and mixed.weight_sha256[1] == sha
        assert mixed.weight_sha256[2] == rt.store.sha256(2)
        np.testing.assert_array_equal(mixed.logprobs[2:4], ref[2:4])
        assert exact.exact is True
        with pytest.raises(UnknownVersion):  # opting in does not invent future versions
            await rt.logprobs(_req(ids, 9, allow_inexact=True))
        return sha

    try:
        sha = asyncio.run(go())
    finally:
        rt.close()
        rt.store.close()

    # A restart on the same snapshot dir keeps the average (and answers the same bits).
    rt2 = _runtime(tiny_model_dir, tmp_path / "snap", ewma_beta=BETA)
    try:
        assert rt2.ewma is not None and rt2.ewma.last_version == 3 and rt2.ewma.count == 4
        snap2 = rt2.ewma.snapshot()
        assert snap2 is not None and snap2.sha256 == sha
    finally:
        rt2.close()
        rt2.store.close()


def test_runtime_without_ewma_refuses_proxy(tiny_model_dir: Path, tmp_path: Path) -> None:
    rt = _runtime(tiny_model_dir, tmp_path / "snap")
    try:
        assert rt.ewma is None
        with pytest.raises(InvalidRequest, match="proxy") as ei:
            asyncio.run(rt.logprobs(_req([1, 2, 3], 0, proxy="ewma")))
        assert ei.value.parameter == "proxy"
        asyncio.run(rt.delete_version(0))
        with pytest.raises(VersionEvicted):  # opting in needs a proxy to fall back on
            asyncio.run(rt.logprobs(_req([1, 2, 3], 0, allow_inexact=True)))
    finally:
        rt.close()
        rt.store.close()


def test_start_up_folds_versions_published_before(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Versions already in the store when the proxy is switched on are folded in, in order."""
    rt = _runtime(tiny_model_dir, tmp_path / "snap")
    base = load_weights(tiny_model_dir, rt.model)
    assert base is not None
    vs = demo_versions(base, 3)
    for v in (1, 2):
        rt.store.publish(v, vs[v])
    rt.close()
    rt.store.close()
    rt = _runtime(tiny_model_dir, tmp_path / "snap", ewma_beta=BETA)
    try:
        assert rt.ewma is not None and (rt.ewma.count, rt.ewma.last_version) == (3, 2)
        want = _closed_form([{n: t.to(rt.model.dtype) for n, t in w.items()} for w in vs], BETA)
        for n, t in rt.ewma.accumulators().items():
            torch.testing.assert_close(t.double(), want[n], rtol=1e-6, atol=1e-6)
    finally:
        rt.close()
        rt.store.close()


def test_settings_and_cli_flag() -> None:
    from oldlogit_service.cli import _parser

    args = _parser().parse_args(["serve", "--demo", "--ewma-beta", "0.9"])
    assert args.ewma_beta == 0.9
    assert Settings(demo=True).ewma_beta is None
    with pytest.raises(ValueError, match="ewma_beta"):
        Settings(demo=True, ewma_beta=1.0)
