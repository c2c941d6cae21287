"""The architecture matrix, served: each family starts from its checkpoint and takes its own
state dict from a trainer.

Per family of ``tests/architectures.py``: ``oldlogit serve`` (a real server) starts from the
``save_pretrained`` directory (MoE: the per-expert hub layout), a trainer publishes its own
``model.state_dict()`` — tied entries, fused experts and persistent buffers as transformers
holds them — once full and twice as a delta, and every answer, over gRPC and HTTP, is bitwise
the reference at that version, under the hash of the canonical weights; in both numerics
profiles (``hf``: ``slow``).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from oldlogit import Client, Sequence
from oldlogit.contract.weights import weight_sha256
from oldlogit_service.config import Settings
from oldlogit_service.model.checkpoints import canonicalize_weights
from oldlogit_service.model.loaded import load_model
from oldlogit_service.model.numerics import SamplingParams
from oldlogit_service.model.reference import reference_logprobs
from oldlogit_service.server import ServerThread
from tests.architectures import ARCHS, VOCAB, hf_model, model_dir, persistent_state
from tests.integration.conftest import WRITE_TOKEN

# The `hf` profile's servers are `slow` (15 servers, ~14 s on 2 cores): the publish path does
# not depend on the profile, and the default run holds every family's `hf` engine bitwise the
# reference in-process (tests/unit/test_architectures.py).
PROFILES = [
    pytest.param(
        (arch, profile), marks=[pytest.mark.slow] if profile == "hf" else [], id=f"{arch}-{profile}"
    )
    for arch in ARCHS
    for profile in ("invariant", "hf")
]


@pytest.fixture
def arch_server(
    request: pytest.FixtureRequest, tmp_path: Path
) -> Iterator[tuple[ServerThread, Path, str]]:
    arch, profile = request.param
    hub = model_dir(tmp_path / "model", arch)
    settings = Settings(
        model=hub,
        snapshot_dir=tmp_path / "snapshots",
        http_port=0,
        grpc_port=0,
        dtype="float32",
        numerics=profile,
        tile_rows=16,
        write_token=WRITE_TOKEN,
        max_wait_ms=1.0,
    )
    server = ServerThread(settings).start()
    yield server, hub, arch
    server.stop()


def _nudge(model: torch.nn.Module, seed: int, share: float) -> None:
    """An optimizer step's worth of change: a fraction of elements moves."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            mask = torch.rand(p.shape, generator=gen) < share
            p.add_(mask * torch.randn(p.shape, generator=gen) * 0.01)


@pytest.mark.parametrize("arch_server", PROFILES, indirect=True)
def test_trainer_publishes_its_own_state_dict_and_gets_reference_bits(arch_server):
    server, hub, arch = arch_server
    runtime = server.runtime
    assert runtime is not None
    served = runtime.model
    reference = load_model(
        hub, dtype="float32", device="cpu", numerics=served.profile, tile_rows=16
    )
    trainer = hf_model(arch, seed=5)  # the trainer's weights: not the directory's
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, VOCAB, (n,), generator=gen) for n in (4, 19, 37)]
    with Client(server.grpc_url, token=WRITE_TOKEN) as grpc, Client(server.http_url) as http:
        for version, delta in ((1, False), (2, True), (3, True)):
            if version > 1:
                _nudge(trainer, version, 0.05)
            state = persistent_state(trainer)  # tied duplicates and all, as a trainer has it
            res = grpc.publish(version, state, delta=delta)
            canonical = canonicalize_weights(reference, state)
            assert res.weight_sha256 == weight_sha256(canonical)
            for client in (grpc, http):
                results = client.logprobs_batch(
                    [Sequence(token_ids=s, policy_version=version) for s in seqs],
                    temperature=0.8,
                    use_cache=False,
                )
                for s, r in zip(seqs, results, strict=True):
                    ref = reference_logprobs(reference, canonical, s, SamplingParams(0.8))
                    assert np.array_equal(r.logprobs[1:], ref[1:], equal_nan=True), version
                    assert r.weight_sha256 == {version: res.weight_sha256}
        kinds = {v.policy_version: v.kind for v in grpc.versions()}
    assert set(kinds) >= {0, 1, 2, 3}
