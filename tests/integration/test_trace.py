"""``/v1/trace`` and ``Trace`` on a live server: the service runs ``forward_trace`` — the very
function a trainer runs — on its skeleton with a version's weights, so its stages equal, digest
for digest, those of a transformers model loaded from the same directory under
``trainer_numerics``; a model with one weight off diverges at the stage that reads it; bad input
is refused naming the parameter; a read token guards it like ``/v1/logprobs``."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from oldlogit import Client, Trace
from oldlogit.contract import errors
from oldlogit.parity import SamplingParams, trainer_numerics
from oldlogit.parity.trace import MAX_TRACE_TOKENS, TraceStage, first_divergence, forward_trace

from .conftest import Served, start_served

pytestmark = pytest.mark.integration

READ_TOKEN = "trace-reader"
VOCAB = 384  # conftest's tiny model
SAMPLINGS = [{}, {"temperature": 0.7, "top_k": 8}]


@pytest.fixture(scope="module")
def trainer(model_dir: Path) -> torch.nn.Module:
    """The trainer's side: a plain transformers model from the same directory, in bfloat16."""
    model: torch.nn.Module = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    return model.eval()


def _ids(seed: int, n: int = 37) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(0, VOCAB, n)]


def _mine(
    model: torch.nn.Module,
    served: Served,
    client: Client,
    version: int,
    ids: list[int],
    **kw: float,
) -> list[TraceStage]:
    model.load_state_dict(served.weights[version])  # what a trainer holds at that version
    with trainer_numerics(model, like=client.info().numerics_spec()):
        return forward_trace(model, torch.tensor(ids)[None], sampling=SamplingParams(**kw))


def _theirs(trace: Trace) -> list[TraceStage]:
    return [
        TraceStage(s.name, s.dtype, tuple(s.shape), s.sha256, s.total, s.absmax)
        for s in trace.stages
    ]


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["raw", "t0.7-k8"])
def test_the_services_trace_equals_the_trainers_stage_by_stage(
    served: Served, trainer: torch.nn.Module, transport: str, sampling: dict[str, float]
) -> None:
    version, ids = 2, _ids(1)
    with Client(served.url(transport), retries=0) as c:
        got = c.trace(ids, version, **sampling)
        mine = _mine(trainer, served, c, version, ids, **sampling)
        assert got.policy_version == version
        assert got.weight_sha256 == c.version(version).weight_sha256
        assert got.numerics == c.info().numerics_spec().key
    theirs = _theirs(got)
    names = [s.name for s in theirs]
    assert names == [s.name for s in mine]
    assert [s.sha256 for s in theirs] == [s.sha256 for s in mine]
    assert first_divergence(mine, theirs) is None
    # Every stage is there: embeddings, rotary, each layer's parts and output, norm, head.
    assert names[-1] == "logprobs" and "lm_head" in names and "model.norm" in names
    assert {"model.layers.1.mlp", "model.layers.1.self_attn", "model.layers.1"} <= set(names)
    assert theirs[-1].shape == (len(ids) - 1,) and theirs[-1].dtype == "float32"
    assert theirs[0].dtype == "bfloat16"
    # Another version is another forward.
    with Client(served.url(transport)) as c:
        other = c.trace(ids, 3, **sampling)
    assert first_divergence(theirs, _theirs(other)) is not None


def test_one_weight_off_diverges_at_the_stage_that_reads_it(
    served: Served, trainer: torch.nn.Module
) -> None:
    version, ids = 1, _ids(2)
    with Client(served.url("grpc")) as c:
        theirs = _theirs(c.trace(ids, version))
        trainer.load_state_dict(served.weights[version])
        with torch.no_grad():
            trainer.model.layers[1].mlp.down_proj.weight[0, 0] += 2**-6
        with trainer_numerics(trainer, like=c.info().numerics_spec()):
            mine = forward_trace(trainer, torch.tensor(ids)[None])
    where = first_divergence(mine, theirs)
    assert where is not None
    assert "layer 1's MLP output (model.layers.1.mlp)" in where, where
    before = [s.name for s in mine].index("model.layers.1.mlp")
    assert f"(the {before} stages before agree)" in where


@pytest.mark.parametrize(
    ("kwargs", "error", "parameter", "words"),
    [
        ({"token_ids": [1] * (MAX_TRACE_TOKENS + 1)}, errors.SequenceTooLong, "token_ids", "512"),
        ({"token_ids": [5]}, errors.InvalidRequest, "token_ids", "at least 2"),
        ({"token_ids": [1, 2, 3, VOCAB, 4]}, errors.TokenOutOfVocab, "token_ids", "token_ids[3]"),
        ({"policy_version": 7}, errors.UnknownVersion, None, "7"),
        ({"temperature": 0.0}, errors.BadSampling, "temperature", "temperature"),
        ({"top_p": 1.5}, errors.BadSampling, "top_p", "top_p"),
        ({"token_ids": "abc"}, errors.InvalidRequest, "token_ids", "token_ids"),
    ],
    ids=["too-long", "one-token", "out-of-vocab", "unknown-version", "temp-0", "top-p", "not-ids"],
)
def test_bad_input_is_refused_naming_the_parameter(
    served: Served,
    transport: str,
    kwargs: dict[str, object],
    error: type[errors.OldLogitError],
    parameter: str | None,
    words: str,
) -> None:
    args: dict[str, object] = {"token_ids": [1, 2, 3], "policy_version": 0, **kwargs}
    with Client(served.url(transport), retries=0) as c:
        with pytest.raises(error) as info:
            c.trace(args.pop("token_ids"), args.pop("policy_version"), **args)  # type: ignore[arg-type]
    if parameter is not None:
        assert info.value.parameter == parameter
    assert words in info.value.message


def test_malformed_bodies_are_refused_by_the_service(served: Served) -> None:
    """What the client would refuse itself, sent raw: the service's own parse names it too."""
    url = f"{served.server.http_url}/v1/trace"
    for body, parameter in (
        ({"token_ids": "abc", "policy_version": 0}, "token_ids"),
        ({"token_ids": [1, 2], "policy_version": 0, "extra": 1}, "extra"),
        ({"token_ids": [1, 2]}, "policy_version"),
    ):
        r = httpx.post(url, json=body)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["parameter"] == parameter, r.text
    r = httpx.post(url, json={"token_ids": [1, 2, 3], "policy_version": 0})
    assert r.status_code == 200 and r.json()["stages"][-1]["name"] == "logprobs"


@pytest.fixture(scope="module")
def guarded(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[Served]:
    s = start_served(tmp_path_factory.mktemp("trace-auth"), model_dir, read_token=READ_TOKEN)
    yield s
    s.server.stop()


def test_a_read_token_guards_the_trace(guarded: Served, transport: str) -> None:
    with Client(guarded.url(transport), retries=0) as c:
        with pytest.raises(errors.Unauthorized) as info:
            c.trace([1, 2, 3], 0)
        assert info.value.parameter == "authorization"
    with Client(guarded.url(transport), token=READ_TOKEN) as c:
        assert c.trace([1, 2, 3], 0).stages[-1].name == "logprobs"
