"""Sequences packed into one row for a scoring call: positions restarting at 0 per sequence."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def packed_logprobs(model: Any, seqs: Sequence[torch.Tensor], **kwargs: Any) -> list[torch.Tensor]:
    """``token_logprobs`` of ``seqs`` packed back to back in one row, split per sequence."""
    from oldlogit.parity import token_logprobs

    ids = torch.cat(list(seqs))[None]
    pos = torch.cat([torch.arange(len(s)) for s in seqs])[None]
    row = token_logprobs(model, ids, position_ids=pos, **kwargs)[0]
    return list(torch.split(row, [len(s) for s in seqs]))
