"""verl: π_old for a verl rollout batch, in the shape of verl's ``compute_log_prob``.

In: a verl-style batch — a mapping, or anything with a ``.batch`` mapping (``DataProto``) —
holding ``input_ids`` [bs, T] (prompt left-padded, response right-padded), ``attention_mask``
[bs, T], ``responses`` [bs, R] (the last R columns of ``input_ids``) and optionally
``response_mask`` [bs, R] (else ``attention_mask[:, -R:]``); ``position_ids`` is not needed
(the service counts positions per sequence). Versions: ``policy_version`` for the whole batch,
or ``versions`` per sample [bs] or per response token [bs, R] (a partial rollout that spans
versions). Out: ``{"old_log_probs": [bs, R], "old_log_probs_mask": [bs, R]}``, float32 and
0 where unscored, torch when the batch is. verl itself is never imported.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from oldlogit.errors import InvalidRequest

__all__ = ["compute_old_log_prob"]


def _get(batch: Mapping[str, Any], key: str, required: bool = True) -> Any:
    if key in batch:
        return batch[key]
    if required:
        raise InvalidRequest(f"the batch has no {key!r}", parameter=key)
    return None


def _np(x: Any) -> np.ndarray[Any, Any]:
    if hasattr(x, "detach"):
        return np.asarray(x.detach().cpu().numpy())
    return np.asarray(x)


def compute_old_log_prob(
    client: Any,
    data: Any,
    *,
    policy_version: int | None = None,
    versions: Any = None,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
) -> dict[str, Any]:
    """The response tokens' π_old from the service (see the module docstring).

    ``client``: an ``oldlogit.Client``. ``temperature``/``top_k``/``top_p``: the rollout's
    sampling (verl passes ``temperature`` in ``meta_info``).
    """
    batch: Mapping[str, Any] = getattr(data, "batch", data)
    input_ids = _get(batch, "input_ids")
    attention_mask = _get(batch, "attention_mask")
    responses = _get(batch, "responses")
    ids, resp = _np(input_ids), _np(responses)
    if ids.ndim != 2 or resp.ndim != 2 or resp.shape[0] != ids.shape[0]:
        raise InvalidRequest(
            f"input_ids [bs, T] and responses [bs, R] expected, got {list(ids.shape)} and "
            f"{list(resp.shape)}",
            parameter="responses",
        )
    bs, total = ids.shape
    width = resp.shape[1]
    if width > total:
        raise InvalidRequest("responses are longer than input_ids", parameter="responses")
    response_mask = _get(batch, "response_mask", required=False)
    mask = _np(attention_mask)[:, total - width :] if response_mask is None else _np(response_mask)
    if mask.shape != (bs, width):
        raise InvalidRequest(
            f"response_mask must be [bs, R] = {[bs, width]}, got {list(mask.shape)}",
            parameter="response_mask",
        )
    scored = mask != 0
    if not np.array_equal(np.where(scored, ids[:, total - width :], 0), np.where(scored, resp, 0)):
        raise InvalidRequest(
            "responses are not the last R columns of input_ids", parameter="responses"
        )
    full_mask = np.zeros((bs, total), dtype=np.int64)
    full_mask[:, total - width :] = scored
    token_versions = None
    if versions is not None:
        v = _np(versions).astype(np.int64)
        if v.shape == (bs,):
            token_versions = v
        elif v.shape == (bs, width):
            token_versions = np.full((bs, total), -1, dtype=np.int64)
            token_versions[:, total - width :] = v
        else:
            raise InvalidRequest(
                f"versions must be per sample [{bs}] or per response token [{bs}, {width}], "
                f"got {list(v.shape)}",
                parameter="versions",
            )
    out = client.logprobs_padded(
        input_ids,
        attention_mask,
        response_mask=full_mask,
        policy_version=policy_version,
        versions=token_versions,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
    )
    return {
        "old_log_probs": out.logprobs[:, total - width :],
        "old_log_probs_mask": out.mask[:, total - width :],
    }
