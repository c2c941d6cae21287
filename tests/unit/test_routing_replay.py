"""MoE routing replay in process: the engine and a patched trainer replay one record the same way.

For Qwen3-MoE, Qwen2-MoE (a shared expert), Mixtral and DeepSeek-V3 (routing bias, grouped
top-k, a dense first layer), tiny models of ``tests/architectures.py``:
- the routing the engine records (``Job.record_routing``), replayed, gives bitwise the
  free-routing answer, packed with other sequences or alone;
- a different routing — partial: a start offset and −1 rows route freely — gives bitwise what
  a trainer under ``trainer_numerics`` computes with ``token_logprobs(routed_experts=…)``, in
  left and right padding, packed rows, micro-batches of 1 and 3 and ``logits_to_keep``;
- the backward replays too: activation checkpointing's recompute gives the same gradients.
The record's rules (``oldlogit.contract.routing``), the request's checks (``validate``), the
wire (JSON, msgpack, protobuf) and the engines' layouts (vLLM, SGLang) are checked here too;
served over both transports in tests/integration/test_routing_served.py.
"""

from __future__ import annotations

import base64
import io
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from oldlogit.contract import convert, wire
from oldlogit.contract.errors import InvalidRequest
from oldlogit.contract.routing import check_routing, from_sglang, from_vllm, routing_rows
from oldlogit.contract.types import (
    LogprobsRequest,
    LogprobsResponse,
    MoeInfo,
    RoutedExperts,
    Sequence,
    SequenceResult,
)
from oldlogit.parity import token_logprobs, trainer_numerics
from oldlogit_service.cache import make_key
from oldlogit_service.model.checkpoints import load_weights
from oldlogit_service.model.engine import Engine, Job
from oldlogit_service.model.loaded import load_model
from oldlogit_service.validate import Limits, plan_request
from tests.architectures import MOE, VOCAB, model_dir

LENGTHS = (5, 17, 30)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, object, dict]]:
    return {}


def _setup(arch: str, cache: dict, tmp: pytest.TempPathFactory):
    if arch not in cache:
        hub = model_dir(tmp.mktemp(arch), arch)
        model = load_model(hub, dtype="float32", device="cpu", tile_rows=16)
        weights = load_weights(hub, model)
        cache[arch] = (hub, model, weights)
    return cache[arch]


def _random_routing(
    n: int, layers: int, k: int, experts: int, gen: torch.Generator
) -> torch.Tensor:
    """[n, layers, k] distinct ids per (row, layer)."""
    rows = [torch.randperm(experts, generator=gen)[:k] for _ in range(n * layers)]
    return torch.stack(rows).view(n, layers, k).to(torch.int32)


@pytest.mark.parametrize("arch", MOE)
def test_replay_is_bitwise_free_answer_and_the_trainer_replaying_it(arch, served, tmp_path_factory):
    hub, model, weights = _setup(arch, served, tmp_path_factory)
    engine = Engine(model, max_batch_tokens=40)  # several packed forwards
    moe = engine.moe
    assert moe is not None and model.moe_info() is not None
    layers, k, experts = len(moe.layers), moe.top_k, moe.num_experts
    gen = torch.Generator().manual_seed(len(arch))
    seqs = [torch.randint(3, VOCAB, (n,), generator=gen) for n in LENGTHS]

    # 1. The service's own routing, recorded and replayed: the free-routing bits.
    free = engine.score(
        weights, [Job(s, torch.arange(1, len(s)), record_routing=True) for s in seqs]
    )
    for s, got in zip(seqs, free, strict=True):
        assert got.routing is not None and tuple(got.routing.shape) == (len(s) - 1, layers, k)
    replayed = []
    for s, got in zip(seqs, free, strict=True):
        rows = torch.full((len(s), layers, k), -1, dtype=torch.int32)
        rows[:-1] = got.routing
        replayed.append(Job(s, torch.arange(1, len(s)), routing=rows))
    again = engine.run(weights, replayed[::-1])[::-1]  # another packing order
    assert all(torch.equal(a.logprobs, b) for a, b in zip(free, again, strict=True))
    (alone,) = engine.run(weights, [replayed[1]])
    assert torch.equal(alone, free[1].logprobs)

    # 2. Another routing, partial: rows before a start offset and some −1 rows route freely.
    records = [_random_routing(len(s), layers, k, experts, gen) for s in seqs]
    records[1][:4] = -1  # a start offset of 4
    records[2][7:9] = -1  # no record at positions 7 and 8
    for r in records:
        r[-1] = -1  # the last row is never needed
    jobs = [
        Job(s, torch.arange(1, len(s)), routing=r, record_routing=True)
        for s, r in zip(seqs, records, strict=True)
    ]
    other = engine.score(weights, jobs)
    differs = sum(int((o.logprobs != f.logprobs).sum()) for o, f in zip(other, free, strict=True))
    assert differs > 0, "replaying another routing changes the answer"
    for r, o in zip(records, other, strict=True):  # replayed rows are used as given
        forced = r[:-1, 0, 0] >= 0
        assert torch.equal(o.routing[forced], r[:-1][forced])

    # 3. The trainer: padded (left, right), packed, micro-batches, logits_to_keep.
    trainer = AutoModelForCausalLM.from_pretrained(hub, dtype=torch.float32).eval()
    t_max = max(LENGTHS)
    with trainer_numerics(trainer, tile_rows=16), torch.no_grad():
        for side in ("left", "right"):
            ids = torch.zeros(3, t_max, dtype=torch.long)
            mask = torch.zeros_like(ids)
            routed = torch.full((3, t_max, layers, k), 5, dtype=torch.long)  # padding: ignored
            spans = []
            for b, (s, r) in enumerate(zip(seqs, records, strict=True)):
                lo = t_max - len(s) if side == "left" else 0
                ids[b, lo : lo + len(s)] = s
                mask[b, lo : lo + len(s)] = 1
                routed[b, lo : lo + len(s)] = r
                spans.append(lo)
            lp = token_logprobs(trainer, ids, mask, routed_experts=routed)
            for b, (s, o) in enumerate(zip(seqs, other, strict=True)):
                assert torch.equal(lp[b, spans[b] + 1 : spans[b] + len(s)], o.logprobs), (side, b)
            # Micro-batches of 1.
            for b, (s, o) in enumerate(zip(seqs, other, strict=True)):
                one = token_logprobs(
                    trainer,
                    ids[b : b + 1],
                    mask[b : b + 1],
                    routed_experts=routed[b : b + 1],
                )
                assert torch.equal(one[0, spans[b] + 1 : spans[b] + len(s)], o.logprobs)
        # Packed into one row, positions restarting per sequence.
        ids = torch.cat(seqs)[None]
        pos = torch.cat([torch.arange(len(s)) for s in seqs])[None]
        routed = torch.cat(records)[None].long()
        lp = token_logprobs(trainer, ids, position_ids=pos, routed_experts=routed)[0]
        start = 0
        for s, o in zip(seqs, other, strict=True):
            assert torch.equal(lp[start + 1 : start + len(s)], o.logprobs)
            start += len(s)
        # TRL's layout: the last K tokens of a left-padded batch.
        keep = 6
        b = 2
        s = seqs[b]
        last = token_logprobs(
            trainer, s[None], routed_experts=records[b][None].long(), logits_to_keep=keep
        )
        assert torch.equal(last[0], other[b].logprobs[-keep:])


def test_backward_replays_under_activation_checkpointing(served, tmp_path_factory):
    hub, model, _ = _setup("qwen3_moe", served, tmp_path_factory)
    layers = len(model.moe_info().layers)  # type: ignore[union-attr]
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(3, VOCAB, (2, 12), generator=gen)
    routed = torch.stack([_random_routing(12, layers, 2, 4, gen) for _ in range(2)]).long()
    grads = []
    for ckpt in (False, True, None):  # None: free routing, for contrast
        trainer = AutoModelForCausalLM.from_pretrained(hub, dtype=torch.float32)
        trainer.train()
        if ckpt:
            trainer.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
        with trainer_numerics(trainer, tile_rows=16):
            lp = token_logprobs(trainer, ids, routed_experts=None if ckpt is None else routed)
            lp.sum().backward()
        grads.append(
            {n: p.grad.clone() for n, p in trainer.named_parameters() if p.grad is not None}
        )
    replay, recomputed, free_grads = grads
    assert replay.keys() == recomputed.keys()
    assert all(torch.equal(replay[n], recomputed[n]) for n in replay)
    assert any(not torch.equal(replay[n], free_grads[n]) for n in replay if "experts" in n)


def test_trainer_refuses_routing_outside_the_numerics_and_bad_records(served, tmp_path_factory):
    hub, _model, _ = _setup("mixtral", served, tmp_path_factory)
    trainer = AutoModelForCausalLM.from_pretrained(hub, dtype=torch.float32).eval()
    ids = torch.randint(3, VOCAB, (1, 6))
    routed = torch.tensor([[0, 1], [2, 3]]).expand(1, 6, 2, 2)
    with pytest.raises(ValueError, match="under trainer_numerics"):
        token_logprobs(trainer, ids, routed_experts=routed)
    with trainer_numerics(trainer, tile_rows=16):
        with pytest.raises(ValueError, match=r"\[batch, seq, MoE layers, top_k\]"):
            token_logprobs(trainer, ids, routed_experts=routed[:, :, :1])
        bad = routed.clone()
        bad[0, 3, 1] = torch.tensor([1, 1])
        with pytest.raises(InvalidRequest, match=r"position 3, MoE layer 1 repeats") as err:
            token_logprobs(trainer, ids, routed_experts=bad)
        assert err.value.parameter == "routed_experts[0]"


# ------------------------------------------------------------------------ the record's rules

MOE_INFO = MoeInfo(layers=[1, 3], num_experts=8, top_k=2, num_hidden_layers=4)
LIMITS = Limits(
    vocab_size=100,
    max_seq_len=64,
    max_tokens_per_request=256,
    max_sequences_per_request=4,
    moe=MOE_INFO,
)


def _ids(rows: int, fill: int | None = None) -> np.ndarray:
    out = np.tile(np.array([[0, 1], [2, 3]], dtype=np.int32), (rows, 1, 1))
    if fill is not None:
        out[:] = fill
    return out


def _plan(record: RoutedExperts, n: int = 6, limits: Limits = LIMITS, **kw: object):
    seq = Sequence(token_ids=list(range(1, n + 1)), policy_version=1, routed_experts=record)
    return plan_request(LogprobsRequest(sequences=[seq], **kw), limits)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("ids", "start", "match"),
    [
        (np.zeros((5, 3, 2), np.int32), 0, r"must be \[rows, 2 MoE layers, top_k 2\]"),
        (np.zeros((5, 2, 3), np.int32), 0, r"must be \[rows, 2 MoE layers, top_k 2\]"),
        (np.where(np.arange(5)[:, None, None] == 2, 8, _ids(5)), 0, r"position 2, MoE layer 0: 8"),
        (np.where(np.arange(5)[:, None, None] == 4, 1, _ids(5)), 0, "position 4, MoE layer 0 rep"),
        (np.concatenate([_ids(2), [[[0, -1], [2, 3]]], _ids(2)]), 1, "position 3 mixes -1"),
        (_ids(5), 2, r"5 rows from position 2 cover positions \[2, 7\)"),
        (_ids(3), 0, r"3 rows from position 0"),
    ],
)
def test_bad_records_are_refused_naming_the_parameter_and_position(ids, start, match):
    with pytest.raises(InvalidRequest, match=match) as err:
        _plan(RoutedExperts(ids=ids, start=start))
    assert err.value.parameter == "sequences[0].routed_experts"
    assert err.value.http_status == 400 and err.value.grpc_status == "INVALID_ARGUMENT"


def test_records_placed_on_positions_and_free_rows():
    (plan,) = _plan(RoutedExperts(ids=_ids(5)))  # n − 1 rows: vLLM's and SGLang's layout
    assert plan.routing is not None and plan.routing.shape == (6, 2, 2)
    assert (plan.routing[5] == -1).all() and (plan.routing[:5] == _ids(5)).all()
    (plan,) = _plan(RoutedExperts(ids=_ids(4), start=2))  # one row per token from start (verl)
    assert plan.routing is not None and (plan.routing[:2] == -1).all()
    assert (plan.routing[2:5] == _ids(3)).all() and (plan.routing[5] == -1).all()
    (plan,) = _plan(RoutedExperts(ids=_ids(5, fill=-1)))  # no row recorded: free routing
    assert plan.routing is None
    # No rows (a record from the last position on; JSON's [] has no inner shape): free.
    empty = wire.decode_request(
        wire.encode_request(
            LogprobsRequest(
                sequences=[
                    Sequence(
                        token_ids=[1, 2],
                        policy_version=1,
                        routed_experts=RoutedExperts(ids=_ids(0), start=1),
                    )
                ]
            )
        )
    )
    (plan,) = plan_request(empty, LIMITS)
    assert plan.routing is None
    assert routing_rows(RoutedExperts(ids=_ids(1)), 2, "r").shape == (2, 2, 2)


def test_routing_needs_a_moe_model_under_the_invariant_numerics():
    dense = Limits(
        vocab_size=100, max_seq_len=64, max_tokens_per_request=256, max_sequences_per_request=4
    )
    with pytest.raises(InvalidRequest, match="dense model") as err:
        _plan(RoutedExperts(ids=_ids(5)), limits=dense)
    assert err.value.parameter == "sequences[0].routed_experts"
    with pytest.raises(InvalidRequest, match="dense model") as err:
        _plan(None, limits=dense, return_routing=True)  # type: ignore[arg-type]
    assert err.value.parameter == "return_routing"
    hf = Limits(**{**LIMITS.__dict__, "replay": False})
    with pytest.raises(InvalidRequest, match="invariant numerics"):
        _plan(RoutedExperts(ids=_ids(5)), limits=hf)


def test_check_routing_accepts_free_rows_and_ids_in_any_order():
    ids = _ids(3)
    ids[1] = -1
    ids[2, 0] = [7, 0]
    recorded = check_routing(ids, layers=2, top_k=2, num_experts=8, parameter="p")
    assert recorded.tolist() == [True, False, True]


def test_cache_keys_hold_the_routing():
    base = dict(
        weight_sha256="a" * 64,
        numerics="n",
        sampling=(1.0, 0, 1.0),
        token_ids=[1, 2, 3],
        positions=[1, 2],
    )
    free = make_key(**base)  # type: ignore[arg-type]
    assert make_key(**base, routing=None) == free  # type: ignore[arg-type]
    one = make_key(**base, routing=_ids(3))  # type: ignore[arg-type]
    other = _ids(3)
    other[0, 0] = [1, 0]  # the same experts, another order: another record
    assert len({free, one, make_key(**base, routing=other)}) == 3  # type: ignore[arg-type]


# ------------------------------------------------------------------------ the wire


def _request(return_routing: bool) -> LogprobsRequest:
    ids = _ids(5)
    ids[1] = -1
    return LogprobsRequest(
        sequences=[
            Sequence(
                token_ids=list(range(1, 7)),
                policy_version=1,
                routed_experts=RoutedExperts(ids=ids, start=0),
            ),
            Sequence(token_ids=[1, 2, 3], policy_version=1),
        ],
        return_routing=return_routing,
    )


@pytest.mark.parametrize("kind", [wire.JSON_TYPE, wire.MSGPACK_TYPE, "proto"])
def test_records_round_trip_on_every_encoding(kind):
    req = _request(True)
    if kind == "proto":
        back = convert.request_from_proto(convert.request_to_proto(req))
    else:
        back = wire.decode_request(wire.encode_request(req, kind), kind)
    assert back.return_routing
    got = back.sequences[0].routed_experts
    assert got is not None and np.array_equal(got.ids, req.sequences[0].routed_experts.ids)  # type: ignore[union-attr]
    assert back.sequences[1].routed_experts is None
    nan = np.float32("nan")
    results = [
        SequenceResult(
            logprobs=np.array([nan, -1, -2, -3, -4, -5], np.float32),
            versions=[1],
            weight_sha256={1: "a" * 64},
            routed_experts=[RoutedExperts(ids=_ids(5))],
        ),
        SequenceResult(
            logprobs=np.array([nan, -1, -2], np.float32),
            versions=[1],
            weight_sha256={1: "a" * 64},
            routed_experts=[RoutedExperts(ids=_ids(2))],
        ),
    ]
    resp = LogprobsResponse(results=results)
    if kind == "proto":
        out = convert.response_from_proto(convert.response_to_proto(resp, req), req)
    else:
        out = wire.decode_response(wire.encode_response(resp, req, kind), req, kind)
    for a, b in zip(out.results, results, strict=True):
        assert a.routed_experts is not None and b.routed_experts is not None
        assert np.array_equal(a.routed_experts[0].ids, b.routed_experts[0].ids)


def test_return_routing_travels_only_when_asked_and_ids_are_int16():
    body = wire.encode_request(_request(False), wire.JSON_TYPE)
    assert b"return_routing" not in body  # a server without routing replay still parses it
    packed = wire.encode_routing(RoutedExperts(ids=_ids(4)), wire.MSGPACK_TYPE)
    assert packed["dtype"] == "<i2" and len(packed["ids"]) == 4 * 2 * 2 * 2
    wide = wire.encode_routing(RoutedExperts(ids=_ids(1, fill=40000)), wire.MSGPACK_TYPE)
    assert wide["dtype"] == "<i4"
    with pytest.raises(InvalidRequest, match="shape"):
        wire.decode_routing(
            {"ids": b"\0" * 6, "dtype": "<i2", "shape": [1, 2, 2]}, "r", InvalidRequest
        )


# ------------------------------------------------------------------------ engines' layouts


def test_vllm_and_sglang_layouts_map_onto_records():
    moe = MoeInfo(layers=[1, 3], num_experts=8, top_k=2, num_hidden_layers=4)
    n = 6  # tokens; the engines return n − 1 rows, every decoder layer (dense ones: zeros)
    full = np.zeros((n - 1, 4, 2), dtype=np.int16)
    full[:, 1] = [0, 1]
    full[:, 3] = [2, 3]
    npy = io.BytesIO()
    np.save(npy, full)
    for rec in (
        from_vllm(full, moe=moe),
        from_vllm(base64.b64encode(npy.getvalue()).decode(), moe=moe),
        from_sglang(base64.b64encode(full.astype("<i4").tobytes()).decode(), moe=moe),
        from_sglang(full, moe_layers=[1, 3]),
    ):
        assert rec.start == 0 and np.array_equal(rec.ids, _ids(n - 1))
        (plan,) = _plan(rec, n=n)
        assert plan.routing is not None
    rec = from_vllm(full[2:], moe=moe, prompt_start=2)  # vLLM's routed_experts_prompt_start
    assert rec.start == 2 and rec.ids.shape == (n - 3, 2, 2)
    rec = from_sglang(full[3:].astype("<i4"), moe=moe, start_len=3)  # routed_experts_start_len
    (plan,) = _plan(rec, n=n)
    assert plan.routing is not None and (plan.routing[:3] == -1).all()
    with pytest.raises(InvalidRequest, match="MoE layers"):
        from_vllm(full)
