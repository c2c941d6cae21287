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
