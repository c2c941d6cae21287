"""The tensor-parallel definition (``tp_chunks=8``): the same bits at TP 1, 2 and 4.

Each rank (tests/integration/tp_worker.py, one gloo process per rank, one CPU thread each)
computes π with a trainer split by torch's ``parallelize_module`` (head output replicated, and
left split per rank) and with the service's engine on its weight shards under
``tensor_parallel.use``. This process computes the same at TP 1 with two threads: the trainer
unsplit under ``trainer_numerics(tp_chunks=8)`` and the engine on whole weights. Every scored
token is bitwise equal across all of them, raw and processed (temperature, top-k, top-p); the
TP trainer's backward reaches every parameter; after a step, the TP trainer publishes from its
DTensor shards and its π equals, bitwise, the answer for that version of a ``--tp-chunks 8``
service on one device and (TP 2, ``slow``) of one at ``--tensor-parallel 2``; the one-device
service over HTTP and gRPC equals the TP 1 trainer. TP 4 runs under the ``slow`` marker.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from safetensors.torch import save_file

from oldlogit.parity import token_logprobs, trainer_numerics
from tests.e2e.conftest import CliServer, start_cli
from tests.integration import tp_worker
from tests.integration.conftest import WRITE_TOKEN, Served, run_ranks, start_served

DTYPE = "bfloat16"


def _model_dir(root: Path, tied: bool) -> Path:
    torch.manual_seed(3)
    config = transformers.Qwen2Config(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=256,
        tie_word_embeddings=tied,
    )
    model = transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    path = root / ("tied" if tied else "untied")
    path.mkdir()
    config.save_pretrained(path)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if tied:
        state.pop("lm_head.weight", None)
    save_file(state, str(path / "model.safetensors"))
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tp_models")
    return {"untied": _model_dir(root, False), "tied": _model_dir(root, True)}


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory, models: dict[str, Path]) -> Iterator[Served]:
    """A ``--tp-chunks 8`` service of the untied model (one device)."""
    served = start_served(tmp_path_factory.mktemp("tp_service"), models["untied"], tp_chunks=8)
    yield served
    served.server.stop()


@pytest.fixture(scope="module")
def service_tp2(
    tmp_path_factory: pytest.TempPathFactory, models: dict[str, Path]
) -> Iterator[CliServer]:
    """``oldlogit serve --tensor-parallel 2`` (tp_chunks 8) of the untied model, its own
    process (one tensor-parallel front per process)."""
    snap = tmp_path_factory.mktemp("tp2_service")
    srv = start_cli(
        [
            *("--model", str(models["untied"]), "--tensor-parallel", "2"),
            *("--dtype", DTYPE, "--write-token", WRITE_TOKEN, "--snapshot-dir", str(snap)),
            *("--http-port", "0", "--grpc-port", "0"),
        ]
    )
    yield srv
    srv.stop()


def _run_ranks(
    world: int, models: dict[str, Path], tmp: Path, urls: list[str]
) -> list[dict[str, Any]]:
    def argv(rank: int) -> list[str]:
        return [
            *(str(rank), str(world), str(tmp / "init"), str(models["untied"]), DTYPE),
            *(str(tmp / f"rank{rank}.pt"), str(models["tied"]), ",".join(urls)),
        ]

    ranks = run_ranks("tests.integration.tp_worker", argv, world, threads="1", timeout_s=400)
    for code, log in ranks:
        assert code == 0, log[-4000:]
    return [torch.load(tmp / f"rank{rank}.pt") for rank in range(world)]


@pytest.fixture(scope="module")
def single(models: dict[str, Path]) -> dict[str, torch.Tensor]:
    """TP 1 in this process (the suite's thread count): trainer and engine."""
    from oldlogit.parity import tensor_parallel

    model = transformers.AutoModelForCausalLM.from_pretrained(
        models["untied"], dtype=torch.bfloat16
    )
    vocab = int(model.config.vocab_size)
    ids, mask = tp_worker.left_padded(tp_worker.samples(vocab))
    with trainer_numerics(model, tp_chunks=8), torch.no_grad():
        raw = token_logprobs(model, ids, mask)
        processed = token_logprobs(model, ids, mask, **tp_worker.PROCESSED)
    whole = tensor_parallel.TensorParallel()
    seen = {"trainer.raw": raw, "trainer.processed": processed}
    seen["engine"] = tp_worker.engine_logprobs(str(models["untied"]), DTYPE, whole)["engine"]
    seen["engine_tied"] = tp_worker.engine_logprobs(str(models["tied"]), DTYPE, whole)["engine"]
    return seen


def _trainer_as_engine(seen: dict[str, torch.Tensor], key: str) -> torch.Tensor:
    """The trainer's [B, T] left-padded logprobs as the engine's flat per-job answers."""
    raw, processed = seen[f"{key}.raw"], seen[f"{key}.processed"]
    width = raw.shape[1]
    parts = []
    for table in (raw, processed):
        for i, seq in enumerate(tp_worker.samples(512)):
            parts.append(table[i, width - len(seq) + 1 :])
    return torch.cat(parts)


def _check(ranks: list[dict[str, Any]], single: dict[str, torch.Tensor]) -> None:
    assert torch.isfinite(single["trainer.raw"]).all()
    assert torch.isinf(single["trainer.processed"]).any()  # top-k/top-p removed some targets
    # TP 1: the engine is the trainer.
    assert torch.equal(single["engine"], _trainer_as_engine(single, "trainer"))
    for seen in ranks:
        for key in ("trainer", "trainer_local_head", "trainer_sequence_parallel"):
            assert torch.equal(seen[f"{key}.raw"], single["trainer.raw"]), key
            assert torch.equal(seen[f"{key}.processed"], single["trainer.processed"]), key
            grads, params = seen[f"{key}.grads"].tolist()
            assert grads == params, f"{key}: {grads} of {params} parameters got a gradient"
        assert torch.equal(seen["fsdp_tp.raw"], single["trainer.raw"])  # FSDP2 over TP 2
        assert torch.equal(seen["engine"], single["engine"])
        assert torch.equal(seen["engine_tied"], single["engine_tied"])
        for equal, total in seen["served"].tolist():  # each service the ranks published to
            assert total > 200 and equal == total, f"{equal} of {total} tokens equal the service's"
        # transformers' own tensor parallelism (from_pretrained(tp_plan="auto")) reduces in a
        # library all-reduce: refused by name with and without tp_chunks, never silently run.
        for said in seen["hf_tp_plan"]:
            assert "transformers' own tensor parallelism" in said and "tp_plan" in said, said


def test_tp2_bitwise_with_tp1(
    models: dict[str, Path], single: dict[str, torch.Tensor], tmp_path: Path, service: Served
) -> None:
    _check(_run_ranks(2, models, tmp_path, [service.server.http_url]), single)


# `slow`: the ranks again, publishing to a `--tensor-parallel 2` service as well (its own three
# processes, ~15 s to start on 2 cores). The default run holds that service bitwise a TP 1 one
# through delta publishes (tests/integration/test_tensor_parallel_serving.py), and the ranks
# bitwise a TP 1 `--tp-chunks 8` service (above).
@pytest.mark.slow
def test_tp2_bitwise_with_tp1_and_a_tp2_service(
    models: dict[str, Path],
    single: dict[str, torch.Tensor],
    tmp_path: Path,
    service: Served,
    service_tp2: CliServer,
) -> None:
    urls = [service.server.http_url, f"grpc://{service_tp2.grpc}"]
    _check(_run_ranks(2, models, tmp_path, urls), single)


@pytest.mark.slow
def test_tp4_bitwise_with_tp1(
    models: dict[str, Path], single: dict[str, torch.Tensor], tmp_path: Path, service: Served
) -> None:
    _check(_run_ranks(4, models, tmp_path, [service.server.http_url]), single)


@pytest.mark.parametrize("transport", ["http", "grpc"])
def test_service_tp1_is_the_tp_trainer(
    transport: str, models: dict[str, Path], single: dict[str, torch.Tensor], service: Served
) -> None:
    """A service started with --tp-chunks 8 answers the TP trainer's bits (the ranks above
    equal ``single``), says so in /v1/info, and a trainer adopting its spec (``like=``) gets
    the tensor-parallel definition."""
    import numpy as np

    from oldlogit import Client, Sequence

    url = service.server.http_url if transport == "http" else service.server.grpc_url
    with Client(url, timeout_s=60) as client:
        info = client.info()
        spec = info.numerics_spec()
        seqs = [
            Sequence(token_ids=s.numpy(), policy_version=0, score_from=1)
            for s in tp_worker.samples(512)
        ]
        raw = client.logprobs_batch(seqs, use_cache=False)
        processed = client.logprobs_batch(seqs, use_cache=False, **tp_worker.PROCESSED)
    assert info.tp_chunks == 8 and spec.tp_chunks == 8 and "tp_chunks=8" in spec.key
    got = np.concatenate([r.logprobs[1:] for r in [*raw, *processed]])
    want = _trainer_as_engine(single, "trainer").numpy()
    assert np.array_equal(got, want)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        models["untied"], dtype=torch.bfloat16
    )
    ids, mask = tp_worker.left_padded(tp_worker.samples(512))
    with trainer_numerics(model, like=spec) as patch, torch.no_grad():
        assert patch.tp_chunks == 8
        assert torch.equal(token_logprobs(model, ids, mask), single["trainer.raw"])
