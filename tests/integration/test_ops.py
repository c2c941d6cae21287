"""Operations: health (both transports), reflection, metrics, responsiveness during long
batches, deadlines, draining, and no 5xx for malformed bodies."""

from __future__ import annotations

import json
import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from oldlogit import Client
from oldlogit.contract import errors

from .conftest import Served, start_served

pytestmark = pytest.mark.integration


def test_grpc_health_and_reflection(served: Served) -> None:
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    target = served.server.grpc_url.removeprefix("grpc://")
    with grpc.insecure_channel(target) as ch:
        health = health_pb2_grpc.HealthStub(ch)
        for name in ("", "oldlogit.v1.OldLogit"):
            r = health.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
            assert r.status == health_pb2.HealthCheckResponse.SERVING
        refl = reflection_pb2_grpc.ServerReflectionStub(ch)
        req = reflection_pb2.ServerReflectionRequest(list_services="")
        (resp,) = list(refl.ServerReflectionInfo(iter([req]), timeout=5))
        names = {s.name for s in resp.list_services_response.service}
        assert {"oldlogit.v1.OldLogit", "grpc.health.v1.Health"} <= names


def test_metrics_export_the_promised_series(served: Served) -> None:
    with Client(served.url("grpc")) as c:
        c.logprobs(list(range(20)), policy_version=1)
    with Client(served.url("http")) as c:
        c.logprobs(list(range(20)), policy_version=1)
    text = httpx.get(f"{served.server.http_url}/metrics").text
    for series in (
        "oldlogit_requests_total",
        "oldlogit_request_latency_seconds_bucket",
        "oldlogit_queue_wait_seconds_bucket",
        "oldlogit_batch_tokens_bucket",
        "oldlogit_tokens_total",
        "oldlogit_tier_bytes",
        "oldlogit_tier_budget_bytes",
        "oldlogit_evictions_total",
        'oldlogit_weight_loads_total{source="disk"}',
        "oldlogit_weight_load_seconds_total",
        "oldlogit_rebuilds_total",
        "oldlogit_patches_applied_total",
        "oldlogit_background_paused_seconds_total",
        "oldlogit_background_turns_total",
        "oldlogit_forward_turn_wait_seconds_total",
        "oldlogit_cache_hits_total",
        "oldlogit_cache_misses_total",
        "oldlogit_publish_seconds_bucket",
        "oldlogit_queue_depth",
        "oldlogit_versions",
    ):
        assert series in text, series
    assert 'transport="grpc"' in text and 'transport="http"' in text
    assert 'route="/v1/logprobs"' in text and 'route="Logprobs"' in text


def test_openapi_documents_the_routes(served: Served) -> None:
    spec = httpx.get(f"{served.server.http_url}/openapi.json").json()
    for path in (
        "/v1/logprobs",
        "/v1/trace",
        "/v1/versions",
        "/v1/versions/{policy_version}",
        "/v1/watermark",
        "/v1/leases",
        "/v1/leases/{lease_id}",
        "/v1/info",
        "/healthz",
        "/readyz",
        "/metrics",
    ):
        assert path in spec["paths"], path
    body = spec["paths"]["/v1/logprobs"]["post"]["requestBody"]["content"]
    assert "application/json" in body and "application/msgpack" in body


def test_health_answers_during_a_long_batch(
    served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    """/healthz answers promptly while the compute thread is inside a batch. The batch is long
    by construction, not by its size: once the engine is called it keeps running real forwards
    of that batch until the probes are done (bounded), so the probes always overlap it."""
    from oldlogit import Sequence
    from oldlogit_service.model.engine import Engine

    inside = threading.Event()
    release = threading.Event()
    original = Engine.run
    forwards = 0

    def held_run(self: Engine, weights: Any, jobs: Any) -> Any:
        nonlocal forwards
        out = original(self, weights, jobs)
        inside.set()
        deadline = time.monotonic() + 60
        while True:  # the same real work again, at least once: the GIL and cores busy
            original(self, weights, jobs)
            forwards += 1
            if release.is_set() or time.monotonic() > deadline:
                break
        return out

    monkeypatch.setattr(Engine, "run", held_run)
    failures: list[BaseException] = []

    def long_request() -> None:
        try:
            with Client(served.url("grpc")) as c:
                seqs = [[(i + j) % 384 for j in range(200)] for i in range(8)]
                c.logprobs_batch(
                    [Sequence(token_ids=s, policy_version=2) for s in seqs], use_cache=False
                )
        except BaseException as exc:  # reported by the main thread
            failures.append(exc)
            inside.set()

    t = threading.Thread(target=long_request)
    t.start()
    assert inside.wait(60), "the batch never reached the engine"
    worst = 0.0
    probes = 0
    try:
        while probes < 20:
            t0 = time.perf_counter()
            assert httpx.get(f"{served.server.http_url}/healthz", timeout=5).status_code == 200
            worst = max(worst, time.perf_counter() - t0)
            probes += 1
            time.sleep(0.02)
        still_inside = not release.is_set() and t.is_alive()
    finally:
        release.set()
        t.join(timeout=120)
    assert not t.is_alive(), "a worker thread did not finish in time"
    assert not failures, failures
    assert still_inside, "the batch ended before the probes did"
    assert forwards > 0  # the compute thread was running forwards while the probes ran
    assert worst < 0.5, f"/healthz took {worst:.3f}s during a batch"


def test_deadline_exceeded_over_both_transports(served: Served, transport: str) -> None:
    from oldlogit import Sequence

    seqs = [
        Sequence(token_ids=[(i + j) % 384 for j in range(400)], policy_version=3) for i in range(60)
    ]
    with Client(served.url(transport), retries=0) as c:
        with pytest.raises(errors.DeadlineExceeded):
            c.logprobs_batch(seqs, use_cache=False, timeout_s=0.05)


def test_no_5xx_for_malformed_bodies(served: Served) -> None:
    rng = random.Random(0)
    atoms: list[object] = [
        None,
        True,
        0,
        -1,
        1.5,
        "x",
        "-inf",
        [],
        {},
        [1, 2],
        10**30,
        float("nan"),
    ]

    def rand_value(depth: int = 0) -> object:
        r = rng.random()
        if depth < 3 and r < 0.25:
            return {
                rng.choice(
                    [
                        "sequences",
                        "token_ids",
                        "policy_version",
                        "versions",
                        "score_from",
                        "sampling",
                        "temperature",
                        "top_k",
                        "top_p",
                        "use_cache",
                        "proxy",
                        "timeout_s",
                        "zzz",
                    ]
                ): rand_value(depth + 1)
                for _ in range(rng.randint(0, 4))
            }
        if depth < 3 and r < 0.45:
            return [rand_value(depth + 1) for _ in range(rng.randint(0, 4))]
        return rng.choice(atoms)

    statuses: dict[int, int] = {}
    with httpx.Client(base_url=served.server.http_url, timeout=30) as h:
        for i in range(300):
            body = rand_value()
            if i % 3 == 0:
                body = {"sequences": [rand_value() for _ in range(rng.randint(0, 3))]}
            raw = json.dumps(body, allow_nan=True).encode()
            if i % 17 == 0:
                raw = raw[: rng.randint(0, len(raw))]
            r = h.post("/v1/logprobs", content=raw, headers={"content-type": "application/json"})
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
            assert r.status_code < 500, (raw, r.text)
            if r.status_code >= 400:
                err = r.json()["error"]
                assert err["code"] in errors._BY_CODE, err
                assert "Traceback" not in r.text
    assert statuses.get(400, 0) > 100


@pytest.fixture
def drainable(tmp_path: Path, model_dir: Path) -> Iterator[Served]:
    s = start_served(tmp_path, model_dir)
    yield s
    s.server.stop()


def test_draining_flips_readiness_and_refuses_new_work(drainable: Served, transport: str) -> None:
    rt = drainable.server.runtime
    assert rt is not None
    assert httpx.get(f"{drainable.server.http_url}/readyz").status_code == 200
    rt.start_draining()
    assert httpx.get(f"{drainable.server.http_url}/readyz").status_code == 503
    assert httpx.get(f"{drainable.server.http_url}/healthz").status_code == 200  # still alive
    with Client(drainable.url(transport), retries=0) as c:
        with pytest.raises(errors.Unavailable):
            c.logprobs([1, 2, 3], policy_version=0)
