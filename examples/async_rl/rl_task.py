"""The verifiable task: reverse a few digits. Prompts in, per-token rewards out (no model here).

A prompt is ``[BOS, d1 … dK, SEP]``; the answer is the K digits reversed. The reward of a
response is the fraction of positions it gets right, and each position's correctness is also
returned, so the trainer can credit tokens individually.
"""

from __future__ import annotations

import torch

DIGITS = 10  # tokens 0..9
BOS = 10
SEP = 11
VOCAB = 16  # a few unused ids: the policy must learn to avoid them too


def prompt_len(k: int) -> int:
    return k + 2


def make_prompts(gen: torch.Generator, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[n, K+2] prompt token ids and the [n, K] digits they hold."""
    digits = torch.randint(0, DIGITS, (n, k), generator=gen)
    ids = torch.cat([torch.full((n, 1), BOS), digits, torch.full((n, 1), SEP)], dim=1)
    return ids, digits


def target(digits: torch.Tensor) -> torch.Tensor:
    """[n, K] the correct response."""
    return digits.flip(-1)


def correctness(response: torch.Tensor, digits: torch.Tensor) -> torch.Tensor:
    """[n, K] float: 1 where the response token is right."""
    return (response == target(digits)).float()
