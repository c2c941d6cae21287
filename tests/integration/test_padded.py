"""π_old where trainers keep their tensors: padded [B, T] batches and verl rollout batches.

``Client.logprobs_padded`` over both transports: left and right padding, a response mask or a
scoring column (one or per row), versions per batch, row or token; the answer is [B, T],
aligned with the input, bitwise the service's per-sequence answer where scored and 0 (mask 0)
elsewhere. ``oldlogit.integrations.verl.compute_old_log_prob`` on verl-shaped batches (prompt
left-padded, response right-padded, ``responses`` and ``response_mask``), verl not installed.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from oldlogit import Client, InvalidRequest
from oldlogit.integrations.verl import compute_old_log_prob

from .conftest import Served

pytestmark = pytest.mark.integration


def _rows(rng: np.random.Generator, vocab: int, count: int) -> list[np.ndarray]:
    return [rng.integers(0, vocab, int(rng.integers(2, 30))) for _ in range(count)]


def _pad(rows: list[np.ndarray], side: str) -> tuple[np.ndarray, np.ndarray, list[int]]:
    width = max(len(r) for r in rows) + 2
    ids = np.zeros((len(rows), width), dtype=np.int64)
    mask = np.zeros_like(ids)
    firsts = []
    for i, r in enumerate(rows):
        first = 0 if side == "right" else width - len(r)
        ids[i, first : first + len(r)], mask[i, first : first + len(r)] = r, 1
        firsts.append(first)
    return ids, mask, firsts


@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_batches_get_the_per_sequence_bits_in_place(
    served: Served, transport: str, side: str
) -> None:
    rng = np.random.default_rng(1 if side == "left" else 2)
    rows = _rows(rng, served.model.vocab_size, 5)
    ids, mask, firsts = _pad(rows, side)
    batch, width = ids.shape
    response = np.zeros_like(ids)
    row_versions = np.array([0, 1, 2, 3, 10])
    token_versions = np.full_like(ids, -1)
    for i, (r, first) in enumerate(zip(rows, firsts, strict=True)):
        start = first + len(r) // 2
        response[i, start : first + len(r)] = 1
        token_versions[i, first : first + len(r)] = rng.choice([1, 2, 3], len(r))
    with Client(served.url(transport)) as c:
        cases = [
            (dict(response_mask=response, versions=row_versions), row_versions[:, None]),
            (dict(score_from=width // 2, policy_version=3), None),
            (dict(score_from=[f + 1 for f in firsts], versions=token_versions), token_versions),
        ]
        for kwargs, _ in cases:
            out = c.logprobs_padded(ids, mask, temperature=0.8, **kwargs)
            assert out.logprobs.shape == (batch, width) and out.logprobs.dtype == np.float32
            for i, (r, first) in enumerate(zip(rows, firsts, strict=True)):
                cols = np.flatnonzero(out.mask[i])
                assert np.all(out.logprobs[i, out.mask[i] == 0] == 0)
                assert cols.size == 0 or (cols.min() > first and cols.max() < first + len(r))
                if "response_mask" in kwargs:
                    v = np.where(response[i, first : first + len(r)] == 1, row_versions[i], -1)
                elif "policy_version" in kwargs:
                    v = np.where(np.arange(first, first + len(r)) >= width // 2, 3, -1)
                else:
                    v = token_versions[i, first : first + len(r)].copy()
                v[0] = -1
                one = c.logprobs(r, versions=v, temperature=0.8)
                expected = np.nan_to_num(one.logprobs, nan=0.0)
                assert np.array_equal(out.logprobs[i, first : first + len(r)], expected)
                assert np.array_equal(out.mask[i, first : first + len(r)], ~np.isnan(one.logprobs))


def test_torch_in_torch_out_and_errors_name_the_parameter(served: Served) -> None:
    rows = _rows(np.random.default_rng(3), served.model.vocab_size, 3)
    ids, mask, _ = _pad(rows, "left")
    with Client(served.server.grpc_url) as c:
        out = c.logprobs_padded(
            torch.from_numpy(ids), torch.from_numpy(mask), score_from=0, policy_version=1
        )
        assert isinstance(out.logprobs, torch.Tensor) and out.logprobs.dtype == torch.float32
        assert isinstance(out.mask, torch.Tensor) and bool(torch.isfinite(out.logprobs).all())
        bad = mask.copy()
        bad[0, -2] = 0  # a hole: two runs of real tokens in one row
        cases = [
            (dict(attention_mask=bad, score_from=0, policy_version=1), "attention_mask"),
            (dict(attention_mask=mask, policy_version=1), "response_mask"),
            (dict(attention_mask=mask, score_from=0), "versions"),
            (dict(attention_mask=mask, score_from=0, versions=[1, 2]), "versions"),
            (dict(attention_mask=mask[:, 1:], score_from=0, policy_version=1), "attention_mask"),
            (dict(attention_mask=mask, score_from=[0, 1], policy_version=1), "score_from"),
        ]
        for kwargs, parameter in cases:
            with pytest.raises(InvalidRequest) as info:
                c.logprobs_padded(ids, **kwargs)
            assert info.value.parameter == parameter, kwargs


def _verl_batch(
    rng: np.random.Generator, vocab: int, bs: int, prompt: int, resp: int
) -> dict[str, torch.Tensor]:
    """What verl's rollout hands the actor: prompts left-padded, responses right-padded."""
    ids = torch.zeros(bs, prompt + resp, dtype=torch.long)
    attn = torch.zeros_like(ids)
    responses = torch.zeros(bs, resp, dtype=torch.long)
    for i in range(bs):
        p, r = int(rng.integers(1, prompt + 1)), int(rng.integers(1, resp + 1))
        ids[i, prompt - p : prompt] = torch.from_numpy(rng.integers(0, vocab, p))
        responses[i, :r] = torch.from_numpy(rng.integers(0, vocab, r))
        attn[i, prompt - p : prompt + r] = 1
    ids[:, prompt:] = responses
    position_ids = (attn.cumsum(1) - 1).clamp_min(0)
    return {
        "input_ids": ids,
        "attention_mask": attn,
        "position_ids": position_ids,
        "responses": responses,
        "response_mask": attn[:, prompt:].float(),
    }


def test_verl_compute_old_log_prob_matches_the_service_per_sequence(served: Served) -> None:
    rng = np.random.default_rng(4)
    batch = _verl_batch(rng, served.model.vocab_size, bs=6, prompt=9, resp=12)
    per_token = torch.from_numpy(rng.choice([1, 2, 3], (6, 12)))  # a partial rollout
    with Client(served.server.grpc_url) as c:
        for kwargs in (
            {"policy_version": 2},
            {"versions": [0, 1, 2, 3, 10, 2]},
            {"versions": per_token},
        ):
            data = SimpleNamespace(batch=batch)  # DataProto-like: the tensors in .batch
            out = compute_old_log_prob(c, data, temperature=0.9, **kwargs)
            old, scored = out["old_log_probs"], out["old_log_probs_mask"]
            assert old.shape == (6, 12) and old.dtype == torch.float32
            assert torch.equal(scored.float(), batch["response_mask"])
            for i in range(6):
                real = batch["attention_mask"][i].bool()
                seq = batch["input_ids"][i][real].numpy()
                n_resp = int(batch["response_mask"][i].sum())
                if "policy_version" in kwargs:
                    r = c.logprobs(
                        seq, policy_version=2, score_from=len(seq) - n_resp, temperature=0.9
                    )
                else:
                    v = np.full(len(seq), -1)
                    want = kwargs["versions"]
                    v[len(seq) - n_resp :] = (
                        want[i] if not torch.is_tensor(want) else want[i, :n_resp].numpy()
                    )
                    r = c.logprobs(seq, versions=v, temperature=0.9)
                expected = torch.from_numpy(r.logprobs[len(seq) - n_resp :])
                assert torch.equal(old[i, :n_resp], expected)
                assert not old[i, n_resp:].any()
        wrong = {**batch, "responses": batch["responses"] + 1}
        with pytest.raises(InvalidRequest) as info:
            compute_old_log_prob(c, wrong, policy_version=1)
        assert info.value.parameter == "responses"
