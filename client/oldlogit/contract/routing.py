"""MoE routing records: which experts a forward sent each token to, checked and converted.

A record (``types.RoutedExperts``) is ``ids`` [R, L, k] with a ``start`` position: row r holds,
for each of the model's L mixture-of-experts layers (decoder order; dense layers have none), the
k expert ids the forward chose when it processed the token at position ``start + r``. A row of
all ``NO_RECORD`` (−1) has no record: that position routes freely. The scored logprobs of an
n-token sequence depend on rows 0 … n − 2 (the last token's forward predicts nothing scored).
The meaning of a replayed record — which experts, which combine weights — is in
docs/exactness.md ("Routing replay"); the service's ``validate`` and the trainer's
``token_logprobs`` check a record with ``check_routing`` (one rule, one message, both sides).

``from_vllm`` and ``from_sglang`` map the engines' own layouts onto records. Both engines return
``[tokens − 1, num_hidden_layers, top_k]``: row i is the routing of the forward that took token
i as input (it produced the logits of token i + 1), layers indexed by decoder layer (dense ones
hold zeros or −1), the last token (sampled, never fed back) without a row. vLLM (``routed_
experts`` of a completion: a numpy array, or base64 of a ``.npy`` on its OpenAI server) may drop
leading prompt rows (``routed_experts_prompt_start``); SGLang (``meta_info["routed_experts"]``:
base64 of raw int32, no shape) starts at ``routed_experts_start_len``. Numpy only: no torch.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Sequence as Seq
from typing import Any

import numpy as np
import numpy.typing as npt

from oldlogit.contract.errors import InvalidRequest
from oldlogit.contract.types import MoeInfo, RoutedExperts

__all__ = [
    "NO_RECORD",
    "check_routing",
    "from_sglang",
    "from_vllm",
    "routing_rows",
    "wire_dtype",
]

NO_RECORD = -1
_I16 = np.dtype("<i2")
_I32 = np.dtype("<i4")


def wire_dtype(ids: npt.NDArray[Any]) -> np.dtype[Any]:
    """The narrowest little-endian dtype a record's ids travel in: int16 when every id fits
    (every model with fewer than 32768 experts), else int32."""
    if ids.size and (int(ids.max()) > np.iinfo(np.int16).max):
        return _I32
    return _I16


def check_routing(
    ids: npt.NDArray[Any],
    *,
    layers: int,
    top_k: int,
    num_experts: int,
    parameter: str,
    start: int = 0,
) -> npt.NDArray[np.bool_]:
    """Check a record's rows [R, layers, top_k]; return which rows are recorded ([R] bool).

    A row is all −1 (no record) or, in every layer, ``top_k`` distinct ids in
    [0, ``num_experts``). ``InvalidRequest`` names ``parameter`` and the first bad position
    (``start + r``) and layer.
    """
    if ids.ndim == 3 and ids.shape[0] == 0:
        return np.zeros(0, dtype=bool)  # no rows: nothing recorded, whatever the inner shape
    if ids.ndim != 3 or ids.shape[1:] != (layers, top_k):
        raise InvalidRequest(
            f"{parameter} must be [rows, {layers} MoE layers, top_k {top_k}], got "
            f"{list(ids.shape)}",
            parameter=parameter,
        )
    if not ids.size:
        return np.zeros(ids.shape[0], dtype=bool)
    free = ids == NO_RECORD  # [R, L, k]
    row_free = free.all(axis=(1, 2))  # [R]
    mixed = free.any(axis=(1, 2)) & ~row_free
    if mixed.any():
        r = int(np.argmax(mixed))
        raise InvalidRequest(
            f"{parameter}: the row of position {start + r} mixes -1 and expert ids: a row is "
            "all -1 (no record, routes freely) or a full record",
            parameter=parameter,
        )
    recorded = ~row_free
    bad = recorded[:, None, None] & ((ids < 0) | (ids >= num_experts))
    if bad.any():
        r, j, s = (int(x) for x in np.argwhere(bad)[0])
        raise InvalidRequest(
            f"{parameter}: position {start + r}, MoE layer {j}: {int(ids[r, j, s])} is not an "
            f"expert id in [0, {num_experts})",
            parameter=parameter,
        )
    ordered = np.sort(ids, axis=2)
    repeated = recorded[:, None] & (ordered[:, :, 1:] == ordered[:, :, :-1]).any(axis=2)
    if repeated.any():
        r, j = (int(x) for x in np.argwhere(repeated)[0])
        raise InvalidRequest(
            f"{parameter}: position {start + r}, MoE layer {j} repeats an expert "
            f"({ids[r, j].tolist()}): a token's top_k experts are distinct",
            parameter=parameter,
        )
    return recorded  # type: ignore[no-any-return]


def routing_rows(record: RoutedExperts, n: int, parameter: str) -> npt.NDArray[np.int32]:
    """A record placed on an n-token sequence: [n, L, k] int32, −1 where it holds no row.

    The record's rows must end at position n − 2 (``n − 1 − start`` rows, as vLLM and SGLang
    return them) or n − 1 (one row per token from ``start``, as verl holds them); the last
    token's row, which no scored logprob depends on, is always −1 here.
    """
    ids = record.ids
    rows, start = int(ids.shape[0]), int(record.start)
    if start < 0 or start + rows not in (max(0, n - 1), n):
        raise InvalidRequest(
            f"{parameter}: {rows} rows from position {start} cover positions "
            f"[{start}, {start + rows}) of a sequence of {n} tokens: a record's rows end at "
            f"position {n - 2} ({max(0, n - 1 - start)} rows from start, the layout vLLM and "
            f"SGLang return) or {n - 1}",
            parameter=parameter,
        )
    if not rows:
        return np.full((n, 0, 0), NO_RECORD, dtype=np.int32)
    out = np.full((n, *ids.shape[1:]), NO_RECORD, dtype=np.int32)
    out[start : start + rows] = ids
    if n:
        out[n - 1] = NO_RECORD
    return out


def _decode_npy(value: str) -> npt.NDArray[Any]:
    try:
        return np.load(io.BytesIO(base64.b64decode(value)), allow_pickle=False)  # type: ignore[no-any-return]
    except (ValueError, OSError) as exc:
        raise InvalidRequest(
            f"routed_experts: not base64 of a .npy array ({exc})", parameter="routed_experts"
        ) from exc


def _layers(
    arr: npt.NDArray[Any], moe: MoeInfo | None, moe_layers: Seq[int] | None
) -> npt.NDArray[Any]:
    """Keep the MoE layers' columns of a [rows, num_hidden_layers, k] array (an array that
    holds one column per MoE layer already is kept as it is)."""
    layers = list(moe.layers) if moe is not None else list(moe_layers or [])
    if not layers:
        raise InvalidRequest(
            "pass the model's MoE layers (Client.info().moe, or moe_layers=[decoder layer "
            "index of each MoE layer])",
            parameter="moe_layers",
        )
    if arr.ndim != 3:
        raise InvalidRequest(
            f"routed_experts must be [rows, layers, top_k], got {list(arr.shape)}",
            parameter="routed_experts",
        )
    if arr.shape[1] == len(layers):
        return arr
    if max(layers) >= arr.shape[1]:
        raise InvalidRequest(
            f"routed_experts holds {arr.shape[1]} layers; the model's MoE layers are decoder "
            f"layers {layers}",
            parameter="routed_experts",
        )
    return arr[:, layers, :]


def from_vllm(
    routed_experts: Any,
    *,
    moe: MoeInfo | None = None,
    moe_layers: Seq[int] | None = None,
    prompt_start: int = 0,
) -> RoutedExperts:
    """vLLM's ``routed_experts`` of one completion as a record.

    ``routed_experts``: the array ``CompletionOutput.routed_experts`` holds, or the base64
    ``.npy`` string its OpenAI server returns: [tokens − 1 − prompt_start, num_hidden_layers,
    top_k], row i the routing of the forward that took token ``prompt_start + i`` (prompt and
    completion concatenated) as input. ``prompt_start``: the request's
    ``routed_experts_prompt_start`` (leading prompt rows vLLM dropped). ``moe``: the service's
    ``Info.moe`` (or ``moe_layers``: the decoder layer index of each MoE layer), whose columns
    are kept.
    """
    arr = _decode_npy(routed_experts) if isinstance(routed_experts, str) else routed_experts
    if hasattr(arr, "detach") and hasattr(arr, "cpu"):
        arr = arr.detach().cpu().numpy()
    arr = _layers(np.asarray(arr), moe, moe_layers)
    return RoutedExperts(ids=arr, start=int(prompt_start))


def from_sglang(
    routed_experts: Any,
    *,
    moe: MoeInfo | None = None,
    num_hidden_layers: int | None = None,
    top_k: int | None = None,
    moe_layers: Seq[int] | None = None,
    start_len: int = 0,
) -> RoutedExperts:
    """SGLang's ``meta_info["routed_experts"]`` (base64 of raw little-endian int32, no shape)
    as a record: reshaped to [-1, num_hidden_layers, top_k] (``moe`` gives both, or pass
    them), rows positions [``start_len``, tokens − 1) — ``start_len`` is the request's
    ``routed_experts_start_len`` — and the MoE layers' columns kept."""
    layers_total = moe.num_hidden_layers if moe is not None else num_hidden_layers
    k = moe.top_k if moe is not None else top_k
    if isinstance(routed_experts, str):
        if not layers_total or not k:
            raise InvalidRequest(
                "pass moe=Client.info().moe (or num_hidden_layers and top_k) to reshape "
                "SGLang's flat routed_experts",
                parameter="moe",
            )
        try:
            raw = base64.b64decode(routed_experts)
        except ValueError as exc:
            raise InvalidRequest(
                f"routed_experts: not base64 ({exc})", parameter="routed_experts"
            ) from exc
        if len(raw) % (4 * layers_total * k):
            raise InvalidRequest(
                f"routed_experts: {len(raw)} bytes are not whole rows of {layers_total} layers "
                f"x {k} int32 ids",
                parameter="routed_experts",
            )
        arr = np.frombuffer(raw, dtype=_I32).reshape(-1, layers_total, k)
    else:
        arr = np.asarray(routed_experts)
    arr = _layers(arr, moe, moe_layers)
    return RoutedExperts(ids=arr, start=int(start_len))
