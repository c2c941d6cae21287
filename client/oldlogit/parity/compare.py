"""How far a trainer's own forward is from the service, per micro-batch size.

In: the trainer's model (holding the weights of one published version), a client, samples
(token ids + the first scored position). Out: a ``ParityReport``: for the plain forward and/or
the forward under ``trainer_numerics``, per micro-batch size, max |Δ logprob| and the share of
scored tokens whose ratio π_trainer / π_service differs from 1 by more than 0, 1e-3 and 1e-2.
A trainer that cannot be patched learns what its PPO ratio carries at zero staleness.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from oldlogit.contract.numerics import NumericsMismatch

from .logprobs import token_logprobs
from .numerics import local_spec, trainer_numerics, unwrap_model

__all__ = ["THRESHOLDS", "ParityReport", "ParityRow", "compare"]

THRESHOLDS = (0.0, 1e-3, 1e-2)

# (model, input_ids [B, T], attention_mask [B, T], sampling kwargs) → logprobs [B, T] aligned.
LogprobFn = Callable[[nn.Module, Tensor, Tensor, dict[str, Any]], Tensor]


@dataclass(frozen=True)
class ParityRow:
    forward: str  # "plain" or "patched"
    micro_batch: int
    tokens: int  # scored tokens compared
    max_abs: float  # max |logp_trainer − logp_service| (inf where the support differs)
    share_off: dict[float, float] = field(default_factory=dict)  # threshold → share of tokens


@dataclass
class ParityReport:
    policy_version: int
    padding_side: str
    sampling: dict[str, float | int]
    rows: list[ParityRow] = field(default_factory=list)

    def table(self) -> str:
        """A plain-text table: one row per (forward, micro-batch size)."""
        head = ["forward", "micro-batch", "tokens", "max |Δ|"] + [
            f"|ratio−1|>{t:g}" for t in THRESHOLDS
        ]
        lines = [
            f"version {self.policy_version}, {self.padding_side} padding, sampling {self.sampling}",
            "  ".join(f"{h:>12}" for h in head),
        ]
        for r in self.rows:
            cells = [r.forward, str(r.micro_batch), str(r.tokens), f"{r.max_abs:.3g}"] + [
                f"{100 * r.share_off[t]:.1f} %" for t in THRESHOLDS
            ]
            lines.append("  ".join(f"{c:>12}" for c in cells))
        return "\n".join(lines)


def _default_logprobs(
    model: nn.Module, ids: Tensor, mask: Tensor, sampling: dict[str, Any]
) -> Tensor:
    return token_logprobs(model, ids, mask, **sampling)


def _batches(
    samples: Sequence[tuple[np.ndarray, int]], size: int, side: str
) -> list[tuple[Tensor, Tensor, list[tuple[int, int, int]]]]:
    """Padded micro-batches: (ids, mask, [(sample index, column of token 0, length)])."""
    out = []
    for lo in range(0, len(samples), size):
        chunk = list(range(lo, min(lo + size, len(samples))))
        width = max(len(samples[i][0]) for i in chunk)
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        placed = []
        for row, i in enumerate(chunk):
            n = len(samples[i][0])
            col = 0 if side == "right" else width - n
            ids[row, col : col + n] = torch.from_numpy(np.asarray(samples[i][0], dtype=np.int64))
            mask[row, col : col + n] = 1
            placed.append((i, col, n))
        out.append((ids, mask, placed))
    return out


def compare(
    model: nn.Module,
    client: Any,
    samples: Sequence[tuple[Sequence[int] | np.ndarray, int]],
    *,
    policy_version: int,
    micro_batch_sizes: Sequence[int] = (1, 4, 8),
    padding_side: str = "left",
    forwards: Sequence[str] = ("plain", "patched"),
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    logprob_fn: LogprobFn | None = None,
    check_weights: bool = True,
) -> ParityReport:
    """Score ``samples`` (token ids, first scored position) on the trainer and the service.

    ``model`` must hold the weights of ``policy_version`` (checked by weight hash unless
    ``check_weights=False``). ``logprob_fn`` is the trainer's own per-token logprob code
    ([B, T] aligned with the input); the default is ``token_logprobs``. Under "patched" the
    model runs with the service's numerics (``like=`` its ``/v1/info``); a dtype or device kind
    the two sides do not share is refused with ``NumericsMismatch``.
    """
    from oldlogit.contract.types import Sequence as WireSequence
    from oldlogit.contract.weights import weight_sha256

    if padding_side not in ("left", "right"):
        raise ValueError(f"padding_side must be 'left' or 'right', got {padding_side!r}")
    unknown = set(forwards) - {"plain", "patched"}
    if unknown:
        raise ValueError(f"forwards must be 'plain' and/or 'patched', got {sorted(unknown)}")
    core = unwrap_model(model)
    info = client.info()
    service = info.numerics_spec()
    mine = local_spec(core, profile="invariant", tile_rows=service.tile_rows, lm_head_fp32=False)
    problems = [p for p in mine.mismatches(service) if p.split(":")[0] in ("dtype", "device_kind")]
    if problems:
        raise NumericsMismatch("the trainer's model and the service differ: " + "; ".join(problems))
    if check_weights:
        params = {n: p.detach() for n, p in core.named_parameters()}
        ours = weight_sha256(params)
        theirs = client.version(policy_version).weight_sha256
        if ours != theirs:
            raise ValueError(
                f"the model does not hold the weights of version {policy_version} "
                f"(sha256 {ours[:12]}… here, {theirs[:12]}… there)"
            )
    sampling: dict[str, Any] = {"temperature": temperature, "top_k": top_k, "top_p": top_p}
    norm = [(np.asarray(ids, dtype=np.int64), int(start)) for ids, start in samples]
    served = client.logprobs_batch(
        [
            WireSequence(token_ids=ids, policy_version=policy_version, score_from=s)
            for ids, s in norm
        ],
        use_cache=False,
        **sampling,
    )
    reference = [r.logprobs for r in served]
    fn = logprob_fn or _default_logprobs
    report = ParityReport(policy_version, padding_side, sampling)
    for forward in forwards:
        for size in micro_batch_sizes:
            diffs: list[np.ndarray] = []
            with torch.no_grad():
                if forward == "patched":
                    ctx: Any = trainer_numerics(core, like=service)
                else:
                    ctx = _null()
                with ctx:
                    for ids, mask, placed in _batches(norm, size, padding_side):
                        out = fn(core, ids.to(_device(core)), mask.to(_device(core)), sampling)
                        out = out.float().cpu()
                        for row, (i, col, n) in enumerate(placed):
                            start = norm[i][1]
                            mine_row = out[row, col + start : col + n].numpy()
                            diffs.append(_delta(mine_row, reference[i][start:n]))
            report.rows.append(_row(forward, size, np.concatenate(diffs) if diffs else np.zeros(0)))
    return report


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def _delta(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """|a − b| per token; 0 where both are −inf, inf where only one is."""
    both = np.isneginf(a) & np.isneginf(b)
    with np.errstate(invalid="ignore"):
        d = np.abs(a.astype(np.float64) - b.astype(np.float64))
    d[both] = 0.0
    return np.nan_to_num(d, nan=math.inf)


def _row(forward: str, size: int, diffs: np.ndarray) -> ParityRow:
    tokens = int(diffs.size)
    ratio_off = np.abs(np.expm1(np.minimum(diffs, 50.0)))  # |exp(Δ) − 1| ≥ the ratio's distance
    share = {t: float((ratio_off > t).mean()) if tokens else 0.0 for t in THRESHOLDS}
    return ParityRow(forward, size, tokens, float(diffs.max()) if tokens else 0.0, share)
