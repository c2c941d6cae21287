"""A trainer under ``trainer_numerics`` computes π_θ bitwise equal to the service's π_old.

The trainer side is a plain transformers model loaded from the same directory, run as trainers
run it: micro-batches of 1, 3 and 8, prompts left- or right-padded, packed sequences, TRL's
``logits_to_keep`` layout, temperature/top-k/top-p; ``like=`` adopts the service's tile rows
and head setting from ``/v1/info``. The service answers over HTTP and gRPC. At the same weights
the PPO ratio is therefore exactly 1 on every token — in float32 and bfloat16, fp32 head on/off.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from oldlogit import Client, Sequence
from oldlogit.contract.weights import weight_sha256
from oldlogit.parity import token_logprobs, trainer_numerics
from tests.integration.conftest import Served, start_served

COMBOS = [(d, h) for d in ("float32", "bfloat16") for h in (False, True)]
CASES_PER_COMBO = 52  # 4 combos → 208 cases, each a micro-batch of 1–8 sequences


@pytest.fixture(scope="module", params=COMBOS, ids=[f"{d}-head_fp32={h}" for d, h in COMBOS])
def parity_served(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, model_dir: Path
) -> Iterator[tuple[Served, str, bool]]:
    dtype, head = request.param
    s = start_served(tmp_path_factory.mktemp("parity"), model_dir, dtype=dtype, lm_head_fp32=head)
    yield s, dtype, head
    s.server.stop()


def _layout(
    rng: np.random.Generator, vocab: int, count: int, kind: str
) -> tuple[list[np.ndarray], list[int]]:
    """Sequences and, per sequence, the first scored position (TRL: the completion's start)."""
    seqs, starts = [], []
    for _ in range(count):
        if kind == "trl":
            prompt = rng.integers(0, vocab, int(rng.integers(2, 40)))
            completion = rng.integers(0, vocab, int(rng.integers(1, 50)))
            seqs.append(np.concatenate([prompt, completion]))
            starts.append(len(prompt))
        else:
            seqs.append(rng.integers(0, vocab, int(rng.integers(2, 140))))
            starts.append(1)
    return seqs, starts


def _trainer_rows(
    model: torch.nn.Module,
    seqs: list[np.ndarray],
    starts: list[int],
    kind: str,
    sampling: dict[str, float | int],
) -> list[np.ndarray]:
    """The trainer's logprobs for positions [start, n) of each sequence, as its batch holds it."""
    tensors = [torch.from_numpy(s.astype(np.int64)) for s in seqs]
    if kind == "packed":
        ids = torch.cat(tensors)[None]
        pos = torch.cat([torch.arange(len(t)) for t in tensors])[None]
        out = token_logprobs(model, ids, position_ids=pos, **sampling)[0]
        rows, at = [], 0
        for t, s in zip(tensors, starts, strict=True):
            rows.append(out[at + s : at + len(t)].detach().numpy())
            at += len(t)
        return rows
    if kind == "trl":  # prompts left-padded, completions right-padded, logits for the last K
        prompts = [t[:s] for t, s in zip(tensors, starts, strict=True)]
        comps = [t[s:] for t, s in zip(tensors, starts, strict=True)]
        p_w, c_w = max(len(p) for p in prompts), max(len(c) for c in comps)
        ids = torch.zeros(len(seqs), p_w + c_w, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, (p, c) in enumerate(zip(prompts, comps, strict=True)):
            ids[i, p_w - len(p) : p_w], mask[i, p_w - len(p) : p_w] = p, 1
            ids[i, p_w : p_w + len(c)], mask[i, p_w : p_w + len(c)] = c, 1
        out = token_logprobs(model, ids, mask, logits_to_keep=c_w, **sampling)
        return [out[i, : len(c)].detach().numpy() for i, c in enumerate(comps)]
    width = max(len(t) for t in tensors)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, t in enumerate(tensors):
        sl = slice(0, len(t)) if kind == "right" else slice(width - len(t), width)
        ids[i, sl], mask[i, sl] = t, 1
    out = token_logprobs(model, ids, mask, **sampling)
    rows = []
    for i, (t, s) in enumerate(zip(tensors, starts, strict=True)):
        row = out[i, : len(t)] if kind == "right" else out[i, width - len(t) :]
        rows.append(row[s:].detach().numpy())
    return rows


def test_trainer_pi_theta_is_bitwise_the_service_pi_old(parity_served, model_dir):
    served, dtype, head = parity_served
    torch_dtype = getattr(torch, dtype)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype).eval()
    rng = np.random.default_rng(COMBOS.index((dtype, head)))
    vocab = served.model.vocab_size
    cases = tokens = 0
    with (
        Client(served.server.http_url) as http,
        Client(served.server.grpc_url) as grpc,
    ):
        info = http.info()
        assert info.numerics == "invariant" and info.lm_head_fp32 is head
        for version in (0, 1, 2, 3):
            weights = served.weights[version]
            model.load_state_dict(weights)  # what a trainer holds at that version
            assert weight_sha256(dict(model.state_dict())) == http.versions()[version].weight_sha256
            with torch.no_grad(), trainer_numerics(model, like=info.numerics_spec()):
                for case in range(CASES_PER_COMBO // 4):
                    kind = str(rng.choice(["left", "right", "packed", "trl"]))
                    seqs, starts = _layout(rng, vocab, int(rng.choice([1, 3, 8])), kind)
                    sampling = {
                        "temperature": float(rng.choice([1.0, 0.7, 1.2])),
                        "top_k": int(rng.choice([0, 0, 8, 64])),
                        "top_p": float(rng.choice([1.0, 1.0, 0.9, 0.6])),
                    }
                    mine = _trainer_rows(model, seqs, starts, kind, sampling)
                    client = http if case % 2 else grpc
                    results = client.logprobs_batch(
                        [
                            Sequence(token_ids=s, policy_version=version, score_from=st)
                            for s, st in zip(seqs, starts, strict=True)
                        ],
                        use_cache=False,
                        **sampling,
                    )
                    for s, st, row, res in zip(seqs, starts, mine, results, strict=True):
                        served_row = res.logprobs[st:]
                        assert res.exact and res.versions == [version]
                        assert np.array_equal(row, served_row), (version, case, kind, sampling)
                        finite = np.isfinite(row)  # −inf: outside top-k/top-p on both sides
                        assert np.all(np.exp(row[finite] - served_row[finite]) == 1.0)
                        tokens += len(s) - st
                    cases += 1
    assert cases * len(COMBOS) >= 200 and tokens > 1000
