"""Behaviour over both transports against real servers: answers bitwise equal to the reference."""

from __future__ import annotations

import random
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

import numpy as np
import pytest
import torch

from oldlogit import Client, Sequence
from oldlogit.contract.numerics import NUMERICS_REVISION
from oldlogit_service.model.numerics import SamplingParams
from oldlogit_service.model.reference import reference_logprobs_versions

from .conftest import WRITE_TOKEN, Served, start_served

pytestmark = pytest.mark.integration


def _random_case(rng: random.Random, vocab: int) -> tuple[Sequence, np.ndarray, SamplingParams]:
    n = rng.randint(2, 160)
    ids = [rng.randrange(vocab) for _ in range(n)]
    if rng.random() < 0.5:
        v = rng.randrange(4)
        score_from = rng.randint(0, n)
        seq = Sequence(token_ids=ids, policy_version=v, score_from=score_from)
    else:
        versions = [rng.choice([-1, 0, 1, 2, 3]) for _ in range(n)]
        seq = Sequence(token_ids=ids, versions=versions)
    sp = SamplingParams(
        temperature=rng.choice([1.0, 0.7, 1.3]),
        top_k=rng.choice([0, 0, 5, 50]),
        top_p=rng.choice([1.0, 1.0, 0.9, 0.5]),
    )
    return seq, seq.per_token_versions(), sp


# A LoadedModel is one skeleton module that functional_call re-parametrises per call: not
# thread-safe, so the test's reference forwards take turns (the server has its own model).
_REFERENCE_LOCK = threading.Lock()


def _reference(
    served: Served, seq: Sequence, versions: np.ndarray, sp: SamplingParams
) -> np.ndarray:
    with _REFERENCE_LOCK:
        return reference_logprobs_versions(
            served.model,
            served.weights,
            seq.token_ids,
            versions,
            sp,
            lm_head_fp32=served.settings.lm_head_fp32,
        )


def test_single_sequence_matches_reference(served: Served, transport: str) -> None:
    rng = random.Random(0)
    ids = [rng.randrange(384) for _ in range(50)]
    with Client(served.url(transport)) as c:
        r = c.logprobs(ids, policy_version=2, score_from=10, temperature=0.7)
    ref = _reference(
        served,
        Sequence(token_ids=ids, policy_version=2, score_from=10),
        np.array([-1] * 10 + [2] * 40),
        SamplingParams(temperature=0.7),
    )
    assert r.logprobs.dtype == np.float32 and r.logprobs.shape == (50,)
    assert np.isnan(r.logprobs[:10]).all()
    assert np.array_equal(r.logprobs, ref, equal_nan=True)
    assert r.versions == [2]
    assert r.weight_sha256 == {2: served.server.runtime.store.sha256(2)}  # type: ignore[union-attr]
    assert r.exact is True


def _threads_bitwise(
    served: Served,
    n_threads: int,
    seed: int,
    client_of: Callable[[], AbstractContextManager[Client]],
) -> None:
    """``n_threads`` threads start together, each scoring 3 random cases through the client
    ``client_of()`` gives it: every answer bitwise its own reference, with its own versions."""
    failures: list[str] = []
    errors: list[BaseException] = []
    barrier = threading.Barrier(n_threads)

    def worker(k: int) -> None:
        rng = random.Random(seed + k)
        cases = [_random_case(rng, 384) for _ in range(3)]
        try:
            with client_of() as c:
                barrier.wait(timeout=30)
                for seq, versions, sp in cases:
                    r = c.logprobs_batch(
                        [seq], temperature=sp.temperature, top_k=sp.top_k, top_p=sp.top_p
                    )[0]
                    ref = _reference(served, seq, versions, sp)
                    if r.logprobs.shape != ref.shape or not np.array_equal(
                        r.logprobs, ref, equal_nan=True
                    ):
                        failures.append(f"thread {k}: {r.logprobs} vs {ref}")
                    used = sorted({int(v) for v in versions[1:] if v >= 0})
                    if r.versions != used:
                        failures.append(f"thread {k}: versions {r.versions} != {used}")
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=240)
        assert not t.is_alive(), "a worker thread did not finish in time"
    assert not errors, errors[:3]
    assert not failures, failures[:5]


def test_concurrent_clients_mixed_versions_bitwise(served: Served, transport: str) -> None:
    """>= 32 concurrent clients, mixed versions and per-token versions, deterministic mode."""
    _threads_bitwise(served, 32, 1000, lambda: Client(served.url(transport)))


def test_one_client_shared_by_many_threads(served: Served, transport: str) -> None:
    """One blocking ``Client`` called from 16 threads at once (a rollout worker's thread pool):
    every answer bitwise the reference for its own sequence, none crossed with another's."""
    with Client(served.url(transport)) as shared:
        _threads_bitwise(served, 16, 2000, lambda: nullcontext(shared))


def test_batch_of_sequences_and_cache(served: Served, transport: str) -> None:
    rng = random.Random(7)
    cases = [_random_case(rng, 384) for _ in range(12)]
    seqs = [c[0] for c in cases]
    with Client(served.url(transport)) as c:
        first = c.logprobs_batch(seqs, use_cache=True)
        second = c.logprobs_batch(seqs, use_cache=True)
    for (seq, versions, _), a, b in zip(cases, first, second, strict=True):
        ref = _reference(served, seq, versions, SamplingParams())
        assert np.array_equal(a.logprobs, ref, equal_nan=True)
        assert np.array_equal(b.logprobs, ref, equal_nan=True)
        if a.versions:
            assert b.cached is True
    assert served.server.runtime.cache.stats().hits > 0  # type: ignore[union-attr]


def test_out_of_support_tokens_are_minus_inf(served: Served, transport: str) -> None:
    ids = list(range(40))
    with Client(served.url(transport)) as c:
        r = c.logprobs(ids, policy_version=1, top_k=1)
    ref = _reference(
        served,
        Sequence(token_ids=ids, policy_version=1),
        np.array([-1] + [1] * 39),
        SamplingParams(top_k=1),
    )
    assert np.isneginf(r.logprobs).any()
    assert np.array_equal(r.logprobs, ref, equal_nan=True)


def test_torch_tensor_input_accepted(served: Served, transport: str) -> None:
    import torch

    ids = torch.arange(30)
    with Client(served.url(transport)) as c:
        r = c.logprobs(ids, policy_version=0)
    assert isinstance(r.logprobs, np.ndarray) and r.logprobs.shape == (30,)


def test_versions_info_leases_watermark(served: Served, transport: str) -> None:
    with Client(served.url(transport), token=WRITE_TOKEN) as c:
        vs = c.versions()
        assert [v.policy_version for v in vs][:4] == [0, 1, 2, 3]
        info = c.info()
        assert info.vocab_size == 384 and info.dtype == "bfloat16" and info.mode == "deterministic"
        # The numerics a trainer must share, the same over both transports.
        assert (info.numerics, info.tile_rows, info.attention) == (
            "invariant",
            64,
            "oldlogit_invariant",
        )
        assert info.threads == torch.get_num_threads() and info.lm_head_fp32 is False
        spec = info.numerics_spec()
        assert (spec.profile, spec.dtype, spec.device_kind) == ("invariant", "bfloat16", "cpu")
        assert (info.numerics_revision, info.torch_version) == (
            NUMERICS_REVISION,
            torch.__version__,
        )
        assert info.numerics_revision == 4  # the CUDA definition (docs/exactness.md)
        assert served.server.runtime is not None
        assert served.server.runtime.numerics.startswith(spec.key)  # part of every cache key
        one = c.version(1)
        assert one.weight_sha256 == vs[1].weight_sha256
        with c.lease(2, ttl_s=30) as lease:
            assert lease.policy_version == 2
            assert c.version(2).leases >= 1
        assert c.version(2).leases == 0


def test_fast_mode_under_the_plain_numerics_pads_and_says_so(
    tmp_path_factory: pytest.TempPathFactory, model_dir: Path
) -> None:
    """--numerics hf --mode fast pads sequences of one batch together: its deviation is
    measured at start-up and reported in /v1/info, and every answer says exact=false."""
    s = start_served(tmp_path_factory.mktemp("fast-hf"), model_dir, mode="fast", numerics="hf")
    try:
        with Client(s.server.grpc_url) as c:
            info = c.info()
            assert info.mode == "fast" and info.numerics == "hf"
            assert isinstance(info.fast_mode_max_abs_deviation, float)
            assert 0.0 <= info.fast_mode_max_abs_deviation < 0.25  # bf16, a tiny model
            seqs = [Sequence(token_ids=list(range(1, n)), policy_version=1) for n in (9, 40, 23)]
            res = c.logprobs_batch(seqs)
            assert [r.exact for r in res] == [False, False, False]
            again = c.logprobs(list(range(1, 9)), policy_version=1)  # from the result cache
            assert again.cached and not again.exact
    finally:
        s.server.stop()


def test_fast_mode_is_deterministic_under_the_invariant_numerics(
    tmp_path_factory: pytest.TempPathFactory, model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A padded invariant batch would give the packed bits at the padding's cost: --mode fast
    is an alias there, said in /v1/info and at start-up."""
    with caplog.at_level("WARNING"):
        s = start_served(tmp_path_factory.mktemp("fast"), model_dir, mode="fast")
    try:
        assert any("alias of deterministic" in r.message for r in caplog.records)
        with Client(s.server.grpc_url) as c:
            info = c.info()
            assert info.mode == "deterministic" and info.numerics == "invariant"
            ids = list(range(1, 40))
            got = c.logprobs(ids, policy_version=1).logprobs
        ref = reference_logprobs_versions(s.model, s.weights, ids, [-1] + [1] * (len(ids) - 1))
        assert np.array_equal(got[1:], ref[1:])
    finally:
        s.server.stop()


def test_http_keep_alive_requests_are_not_held_by_nagle(served: Served) -> None:
    """Sequential requests on one keep-alive connection answer in milliseconds: the listening
    socket turns Nagle's algorithm off, so a response's body (uvicorn sends it after the head)
    never waits for the client's delayed ACK (40 ms on Linux; every such request took 44 ms
    before). The same for a scoring call, whose answer takes one small forward."""
    import time

    import httpx

    body = {"sequences": [{"token_ids": [1, 2, 3, 4], "policy_version": 0}], "use_cache": False}
    with httpx.Client(base_url=served.server.http_url, timeout=30) as h:
        h.get("/healthz").raise_for_status()  # the connection, opened once
        h.post("/v1/logprobs", json=body).raise_for_status()
        for method, path, kw in (("GET", "/healthz", {}), ("POST", "/v1/logprobs", {"json": body})):
            took = []
            for _ in range(15):
                start = time.perf_counter()
                h.request(method, path, **kw).raise_for_status()
                took.append(time.perf_counter() - start)
            # Nagle's stall holds every response for the delayed ACK (≥ 40 ms each, by
            # construction); a busy machine slows some requests, not all: the fastest of 15
            # shows which it is without assuming how fast this machine is.
            assert min(took) < 0.03, (path, [round(t * 1e3, 1) for t in took])


def test_client_requests_import_nothing(served: Served, transport: str) -> None:
    """A request through the client imports no module it has not imported before: httpcore
    imports ``sniffio`` on every async HTTP request (four times), and without it installed each
    import searched the whole ``sys.path`` again (a dependency of the client for that reason)."""
    import asyncio
    import builtins
    import sys

    from oldlogit import AsyncClient

    missed: list[str] = []
    real_import = builtins.__import__

    def watching(name: str, *args: object, **kwargs: object) -> object:
        level = args[3] if len(args) > 3 else kwargs.get("level", 0)
        if level == 0 and name not in sys.modules:
            missed.append(name)
        return real_import(name, *args, **kwargs)  # type: ignore[arg-type]

    async def calls() -> None:
        async with AsyncClient(served.url(transport)) as c:
            await c.logprobs([1, 2, 3, 4], policy_version=0, use_cache=False)  # imports settle
            builtins.__import__ = watching
            try:
                for _ in range(3):
                    await c.logprobs([1, 2, 3, 4], policy_version=0, use_cache=False)
            finally:
                builtins.__import__ = real_import

    asyncio.run(calls())
    assert not missed, f"imported on every request: {sorted(set(missed))}"
