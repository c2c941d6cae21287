"""oldlogit.correction, part 2: the decoupled PPO loss, each term's diagnostics, health flags and
the one-call pipeline — against values computed by hand (see the comments for the arithmetic).
"""

from __future__ import annotations

import math

import pytest
import torch

from oldlogit.contract.errors import InvalidRequest
from oldlogit.correction import (
    DISCREPANCY_PREFIX,
    STALENESS_PREFIX,
    CorrectionConfig,
    HealthThresholds,
    corrected_ppo_loss,
    decoupled_ppo_loss,
    health_flags,
    is_weights,
    log_ratios,
    term_metrics,
    two_term_metrics,
)

L2 = math.log(2.0)
INF = math.inf
NAN = math.nan


def t(x: object, **kw: object) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x.detach().double()
    return torch.tensor(x, dtype=torch.float64, **kw)  # type: ignore[arg-type]


def close(a: torch.Tensor | float, b: object) -> None:
    a_t = a.detach().double() if isinstance(a, torch.Tensor) else t(a)
    torch.testing.assert_close(a_t, t(b), rtol=1e-9, atol=1e-12)


# ------------------------------------------------------------------------------------ loss

# r = [1.5, 0.5, 1, 1.1], A = [1, 1, −1, −1], ε = 0.2:
#   t0: max(−1.5, −1.2) = −1.2 (clipped branch active); t1: max(−0.5, −0.8) = −0.5;
#   t2: max(1, 1) = 1; t3: max(1.1, 1.1) = 1.1  →  token mean 0.4 / 4 = 0.1, clipfrac 1/4.
STALE = [[math.log(1.5), math.log(0.5), 0.0, math.log(1.1)]]
ADV = [[1.0, 1.0, -1.0, -1.0]]


def test_ppo_loss_by_hand() -> None:
    lr = t(STALE, requires_grad=True)
    out = decoupled_ppo_loss(lr, t(ADV), clip_low=0.2)
    close(out.loss, 0.1)
    close(out.token_loss, [[-1.2, -0.5, 1.0, 1.1]])
    assert out.metrics["actor/pg_clipfrac"] == pytest.approx(0.25)
    assert out.metrics["actor/pg_clipfrac_lower"] == 0.0
    assert out.metrics["actor/pg_loss"] == pytest.approx(0.1)
    # ppo_kl = mean(−log r) = −(ln 1.5 + ln 0.5 + ln 1.1) / 4.
    want_kl = -(math.log(1.5) + math.log(0.5) + math.log(1.1)) / 4
    assert out.metrics["actor/ppo_kl"] == pytest.approx(want_kl)
    out.loss.backward()
    # d/d log r of −A r is −A r (unclipped), 0 where the clipped branch is active; ÷ 4 tokens.
    assert lr.grad is not None
    close(lr.grad, [[0.0, -0.5 / 4, 1.0 / 4, 1.1 / 4]])


def test_ppo_loss_asymmetric_clip_weight_and_aggregation() -> None:
    # ε_high = 0.6: t0 (r = 1.5) is no longer clipped → −1.5; total (−1.5 −.5 + 1 + 1.1)/4.
    out = decoupled_ppo_loss(t(STALE), t(ADV), clip_low=0.2, clip_high=0.6)
    close(out.loss, 0.1 / 4)
    assert out.metrics["actor/pg_clipfrac"] == 0.0
    # The behaviour weight multiplies each token's clipped objective (and stays detached).
    w = t([[2.0, 1.0, 0.5, 1.0]], requires_grad=True)
    out = decoupled_ppo_loss(t(STALE), t(ADV), behaviour_weight=w)
    close(out.loss, (-2.4 - 0.5 + 0.5 + 1.1) / 4)
    assert not out.loss.requires_grad  # nothing else needs grad here: w was detached
    # seq_mean_token_mean: [[t0, t1, t2], [t3, —]] → mean(−0.7 / 3, 1.1).
    lr2 = t([[STALE[0][0], STALE[0][1], 0.0], [STALE[0][3], 0.0, 0.0]])
    adv2 = t([[1.0, 1.0, -1.0], [-1.0, 0.0, 0.0]])
    m2 = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=torch.bool)
    out = decoupled_ppo_loss(lr2, adv2, m2, aggregation="seq_mean_token_mean")
    close(out.loss, (-0.7 / 3 + 1.1) / 2)
    out = decoupled_ppo_loss(lr2, adv2, m2, aggregation="token_mean")
    close(out.loss, 0.4 / 4)


def test_ppo_dual_clip() -> None:
    # r = 3, A = −1: max(3, 1.2) = 3; the dual clip caps it at c·|A| = 2.
    lr = t([[math.log(3.0), math.log(1.5)]], requires_grad=True)
    adv = t([[-1.0, 1.0]])
    plain = decoupled_ppo_loss(lr, adv)
    close(plain.token_loss, [[3.0, -1.2]])
    dual = decoupled_ppo_loss(lr, adv, dual_clip=2.0)
    close(dual.token_loss, [[2.0, -1.2]])
    assert dual.metrics["actor/pg_clipfrac_lower"] == pytest.approx(0.5)
    assert dual.metrics["actor/pg_clipfrac"] == pytest.approx(0.5)
    dual.loss.backward()
    assert lr.grad is not None
    close(lr.grad, [[0.0, 0.0]])  # both tokens sit on a clip: no gradient
    with pytest.raises(InvalidRequest) as ei:
        decoupled_ppo_loss(lr, adv, dual_clip=0.5)
    assert ei.value.parameter == "dual_clip"


def test_ppo_loss_per_sequence_advantages_and_empty_batch() -> None:
    lr = t([[0.0, 0.0], [0.0, 0.0]], requires_grad=True)
    out = decoupled_ppo_loss(lr, t([2.0, -1.0]))  # [B] broadcast over tokens
    close(out.token_loss, [[-2.0, -2.0], [1.0, 1.0]])
    empty = decoupled_ppo_loss(lr, t([2.0, -1.0]), torch.zeros(2, 2))
    close(empty.loss, 0.0)
    empty.loss.backward()
    assert lr.grad is not None
    close(lr.grad, [[0.0, 0.0], [0.0, 0.0]])
    assert all(v == 0.0 for v in empty.metrics.values())


def test_ppo_loss_extremes_do_not_leak() -> None:
    # Masked-out NaN/inf everywhere, a selected ratio of e^1000 (clamped to e^20).
    lr = t([[NAN, INF, 1000.0, -1000.0]], requires_grad=True)
    adv = t([[NAN, 1.0, -1.0, 1.0]])
    m = torch.tensor([[0, 0, 1, 1]], dtype=torch.bool)
    out = decoupled_ppo_loss(lr, adv, m, dual_clip=3.0)
    # t2: r = e^20, A = −1 → capped at 3; t3: r = e^−20, A = 1 → max(−e^−20, −0.8) = −e^−20.
    close(out.loss, (3.0 - math.exp(-20)) / 2)
    out.loss.backward()
    assert lr.grad is not None and torch.isfinite(lr.grad).all()
    assert all(math.isfinite(v) for v in out.metrics.values())


def test_ppo_loss_bad_arguments() -> None:
    with pytest.raises(InvalidRequest) as ei:
        decoupled_ppo_loss(t(STALE), t(ADV), clip_low=0.0)
    assert ei.value.parameter == "clip_low"
    with pytest.raises(InvalidRequest) as ei:
        decoupled_ppo_loss(t(STALE), t([[1.0]]))
    assert ei.value.parameter == "advantages"
    with pytest.raises(InvalidRequest) as ei:
        decoupled_ppo_loss(t(STALE), t(ADV), aggregation="sum")  # type: ignore[arg-type]
    assert ei.value.parameter == "aggregation"


# ----------------------------------------------------------------------------- diagnostics

# Two sequences, ρ = [2, 1 | 0.5]: π_num = [.5, .25 | .2], π_den = [.25, .25 | .4].
NUM = [[math.log(0.5), math.log(0.25)], [math.log(0.2), NAN]]
DEN = [[math.log(0.25), math.log(0.25)], [math.log(0.4), 0.0]]
DMASK = torch.tensor([[1, 1], [1, 0]], dtype=torch.bool)


def test_term_metrics_by_hand() -> None:
    m = term_metrics(t(NUM), t(DEN), DMASK, prefix="p/", threshold=1.5)
    want = {
        "num_tokens": 3.0,
        "num_sequences": 2.0,
        "kl": 0.0,  # mean(−log ρ) = −(ln 2 + 0 − ln 2) / 3
        "k3_kl": 1 / 6,  # ((2 − 1 − ln 2) + 0 + (.5 − 1 + ln 2)) / 3 = .5 / 3
        "chi2_token": 0.75,  # (4 + 1 + .25) / 3 − 1
        "chi2_seq": 1.125,  # (2² + .5²) / 2 − 1
        "training_log_ppl": (-(math.log(0.5) + math.log(0.25)) / 2 - math.log(0.2)) / 2,
        "rollout_log_ppl": (-math.log(0.25) - math.log(0.4)) / 2,
        "training_ppl": (2 * math.sqrt(2) + 5) / 2,  # exp(−mean log π) per sequence
        "rollout_ppl": (4 + 2.5) / 2,
        "log_ppl_diff": (-L2 / 2 + L2) / 2,  # mean log π_den − mean log π_num per sequence
        "ppl_ratio": (2**-0.5 + 2) / 2,
        "rollout_is_mean": 3.5 / 3,
        "rollout_is_std": math.sqrt(((2 - 7 / 6) ** 2 + (1 - 7 / 6) ** 2 + (0.5 - 7 / 6) ** 2) / 3),
        "rollout_is_min": 0.5,
        "rollout_is_max": 2.0,
        # w = clamp(ρ, 2/3, 1.5) = [1.5, 1, 2/3]: 1 / mean((w / mean w)²) = 19 / 21.
        "rollout_is_eff_sample_size": 19 / 21,
        "rollout_is_ratio_fraction_high": 1 / 3,
        "rollout_is_ratio_fraction_low": 1 / 3,
    }
    assert set(m) == {"p/" + k for k in want}
    for k, v in want.items():
        assert m["p/" + k] == pytest.approx(v, rel=1e-9, abs=1e-12), k
    # threshold 2: ρ = 2 and .5 sit on the bounds, not beyond; ESS of [2, 1, .5] is 7/9.
    m2 = term_metrics(t(NUM), t(DEN), DMASK, prefix="", threshold=2.0)
    assert m2["rollout_is_ratio_fraction_high"] == 0.0 == m2["rollout_is_ratio_fraction_low"]
    assert m2["rollout_is_eff_sample_size"] == pytest.approx(7 / 9)


def test_term_metrics_empty_and_extreme_are_finite() -> None:
    empty = term_metrics(t(NUM), t(DEN), torch.zeros(2, 2, dtype=torch.bool))
    assert empty["rollout_corr/num_tokens"] == 0.0
    assert empty["rollout_corr/kl"] == 0.0 and empty["rollout_corr/rollout_is_mean"] == 1.0
    assert all(math.isfinite(v) for v in empty.values())
    # π_num = 0 (−inf) at a selected token, π_den = 0 at another: clamped ratios, floored ppl.
    m = term_metrics(t([[-INF, -1.0, -2.0]]), t([[-1.0, -INF, -2.0]]))
    assert all(math.isfinite(v) for v in m.values())
    assert m["rollout_corr/rollout_is_min"] == pytest.approx(math.exp(-20))
    assert m["rollout_corr/rollout_is_max"] == pytest.approx(math.exp(20))
    assert m["rollout_corr/training_log_ppl"] == pytest.approx((100 + 1 + 2) / 3)


def test_two_term_metrics_keep_the_terms_apart() -> None:
    cur = t([[-1.0, -2.0]])
    old = t([[-1.5, -2.0]])
    beh = t([[-1.5, -2.5]])
    m = two_term_metrics(cur, old, beh)
    assert m[DISCREPANCY_PREFIX + "kl"] == pytest.approx(-0.25)  # mean(log μ − log π_old)
    assert m[STALENESS_PREFIX + "kl"] == pytest.approx(-0.25)  # mean(log π_old − log π_θ)
    assert m[DISCREPANCY_PREFIX + "rollout_is_max"] == pytest.approx(math.exp(0.5))
    assert m[STALENESS_PREFIX + "rollout_is_min"] == pytest.approx(1.0)


# ---------------------------------------------------------------------------- health flags


def _metrics(prefix: str, **kw: float) -> dict[str, float]:
    base = {
        "num_tokens": 10.0,
        "rollout_is_mean": 1.0,
        "rollout_is_eff_sample_size": 0.9,
        "kl": 0.0,
        "chi2_token": 0.1,
        "rollout_is_min": 0.9,
        "rollout_is_max": 1.1,
    }
    base.update(kw)
    return {prefix + k: v for k, v in base.items()}


def test_health_flags_thresholds() -> None:
    # Exactly on every documented bound: healthy (the bounds are inclusive).
    ok = _metrics(DISCREPANCY_PREFIX, rollout_is_mean=2.0, rollout_is_eff_sample_size=0.3)
    ok.update(_metrics(STALENESS_PREFIX, rollout_is_mean=0.5, kl=-0.1, chi2_token=1.0))
    assert health_flags(ok) == []
    bad = _metrics(
        STALENESS_PREFIX,
        rollout_is_mean=2.5,
        rollout_is_eff_sample_size=0.2,
        kl=-0.2,
        chi2_token=1.5,
    )
    flags = health_flags(bad)
    assert {(f.name, f.metric) for f in flags} == {
        ("weight_mean_out_of_range", "staleness_corr/rollout_is_mean"),
        ("ess_low", "staleness_corr/rollout_is_eff_sample_size"),
        ("kl_high", "staleness_corr/kl"),
        ("chi2_high", "staleness_corr/chi2_token"),
    }
    assert all(f.message.startswith("staleness:") for f in flags)
    strict = health_flags(
        _metrics(DISCREPANCY_PREFIX, kl=0.05), thresholds=HealthThresholds(abs_kl_max=0.01)
    )
    assert [f.name for f in strict] == ["kl_high"]
    # A term with no tokens raises nothing.
    assert health_flags(_metrics(DISCREPANCY_PREFIX, num_tokens=0.0, kl=5.0)) == []


def test_health_flags_ratio_identically_one() -> None:
    m = _metrics(STALENESS_PREFIX, rollout_is_min=1.0, rollout_is_max=1.0)
    m.update(_metrics(DISCREPANCY_PREFIX, rollout_is_min=1.0, rollout_is_max=1.0))
    flags = {f.metric: f for f in health_flags(m)}
    assert "recomputed at the current weights" in flags["staleness_corr/rollout_is_max"].message
    assert "behaviour logprobs" in flags["rollout_corr/rollout_is_max"].message


# -------------------------------------------------------------------------------- pipeline


def test_corrected_loss_composes_the_parts() -> None:
    cur = t([[-1.0, -2.0, -0.5], [-1.0, -1.0, -1.0]], requires_grad=True)
    old = t([[-1.2, -2.0, -0.6], [-1.0, -12.0, -1.0]])
    beh = t([[-1.0, -2.5, -0.6], [-1.0, -1.0, -1.0]])  # row 1 holds ρ_disc = e^−11 < 1e-4
    adv = t([1.0, -0.5])
    cfg = CorrectionConfig(is_level="token", is_threshold=1.5, veto_floor=1e-4)
    c = corrected_ppo_loss(cur, old, beh, adv, None, cfg)
    assert c.mask.int().tolist() == [[1, 1, 1], [0, 0, 0]]  # vetoed sequence
    lr = log_ratios(cur, old, beh)
    w = is_weights(lr.disc, c.mask, level="token", threshold=1.5)
    close(c.weight, w)
    close(c.weight[0], [math.exp(-0.2), 1.5, 1.0])  # e^.5 truncated at 1.5
    want = decoupled_ppo_loss(lr.stale, adv, c.mask, behaviour_weight=w)
    close(c.loss, want.loss)
    assert c.metrics[DISCREPANCY_PREFIX + "rollout_is_veto_fraction"] == 0.5
    assert c.metrics[DISCREPANCY_PREFIX + "rollout_is_catastrophic_token_fraction"] == 1 / 6
    # Diagnostics describe the data before rejection: all 6 tokens.
    assert c.metrics[STALENESS_PREFIX + "num_tokens"] == 6.0
    c.loss.backward()
    assert cur.grad is not None and torch.isfinite(cur.grad).all()
    close(cur.grad[1], [0.0, 0.0, 0.0])


def test_corrected_loss_with_rejection_and_flags() -> None:
    cur = t([[-1.0, -2.0], [-1.0, -1.0]], requires_grad=True)
    beh = t([[-1.0, -2.0], [-1.0, -3.0]])
    cfg = CorrectionConfig(
        rejection_level="token", rejection_divergence="k1", rejection_threshold=math.log(2.0)
    )
    # "old" = the behaviour logprobs: the discrepancy term is identically 1 — flagged.
    c = corrected_ppo_loss(cur, beh, beh, t([1.0, 1.0]), None, cfg)
    assert "ratio_identically_one" in {f.name for f in c.flags if f.metric.startswith("rollout")}
    assert c.metrics[DISCREPANCY_PREFIX + "rollout_rs_masked_fraction"] == 0.0
    # "old" recomputed at the current weights: the staleness term is identically 1 — flagged,
    # and PPO clipping never triggers.
    old = cur.detach().clone()
    c = corrected_ppo_loss(cur, old, beh, t([1.0, 1.0]), None, cfg)
    stale_flags = {f.name for f in c.flags if f.metric.startswith("staleness")}
    assert "ratio_identically_one" in stale_flags
    assert c.metrics["actor/pg_clipfrac"] == 0.0
    # ρ_disc = e^2 on the last token: rejected (|log ρ| > ln 2), 1 of 4 tokens, 1 of 2 seqs.
    assert c.mask.int().tolist() == [[1, 1], [1, 0]]
    assert c.metrics[DISCREPANCY_PREFIX + "rollout_rs_masked_fraction"] == 0.25
    assert c.metrics[DISCREPANCY_PREFIX + "rollout_rs_seq_masked_fraction"] == 0.5
