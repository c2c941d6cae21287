"""The Ray Serve peer of `oldlogit bench peer` (benchmarks/peer.py): model multiplexing as
Ray Serve's docs teach it, held fixed. One replica; a version is a multiplexed model (its id
is the version number, sent in the ``serve_multiplexed_model_id`` header); on a miss the
replica builds the transformers model from the model directory and loads the version's
safetensors file into it, keeping at most BUDGET_VERSIONS models (Ray's LRU); one forward per
request (benchmarks/naive_server.py's ``token_logprobs``).

Needs the optional extra: ``pip install 'oldlogit[peer]'`` (ray[serve]). Ray runs locally only:
its own cluster on this machine, no dashboard, shut down by ``stop``.
"""

from __future__ import annotations

import logging
import os
import socket
from pathlib import Path
from typing import Any

import ray
import torch
from ray import serve
from starlette.requests import Request

from benchmarks.common import BUDGET_VERSIONS
from benchmarks.naive_server import load_version, token_logprobs


@serve.deployment(num_replicas=1)
class VersionedLogprobs:
    def __init__(self, model_dir: str, versions_dir: str, dtype: str, threads: int) -> None:
        # Ray gives a worker one intra-op thread; the peer gets as many as our server.
        torch.set_num_threads(threads)
        self.model_dir = model_dir
        self.versions_dir = Path(versions_dir)
        self.dtype = getattr(torch, dtype)

    @serve.multiplexed(max_num_models_per_replica=BUDGET_VERSIONS)
    async def get_model(self, model_id: str) -> Any:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=self.dtype).eval()
        load_version(model, self.versions_dir, model_id)
        return model

    async def __call__(self, request: Request) -> dict[str, Any]:
        model = await self.get_model(serve.get_multiplexed_model_id())
        body = await request.json()
        return {"logprobs": token_logprobs(model, body["token_ids"])}


def start(model_dir: Path, versions_dir: Path, *, dtype: str, threads: int) -> str:
    """A local Ray cluster (2 CPUs, no dashboard) with the deployment on one replica; returns
    its HTTP URL once the replica is up."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(
        address="local",
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        logging_level=logging.WARNING,
        object_store_memory=256 * 1024**2,
    )
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    app = VersionedLogprobs.bind(str(model_dir), str(versions_dir), dtype, threads)
    serve.run(app, name="peer", route_prefix="/")
    return f"http://127.0.0.1:{port}"


def stop() -> None:
    """Serve, then the local Ray cluster, shut down (nothing when ``start`` got no cluster)."""
    if not ray.is_initialized():
        return
    try:
        serve.shutdown()
    finally:
        ray.shutdown()
