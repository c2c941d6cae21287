"""The reference logprobs: what "exact" means (docs/exactness.md), written to be read.

In: one version's weights (or one per version) and a whole token sequence; out: float32
logprobs, NaN where not scored. The whole sequence is forwarded alone, unpadded, batch 1:
- ``invariant`` profile: ``oldlogit.parity.token_logprobs`` of the sequence — the very call a
  trainer makes under ``trainer_numerics``;
- ``hf`` profile: the unpatched decoder, then the model's own head path on every fixed
  256-row chunk, and the shared processing.
No batching, no shortcuts: the engine is tested bitwise against this.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import numpy as np
import numpy.typing as npt
import torch
from torch import Tensor

from oldlogit.parity import token_logprobs
from oldlogit_service.model.loaded import LoadedModel
from oldlogit_service.model.numerics import (
    HEAD_CHUNK_ROWS,
    SamplingParams,
    head_chunk_bounds,
    processed_logprobs,
)

logger = logging.getLogger(__name__)

__all__ = ["reference_logprobs", "reference_logprobs_versions"]


def _as_token_tensor(token_ids: Sequence[int] | npt.NDArray[np.integer] | Tensor) -> Tensor:
    if isinstance(token_ids, Tensor):
        ids = token_ids.detach().to(torch.int64)
    else:
        ids = torch.tensor(np.asarray(token_ids, dtype=np.int64))
    if ids.dim() != 1:
        raise ValueError(f"token_ids must be 1-D, got shape {list(ids.shape)}")
    return ids.cpu()


@torch.inference_mode()
def reference_logprobs(
    model: LoadedModel,
    weights: Mapping[str, Tensor],
    token_ids: Sequence[int] | npt.NDArray[np.integer] | Tensor,
    sampling: SamplingParams = SamplingParams(),
    *,
    lm_head_fp32: bool = False,
    head_chunk_rows: int = HEAD_CHUNK_ROWS,
) -> npt.NDArray[np.float32]:
    """[n] float32: NaN at 0, and log p(token_ids[i] | token_ids[:i]) for every i ≥ 1."""
    ids = _as_token_tensor(token_ids)  # [T]
    n = ids.shape[0]
    out = np.full(n, np.nan, dtype=np.float32)
    if n < 2:
        return out
    device = model.device
    weights = {k: v.to(device) for k, v in weights.items()}
    ids = ids.to(device)
    if model.profile == "invariant":
        lp_all = token_logprobs(
            model.module,
            ids[None, :],
            weights=weights,
            temperature=sampling.temperature,
            top_k=sampling.top_k,
            top_p=sampling.top_p,
            lm_head_fp32=lm_head_fp32,
        )[0]  # [T], 0 at position 0
        out[1:] = lp_all[1:].cpu().numpy()
        return out
    hidden = model.hidden_states(weights, ids[None, :], None)[0]  # [T, H]
    # Hidden row r predicts token r + 1; the last row predicts nothing and is dropped.
    for start, end in head_chunk_bounds(n, head_chunk_rows):
        # [C, V]: the model's own head path (lm_head, soft-capping, logit scaling)
        logits = model.head_logits(weights, hidden[start:end], lm_head_fp32)
        rows = min(end, n - 1) - start
        if rows <= 0:
            continue
        targets = ids[start + 1 : start + 1 + rows]  # [rows]
        lp = processed_logprobs(logits[:rows], targets, sampling)  # [rows]
        out[start + 1 : start + 1 + rows] = lp.cpu().numpy()
    return out


def reference_logprobs_versions(
    model: LoadedModel,
    weights_by_version: Mapping[int, Mapping[str, Tensor]],
    token_ids: Sequence[int] | npt.NDArray[np.integer] | Tensor,
    versions: Sequence[int] | npt.NDArray[np.integer],
    sampling: SamplingParams = SamplingParams(),
    *,
    lm_head_fp32: bool = False,
    head_chunk_rows: int = HEAD_CHUNK_ROWS,
) -> npt.NDArray[np.float32]:
    """Per-token versions (−1 = not scored): each distinct version gets its own whole-sequence
    forward and contributes the positions it scores; NaN elsewhere and at 0."""
    version_arr = np.asarray(versions, dtype=np.int64)
    n = len(_as_token_tensor(token_ids))
    if version_arr.shape != (n,):
        raise ValueError(f"versions must have shape ({n},), got {version_arr.shape}")
    out = np.full(n, np.nan, dtype=np.float32)
    for version in sorted(set(version_arr[1:].tolist()) - {-1}):
        full = reference_logprobs(
            model,
            weights_by_version[version],
            token_ids,
            sampling,
            lm_head_fp32=lm_head_fp32,
            head_chunk_rows=head_chunk_rows,
        )
        mask = version_arr == version
        mask[0] = False
        out[mask] = full[mask]
    return out
