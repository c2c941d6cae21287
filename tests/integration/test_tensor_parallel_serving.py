"""`oldlogit serve --tensor-parallel N`: one replica over N gloo ranks, bitwise equal to N = 1.

A TP 2 server and a TP 1 server (both ``--tp-chunks 8``, device budgets that hold about one
version, so requests evict and reload) take the same delta publishes over both transports and
answer every request with the same bits; a killed rank fails readiness and requests by name;
bad setups and a rank that cannot join are refused by name at start-up. The killed rank and
the rank that cannot join (each its own TP 2 server) run under the ``slow`` marker.
"""

from __future__ import annotations

import random
import signal
import time
from collections.abc import Iterator
from collections.abc import Set as AbstractSet
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import psutil
import pytest
import torch

from oldlogit import Client, Sampling, Sequence, Unavailable
from oldlogit.parity.tensor_parallel import TensorParallelError
from oldlogit_service.config import Settings
from oldlogit_service.demo.tiny import make_tiny_model_dir
from oldlogit_service.model.checkpoints import load_weights
from oldlogit_service.model.loaded import UnsupportedModel, load_model
from oldlogit_service.server import ServerThread, build_service

from ..e2e.conftest import start_cli
from .conftest import WRITE_TOKEN

pytestmark = pytest.mark.integration

GIB = 1024**3


@dataclass
class Pair:
    tp: ServerThread  # --tensor-parallel N
    one: ServerThread  # --tensor-parallel 1, the same --tp-chunks
    base: dict[str, torch.Tensor]  # version 0 (the model directory's weights)


def _settings(tmp: Path, model_dir: Path, degree: int, budget_gib: float) -> Settings:
    return Settings(
        model=model_dir,
        snapshot_dir=tmp / f"tp{degree}",
        http_port=0,
        grpc_port=0,
        dtype="bfloat16",
        tensor_parallel=degree,
        tp_chunks=8,
        device_budget_gib=budget_gib,
        keyframe_every=3,
        write_token=WRITE_TOKEN,
        max_seq_len=512,
        max_wait_ms=1.0,
        drain_timeout_s=5.0,
        rank_timeout_s=60.0,
    )


def start_pair(tmp: Path, model_dir: Path, degree: int, versions: float = 1.4) -> Pair:
    model = load_model(model_dir, dtype="bfloat16", device="cpu")
    base = load_weights(model_dir, model)
    assert base is not None
    # About one version resident per rank: the requests below evict and reload.
    budget = versions * model.nbytes / GIB
    tp = ServerThread(_settings(tmp, model_dir, degree, budget)).start()
    try:
        one = ServerThread(_settings(tmp, model_dir, 1, budget)).start()
    except BaseException:
        tp.stop()
        raise
    return Pair(tp, one, dict(base))


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[Pair]:
    p = start_pair(tmp_path_factory.mktemp("tp"), model_dir, 2)
    yield p
    p.tp.stop()
    p.one.stop()


def _url(server: ServerThread, transport: str) -> str:
    return server.http_url if transport == "http" else server.grpc_url


def step(w: dict[str, torch.Tensor], seed: int, frac: float = 0.03) -> dict[str, torch.Tensor]:
    """An optimizer-like step: a few elements move (a delta publish carries only those)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, t in w.items():
        mask = torch.rand(t.shape, generator=g) < frac
        out[k] = torch.where(mask, (t.float() * 1.01 + 1e-3).to(t.dtype), t)
    return out


def _sequences(rng: random.Random, versions: list[int], n: int) -> list[Sequence]:
    out = []
    for _ in range(n):
        length = rng.randint(2, 120)
        ids = [rng.randrange(384) for _ in range(length)]
        sampling = rng.choice(
            [
                Sampling(),
                Sampling(temperature=0.7),
                Sampling(temperature=1.3, top_k=50),
                Sampling(top_p=0.9),
            ]
        )
        if rng.random() < 0.5:
            out.append(
                Sequence(
                    token_ids=ids,
                    policy_version=rng.choice(versions),
                    score_from=rng.randint(1, length),
                    sampling=sampling,
                )
            )
        else:
            per_token = [rng.choice([-1, *versions]) for _ in range(length)]
            out.append(Sequence(token_ids=ids, versions=per_token, sampling=sampling))
    return out


def _assert_same(pair: Pair, transport: str, seqs: list[Sequence]) -> None:
    _assert_urls_same(_url(pair.tp, transport), _url(pair.one, transport), seqs)


def _assert_urls_same(tp_url: str, one_url: str, seqs: list[Sequence]) -> None:
    """The tensor-parallel server at ``tp_url`` answers ``seqs`` as the one at ``one_url``."""
    with Client(tp_url) as a, Client(one_url) as b:
        got = a.logprobs_batch(seqs, use_cache=False)
        want = b.logprobs_batch(seqs, use_cache=False)
    for seq, x, y in zip(seqs, got, want, strict=True):
        assert np.array_equal(x.logprobs, y.logprobs, equal_nan=True), seq
        assert x.weight_sha256 == y.weight_sha256


@pytest.mark.parametrize(("transport", "first"), [("http", 100), ("grpc", 200)])
def test_tp2_equals_tp1_through_deltas_and_evictions(
    pair: Pair, transport: str, first: int
) -> None:
    w = pair.base
    published = []
    with (
        Client(_url(pair.tp, transport), token=WRITE_TOKEN) as a,
        Client(_url(pair.one, transport), token=WRITE_TOKEN) as b,
    ):
        for i in range(4):
            w = step(w, first + i)
            ra = a.publish(first + i, w, delta=True)
            rb = b.publish(first + i, w, delta=True)
            assert ra.created and ra.weight_sha256 == rb.weight_sha256  # the whole-version hash
            published.append(first + i)
        assert not a.publish(first + 3, w, delta=True).created  # idempotent
        kinds = {v.policy_version: v.kind for v in a.versions()}
        assert {kinds[v] for v in published} == {"patch", "keyframe"}
    # Every rank stores its own part of each version, delta-encoded against its own parts.
    svc = pair.tp.service
    assert svc is not None and svc.replica is not None
    front = svc.replica.front
    assert {r.kind for r in front.store.versions() if r.version in published} >= {"patch"}
    rng = random.Random(first)
    # Interleaved versions, one per request, then mixed: loads evict the other versions.
    for v in [published[0], published[3], published[1], published[3], published[2], 0]:
        _assert_same(pair, transport, _sequences(rng, [v], 3))
    _assert_same(pair, transport, _sequences(rng, [0, *published], 8))
    stats = front.rank_stats()
    assert len(stats) == 2
    for rank in stats:
        assert rank["device_evictions"] > 0, rank  # versions were evicted and reloaded
        assert rank["device_versions"] >= 1


def test_a_version_one_rank_evicted_is_held_on_every_rank_before_it_runs(
    pair: Pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each rank's store evicts by its own clock, so a version can stay resident on the front
    and be gone on another rank. It must not run until the load stage has held it on every
    rank: otherwise that rank loads it inside the forward while the versions held for the
    queued work fill its budget, and the ranks wait on each other."""
    first = 300
    w = pair.base
    with (
        Client(pair.tp.http_url, token=WRITE_TOKEN) as a,
        Client(pair.one.http_url, token=WRITE_TOKEN) as b,
    ):
        for i in range(3):
            w = step(w, first + i)
            assert a.publish(first + i, w).created and b.publish(first + i, w).created
    svc = pair.tp.service
    assert svc is not None and svc.replica is not None
    front = svc.replica.front
    # Every forward's version must be held on every rank when it starts.
    held: dict[int, int] = {}
    letting_go: dict[int, int] = {}
    unheld_forwards: list[int] = []
    hold, unhold, forward = front.hold, front.unhold, front.forward

    def holding(version: int, wanted: AbstractSet[int] = frozenset()) -> None:
        hold(version, wanted)
        held[version] = held.get(version, 0) + 1

    def unholding(version: int, *, ranks: list[int] | None = None) -> None:
        # Counted unheld before the ranks let go (a forward in between would be unheld), and
        # let go only once every rank has replied: the test evicts after that.
        letting_go[version] = letting_go.get(version, 0) + 1
        held[version] -= 1
        try:
            unhold(version, ranks=ranks)
        finally:
            letting_go[version] -= 1

    def forwarding(op: str, weights: Any, jobs: Any) -> Any:
        if not held.get(weights.version):
            unheld_forwards.append(weights.version)
        return forward(op, weights, jobs)

    monkeypatch.setattr(front, "hold", holding)
    monkeypatch.setattr(front, "unhold", unholding)
    monkeypatch.setattr(front, "forward", forwarding)
    rng = random.Random(first)
    for _ in range(3):
        for _attempt in range(5):
            _assert_same(pair, "http", _sequences(rng, [first], 2))  # resident on every rank
            deadline = time.monotonic() + 10
            # The load stage lets it go on every rank.
            while (held.get(first) or letting_go.get(first)) and time.monotonic() < deadline:
                time.sleep(0.01)
            # Letting go may evict it on the front too (its store keeps by its own order,
            # which credits rebuild cost and reuse, not only recency; seen once in a full
            # run). Nothing else runs now, so what is resident stays until the eviction below.
            if front.store.resident(first):
                break
        # Rank 1 drops it; the front keeps it.
        evicted = [r.raise_for(rank) for rank, r in enumerate(front._command("evict", first))]
        assert front.store.resident(first) and evicted[1]
        # The evicted version first, the others at once: the load stage holds two of them
        # while the compute stage takes the first.
        batches = [_sequences(rng, [v], 2) for v in (first, first + 1, first + 2)]
        with ThreadPoolExecutor(len(batches)) as pool:
            done = [pool.submit(_answers, pair.tp.http_url, seqs) for seqs in batches]
            got = [f.result(timeout=60) for f in done]
        for seqs, answers in zip(batches, got, strict=True):
            assert answers == _answers(pair.one.http_url, seqs)
    assert not unheld_forwards


def _answers(url: str, seqs: list[Sequence]) -> list[bytes]:
    with Client(url, timeout_s=30) as c:
        return [r.logprobs.tobytes() for r in c.logprobs_batch(seqs, use_cache=False)]


def test_info_reports_the_ranks(pair: Pair) -> None:
    r = httpx.get(f"{pair.tp.http_url}/v1/info", timeout=30)
    r.raise_for_status()
    info = r.json()
    assert info["tp_chunks"] == 8
    assert info["tensor_parallel"] == 2
    ranks = info["ranks"]
    assert [x["rank"] for x in ranks] == [0, 1]
    assert all(x["threads"] >= 1 and x["device_bytes"] > 0 for x in ranks)
    assert httpx.get(f"{pair.tp.http_url}/readyz", timeout=10).status_code == 200


@pytest.mark.slow  # a TP 2 `oldlogit serve` of its own, one rank SIGKILLed: ~20 s on 2 cores
def test_a_killed_rank_fails_readiness_and_requests_by_name(
    tmp_path: Path, model_dir: Path
) -> None:
    srv = start_cli(
        [
            "--model",
            str(model_dir),
            "--tensor-parallel",
            "2",
            "--dtype",
            "bfloat16",
            "--http-port",
            "0",
            "--grpc-port",
            "0",
            "--snapshot-dir",
            str(tmp_path / "snap"),
        ]
    )
    try:
        ids = list(range(5, 60))
        with Client(f"http://{srv.http}") as c:
            before = c.logprobs(ids, policy_version=0, use_cache=False)
            assert np.isfinite(before.logprobs[1:]).all()
        info = httpx.get(f"http://{srv.http}/v1/info", timeout=30).json()
        follower = psutil.Process(info["ranks"][1]["pid"])
        assert follower.ppid() == srv.proc.pid  # the front started it
        follower.send_signal(signal.SIGKILL)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            r = httpx.get(f"http://{srv.http}/readyz", timeout=10)
            if r.status_code == 503:
                break
            time.sleep(0.1)
        assert r.status_code == 503
        assert "rank 1" in r.json()["reason"]
        for url in (f"http://{srv.http}", f"grpc://{srv.grpc}"):
            with Client(url, retries=0) as c:
                start = time.monotonic()
                with pytest.raises(Unavailable, match="rank 1"):
                    c.logprobs(ids, policy_version=0, use_cache=False)
                assert time.monotonic() - start < 10
    finally:
        assert srv.stop() == 0
    assert not any("Traceback" in line for line in srv.lines), "\n".join(srv.lines[-40:])


@pytest.mark.slow  # a TP 2 `oldlogit serve` start that fails late: ~19 s on 2 cores
def test_a_rank_that_cannot_join_is_refused_by_name(tmp_path: Path, model_dir: Path) -> None:
    snap = tmp_path / "snap"
    (snap / "ranks" / "tp2").mkdir(parents=True)
    (snap / "ranks" / "tp2" / "1").write_text("not a directory")  # rank 1 cannot open its store
    with pytest.raises(RuntimeError) as info:
        start_cli(
            [
                "--model",
                str(model_dir),
                "--tensor-parallel",
                "2",
                "--http-port",
                "0",
                "--grpc-port",
                "0",
                "--snapshot-dir",
                str(snap),
                "--rank-timeout-s",
                "30",
            ],
            timeout_s=60,
        )
    text = str(info.value)
    assert "tensor-parallel rank 1 could not join the replica at 127.0.0.1:" in text
    assert "Traceback" not in text


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        ({"tensor_parallel": 2, "numerics": "hf"}, "--numerics hf"),
        ({"tensor_parallel": 2, "tp_chunks": 0}, "--tp-chunks"),
        ({"tensor_parallel": 2, "strategy": "lagging"}, "--strategy lagging"),
        ({"tensor_parallel": 2, "ewma_beta": 0.5}, "--ewma-beta"),
    ],
)
def test_bad_settings_are_refused_by_name(
    tmp_path: Path, model_dir: Path, overrides: dict[str, object], named: str
) -> None:
    with pytest.raises(ValueError, match=named):
        Settings(model=model_dir, snapshot_dir=tmp_path, **overrides)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("degree", "chunks", "named"),
    [
        (8, 8, "num_attention_heads"),  # 4 query heads
        (4, 8, "num_key_value_heads"),  # 2 KV heads
        (2, 6, "tp_chunks 6 does not divide"),  # hidden 64 in 6 chunks
        (4, 2, "does not divide tp_chunks 2"),
    ],
)
def test_bad_degrees_are_refused_by_name_before_any_rank_starts(
    tmp_path: Path, model_dir: Path, degree: int, chunks: int, named: str
) -> None:
    settings = Settings(
        model=model_dir, snapshot_dir=tmp_path, tensor_parallel=degree, tp_chunks=chunks
    )
    before = {p.pid for p in psutil.Process().children()}
    # The skeleton's own check (UnsupportedModel) or the replica's (TensorParallelError).
    with pytest.raises((TensorParallelError, UnsupportedModel), match=named):
        build_service(settings)
    assert {p.pid for p in psutil.Process().children()} <= before  # no rank was started


@pytest.mark.slow
def test_tp4_equals_tp1(tmp_path: Path, tiny_model_factory: object) -> None:
    """TP 4 (its own process: one tensor-parallel front per process) against TP 1, through a
    delta publish."""
    model_dir = tiny_model_factory(  # type: ignore[operator]
        arch="llama", seed=5, vocab_size=384, hidden_size=64, num_heads=4, num_kv_heads=4
    )
    model = load_model(model_dir, dtype="bfloat16", device="cpu")
    base = load_weights(model_dir, model)
    assert base is not None
    budget = 4.0 * model.nbytes / GIB  # every rank holds a version
    srv = start_cli(
        [
            *("--model", str(model_dir), "--tensor-parallel", "4", "--dtype", "bfloat16"),
            *("--device-budget-gib", f"{budget:.9f}", "--keyframe-every", "3"),
            *("--write-token", WRITE_TOKEN, "--snapshot-dir", str(tmp_path / "snap")),
            *("--http-port", "0", "--grpc-port", "0", "--rank-timeout-s", "60"),
        ]
    )
    one = ServerThread(_settings(tmp_path, model_dir, 1, budget)).start()
    try:
        w = step(dict(base), 1)
        for url in (f"http://{srv.http}", one.http_url):
            with Client(url, token=WRITE_TOKEN) as c:
                c.publish(1, w, delta=True)
        rng = random.Random(4)
        for tp_url, one_url in (
            (f"http://{srv.http}", one.http_url),
            (f"grpc://{srv.grpc}", one.grpc_url),
        ):
            _assert_urls_same(tp_url, one_url, _sequences(rng, [0, 1], 6))
    finally:
        one.stop()
        assert srv.stop() == 0


@pytest.mark.gpu
def test_nccl_tp2_equals_tp1(tmp_path: Path, model_dir: Path) -> None:
    """NCCL ranks on two GPUs (their own process: one tensor-parallel front per process)."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    srv = start_cli(
        [
            *("--model", str(model_dir), "--tensor-parallel", "2", "--dtype", "bfloat16"),
            *("--device", "cuda", "--snapshot-dir", str(tmp_path / "snap")),
            *("--http-port", "0", "--grpc-port", "0"),
        ]
    )
    one = ServerThread(
        _settings(tmp_path, model_dir, 1, 1.0).model_copy(update={"device": "cuda"})
    ).start()
    try:
        _assert_urls_same(f"grpc://{srv.grpc}", one.grpc_url, _sequences(random.Random(2), [0], 6))
    finally:
        one.stop()
        assert srv.stop() == 0


@pytest.mark.slow  # the engine's tied head at TP 2 is in the default run: tp_worker's engine_tied
def test_tied_head_tp2_equals_tp1(tmp_path: Path) -> None:
    """A head tied to the embedding: the ranks hold the embedding whole and each takes its
    vocabulary rows of the head at the forward; the answers are TP 1's. (The TP 2 server runs
    as its own process: one tensor-parallel front per process, and this module's is taken.)"""
    tied = make_tiny_model_dir(
        tmp_path / "tied",
        arch="qwen2",
        seed=5,
        vocab_size=384,
        hidden_size=64,
        num_layers=2,
        max_positions=1024,
        tie_word_embeddings=True,
    )
    assert load_model(tied, dtype="bfloat16", device="cpu").aliases  # tied indeed
    srv = start_cli(
        [
            *("--model", str(tied), "--tensor-parallel", "2", "--dtype", "bfloat16"),
            *("--http-port", "0", "--grpc-port", "0", "--snapshot-dir", str(tmp_path / "snap")),
        ]
    )
    one = ServerThread(_settings(tmp_path, tied, 1, 1.0)).start()
    try:
        _assert_urls_same(f"grpc://{srv.grpc}", one.grpc_url, _sequences(random.Random(7), [0], 6))
    finally:
        one.stop()
        assert srv.stop() == 0
