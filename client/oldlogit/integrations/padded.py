"""Logprobs for a padded ``[B, T]`` batch, the layout TRL and verl hold.

In: ``input_ids`` [B, T] and ``attention_mask`` [B, T] (each row one sequence: a single run of
real tokens, left- or right-padded), which tokens to score (``response_mask`` [B, T], or
``score_from``: a column, or one per row) and their versions (``policy_version``: one for all;
``versions``: one per row [B] or per token [B, T], −1 = not scored). Out: ``PaddedLogprobs``
— ``logprobs`` [B, T] float32 aligned with the input and ``mask`` [B, T], 1 where a value was
returned; 0 in both elsewhere (padding, prompts, a sequence's first token), so masked losses
stay finite. MoE models: ``routed_experts`` [B, T, L, k] aligned with the input travels as
each sequence's routing record. Torch tensors in → torch tensors out (on the input's device);
else numpy. Builds ``Sequence`` requests and puts the answers back in place; torch is never
imported for numpy input.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from oldlogit.contract.errors import InvalidRequest
from oldlogit.contract.types import NOT_SCORED, RoutedExperts, Sequence

__all__ = ["PaddedLogprobs", "padded_requests", "place_results"]


class PaddedLogprobs(NamedTuple):
    """[B, T] logprobs (float32, 0 where unscored) and mask (1 where scored)."""

    logprobs: Any
    mask: Any


def _array(x: Any, name: str) -> npt.NDArray[np.int64]:
    """An integer array from a list, numpy array or torch tensor (never importing torch)."""
    if hasattr(x, "detach") and hasattr(x, "cpu"):  # a torch tensor
        x = x.detach().cpu().numpy()
    try:
        arr = np.asarray(x)
    except (TypeError, ValueError) as exc:
        raise InvalidRequest(f"{name} must be an array", parameter=name) from exc
    if arr.dtype == np.bool_ or np.issubdtype(arr.dtype, np.integer):
        return arr.astype(np.int64)
    if np.issubdtype(arr.dtype, np.floating) and bool(np.all(arr == np.round(arr))):
        return arr.astype(np.int64)  # a float 0/1 mask (verl's response_mask)
    raise InvalidRequest(f"{name} must hold integers, got {arr.dtype}", parameter=name)


def padded_requests(
    input_ids: Any,
    attention_mask: Any = None,
    *,
    response_mask: Any = None,
    score_from: int | Seq[int] | Any = None,
    policy_version: int | None = None,
    versions: Any = None,
    routed_experts: Any = None,
) -> tuple[list[Sequence], list[tuple[int, int]], tuple[int, int]]:
    """The requests for a padded batch: (sequences, (row, first column) of each, (B, T)).

    Rows with nothing to score get no request. Errors name the parameter. ``routed_experts``
    (MoE): [B, T, L, k] aligned with ``input_ids``; each sequence sends its rows but the last.
    """
    ids = _array(input_ids, "input_ids")
    if ids.ndim != 2:
        raise InvalidRequest(
            f"input_ids must be [batch, seq], got {list(ids.shape)}", parameter="input_ids"
        )
    batch, length = ids.shape
    mask = np.ones_like(ids) if attention_mask is None else _array(attention_mask, "attention_mask")
    if mask.shape != ids.shape:
        raise InvalidRequest(
            f"attention_mask must have input_ids' shape {[batch, length]}, got {list(mask.shape)}",
            parameter="attention_mask",
        )
    if (response_mask is None) == (score_from is None):
        raise InvalidRequest(
            "pass exactly one of response_mask and score_from", parameter="response_mask"
        )
    if response_mask is not None:
        scored = _array(response_mask, "response_mask") != 0
        if scored.shape != ids.shape:
            raise InvalidRequest(
                f"response_mask must have input_ids' shape {[batch, length]}, got "
                f"{list(scored.shape)}",
                parameter="response_mask",
            )
    else:
        starts = _array(score_from, "score_from")
        if starts.ndim > 1 or (starts.ndim == 1 and starts.shape != (batch,)):
            raise InvalidRequest(
                f"score_from must be a column or one per row [{batch}], got {list(starts.shape)}",
                parameter="score_from",
            )
        scored = np.arange(length)[None, :] >= np.broadcast_to(starts, (batch,))[:, None]
    routing = None
    if routed_experts is not None:
        routing = _array(routed_experts, "routed_experts")
        if routing.ndim != 4 or routing.shape[:2] != (batch, length):
            raise InvalidRequest(
                f"routed_experts must be [batch, seq, MoE layers, top_k] with [batch, seq] = "
                f"{[batch, length]}, got {list(routing.shape)}",
                parameter="routed_experts",
            )
    per_token = _versions(policy_version, versions, batch, length)
    per_token = np.where(scored & (mask != 0), per_token, NOT_SCORED)
    sequences: list[Sequence] = []
    placed: list[tuple[int, int]] = []
    for b in range(batch):
        real = np.flatnonzero(mask[b])
        if real.size == 0:
            continue
        first, last = int(real[0]), int(real[-1]) + 1
        if real.size != last - first:
            raise InvalidRequest(
                f"attention_mask row {b} holds more than one run of real tokens: one sequence "
                "per row",
                parameter="attention_mask",
            )
        row_versions = per_token[b, first:last].copy()
        row_versions[0] = NOT_SCORED  # a sequence's first token has no prefix
        if not bool((row_versions >= 0).any()):
            continue
        record = None
        if routing is not None:  # rows of the sequence's tokens but the last (no logprob needs it)
            record = RoutedExperts(ids=routing[b, first : last - 1], start=0)
        sequences.append(
            Sequence(token_ids=ids[b, first:last], versions=row_versions, routed_experts=record)
        )
        placed.append((b, first))
    return sequences, placed, (batch, length)


def _versions(
    policy_version: int | None, versions: Any, batch: int, length: int
) -> npt.NDArray[np.int64]:
    if (policy_version is None) == (versions is None):
        raise InvalidRequest(
            "pass exactly one of policy_version and versions", parameter="versions"
        )
    if policy_version is not None:
        return np.full((batch, length), int(policy_version), dtype=np.int64)
    arr = _array(versions, "versions")
    if arr.shape == (batch,):
        return np.repeat(arr[:, None], length, axis=1)
    if arr.shape == (batch, length):
        return arr
    raise InvalidRequest(
        f"versions must be one per row [{batch}] or per token [{batch}, {length}], got "
        f"{list(arr.shape)}",
        parameter="versions",
    )


def place_results(
    results: Seq[Any], placed: Seq[tuple[int, int]], shape: tuple[int, int], like: Any
) -> PaddedLogprobs:
    """Put each sequence's logprobs back at its row and columns; torch out if ``like`` is."""
    logprobs = np.zeros(shape, dtype=np.float32)
    mask = np.zeros(shape, dtype=np.int64)
    for res, (row, first) in zip(results, placed, strict=True):
        values = np.asarray(res.logprobs, dtype=np.float32)
        got = ~np.isnan(values)
        cols = first + np.flatnonzero(got)
        logprobs[row, cols] = values[got]
        mask[row, cols] = 1
    if hasattr(like, "detach") and type(like).__module__.split(".")[0] == "torch":
        import torch

        device = like.device
        return PaddedLogprobs(
            torch.from_numpy(logprobs).to(device), torch.from_numpy(mask).to(device)
        )
    return PaddedLogprobs(logprobs, mask)
