"""The shared numerics of DESIGN.md §2: the chunked lm_head and the logit → logprob steps.

In: final hidden states (model dtype) and the head's weight; out: float32 logprobs of targets.
The reference and the engine both call these functions, so the only thing left to prove equal
is *which* rows they compute — never *how*. Must not know about versions, batching or devices.

Why fixed chunks: a GEMM over a subset of rows is not always bitwise equal to the same rows of
the full GEMM (CPU kernels are picked by M). The head is therefore *defined* as applied to the
fixed row chunks [0, C), [C, 2C), … of the whole sequence; the engine computes only the chunks
that hold a scored row, and gets the same bits.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

logger = logging.getLogger(__name__)

__all__ = [
    "HEAD_CHUNK_ROWS",
    "PROCESS_ROWS",
    "SamplingParams",
    "head_chunk_bounds",
    "head_logits_chunk",
    "processed_logprobs",
]

# Rows of the sequence's hidden states per lm_head GEMM. Part of the numerics contract: the
# reference and the engine must use the same value (changing it changes last bits).
HEAD_CHUNK_ROWS = 256
# Rows per slice of the float32 processing stage: bounds [rows, V] float32 temporaries (the
# top-p sort holds several of them). Processing is row-wise, so the slice size is not numerics.
PROCESS_ROWS = 64


@dataclass(frozen=True)
class SamplingParams:
    """The sampler's settings. ``temperature=1, top_k=0, top_p=1`` is the raw distribution.

    ``top_k=0`` (or ≥ vocab) and ``top_p>=1`` switch the filter off. Validation of ranges
    happens in the service's ``validate`` stage; here they are only asserted.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    @property
    def is_raw(self) -> bool:
        return self.temperature == 1.0 and self.top_k <= 0 and self.top_p >= 1.0


def head_chunk_bounds(num_rows: int, chunk_rows: int = HEAD_CHUNK_ROWS) -> list[tuple[int, int]]:
    """The fixed [start, end) row chunks the head is applied to, for a sequence of num_rows."""
    if chunk_rows <= 0:
        raise ValueError(f"chunk_rows must be positive, got {chunk_rows}")
    return [(s, min(s + chunk_rows, num_rows)) for s in range(0, num_rows, chunk_rows)]


def head_logits_chunk(
    hidden_chunk: Tensor, weight: Tensor, bias: Tensor | None, lm_head_fp32: bool
) -> Tensor:
    """Logits of one head chunk: [C, H] → [C, V], in the head's dtype.

    With ``lm_head_fp32`` the hidden states and the weight are cast to float32 before the
    projection (the trainer's "fp32 lm_head" numerics).
    """
    hidden_chunk = hidden_chunk.contiguous()  # [C, H]; a strided view may pick another kernel
    if lm_head_fp32:
        hidden_chunk = hidden_chunk.float()
        weight = weight.float()
        bias = None if bias is None else bias.float()
    return F.linear(hidden_chunk, weight, bias)  # [C, V]


def processed_logprobs(logits_rows: Tensor, targets: Tensor, sampling: SamplingParams) -> Tensor:
    """Logprob of ``targets`` under the processed distribution of each row.

    logits_rows: [S, V] any float dtype; targets: [S] int64 on the same device → [S] float32.
    Steps (each row-independent): float32 → / temperature → top-k (ties at the k-th value kept)
    → top-p (keep a token iff the probability mass strictly before it in the stable descending
    order is < top_p, so the top token is always kept) → log_softmax → gather. A target outside
    the kept support gets −inf, never NaN. Processes PROCESS_ROWS rows at a time.
    """
    assert sampling.temperature > 0, "temperature must be > 0 (validated upstream)"
    assert logits_rows.dim() == 2 and targets.dim() == 1
    assert logits_rows.shape[0] == targets.shape[0]
    out = torch.empty(targets.shape[0], dtype=torch.float32, device=logits_rows.device)  # [S]
    for start in range(0, targets.shape[0], PROCESS_ROWS):
        end = min(start + PROCESS_ROWS, targets.shape[0])
        out[start:end] = _processed_rows(logits_rows[start:end], targets[start:end], sampling)
    return out


def _processed_rows(logits: Tensor, targets: Tensor, sampling: SamplingParams) -> Tensor:
    vocab = logits.shape[-1]
    x = logits.float() / sampling.temperature  # [s, V]; dividing by 1.0 is exact
    if 0 < sampling.top_k < vocab:
        kth = torch.topk(x, sampling.top_k, dim=-1).values[:, -1:]  # [s, 1]
        x = x.masked_fill(x < kth, float("-inf"))
    if sampling.top_p < 1.0:
        probs = torch.softmax(x, dim=-1)  # [s, V]; zero where top-k removed a token
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True, stable=True)
        # Exclusive prefix sum: the mass strictly before each token in the sorted order.
        cumulative = torch.cumsum(sorted_probs, dim=-1)  # [s, V]
        before = torch.cat([torch.zeros_like(cumulative[:, :1]), cumulative[:, :-1]], dim=-1)
        keep_sorted = before < sampling.top_p
        keep = torch.empty_like(keep_sorted).scatter_(-1, order, keep_sorted)  # [s, V]
        x = x.masked_fill(~keep, float("-inf"))
    logprobs = torch.log_softmax(x, dim=-1)  # [s, V]
    return logprobs.gather(-1, targets[:, None]).squeeze(-1)  # [s]
