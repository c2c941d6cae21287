"""One attention call per layer over every packed sequence, each over its own keys (CUDA).

The plan (token-major rows [N, H, D] and int32 cumulative lengths, from a batch's sequences),
the route (``choose_route``: FlashAttention-2's varlen forward, the memory-efficient kernel's,
or the per-sequence path, by name) and the two calls. Why each is batch-invariant, and what it
was read from: docs/exactness.md (attention).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "EAGER",
    "EFFICIENT",
    "FLASH",
    "SDPA",
    "OpSupport",
    "Route",
    "VarlenPlan",
    "choose_route",
    "efficient_varlen",
    "flash_varlen",
    "op_support",
    "pack_rows",
    "unpack_rows",
    "varlen_plan",
]

FLASH = "varlen-flash"  # FlashAttention-2 varlen forward (fp16/bf16): one call per layer
EFFICIENT = "varlen-efficient"  # the memory-efficient (cutlass) kernel with cu_seqlens
SDPA = "sdpa"  # one SDPA call per sequence (CPU: per group of equal lengths)
EAGER = "eager"  # the eager formula per sequence (soft-capped logits, dropout)

# FlashAttention-2's forward takes head dims that are multiples of 8 up to 256
# (flash_api.cpp: mha_varlen_fwd's checks); the memory-efficient kernel is held to multiples of 8
# here too (its aligned kernels).
FLASH_MAX_HEAD_DIM = 256
HEAD_DIM_MULTIPLE = 8


@dataclass(frozen=True)
class VarlenPlan:
    """A batch's sequences as token-major rows: ``index`` [N] into the flattened [B * T] rows
    (None: every row in order), ``cu_seqlens`` [S + 1] int32 (sequence i is rows
    [cu[i], cu[i + 1])), the longest sequence's length, and the batch's [B, T]."""

    index: Tensor | None
    cu_seqlens: Tensor
    lengths: tuple[int, ...]
    max_len: int
    batch: int
    length: int

    @property
    def total(self) -> int:
        """Real tokens in the batch (N)."""
        return sum(self.lengths)


def varlen_plan(
    rows: Sequence[tuple[int, int, int]], batch: int, length: int, device: torch.device
) -> VarlenPlan:
    """The plan of a batch whose sequences are ``rows`` ((batch row, start, end), end exclusive,
    in the order they are packed: ``attention.Segments.rows``)."""
    lengths = tuple(e - s for _, s, e in rows)
    if any(n <= 0 for n in lengths):
        raise ValueError(f"a sequence of no tokens in {list(rows)[:8]}")
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    parts = [torch.arange(b * length + s, b * length + e) for b, s, e in rows]
    index = torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)
    identity = index.shape[0] == batch * length and bool(
        torch.equal(index, torch.arange(batch * length))
    )
    return VarlenPlan(
        index=None if identity else index.to(device),
        cu_seqlens=torch.tensor(cu, dtype=torch.int32).to(device),
        lengths=lengths,
        max_len=max(lengths, default=0),
        batch=batch,
        length=length,
    )


def pack_rows(x: Tensor, plan: VarlenPlan) -> Tensor:
    """[B, H, T, D] → the plan's real tokens as contiguous rows [N, H, D]."""
    batch, heads, length, dim = x.shape
    rows = x.transpose(1, 2).reshape(batch * length, heads, dim)
    if plan.index is not None:
        rows = rows.index_select(0, plan.index)
    return rows.contiguous()


def unpack_rows(rows: Tensor, plan: VarlenPlan) -> Tensor:
    """[N, H, Dv] rows → [B, T, H, Dv]; padding rows are zero."""
    heads, dim = rows.shape[1], rows.shape[2]
    if plan.index is not None:
        rows = rows.new_zeros(plan.batch * plan.length, heads, dim).index_copy(0, plan.index, rows)
    return rows.view(plan.batch, plan.length, heads, dim)


@dataclass(frozen=True)
class OpSupport:
    """What this torch build and device offer (``op_support``); a plain value, so that
    ``choose_route`` is pure and testable anywhere."""

    flash: bool = False  # aten._flash_attention_forward runs here (built in, sm80 or newer)
    flash_window: bool = False  # it takes window_size_left/right
    flash_num_splits: bool = False  # it takes num_splits (torch 2.13; not 2.11)
    efficient: bool = False  # aten._efficient_attention_forward runs here
    torch_version: str = ""


def _schema_args(op: str) -> set[str]:
    overload = getattr(getattr(torch.ops.aten, op, None), "default", None)
    schema = getattr(overload, "_schema", None)
    return {a.name for a in schema.arguments} if schema is not None else set()


@functools.cache
def op_support(device_index: int | None = None) -> OpSupport:
    """The varlen kernels this torch build has and the current CUDA device runs (cached)."""
    flash_args = _schema_args("_flash_attention_forward")
    efficient_args = _schema_args("_efficient_attention_forward")
    cuda = torch.cuda.is_available()
    sm80 = cuda and torch.cuda.get_device_capability(device_index)[0] >= 8
    flash_built = bool(getattr(torch.backends.cuda, "is_flash_attention_available", bool)())
    return OpSupport(
        flash=sm80 and flash_built and {"cum_seq_q", "cum_seq_k", "scale"} <= flash_args,
        flash_window={"window_size_left", "window_size_right"} <= flash_args,
        flash_num_splits="num_splits" in flash_args,
        efficient=cuda and {"cu_seqlens_q", "cu_seqlens_k", "scale"} <= efficient_args,
        torch_version=str(torch.__version__),
    )


@dataclass(frozen=True)
class Route:
    """Which kernel a layer's attention runs (``kernel``: FLASH, EFFICIENT, SDPA or EAGER) and,
    where it is not the device's first choice, the setting that sent it elsewhere."""

    kernel: str
    why: str = ""

    @property
    def varlen(self) -> bool:
        """One call per layer over all sequences."""
        return self.kernel in (FLASH, EFFICIENT)


def choose_route(
    *,
    device_type: str,
    dtype: torch.dtype,
    softcap: float | None,
    dropout: float,
    window: int | None,
    head_dim: int,
    v_dim: int,
    support: OpSupport,
) -> Route:
    """The kernel a layer's attention runs, from its settings and what ``support`` offers.

    CPU (and any device but CUDA): SDPA per sequence, the eager formula where logits are
    soft-capped or dropout is on (what ran before the CUDA routes; its bits stay). CUDA:
    soft-capping and dropout take the eager formula per sequence (torch's FlashAttention-2 call
    takes no softcap); fp16/bf16 FlashAttention-2's varlen forward where it takes the head dims;
    otherwise (fp32, a value head dim other than the key's, a head dim over 256) the
    memory-efficient kernel — except a sliding window there (its window argument is not
    checked against ours yet); anything else SDPA per sequence. ``why`` names the setting.
    """
    if softcap is not None or dropout:
        setting = (
            f"attn_logit_softcapping={softcap}"
            if softcap is not None
            else f"attention dropout {dropout}"
        )
        return Route(EAGER, f"{setting}: the eager formula per sequence")
    if device_type != "cuda":
        return Route(SDPA)
    dims = f"head_dim {head_dim}" + (f", value head_dim {v_dim}" if v_dim != head_dim else "")
    flash_dims = (
        v_dim == head_dim
        and head_dim % HEAD_DIM_MULTIPLE == 0
        and 0 < head_dim <= FLASH_MAX_HEAD_DIM
    )
    windowed = window is not None
    reasons = []
    if dtype in (torch.float16, torch.bfloat16):
        if not support.flash:
            reasons.append(
                f"this torch ({support.torch_version}) or GPU has no FlashAttention-2 kernel"
            )
        elif not flash_dims:
            reasons.append(
                f"{dims}: FlashAttention-2 takes equal key and value head dims, multiples of "
                f"{HEAD_DIM_MULTIPLE} up to {FLASH_MAX_HEAD_DIM}"
            )
        elif windowed and not support.flash_window:
            reasons.append(f"sliding_window={window}: this torch's flash call takes no window")
        else:
            return Route(FLASH)
    else:
        reasons.append(f"{str(dtype).removeprefix('torch.')}: FlashAttention-2 takes fp16/bf16")
    efficient_dims = head_dim % HEAD_DIM_MULTIPLE == 0 and v_dim % HEAD_DIM_MULTIPLE == 0
    if not support.efficient:
        reasons.append("no memory-efficient kernel in this torch build")
    elif windowed:
        reasons.append(
            f"sliding_window={window}: not taken to the memory-efficient kernel (its window "
            "argument is not checked against this forward's yet)"
        )
    elif not efficient_dims:
        reasons.append(f"{dims}: the memory-efficient kernel is held to multiples of 8 here")
    elif dtype in (torch.float16, torch.bfloat16, torch.float32):
        return Route(EFFICIENT, "; ".join(reasons))
    else:
        reasons.append(f"{dtype}: no varlen kernel")
    return Route(SDPA, "; ".join(reasons) + ": SDPA per sequence")


def flash_varlen(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    plan: VarlenPlan,
    *,
    scale: float,
    window: int | None,
    support: OpSupport,
) -> Tensor:
    """FlashAttention-2's varlen forward, causal, over rows q [N, H, D], k/v [N, Hkv, D]
    (grouped heads read in place) → [N, H, D]. Differentiable (torch's own backward formula,
    ``_flash_attention_backward``). A sliding window of W keys (query i sees keys j with
    i − j < W) is FA2's ``window_size_left = W − 1``; ``max_k`` is at least W so that FA2 never
    drops the window for this batch alone (it does where the left window is ≥ max_k), so a
    windowed layer runs the same (local) kernel whatever the batch's longest sequence."""
    extra: dict[str, object] = {"scale": scale}
    max_k = plan.max_len
    if window is not None:
        extra.update(window_size_left=window - 1, window_size_right=0)
        max_k = max(max_k, window)
    if support.flash_num_splits:
        extra["num_splits"] = 1  # no KV split (only paged or single-query GQA calls split)
    out = torch.ops.aten._flash_attention_forward(
        q, k, v, plan.cu_seqlens, plan.cu_seqlens, plan.max_len, max_k, 0.0, True, False, **extra
    )
    result: Tensor = out[0]
    return result


def efficient_varlen(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    plan: VarlenPlan,
    *,
    scale: float,
) -> Tensor:
    """The memory-efficient kernel's forward over all sequences, causal: rows q [N, H, D],
    k [N, Hkv, D], v [N, Hkv, Dv] → [N, H, Dv]. Grouped heads are expanded (the kernel takes
    one key head per query head) as HF's repeat_kv does. The log-sum-exp is always computed,
    so a trainer's call (which needs it) and the service's run the same kernel."""
    heads, kv_heads = q.shape[1], k.shape[1]
    if kv_heads != heads:
        rep = heads // kv_heads
        k, v = (
            t[:, :, None]
            .expand(t.shape[0], kv_heads, rep, t.shape[2])
            .reshape(-1, heads, t.shape[2])
            for t in (k, v)
        )
    out = torch.ops.aten._efficient_attention_forward(
        q[None],
        k[None],
        v[None],
        None,
        plan.cu_seqlens,
        plan.cu_seqlens,
        plan.max_len,
        plan.max_len,
        0.0,
        1,  # custom_mask_type 1: causal from the top left (queries and keys are the same rows)
        True,
        scale=scale,
    )
    result: Tensor = out[0][0]
    return result


# (rows q, k, v, plan) → rows [N, H, Dv]: one varlen call.
VarlenCall = Callable[[Tensor, Tensor, Tensor, VarlenPlan], Tensor]
