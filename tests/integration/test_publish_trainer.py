"""Publishing from a trainer as it lives: tied heads, wrappers, fp32 masters, hub checkpoints.

A real server (bfloat16, a tied Qwen2 and an untied Mixtral) and real trainer objects:
``model.state_dict()`` with its tied ``lm_head.weight`` (and one whose head is not tied:
refused, naming it), a ``torch.compile`` wrapper
(``_orig_mod.``), ``DataParallel`` (``module.``), activation-checkpoint wrappers inside the
model, float32 master weights (refused naming the tensor, accepted with ``cast=True``), a
per-expert hub checkpoint directory uploaded as it is. Every publish is served bitwise under
the hash of the canonical weights, full and delta alike.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from oldlogit import Client, WeightsMismatch
from oldlogit.contract.layout import strip_wrappers
from oldlogit.contract.weights import weight_sha256
from oldlogit_service.config import Settings
from oldlogit_service.model.checkpoints import canonicalize_weights
from oldlogit_service.model.loaded import load_model
from oldlogit_service.model.numerics import SamplingParams
from oldlogit_service.model.reference import reference_logprobs
from oldlogit_service.server import ServerThread
from tests.architectures import hf_model, model_dir

from .conftest import WRITE_TOKEN

pytestmark = pytest.mark.integration


def _serve(tmp: Path, hub: Path) -> ServerThread:
    settings = Settings(
        model=hub,
        snapshot_dir=tmp / "snapshots",
        http_port=0,
        grpc_port=0,
        dtype="bfloat16",
        tile_rows=16,
        write_token=WRITE_TOKEN,
    )
    return ServerThread(settings).start()


@pytest.fixture(scope="module")
def tied(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerThread, Path]]:
    tmp = tmp_path_factory.mktemp("tied")
    hub = model_dir(tmp / "model", "gemma")  # tie_word_embeddings=True
    server = _serve(tmp, hub)
    yield server, hub
    server.stop()


def _check(server: ServerThread, hub: Path, c: Client, version: int, state: dict) -> None:
    model = load_model(hub, dtype="bfloat16", device="cpu", tile_rows=16)
    canonical = canonicalize_weights(model, state)
    assert c.version(version).weight_sha256 == weight_sha256(canonical)
    ids = list(range(3, 40))
    r = c.logprobs(ids, policy_version=version, use_cache=False)
    ref = reference_logprobs(model, canonical, ids, SamplingParams())
    assert np.array_equal(r.logprobs, ref, equal_nan=True)


def test_a_tied_models_own_state_dict_publishes_full_and_delta(tied):
    server, hub = tied
    trainer = hf_model("gemma", seed=7, dtype=torch.bfloat16)
    state = trainer.state_dict()
    assert "lm_head.weight" in state  # the issue: this used to be refused
    with Client(server.grpc_url, token=WRITE_TOKEN) as c:
        assert c.info().tied_weights == {"lm_head.weight": "model.embed_tokens.weight"}
        c.publish(1, state)
        _check(server, hub, c, 1, state)
        with torch.no_grad():
            trainer.model.norm.weight.add_(0.25)
        c.publish(2, trainer.state_dict(), delta=True)
        c.publish(3, trainer.state_dict(), delta=True)  # unchanged: an empty delta
        _check(server, hub, c, 3, trainer.state_dict())
        assert c.version(3).weight_sha256 == c.version(2).weight_sha256


def test_wrapper_prefixes_are_stripped(tied):
    server, hub = tied
    trainer = hf_model("gemma", seed=8, dtype=torch.bfloat16)
    for layer in list(trainer.model.layers):  # activation checkpointing as FSDP users wrap it
        idx = int(next(i for i, m in enumerate(trainer.model.layers) if m is layer))
        trainer.model.layers[idx] = checkpoint_wrapper(layer)
    compiled = torch.compile(trainer)  # lazy: nothing is compiled until it is called
    dp = torch.nn.DataParallel(compiled)
    state = dp.state_dict()  # the checkpoint wrapper's hooks drop its own segment here
    assert all(k.startswith("module._orig_mod.") for k in state)
    params = {n: p.detach() for n, p in dp.named_parameters()}  # ... but not here
    assert any("._checkpoint_wrapped_module." in k for k in params)
    plain = {strip_wrappers(k): v for k, v in state.items()}
    with Client(server.http_url, token=WRITE_TOKEN) as c:
        res = c.publish(10, state)
        c.publish(11, params, delta=True)
        _check(server, hub, c, 10, plain)
        assert c.version(11).weight_sha256 == res.weight_sha256


def test_fp32_masters_need_cast_and_then_publish_the_serving_dtype(tied):
    server, hub = tied
    masters = hf_model("gemma", seed=9, dtype=torch.float32)
    with Client(server.grpc_url, token=WRITE_TOKEN) as c:
        with pytest.raises(WeightsMismatch, match=r"cast=True") as info:
            c.publish(20, masters.state_dict())
        assert info.value.parameter == "weights" and info.value.details["tensor"]
        c.publish(20, masters.state_dict(), cast=True)
        c.publish(21, masters.state_dict(), cast=True, delta=True)
        as_bf16 = {k: v.to(torch.bfloat16) for k, v in masters.state_dict().items()}
        _check(server, hub, c, 21, as_bf16)


def test_bad_names_are_refused_before_the_upload(tied):
    server, _ = tied
    state = dict(hf_model("gemma", seed=9, dtype=torch.bfloat16).state_dict())
    state["model.extra.weight"] = torch.zeros(3)
    with Client(server.grpc_url, token=WRITE_TOKEN) as c:
        with pytest.raises(WeightsMismatch, match=r"model\.extra\.weight") as info:
            c.publish(30, state)
        assert info.value.details == {"tensor": "model.extra.weight"}
        del state["model.extra.weight"], state["model.norm.weight"]
        with pytest.raises(WeightsMismatch, match=r"lack tensor 'model\.norm\.weight'"):
            c.publish(30, state)
        assert 30 not in [v.policy_version for v in c.versions()]


def test_a_per_expert_hub_checkpoint_uploads_as_it_is(tmp_path):
    hub = model_dir(tmp_path / "model", "mixtral")  # block_sparse_moe.experts.N.w1/w2/w3
    other = model_dir(tmp_path / "other", "mixtral", seed=4)
    server = _serve(tmp_path, hub)
    try:
        with Client(server.grpc_url, token=WRITE_TOKEN) as c:
            assert c.info().weight_sources  # the hub layout, described
            # A safetensors directory in the hub layout, saved in float32: cast on the way.
            res = c.publish(1, other, cast=True)
            c.publish(2, other, delta=True, cast=True)
            trainer = hf_model("mixtral", seed=4, dtype=torch.bfloat16)
            _check(server, hub, c, 2, trainer.state_dict())
            assert res.weight_sha256 == c.version(2).weight_sha256
    finally:
        server.stop()


def test_a_one_rank_fsdp2_state_dict_publishes_gathered(tied, tmp_path):
    """FSDP2 on a one-rank mesh: the DTensors are gathered tensor by tensor by Client.publish."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    server, hub = tied
    trainer = hf_model("gemma", seed=12, dtype=torch.bfloat16)
    plain = {k: v.clone() for k, v in trainer.state_dict().items()}
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        fully_shard(trainer, mesh=init_device_mesh("cpu", (1,)))
        state = trainer.state_dict()
        assert all(type(v).__name__ == "DTensor" for v in state.values())
        with Client(server.grpc_url, token=WRITE_TOKEN) as c:
            c.publish(40, state)
            c.publish(41, state, delta=True)
            _check(server, hub, c, 41, plain)
    finally:
        dist.destroy_process_group()


def test_a_trainer_whose_head_is_not_tied_is_refused_naming_the_head(tied):
    # Above every version the tests before it publish on the shared server.
    """The served model ties the head to the embedding; a trainer whose lm_head.weight holds
    other bits (its model unties them) would be scored with the wrong head: refused."""
    server, _ = tied
    state = dict(hf_model("gemma", seed=13, dtype=torch.bfloat16).state_dict())
    head = state["lm_head.weight"].clone()
    head[0, 0] += 1
    state["lm_head.weight"] = head
    with Client(server.grpc_url, token=WRITE_TOKEN) as c:
        for delta in (False, True):
            with pytest.raises(WeightsMismatch, match=r"'lm_head\.weight' differs") as info:
                c.publish(60, state, delta=delta)
            assert info.value.details["tensor"] == "lm_head.weight"
        assert 60 not in [v.policy_version for v in c.versions()]
        state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()  # equal bits
        c.publish(60, state)


def test_an_fsdp2_trainer_whose_head_is_not_tied_is_refused_on_every_rank(tied, tmp_path):
    """The sharded publisher gathers DTensors on every rank: the head and the embedding are
    compared whole there (the same answer on every rank), and the publish is refused."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from oldlogit.integrations import ShardedPublisher

    server, _ = tied
    trainer = hf_model("gemma", seed=14, dtype=torch.bfloat16)
    with torch.no_grad():  # untied in the trainer: its own head, one element moved
        trainer.lm_head.weight = torch.nn.Parameter(trainer.lm_head.weight.detach().clone())
        trainer.lm_head.weight[1, 2] += 1
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        fully_shard(trainer, mesh=init_device_mesh("cpu", (1,)))
        state = trainer.state_dict()
        assert state["lm_head.weight"] is not state["model.embed_tokens.weight"]
        with Client(server.grpc_url, token=WRITE_TOKEN) as c:
            with pytest.raises(WeightsMismatch, match=r"'lm_head\.weight' differs"):
                ShardedPublisher(c).publish(70, state)
            assert 70 not in [v.policy_version for v in c.versions()]
    finally:
        dist.destroy_process_group()


def test_a_hub_checkpoint_published_by_path_is_read_onto_canonical_names(tmp_path):
    """Publish by path: the service reads a per-expert checkpoint itself and rewrites it."""
    hub = model_dir(tmp_path / "model", "mixtral")
    roots = tmp_path / "roots"
    trainer = hf_model("mixtral", seed=6, dtype=torch.bfloat16)
    trainer.save_pretrained(roots / "ckpt")  # block_sparse_moe.experts.N.w1 … in bf16
    settings = Settings(
        model=hub,
        snapshot_dir=tmp_path / "snapshots",
        http_port=0,
        grpc_port=0,
        dtype="bfloat16",
        tile_rows=16,
        write_token=WRITE_TOKEN,
        publish_roots=[roots],
    )
    server = ServerThread(settings).start()
    try:
        with Client(server.http_url, token=WRITE_TOKEN) as c:
            res = c.publish(3, str(roots / "ckpt"), by_path=True)
            _check(server, hub, c, 3, trainer.state_dict())
            assert res.weight_sha256 == c.version(3).weight_sha256
            assert not any(server.runtime.store.staging_dir.iterdir())  # nothing left behind
    finally:
        server.stop()
