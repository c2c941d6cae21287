"""The service's side of the numerics: the logprob pipeline and the ``hf`` profile's head.

The processing steps (logits → float32 → temperature → top-k/top-p → log_softmax → gather) and
``SamplingParams`` are ``oldlogit.parity``'s — one implementation for trainer and service. The
``invariant`` profile needs nothing else here: its head runs through fixed-shape tiles, so any
subset of rows gives the same bits. The ``hf`` profile's head (the model's own head path:
``LoadedModel.head_logits``) is *defined* on the fixed row chunks [0, C), [C, 2C), … of the
whole sequence, because a plain GEMM over a subset of rows is not always bitwise equal to the
same rows of the full GEMM (CPU kernels are picked by M); the engine computes only the chunks
that hold a scored row and gets the same bits. ``head_logits_chunk`` is the plain projection
for models that are not transformers models.
Must not know about versions, batching or devices.
"""

from __future__ import annotations

import logging

import torch.nn.functional as F
from torch import Tensor

from oldlogit.parity import SamplingParams
from oldlogit.parity.logprobs import PROCESS_ROWS, processed_logprobs

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
