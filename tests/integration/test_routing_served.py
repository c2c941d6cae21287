"""MoE routing replay, served: over HTTP (JSON and msgpack) and gRPC, per family.

Per MoE family of ``tests/architectures.py`` (Qwen3-MoE, Qwen2-MoE with its shared expert,
Mixtral, DeepSeek-V3 with its routing bias and a dense first layer): a real server — Mixtral's
on the lagging route — holds the directory's weights (version 0) and a trainer's state dict
(version 1), and
- the routing it returns (``return_routing``: one record per version's forward), replayed,
  gives bitwise the free-routing answer, per-token versions included;
- another routing — a start offset, −1 rows — gives bitwise what the trainer computes replaying
  it under ``trainer_numerics(like=…)`` at each version, on every transport;
- verl's ``routed_experts`` batch key (every decoder layer, zeros in dense layers, padding and
  the last row) is replayed by ``compute_old_log_prob``;
- a bad record is refused with 400 / INVALID_ARGUMENT naming the parameter and position, and a
  good request beside it is answered.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from oldlogit import Client, InvalidRequest, RoutedExperts, Sequence
from oldlogit.parity import token_logprobs, trainer_numerics
from oldlogit_service.config import Settings
from oldlogit_service.server import ServerThread
from tests.architectures import MOE, VOCAB, hf_model, model_dir, persistent_state
from tests.integration.conftest import WRITE_TOKEN

LENGTHS = (6, 15, 24)


@pytest.fixture(scope="module", params=MOE)
def moe_server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[ServerThread, str, dict[int, torch.nn.Module]]]:
    arch = request.param
    tmp = tmp_path_factory.mktemp(f"routing-{arch}")
    hub = model_dir(tmp / "model", arch)
    settings = Settings(
        model=hub,
        snapshot_dir=tmp / "snapshots",
        http_port=0,
        grpc_port=0,
        dtype="float32",
        tile_rows=16,
        write_token=WRITE_TOKEN,
        max_wait_ms=1.0,
        strategy="lagging" if arch == "mixtral" else "snapshot",  # both routes replay
    )
    server = ServerThread(settings).start()
    trainers = {0: hf_model(arch, seed=0), 1: hf_model(arch, seed=7)}
    with Client(server.http_url, token=WRITE_TOKEN) as c:
        c.publish(1, persistent_state(trainers[1]))
    yield server, arch, trainers
    server.stop()


def _clients(server: ServerThread) -> list[Client]:
    return [
        Client(server.grpc_url),
        Client(server.http_url, http_encoding="msgpack"),
        Client(server.http_url, http_encoding="json"),
    ]


def _sequences(seed: int) -> list[np.ndarray]:
    gen = np.random.default_rng(seed)
    return [gen.integers(3, VOCAB, size=n) for n in LENGTHS]


def test_returned_routing_replayed_gives_the_free_bits(moe_server):
    server, _arch, _ = moe_server
    seqs = _sequences(1)
    for client in _clients(server):
        with client:
            moe = client.info().moe
            assert moe is not None
            per_token = [np.where(np.arange(len(s)) < len(s) // 2, 0, 1) for s in seqs]
            free = client.logprobs_batch(
                [Sequence(token_ids=s, versions=v) for s, v in zip(seqs, per_token, strict=True)],
                return_routing=True,
            )
            for s, res in zip(seqs, free, strict=True):
                assert res.versions == [0, 1] and res.routed_experts is not None
                for record in res.routed_experts:  # one per version's forward, rows 0 … n − 2
                    assert record.start == 0
                    assert record.ids.shape == (len(s) - 1, len(moe.layers), moe.top_k)
            for s, v, res in zip(seqs, per_token, free, strict=True):
                for version, record in zip(res.versions, res.routed_experts or [], strict=True):
                    again = client.logprobs(
                        s, policy_version=version, routed_experts=record, use_cache=False
                    )
                    mine = v == version
                    mine[0] = False
                    assert np.array_equal(again.logprobs[mine], res.logprobs[mine])
                # The one record of the first version applies to every version's forward.
                both = client.logprobs(s, versions=v, routed_experts=res.routed_experts[0])  # type: ignore[index]
                first = v == 0
                first[0] = False
                assert np.array_equal(both.logprobs[first], res.logprobs[first])


def test_another_routing_is_the_trainers_bits_on_every_transport(moe_server):
    server, _arch, trainers = moe_server
    seqs = _sequences(2)
    with Client(server.grpc_url) as c:
        info = c.info()
    moe = info.moe
    assert moe is not None
    layers, k = len(moe.layers), moe.top_k
    gen = np.random.default_rng(3)
    records = []
    for i, s in enumerate(seqs):
        ids = np.stack(
            [gen.permutation(moe.num_experts)[:k] for _ in range((len(s) - 1) * layers)]
        ).reshape(len(s) - 1, layers, k)
        ids[1:3] = -1  # no record at positions start + 1, start + 2
        start = 0 if i != 1 else 3  # a start offset: positions 0 … 2 route freely
        records.append(RoutedExperts(ids=ids[start:], start=start))
    # The trainer's batch: left-padded, the record aligned with it (free rows −1).
    t_max = max(LENGTHS)
    ids_b = torch.zeros(len(seqs), t_max, dtype=torch.long)
    mask = torch.zeros_like(ids_b)
    routed = torch.full((len(seqs), t_max, layers, k), -1, dtype=torch.long)
    for b, (s, r) in enumerate(zip(seqs, records, strict=True)):
        lo = t_max - len(s)
        ids_b[b, lo:] = torch.from_numpy(s)
        mask[b, lo:] = 1
        routed[b, lo + r.start : lo + r.start + len(r.ids)] = torch.from_numpy(
            r.ids.astype(np.int64)
        )
    expected = {}
    for version, trainer in trainers.items():
        with trainer_numerics(trainer, like=info.numerics_spec()), torch.no_grad():
            expected[version] = token_logprobs(trainer, ids_b, mask, routed_experts=routed)
            free = token_logprobs(trainer, ids_b, mask)
        assert not torch.equal(expected[version], free), "the record changes the answer"
    for client in _clients(server):
        with client:
            for version in (0, 1):
                got = client.logprobs_batch(
                    [
                        Sequence(token_ids=s, policy_version=version, routed_experts=r)
                        for s, r in zip(seqs, records, strict=True)
                    ]
                )
                for b, (s, res) in enumerate(zip(seqs, got, strict=True)):
                    want = expected[version][b, t_max - len(s) + 1 :].numpy()
                    assert np.array_equal(res.logprobs[1:], want), (version, b)
            # Per-token versions: each version's forward replays the one record.
            v = np.where(np.arange(len(seqs[2])) < 9, 0, 1)
            (mixed,) = client.logprobs_batch(
                [Sequence(token_ids=seqs[2], versions=v, routed_experts=records[2])]
            )
            for version in (0, 1):
                mine = v == version
                mine[0] = False
                want = np.concatenate([[np.nan], expected[version][2, 1:].numpy()])
                assert np.array_equal(mixed.logprobs[mine], want[mine])


def test_bad_records_are_refused_by_name_and_leave_the_rest_alone(moe_server):
    server, _arch, _ = moe_server
    s = _sequences(4)[1]
    with Client(server.grpc_url) as c:
        moe = c.info().moe
    assert moe is not None
    good = np.tile(np.arange(moe.top_k), (len(s) - 1, len(moe.layers), 1))
    bad = good.copy()
    bad[5, 0, 0] = moe.num_experts  # out of range
    for client in _clients(server):
        with client:

            def ask(record: np.ndarray, client: Client = client) -> object:
                try:
                    return client.logprobs(s, policy_version=0, routed_experts=record)
                except InvalidRequest as exc:
                    return exc

            with ThreadPoolExecutor(2) as pool:
                refused, answered = pool.map(ask, [bad, good])
            assert isinstance(refused, InvalidRequest)
            assert refused.parameter == "sequences[0].routed_experts"
            assert "position 5, MoE layer 0" in str(refused)
            assert not isinstance(answered, Exception)
            with pytest.raises(InvalidRequest, match="top_k") as err:
                client.logprobs(s, policy_version=0, routed_experts=good[:, :, :1])
            assert err.value.parameter == "sequences[0].routed_experts"


def test_verl_batch_routed_experts_are_replayed(moe_server):
    server, _arch, trainers = moe_server
    seqs = _sequences(5)
    with Client(server.grpc_url) as c:
        info = c.info()
        moe = info.moe
        assert moe is not None
        width, t_max, bs = 5, max(LENGTHS), len(seqs)
        k = moe.top_k
        gen = np.random.default_rng(6)
        # verl's layout: prompts left-padded, the last `width` columns the response.
        input_ids = np.zeros((bs, t_max), dtype=np.int64)
        attention_mask = np.zeros_like(input_ids)
        routed = np.zeros((bs, t_max, moe.num_hidden_layers, k), dtype=np.uint8)
        for b, s in enumerate(seqs):
            lo = t_max - len(s)
            input_ids[b, lo:], attention_mask[b, lo:] = s, 1
            for t in range(lo, t_max - 1):  # the last row stays 0, as verl leaves it
                for j in moe.layers:
                    routed[b, t, j] = gen.permutation(moe.num_experts)[:k]
        batch = {
            "input_ids": torch.from_numpy(input_ids),
            "attention_mask": torch.from_numpy(attention_mask),
            "responses": torch.from_numpy(input_ids[:, -width:]),
            "routed_experts": torch.from_numpy(routed),
        }
        from oldlogit.integrations import compute_old_log_prob

        out = compute_old_log_prob(c, batch, policy_version=1)
    replay = torch.from_numpy(routed[:, :, list(moe.layers)].astype(np.int64))
    with trainer_numerics(trainers[1], like=info.numerics_spec()), torch.no_grad():
        want = token_logprobs(
            trainers[1],
            torch.from_numpy(input_ids),
            torch.from_numpy(attention_mask),
            routed_experts=replay,
        )[:, -width:]
    assert torch.equal(out["old_log_probs"], want)
    assert bool(out["old_log_probs_mask"].all())
