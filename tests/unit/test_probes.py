"""Checks run once per key (oldlogit.parity.kernels.probes): one answer a key, one seed rule."""

from __future__ import annotations

import torch

from oldlogit.parity.kernels.probes import Probe, probe_randn, seed_of


def test_a_check_runs_once_per_key_and_may_rely_on_another_key():
    probe = Probe()
    runs: list[str] = []

    def check(name: str, answer: bool) -> bool:
        runs.append(name)
        return answer

    assert probe("a", lambda: check("a", True)) is True
    assert probe("a", lambda: check("a", False)) is True  # kept: not run again
    # A check that asks for another key under the same probe (the lock is re-entrant).
    assert probe("b", lambda: probe("c", lambda: check("c", False)) or check("b", True)) is True
    assert runs == ["a", "c", "b"]
    assert probe.get("c") is False and probe.get("d") is None


def test_inputs_are_seeded_by_their_shapes_alone():
    assert seed_of((512, 896)) == 512 * 131 + 896
    a, b = probe_randn((3, 4), (5,), dtype=torch.bfloat16)
    again, _ = probe_randn((3, 4), (5,), dtype=torch.bfloat16)
    assert a.dtype == torch.bfloat16 and b.shape == (5,) and torch.equal(a, again)
    gen = torch.Generator().manual_seed(seed_of((3, 4), (5,)))
    assert torch.equal(a, torch.randn(3, 4, generator=gen).to(torch.bfloat16))
    (scaled,) = probe_randn((7,), scale=3.0)
    assert torch.equal(scaled, torch.randn(7, generator=torch.Generator().manual_seed(7)) * 3)


def test_cancelling_operands_sum_to_exactly_zero_and_are_seeded_by_their_shapes():
    from oldlogit.parity.kernels.probes import probe_cancelling

    x, w = probe_cancelling(5, 3, 9, dtype=torch.bfloat16)
    assert x.shape == (5, 9) and w.shape == (3, 9) and x.dtype == w.dtype == torch.bfloat16
    assert torch.equal(x.double() @ w.double().t(), torch.zeros(5, 3, dtype=torch.float64))
    assert int((w != 0).sum()) == 3 * 8  # an odd k leaves one column at 0
    again, _ = probe_cancelling(5, 3, 9, dtype=torch.bfloat16)
    assert torch.equal(x, again)


def test_attention_probes_nearly_cancel_and_are_seeded_by_their_shapes() -> None:
    from oldlogit.parity.kernels.probes import probe_attention_cancelling

    shapes = ((2, 4, 9, 8), (2, 2, 9, 8), (2, 2, 9, 16))
    q, k, v = probe_attention_cancelling(*shapes, dtype=torch.float16)
    assert (q.shape, k.shape, v.shape) == shapes and v.dtype == torch.float16
    assert torch.equal(v[..., 1::2, :], -v[..., 0:8:2, :])  # pairs of opposite signs
    assert bool((v[..., 8, :] != 0).all())  # an odd length keeps its last value
    assert float(q.abs().max()) < 2.0**-6  # every key weighs almost alike
    magnitudes = v.float().abs()
    assert float(magnitudes.max() / magnitudes[magnitudes > 0].min()) > 2.0**6  # spread
    again = probe_attention_cancelling(*shapes, dtype=torch.float16)
    assert all(torch.equal(a, b) for a, b in zip((q, k, v), again, strict=True))
    # A causal row over an even number of keys that weigh alike sums to nearly nothing.
    row = torch.softmax((q[0, 0] @ k[0, 0].t()).float()[3, :4], -1) @ v[0, 0, :4].float()
    assert float(row.abs().max()) < 1e-2 * float(v[0, 0, :4].float().abs().max())
