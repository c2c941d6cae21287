"""oldlogit.correction, part 1: log-ratios, importance weights, rejection masks, veto, the
log-linear proximal approximation, and import hygiene — against values computed by hand.

Hand values use ln 2, ln 4 … so the expected numbers are exact fractions (2, 4^(1/3), 7/9).
"""

from __future__ import annotations

import math
import subprocess
import sys

import numpy as np
import pytest
import torch

from oldlogit.contract.errors import InvalidRequest
from oldlogit.correction import (
    approx_loglinear_proximal,
    is_weights,
    log_ratio,
    log_ratios,
    rejection_mask,
    token_divergence,
    veto_mask,
)

L2 = math.log(2.0)
INF = math.inf
NAN = math.nan


def t(x: object, **kw: object) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x.detach().double()
    return torch.tensor(x, dtype=torch.float64, **kw)  # type: ignore[arg-type]


def close(a: torch.Tensor, b: object) -> None:
    torch.testing.assert_close(a.double(), t(b), rtol=1e-9, atol=1e-12)


def test_importing_correction_does_not_import_torch() -> None:
    code = (
        "import sys, oldlogit, oldlogit.correction; "
        "from oldlogit.correction import corrected_ppo_loss, log_ratios; "
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


# ----------------------------------------------------------------------------- log-ratios


def test_log_ratios_split_and_clamp() -> None:
    cur = t([[-1.0, -2.0, -0.5, -1.0, -3.0]], requires_grad=True)
    old = t([[-1.5, -2.0, -INF, -1.0, -INF]])
    beh = t([[-1.0, -2.5, -1.0, -INF, -INF]])
    lr = log_ratios(cur, old, beh)
    # disc = old − beh, stale = cur − old; −inf − finite clamps to ∓20; −inf − −inf is undefined.
    close(lr.disc, [[-0.5, 0.5, -20.0, 20.0, 0.0]])
    close(lr.stale, [[0.5, 0.0, 20.0, 0.0, 0.0]])
    assert lr.mask.tolist() == [[True, True, True, True, False]]
    assert int(lr.undefined) == 1
    close(lr.total, [[0.0, 0.5, 0.0, 20.0, 0.0]])
    assert not lr.disc.requires_grad and lr.stale.requires_grad
    lr.stale.sum().backward()
    assert cur.grad is not None
    # Gradient 1 where the ratio is selected and inside ±20; 0 where clamped or undefined.
    close(cur.grad, [[1.0, 1.0, 0.0, 1.0, 0.0]])


def test_log_ratios_masked_nan_does_not_leak() -> None:
    cur = t([[-1.0, NAN, -1.0]], requires_grad=True)
    old = t([[-1.2, NAN, INF]])
    beh = t([[-1.0, -1.0, NAN]])
    mask = torch.tensor([[1, 0, 0]])
    lr = log_ratios(cur, old, beh, mask)
    close(lr.disc, [[-0.2, 0.0, 0.0]])
    close(lr.stale, [[0.2, 0.0, 0.0]])
    assert int(lr.undefined) == 0  # masked-out positions are not "undefined", just unselected
    (lr.stale.exp().sum() + lr.disc.exp().sum()).backward()
    assert cur.grad is not None and torch.isfinite(cur.grad).all()
    close(cur.grad, [[math.exp(0.2), 0.0, 0.0]])


def test_log_ratio_accepts_client_arrays() -> None:
    # The client's arrays: float32, NaN where not scored (always at 0). mask=None selects
    # exactly the scored positions.
    old = np.array([np.nan, -1.0, -2.0, np.nan], dtype=np.float32)
    beh = np.array([np.nan, -1.5, -2.0, -3.0], dtype=np.float32)
    lr, m = log_ratio(old, beh)
    assert m.tolist() == [False, True, True, False]
    close(lr, [0.0, 0.5, 0.0, 0.0])


def test_log_ratios_shape_mismatch_names_parameter() -> None:
    with pytest.raises(InvalidRequest) as ei:
        log_ratios(t([[0.0, 0.0]]), t([[0.0]]), t([[0.0, 0.0]]))
    assert ei.value.parameter == "old" and "old" in ei.value.message
    with pytest.raises(InvalidRequest) as ei:
        log_ratios(t([[0.0]]), t([[0.0]]), t([[0.0]]), mask=torch.ones(2, 2))
    assert ei.value.parameter == "mask"


# -------------------------------------------------------------------------------- weights

LR = [[L2, 2 * L2, -L2, 7.0], [math.log(3.0), 5.0, 5.0, 5.0], [9.0, 9.0, 9.0, 9.0]]
MASK = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]], dtype=torch.bool)


@pytest.mark.parametrize(
    ("level", "threshold", "want"),
    [
        ("token", None, [[2, 4, 0.5, 0], [3, 0, 0, 0], [0, 0, 0, 0]]),
        ("token", 2.0, [[2, 2, 0.5, 0], [2, 0, 0, 0], [0, 0, 0, 0]]),
        # Σ log ρ: ln 2 + ln 4 − ln 2 = ln 4; ln 3.
        ("sequence", None, [[4, 4, 4, 0], [3, 0, 0, 0], [0, 0, 0, 0]]),
        ("sequence", 3.5, [[3.5, 3.5, 3.5, 0], [3, 0, 0, 0], [0, 0, 0, 0]]),
        # mean log ρ: ln 4 / 3 → 4^(1/3).
        ("geometric", None, [[4 ** (1 / 3)] * 3 + [0], [3, 0, 0, 0], [0, 0, 0, 0]]),
        ("geometric", 1.5, [[1.5, 1.5, 1.5, 0], [1.5, 0, 0, 0], [0, 0, 0, 0]]),
    ],
)
def test_is_weights(level: str, threshold: float | None, want: list[list[float]]) -> None:
    w = is_weights(t(LR, requires_grad=True), MASK, level=level, threshold=threshold)  # type: ignore[arg-type]
    close(w, want)
    assert not w.requires_grad


def test_is_weights_batch_normalize() -> None:
    # token: [2, 2, 0.5] and [2] → mean 6.5 / 4.
    w = is_weights(t(LR), MASK, level="token", threshold=2.0, batch_normalize=True)
    close(w, [[2 / 1.625, 2 / 1.625, 0.5 / 1.625, 0], [2 / 1.625, 0, 0, 0], [0, 0, 0, 0]])
    # sequence: one weight per non-empty sequence, 4 and 3 → mean 3.5; the empty one is ignored.
    w = is_weights(t(LR), MASK, level="sequence", threshold=None, batch_normalize=True)
    close(w, [[4 / 3.5] * 3 + [0], [3 / 3.5, 0, 0, 0], [0, 0, 0, 0]])
    # Nothing selected: nothing to normalise by, zeros stay zeros (no 0/0).
    w = is_weights(t(LR), torch.zeros(3, 4, dtype=torch.bool), batch_normalize=True)
    close(w, [[0.0] * 4] * 3)


def test_is_weights_extremes_stay_finite() -> None:
    lr = t([[1e6, -1e6, NAN, 19.0], [19.0] * 4])
    m = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 1]], dtype=torch.bool)
    w = is_weights(lr, m, level="token", threshold=None)
    close(w, [[math.exp(20), math.exp(-20), 0.0, math.exp(19)], [math.exp(19)] * 4])
    # Σ = 76 → clamped to 20 before exponentiating.
    w = is_weights(lr, m, level="sequence", threshold=None)
    assert torch.isfinite(w).all() and float(w[1, 0]) == pytest.approx(math.exp(20))


def test_is_weights_bad_arguments_name_the_parameter() -> None:
    with pytest.raises(InvalidRequest) as ei:
        is_weights(t(LR), MASK, level="sentence")  # type: ignore[arg-type]
    assert ei.value.parameter == "level"
    with pytest.raises(InvalidRequest) as ei:
        is_weights(t(LR), MASK, threshold=0.0)
    assert ei.value.parameter == "threshold"


# ------------------------------------------------------------------------------ rejection


def test_token_divergences() -> None:
    lr = t([L2, -L2, 0.0])
    close(token_divergence(lr, "k1"), [-L2, L2, 0.0])
    close(token_divergence(lr, "k2"), [L2 * L2 / 2, L2 * L2 / 2, 0.0])
    close(token_divergence(lr, "k3"), [1 - L2, -0.5 + L2, 0.0])  # ρ − 1 − log ρ
    with pytest.raises(InvalidRequest) as ei:
        token_divergence(lr, "k4")  # type: ignore[arg-type]
    assert ei.value.parameter == "divergence"


RJ = [[L2, -L2, 0.0, math.log(1.1)], [2 * L2, 0.0, 50.0, 50.0], [NAN, 0.0, 0.0, 0.0]]
RJ_MASK = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [0, 0, 0, 0]], dtype=torch.bool)


@pytest.mark.parametrize(
    ("level", "divergence", "threshold", "want"),
    [
        # |log ρ| > ln 1.5 rejected: ρ ∈ [1/1.5, 1.5] kept.
        ("token", "k1", math.log(1.5), [[0, 0, 1, 1], [0, 1, 0, 0]]),
        # k3: 1 − ln 2 = .307 > .25 rejected, ln 2 − .5 = .193 kept, 4 − 1 − ln 4 = 1.61 rejected.
        ("token", "k3", 0.25, [[0, 1, 1, 1], [0, 1, 0, 0]]),
        # Σ k1 = −ln 1.1 (|.| = .095 ≤ ln 1.5) kept; −ln 4 rejected.
        ("sequence_sum", "k1", math.log(1.5), [[1, 1, 1, 1], [0, 0, 0, 0]]),
        # mean k2: (ln²2 + ln²1.1 / 2) / 4 = .1213; (ln²4 / 2) / 2 = .4805.
        ("sequence_mean", "k2", 0.1, [[0, 0, 0, 0], [0, 0, 0, 0]]),
        ("sequence_mean", "k2", 0.2, [[1, 1, 1, 1], [0, 0, 0, 0]]),
        # max k3: .307 and 1.61 (the unselected 50s do not count).
        ("sequence_max", "k3", 0.25, [[0, 0, 0, 0], [0, 0, 0, 0]]),
        ("sequence_max", "k3", 0.35, [[1, 1, 1, 1], [0, 0, 0, 0]]),
        ("sequence_max", "k3", 2.0, [[1, 1, 1, 1], [1, 1, 0, 0]]),
    ],
)
def test_rejection_mask(
    level: str, divergence: str, threshold: float, want: list[list[int]]
) -> None:
    keep = rejection_mask(
        t(RJ),
        RJ_MASK,
        level=level,  # type: ignore[arg-type]
        divergence=divergence,  # type: ignore[arg-type]
        threshold=threshold,
    )
    assert keep.dtype == torch.bool
    # The third sequence is empty (and holds a NaN): never kept, never an error.
    assert keep.int().tolist() == [*want, [0, 0, 0, 0]]


def test_rejection_mask_bad_arguments() -> None:
    with pytest.raises(InvalidRequest) as ei:
        rejection_mask(t(RJ), RJ_MASK, level="seq", threshold=1.0)  # type: ignore[arg-type]
    assert ei.value.parameter == "level"
    with pytest.raises(InvalidRequest) as ei:
        rejection_mask(t(RJ), RJ_MASK, threshold=-1.0)
    assert ei.value.parameter == "threshold"


def test_veto_mask() -> None:
    lr = t([[0.0, math.log(1e-5), 0.0], [0.0, math.log(1e-3), 0.0], [0.0, -1e9, 0.0]])
    m = torch.tensor([[1, 1, 1], [1, 1, 1], [1, 0, 1]], dtype=torch.bool)
    keep = veto_mask(lr, m, floor=1e-4)
    # Row 0 holds ρ = 1e-5 < 1e-4: all dropped. Row 2's catastrophic token is not selected.
    assert keep.int().tolist() == [[0, 0, 0], [1, 1, 1], [1, 0, 1]]
    assert veto_mask(lr, m, floor=1e-2).int().tolist() == [[0, 0, 0], [0, 0, 0], [1, 0, 1]]
    with pytest.raises(InvalidRequest) as ei:
        veto_mask(lr, m, floor=0.0)
    assert ei.value.parameter == "floor"


# ------------------------------------------------------------------------------- proximal


def test_loglinear_proximal_by_hand() -> None:
    beh = t([[-1.0, -2.0, -3.0, -4.0, -5.0, -INF, -6.0]])
    cur = t([[-2.0, -2.0, -1.0, -4.0, -3.0, -1.0, -1.0]], requires_grad=True)
    versions = torch.tensor([[-1, 5, 8, 9, 10, 9, 12]])
    out = approx_loglinear_proximal(beh, cur, versions, current_version=10)
    # α = clamp((9 − v) / (10 − v), 0, 1): prompt 0; v=5 → .8; v=8 → .5; v=9 → 0; v≥10 → 0.
    close(out, [[-1.0, -2.0, -2.0, -4.0, -5.0, -INF, -6.0]])
    assert not out.requires_grad
    with pytest.raises(InvalidRequest) as ei:
        approx_loglinear_proximal(beh, cur, versions, current_version=10.5)  # type: ignore[arg-type]
    assert ei.value.parameter == "current_version"
