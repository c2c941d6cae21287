"""Attention per sequence over its own unpadded keys, whatever the padding, packing or batch.

In: the segment plan of a batch (which rows of which batch row are one sequence) and HF's
attention call (query/key [B, H(kv), T, D], value [B, Hkv, T, Dv]; Dv ≠ D in multi-head latent
attention). Out: [B, T, H, Dv], each
sequence's rows computed by the same kernel call, on the same shapes, as when that sequence is
run alone; padding rows are zero. Registered with transformers' ``AttentionInterface`` under
``ATTENTION_NAME``; the plan reaches it as the ``oldlogit_segments`` keyword that HF models pass
through to their attention function.

Kernel per sequence of L tokens: ``scaled_dot_product_attention`` with ``is_causal`` when no
window is narrower than L and no logit softcap is set; an explicit causal+window mask when a
sliding window is narrower than L; the eager formula (as HF writes it for Gemma 2) when the
attention logits are soft-capped or dropout is on. Grouped-query key/value heads are expanded
to one per query head (HF's ``repeat_kv``); on CPU with no autograd graph recorded, SDPA reads
them in place instead (``enable_gqa``), where that was checked to give the same bits
(``_gqa_in_kernel``). On CPU, sequences of equal length share one
SDPA call (each batch element gets the bits it gets alone — measured and checked at start-up).
On CUDA a layer is one varlen call over all sequences' token-major rows, each over its own keys
(FlashAttention-2 in fp16/bf16, the memory-efficient kernel in fp32; no KV split), where
``kernels/cuda/varlen_attention.choose_route`` takes it; elsewhere one call per sequence on
fresh contiguous operands (``_gpu_operand``), never cuDNN's kernel.
The SDPA path runs with torch functions' Python layer off (the numerics' mode has no rule for
anything it calls); the eager path runs inside the mode (its ``tanh`` is ruled on CPU, its
softmax on a GPU).
"""

from __future__ import annotations

import contextvars
import functools
import itertools
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from oldlogit.contract.numerics import NumericsMismatch

from .kernels.cuda.varlen_attention import (
    EFFICIENT,
    FLASH,
    OpSupport,
    Route,
    VarlenCall,
    VarlenPlan,
    choose_route,
    efficient_varlen,
    flash_varlen,
    op_support,
    pack_rows,
    unpack_rows,
    varlen_plan,
)
from .kernels.probes import Probe, probe_attention_cancelling, probe_randn

__all__ = [
    "ATTENTION_NAME",
    "InvariantNumericsError",
    "Segments",
    "current_plan",
    "expecting_windows",
    "plan_for",
    "plan_segments",
    "planned",
    "recording_routes",
    "recording_windows",
    "register",
    "route_name",
]

ATTENTION_NAME = "oldlogit_invariant"
SEGMENTS_KWARG = "oldlogit_segments"

_local = threading.local()


class InvariantNumericsError(RuntimeError):
    """The batch-invariant forward cannot be guaranteed for this model or input."""


@contextmanager
def _attending() -> Iterator[None]:
    """Marks this thread as inside the invariant attention for the duration (nestable)."""
    _local.depth = getattr(_local, "depth", 0) + 1
    try:
        yield
    finally:
        _local.depth -= 1


def in_attention() -> bool:
    """True while this thread runs the invariant attention (its matmuls are per segment)."""
    return getattr(_local, "depth", 0) > 0


@contextmanager
def thread_count_free(on: bool) -> Iterator[None]:
    """For the duration, this thread's attention calls give the bits of a one-thread run on
    CPU (the tensor-parallel definition: its ranks run fewer threads than one process)."""
    before = getattr(_local, "thread_free", False)
    _local.thread_free = on
    try:
        yield
    finally:
        _local.thread_free = before


# Kernel calls (shapes, dtype, the call's settings, thread count) → whether this thread count
# gives a one-thread run's bits; measured once each on random inputs of those shapes.
_threads_agree = Probe()


def _one_thread_bits(q: Tensor, k: Tensor, v: Tensor, params: dict[str, Any]) -> Tensor:
    """``_segment_attention`` with the bits of a one-thread run. CPU attention kernels may
    split their work by thread count (measured: fp32 SDPA at head_dim 8 and odd lengths 9–31
    gives other bits at 2 threads than at 1), so each call shape is compared once against one
    thread; where they differ, that shape runs on one thread."""
    threads = torch.get_num_threads()
    if q.device.type != "cpu" or threads == 1:
        return _segment_attention(q, k, v, **params)
    key = (
        tuple(q.shape),
        tuple(k.shape),
        tuple(v.shape),
        q.dtype,
        tuple(sorted(params.items())),
        threads,
    )

    def check() -> bool:
        for probe in _attention_probes(tuple(q.shape), tuple(k.shape), tuple(v.shape), q.dtype):
            here = _segment_attention(*probe, **params)
            with one_thread():
                one = _segment_attention(*probe, **params)
            if not torch.equal(here, one):
                return False
        return True

    with nullcontext() if _threads_agree(key, check) else one_thread():
        return _segment_attention(q, k, v, **params)


@contextmanager
def one_thread() -> Iterator[None]:
    """torch's CPU ops on one thread for the duration (the thread count restored after)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@dataclass(frozen=True)
class Segments:
    """The sequences of a [B, T] batch: (batch row, start, end) each, end exclusive."""

    rows: tuple[tuple[int, int, int], ...]
    batch: int
    length: int
    # (batch row, start, its position id) of each sequence whose given position ids do not
    # start at 0: the rest of a sequence whose beginning is not in this batch.
    continued: tuple[tuple[int, int, int], ...] = ()
    _groups: dict[tuple[bool, str], list[tuple[int, int, Tensor]]] = field(
        default_factory=dict, compare=False, repr=False
    )
    _plans: dict[tuple[bool, str], tuple[list[int], list[tuple[int, int]], Tensor | None]] = field(
        default_factory=dict, compare=False, repr=False
    )
    _bounds_checked: set[int] = field(default_factory=set, compare=False, repr=False)
    _varlen: dict[str, VarlenPlan] = field(default_factory=dict, compare=False, repr=False)

    @property
    def longest(self) -> int:
        """Tokens in the longest sequence (0: every token is padding)."""
        return max((e - s for _, s, e in self.rows), default=0)

    def check_bounds(self, name: str, cu_seq_lens: Tensor) -> None:
        """A packed forward's ``cu_seq_lens_q``/``_k`` (flash-attention varlen: sequence i is
        tokens [cu[i], cu[i+1]) of the flattened batch) must mark the sequences this plan found
        in the mask and position ids; checked once per tensor."""
        if id(cu_seq_lens) in self._bounds_checked:
            return
        bounds = [b * self.length + s for b, s, _ in self.rows]
        if self.rows:
            b, _, e = self.rows[-1]
            bounds.append(b * self.length + e)
        given = [int(x) for x in cu_seq_lens.detach().reshape(-1).tolist()]
        if given != bounds:
            raise InvariantNumericsError(
                f"{name}: cu_seq_lens mark sequences at token offsets {given[:8]}"
                f"{'…' if len(given) > 8 else ''}, the position ids at {bounds[:8]}"
                f"{'…' if len(bounds) > 8 else ''}: oldlogit's attention takes sequences from "
                "position_ids (restarting at 0 per packed sequence) and the attention mask, "
                "so give each packed sequence positions from 0"
            )
        self._bounds_checked.add(id(cu_seq_lens))

    def gather_plan(
        self, share: bool, device: torch.device
    ) -> tuple[list[int], list[tuple[int, int]], Tensor | None]:
        """One gather for every kernel call of a layer: (rows per call, (n, L) per call, the
        token index [Σ n·L] into the flattened [B * T] rows — None when it is every row in
        order, e.g. one unpadded sequence). The calls' tokens are contiguous in that order."""
        key = (share, str(device))
        if key not in self._plans:
            groups = self.groups(share, device)
            index = (
                torch.cat([idx for _, _, idx in groups])
                if groups
                else torch.empty(0, dtype=torch.int64, device=device)  # every token padding
            )
            identity = index.shape[0] == self.batch * self.length and bool(
                torch.equal(index.cpu(), torch.arange(index.shape[0]))
            )
            self._plans[key] = (
                [n * seg_len for n, seg_len, _ in groups],
                [(n, seg_len) for n, seg_len, _ in groups],
                None if identity else index,
            )
        return self._plans[key]

    def varlen(self, device: torch.device) -> VarlenPlan:
        """The sequences as token-major rows and int32 cumulative lengths on ``device``, for
        one varlen kernel call per layer (computed once per forward)."""
        key = str(device)
        if key not in self._varlen:
            self._varlen[key] = varlen_plan(self.rows, self.batch, self.length, device)
        return self._varlen[key]

    def groups(self, share: bool, device: torch.device) -> list[tuple[int, int, Tensor]]:
        """(count n, length L, token index [n * L] into the flattened [B * T] rows) per kernel
        call: one call per sequence, or (``share``) one per distinct length. Computed once per
        forward and reused by every layer."""
        key = (share, str(device))
        if key not in self._groups:
            by_key: dict[int, list[tuple[int, int, int]]] = {}
            for i, (b, s, e) in enumerate(self.rows):
                by_key.setdefault(e - s if share else -i - 1, []).append((b, s, e))
            out = []
            for group in by_key.values():
                idx = torch.cat(
                    [torch.arange(b * self.length + s, b * self.length + e) for b, s, e in group]
                )
                out.append((len(group), group[0][2] - group[0][1], idx.to(device)))
            self._groups[key] = out
        return self._groups[key]


def block_mask_ids(mask: Tensor, batch: int, length: int) -> Tensor:
    """A [B, 1, T, T] (or [B, T, T]) attention mask of packed sequences — bool (True: may
    attend) or additive float (0: may attend, -inf or the dtype's minimum: may not) — as [B, T]
    sequence ids (1, 1, 2, 2, 2 …; 0: a query that attends to nothing, padding). Each query
    must see exactly its own sequence's keys up to itself (block-diagonal and causal); any other
    mask (a bias, a window, a prefix seeing ahead) is refused by name."""
    shape = list(mask.shape)
    if mask.dim() == 4:
        if mask.shape[1] != 1:
            raise InvariantNumericsError(
                f"a 4-D attention_mask must have one head ([batch, 1, seq, seq]), got {shape}"
            )
        mask = mask[:, 0]
    if tuple(mask.shape) != (batch, length, length) and tuple(mask.shape) != (1, length, length):
        raise InvariantNumericsError(
            f"a 4-D attention_mask must be [batch, 1, seq, seq] = {[batch, 1, length, length]}, "
            f"got {shape}"
        )
    m = mask.detach().to("cpu")
    if m.dtype == torch.bool:
        allowed = m
    elif m.is_floating_point():
        masked = m <= torch.finfo(m.dtype).min / 2
        if not bool(((m == 0) | masked).all()):
            raise InvariantNumericsError(
                "a 4-D additive attention_mask holds values other than 0 and -inf (a bias?): "
                "only a block-diagonal causal mask of packed sequences can be scored"
            )
        allowed = ~masked
    else:
        raise InvariantNumericsError(
            f"a 4-D attention_mask must be bool or additive float, got {m.dtype}"
        )
    allowed = allowed.expand(batch, length, length)
    i = torch.arange(length)
    causal = i[None, :] <= i[:, None]  # [T, T]: key j at or before query i
    ids = torch.zeros(batch, length, dtype=torch.int64)
    for b in range(batch):  # one row's [T, T] at a time: long sequences stay within memory
        row = allowed[b]
        real = row.any(dim=-1)  # [T]: a query that sees something
        first = row.to(torch.int8).argmax(dim=-1)  # [T]: the first key it sees
        # Within a sequence every token sees from the sequence's first token: a token whose
        # first key is not itself must share its predecessor's.
        prev_first = torch.cat([torch.full((1,), -1), first[:-1]])
        prev_real = torch.cat([torch.zeros(1, dtype=torch.bool), real[:-1]])
        starts = real & (first == i)
        joined = real & ~starts & prev_real & (prev_first == first)
        block = (i[None, :] >= first[:, None]) & causal & real[:, None]
        if not torch.equal(row, block) or not torch.equal(real, starts | joined):
            raise InvariantNumericsError(
                "the 4-D attention_mask is not block-diagonal and causal (each token seeing its "
                f"own packed sequence up to itself; batch row {b}): only packed sequences can "
                "be scored"
            )
        ids[b] = torch.where(real, starts.to(torch.int64).cumsum(dim=0), 0)
    return ids


def _all_real(attention_mask: Tensor | None, batch: int, length: int) -> bool:
    """No mask, or a [batch, length] padding mask that is all ones."""
    if attention_mask is None:
        return True
    return (
        attention_mask.dim() == 2
        and tuple(attention_mask.shape) == (batch, length)
        and bool((attention_mask == 1).all())
    )


def plan_segments(
    batch: int,
    length: int,
    attention_mask: Tensor | None,
    position_ids: Tensor | None,
) -> tuple[Segments, Tensor]:
    """The segments of a batch and the position ids to run it with.

    attention_mask [B, T] (1 = real token) or None (all real); position_ids [B, T] / [1, T] or
    None. Without position ids each row's real tokens must be one contiguous run (left or right
    padding) and positions count from its first real token, so left padding does not shift
    RoPE. With position ids (packing) a sequence starts wherever a position is not the previous
    one plus 1, and the given positions are used as they are. Returns (segments, position_ids
    [B, T] int64 on the mask's or ids' device).
    """
    device = (
        attention_mask.device
        if attention_mask is not None
        else (position_ids.device if position_ids is not None else torch.device("cpu"))
    )
    if position_ids is None and length > 0 and _all_real(attention_mask, batch, length):
        # The common call: every row one whole sequence (no mask, or a mask of ones): what the
        # general path below computes, without its ~20 tensor ops.
        whole = tuple((b, 0, length) for b in range(batch))
        positions = torch.arange(length, dtype=torch.int64).expand(batch, length).contiguous()
        return Segments(rows=whole, batch=batch, length=length), positions.to(device)
    if attention_mask is not None and attention_mask.dim() in (3, 4):
        attention_mask = block_mask_ids(attention_mask, batch, length)
        if position_ids is None:
            raise InvariantNumericsError(
                "a [batch, 1, seq, seq] attention_mask without position_ids: pass position_ids "
                "restarting at 0 per packed sequence (the service scores each from position 0)"
            )
    if attention_mask is not None:
        if attention_mask.dim() != 2 or tuple(attention_mask.shape) != (batch, length):
            raise InvariantNumericsError(
                f"attention_mask must be a [batch, seq] padding mask of shape "
                f"{[batch, length]}, got {list(attention_mask.shape)}"
            )
        mask = attention_mask.detach().to("cpu")
        real = mask.to(torch.bool)  # [B, T]
        seq_ids = None  # sequence ids of packed rows (values above 1), as some packers give
        if mask.dtype != torch.bool:
            if bool((mask < 0).any()):
                raise InvariantNumericsError(
                    "attention_mask holds negative values (an additive mask?): give 1 for "
                    "real tokens and 0 for padding"
                )
            if bool((mask > 1).any()):
                seq_ids = mask
    else:
        real = torch.ones(batch, length, dtype=torch.bool)
        seq_ids = None
    prev_real = torch.cat([torch.zeros(batch, 1, dtype=torch.bool), real[:, :-1]], dim=1)
    if position_ids is None:
        starts = real & ~prev_real  # [B, T]
        if bool((starts.sum(dim=1) > 1).any()):
            raise InvariantNumericsError(
                "an attention_mask row holds more than one run of real tokens: pass "
                "position_ids (restarting at 0 per sequence) for packed sequences"
            )
        positions = (real.long().cumsum(dim=1) - 1).clamp_min(0) * real  # [B, T]
    else:
        if position_ids.dim() == 1:
            position_ids = position_ids[None, :]
        positions = position_ids.detach().to("cpu", torch.int64).expand(batch, length)
        prev = torch.cat([positions[:, :1] - 1, positions[:, :-1]], dim=1)
        starts = real & (~prev_real | (positions != prev + 1))
    if seq_ids is not None:
        # Packed rows marked by sequence ids in the mask (1, 1, 2, 2, 2, 3 …): the ids must
        # change exactly where the position ids start a sequence within a run of real tokens.
        prev_ids = torch.cat([seq_ids[:, :1], seq_ids[:, :-1]], dim=1)
        changed = real & prev_real & (seq_ids != prev_ids)
        if position_ids is None or not torch.equal(changed, starts & prev_real):
            raise InvariantNumericsError(
                "attention_mask marks packed sequences by id (values above 1) "
                + (
                    "without position_ids"
                    if position_ids is None
                    else "where the position ids start sequences elsewhere"
                )
                + ": pass position_ids restarting at 0 per sequence (and a 0/1 mask); "
                "oldlogit takes sequences from the positions"
            )
    # A sequence ends where the next token is padding, starts another sequence, or is missing.
    next_breaks = torch.cat(
        [starts[:, 1:] | ~real[:, 1:], torch.ones(batch, 1, dtype=torch.bool)], 1
    )
    ends = real & next_breaks
    start_idx = starts.nonzero().tolist()  # row-major: (b, t) in order
    end_idx = ends.nonzero().tolist()
    rows = tuple((b, s, e + 1) for (b, s), (_, e) in zip(start_idx, end_idx, strict=True))
    continued: tuple[tuple[int, int, int], ...] = ()
    if position_ids is not None:
        first = positions[starts]  # [sequences], row-major like start_idx
        if bool((first != 0).any()):
            continued = tuple(
                (b, s, int(p))
                for (b, s), p in zip(start_idx, first.tolist(), strict=True)
                if p != 0
            )
    out_pos = position_ids if position_ids is not None else positions
    segments = Segments(rows=rows, batch=batch, length=length, continued=continued)
    return segments, out_pos.to(device, torch.int64)


# A plan made by the caller of a forward for its very inputs (``token_logprobs`` plans before
# it calls the model): (attention_mask, position_ids, batch, length, the plan).
_PlannedFor = tuple[Tensor | None, Tensor | None, int, int, tuple["Segments", Tensor]]
_planned: contextvars.ContextVar[_PlannedFor | None] = contextvars.ContextVar(
    "oldlogit_planned", default=None
)


@contextmanager
def planned(
    batch: int,
    length: int,
    attention_mask: Tensor | None,
    position_ids: Tensor | None,
    plan: tuple[Segments, Tensor],
) -> Iterator[None]:
    """``plan`` (``plan_segments`` of these very tensors) is what ``plan_for`` answers for them
    for the duration: the forward does not plan the same batch a second time."""
    token = _planned.set((attention_mask, position_ids, batch, length, plan))
    try:
        yield
    finally:
        _planned.reset(token)


def plan_for(
    batch: int, length: int, attention_mask: Tensor | None, position_ids: Tensor | None
) -> tuple[Segments, Tensor]:
    """``plan_segments``, or the plan ``planned`` holds for these same tensor objects."""
    got = _planned.get()
    if (
        got is not None
        and got[0] is attention_mask
        and got[1] is position_ids
        and got[2:4] == (batch, length)
    ):
        return got[4]
    return plan_segments(batch, length, attention_mask, position_ids)


# The segment plan of the invariant forward running in this context (its attention calls get it
# by keyword where the modeling code passes keywords through; this holds it for code that does
# not, and is set again around an activation-checkpointing recompute).
_current_plan: contextvars.ContextVar[Segments | None] = contextvars.ContextVar(
    "oldlogit_current_plan", default=None
)


@contextmanager
def current_plan(segments: Segments | None) -> Iterator[None]:
    """``segments`` is the plan of the forward running in this context, for the duration."""
    token = _current_plan.set(segments)
    try:
        yield
    finally:
        _current_plan.reset(token)


def plan_in_context() -> Segments | None:
    """The plan ``current_plan`` holds here (None: no invariant forward is running)."""
    return _current_plan.get()


@dataclass
class _WindowRule:
    """What the attention calls of a forward do with their sliding windows: record each
    layer's (``seen``), and hold each to the other side's (``expected``); 0 is no window."""

    seen: dict[int, int] | None = None
    expected: dict[int, int] | None = None


_window_rule: contextvars.ContextVar[_WindowRule | None] = contextvars.ContextVar(
    "oldlogit_window_rule", default=None
)


@contextmanager
def recording_windows() -> Iterator[dict[int, int]]:
    """Layer index → the sliding window its attention computed with (0: none), for every
    invariant attention call in this context (the service records its model's at start-up and
    reports them in ``/v1/info``)."""
    seen: dict[int, int] = {}
    token = _window_rule.set(_WindowRule(seen=seen))
    try:
        yield seen
    finally:
        _window_rule.reset(token)


@contextmanager
def expecting_windows(windows: dict[int, int]) -> Iterator[None]:
    """Each attention call in this context must compute with the window ``windows`` gives its
    layer (0: none) wherever the two would differ: a window at least as long as the longest
    sequence of the forward leaves every key in sight, so it is the same as none. Otherwise
    ``NumericsMismatch`` names the layer (``trainer_numerics(like=...)`` with the service's
    windows)."""
    token = _window_rule.set(_WindowRule(expected=windows))
    try:
        yield
    finally:
        _window_rule.reset(token)


def _check_window(module: nn.Module, window: int | None, segments: Segments) -> None:
    rule = _window_rule.get()
    layer = getattr(module, "layer_idx", None)
    if rule is None or not isinstance(layer, int):
        return
    if rule.seen is not None:
        rule.seen[layer] = window or 0
    there = rule.expected.get(layer) if rule.expected is not None else None
    if there is None:
        return
    longest = segments.longest

    def effective(w: int) -> int:  # the same keys in sight as no window at all: 0
        return w if 0 < w < longest else 0

    here = window or 0
    if effective(here) != effective(there):

        def said(w: int) -> str:
            return f"a sliding window of {w} tokens" if w else "no sliding window"

        raise NumericsMismatch(
            f"the trainer's numerics differ from the service's: layer {layer}'s attention "
            f"({type(module).__name__}) computes with {said(here)} here, {said(there)} there, "
            f"and this forward's longest sequence has {longest} tokens, so the keys in sight "
            "differ. The window comes from the model config (sliding_window, "
            "use_sliding_window, max_window_layers, layer_types) and the modeling code of the "
            "transformers release: load the trainer's model with the config the service serves"
        )


def _segment_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    scaling: float,
    sliding_window: int | None,
    softcap: float | None,
    dropout: float,
) -> Tensor:
    """n sequences of the same length L: q/k [n, H(kv), L, D], v [n, Hkv, L, Dv] → [n, H, L, Dv]."""
    n, heads, length = q.shape[0], q.shape[1], q.shape[2]
    kv_heads = k.shape[1]
    gpu = q.device.type != "cpu"
    windowed = sliding_window is not None and sliding_window < length
    sdpa = softcap is None and dropout == 0.0
    if gpu:
        q = _gpu_operand(q)
    in_kernel = kv_heads != heads and not gpu and sdpa and _gqa_in_kernel(q, k, v, windowed)
    if kv_heads != heads and not in_kernel:
        # Grouped-query attention: the same expansion as HF's repeat_kv (its reshape of the
        # expanded view is a fresh contiguous copy already).
        rep = heads // kv_heads
        k = k[:, :, None].expand(n, kv_heads, rep, *k.shape[2:]).reshape(n, heads, *k.shape[2:])
        v = v[:, :, None].expand(n, kv_heads, rep, *v.shape[2:]).reshape(n, heads, *v.shape[2:])
    elif gpu:
        k, v = _gpu_operand(k), _gpu_operand(v)
    if sdpa:
        mask = _causal_mask(length, sliding_window, q.device) if windowed else None
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, scale=scaling, enable_gqa=in_kernel
        )
    weights = torch.matmul(q, k.transpose(2, 3)) * scaling  # [n, H, L, L]
    if softcap is not None:
        weights = torch.tanh(weights / softcap) * softcap
    mask = _causal_mask(length, sliding_window if windowed else None, q.device)
    weights = weights.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(weights, dim=-1, dtype=torch.float32).to(q.dtype)
    if dropout:
        probs = F.dropout(probs, p=dropout, training=True)
    return torch.matmul(probs, v)


# (dtype, heads, kv heads, head dims, windowed, thread count) → whether SDPA's own grouped-query
# indexing gives the bits of the expanded copies; measured once each on random inputs.
_gqa_agrees = Probe()
# The check's inputs: 2 sequences of _GQA_PROBE_LENGTH tokens, a window of _GQA_PROBE_WINDOW
# where the call has one (shorter than the sequences, so the window cuts).
_GQA_PROBE_LENGTH = 77
_GQA_PROBE_WINDOW = 20


def _gqa_in_kernel(q: Tensor, k: Tensor, v: Tensor, windowed: bool) -> bool:
    """Whether a CPU SDPA call may read the key/value heads in place (``enable_gqa``) instead
    of on expanded copies: the kernel computes each query head from its group's key head
    either way, so the bits are the copies' — checked once per call kind (dtype, head counts
    and dims, window, thread count) on seeded random inputs before it is relied on. Only where
    no autograd graph is recorded: the copies' backward sums a group's key gradients in its
    own order, which stays the trainer's. Saves two allocations and copies of the keys and
    values a layer (measured paired on 2 cores, fp32: 0.12 ms of a 13 ms 1 × 128 forward,
    1.9 ms of a 182 ms 4 × 512 one)."""
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return False
    threads = torch.get_num_threads()
    key = (q.dtype, q.shape[1], k.shape[1], q.shape[-1], v.shape[-1], windowed, threads)

    def check() -> bool:
        length, rep = _GQA_PROBE_LENGTH, q.shape[1] // k.shape[1]
        mask = _causal_mask(length, _GQA_PROBE_WINDOW, q.device) if windowed else None
        params = {"attn_mask": mask, "is_causal": mask is None, "scale": q.shape[-1] ** -0.5}
        shapes = [(2, t.shape[1], length, t.shape[-1]) for t in (q, k, v)]
        for pq, pk, pv in _attention_probes(shapes[0], shapes[1], shapes[2], q.dtype):
            grouped = F.scaled_dot_product_attention(pq, pk, pv, enable_gqa=True, **params)
            copies = F.scaled_dot_product_attention(
                pq, pk.repeat_interleave(rep, dim=1), pv.repeat_interleave(rep, dim=1), **params
            )
            if not torch.equal(grouped, copies):
                return False
        return True

    return _gqa_agrees(key, check)


def _gpu_operand(t: Tensor) -> Tensor:
    """A fresh contiguous copy. Measured on an H100 (torch 2.11, bf16): a sequence's attention
    as views into the packed rows and alone differed by one ulp in some rows; as fresh copies
    they agreed (a checkpoint's weights, four draws). Every call on one length then gets the
    same operands, strides and alignment. (With identical operands it still differed at small
    random weights: the cuDNN attention kernel, not deterministic, is switched off for the
    forward in ``settings.py``.)"""
    return t.clone(memory_format=torch.contiguous_format)


def _plain_call(q: Tensor, k: Tensor, v: Tensor, params: dict[str, Any]) -> Tensor:
    return _segment_attention(q, k, v, **params)


def _causal_mask(length: int, window: int | None, device: torch.device) -> Tensor:
    """[L, L] bool, True where query i may see key j: j ≤ i (and i − j < window)."""
    i = torch.arange(length, device=device)[:, None]
    j = torch.arange(length, device=device)[None, :]
    mask = j <= i
    if window is not None:
        mask = mask & (i - j < window)
    return mask


def invariant_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """HF attention-interface function; see the module docstring."""
    if kwargs.get("softcap") is None and not (dropout and module.training):
        # The SDPA path calls nothing the patch's torch-function mode rules (SDPA itself passes
        # inside the attention), so it runs outside the mode: a layer's ~25 shape reads, views
        # and copies here skip the mode's per-call Python (measured ~2 µs a call on CPU).
        with torch._C.DisableTorchFunction():
            return _attention(module, query, key, value, scaling, dropout, kwargs)
    return _attention(module, query, key, value, scaling, dropout, kwargs)


def _attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    scaling: float | None,
    dropout: float,
    kwargs: dict[str, Any],
) -> tuple[Tensor, None]:
    segments = kwargs.get(SEGMENTS_KWARG)
    name = type(module).__name__
    if not isinstance(segments, Segments):
        # Modeling code that does not pass its forward's keywords through to the attention
        # function (StableLM, Nemotron): the plan of the forward this call runs in.
        segments = _current_plan.get()
    if not isinstance(segments, Segments):
        raise InvariantNumericsError(
            f"{name}: the model did not pass oldlogit's segment plan to its attention function; "
            "call the model itself (not a submodule) under trainer_numerics"
        )
    if not getattr(module, "is_causal", True):
        raise InvariantNumericsError(f"{name}: only causal attention is supported")
    if kwargs.get("s_aux") is not None or kwargs.get("sinks") is not None:
        raise InvariantNumericsError(f"{name}: attention sinks are not supported")
    if key.shape[2] != query.shape[2]:
        raise InvariantNumericsError(f"{name}: a KV cache is not supported in scoring calls")
    for bounds in ("cu_seq_lens_q", "cu_seq_lens_k"):
        if isinstance(kwargs.get(bounds), Tensor):
            segments.check_bounds(name, kwargs[bounds])
    batch, heads, length, head_dim = query.shape
    v_dim = value.shape[-1]  # differs from head_dim in multi-head latent attention (DeepSeek)
    if (segments.batch, segments.length) != (batch, length):
        raise InvariantNumericsError(
            f"{name}: the segment plan is for [{segments.batch}, {segments.length}], "
            f"the attention got [{batch}, {length}]"
        )
    scale = float(scaling) if scaling is not None else head_dim**-0.5
    window = kwargs.get("sliding_window")
    _check_window(module, int(window) if window is not None else None, segments)
    softcap = kwargs.get("softcap")
    p = float(dropout) if module.training else 0.0
    params = {
        "scaling": scale,
        "sliding_window": int(window) if window is not None else None,
        "softcap": float(softcap) if softcap is not None else None,
        "dropout": p,
    }
    routes = _routes_seen.get()
    if query.device.type == "cuda" or routes is not None:  # (CPU: no per-call route to pick)
        route = layer_route(query.device, query.dtype, params, head_dim, v_dim)
        layer = getattr(module, "layer_idx", None)
        if routes is not None and isinstance(layer, int):
            routes[layer] = route_name(route)
        if route.varlen:  # CUDA: one call over every sequence's rows, each over its own keys
            with _attending():
                call = _varlen_call(route, params, op_support(query.device.index))
                plan = segments.varlen(query.device)
                return _varlen_attention(query, key, value, plan, call), None
    # Sequences of one length share a kernel call where that was checked to give each the bits
    # of its own call (CPU SDPA; ``_sharing_agrees``); elsewhere one call each.
    share = query.device.type == "cpu" and params["softcap"] is None and p == 0.0
    attend = _one_thread_bits if getattr(_local, "thread_free", False) else _plain_call
    if share:
        dims = (heads, key.shape[1], head_dim, v_dim)
        share = all(
            n == 1 or _sharing_agrees(n, seg_len, dims, query.dtype, params, attend)
            for n, seg_len, _ in segments.groups(True, query.device)
        )
    sizes, shapes, index = segments.gather_plan(share, query.device)
    if index is None and shapes == [(batch, length)]:
        # Every batch row is one whole sequence and they share one call: that call's inputs
        # are the [B, H, T, D] tensors themselves, no round trip through token-major rows.
        with _attending():
            res = attend(query, key, value, params)
        return res.transpose(1, 2).contiguous(), None  # [B, T, H, Dv]
    # Token-major rows [B*T, heads, D], gathered once for every call (one index each; the
    # backward scatters once, not once per call) and split into the calls' contiguous parts.
    q_rows = query.transpose(1, 2).reshape(batch * length, heads, head_dim)
    k_rows = key.transpose(1, 2).reshape(batch * length, key.shape[1], head_dim)
    v_rows = value.transpose(1, 2).reshape(batch * length, value.shape[1], v_dim)
    if index is not None:
        q_rows, k_rows, v_rows = (r.index_select(0, index) for r in (q_rows, k_rows, v_rows))
    parts = []
    with _attending():
        for (n, seg_len), q, k, v in zip(
            shapes,
            torch.split(q_rows, sizes),
            torch.split(k_rows, sizes),
            torch.split(v_rows, sizes),
            strict=True,
        ):

            def calls(rows: Tensor, n: int = n, seg_len: int = seg_len) -> Tensor:
                return rows.view(n, seg_len, *rows.shape[1:]).transpose(1, 2)  # [n, h, L, D]

            res = attend(calls(q), calls(k), calls(v), params)  # [n, H, L, Dv]
            parts.append(res.transpose(1, 2).reshape(n * seg_len, heads, v_dim))
    if not parts:  # every token is padding: nothing attends, the rows stay 0
        return query.new_zeros(batch, length, heads, v_dim), None
    rows = parts[0] if len(parts) == 1 else torch.cat(parts)  # [Σ n·L, H, Dv]
    if index is not None:  # padding rows stay 0
        rows = rows.new_zeros(batch * length, heads, v_dim).index_copy(0, index, rows)
    out = rows.view(batch, length, heads, v_dim)  # [B, T, H, Dv]
    return out, None


def _attention_probes(
    q_shape: tuple[int, ...],
    k_shape: tuple[int, ...],
    v_shape: tuple[int, ...],
    dtype: torch.dtype,
) -> list[tuple[Tensor, Tensor, Tensor]]:
    """A check's attention inputs: seeded random ones, and ones whose weighted sums nearly
    cancel (``probe_attention_cancelling``: random values can round alike under two orders in
    a bfloat16 output)."""
    q, k, v = probe_randn(q_shape, k_shape, v_shape, dtype=dtype)
    return [(q, k, v), probe_attention_cancelling(q_shape, k_shape, v_shape, dtype=dtype)]


# (sequences, length, heads, kv heads, head dims, dtype, the call's settings, thread count, the
# one-thread rule) → whether one call over the sequences gives each the bits of its own call.
_shared_calls = Probe()


def _sharing_agrees(
    n: int,
    length: int,
    dims: tuple[int, int, int, int],
    dtype: torch.dtype,
    params: dict[str, Any],
    attend: Callable[[Tensor, Tensor, Tensor, dict[str, Any]], Tensor],
) -> bool:
    """Whether ``n`` sequences of ``length`` tokens may share one attention call: checked once
    per key on random inputs laid out as the forward lays them out (token-major rows viewed as
    [n, heads, L, D]). CPU kernels split their work over batch × heads by the thread count, so
    a sequence's bits in a shared call may differ from its own call's (measured: fp32 SDPA at
    head dim 8, lengths 23 and 29, 2 threads, on an AMD EPYC; one thread agreed)."""
    heads, kv_heads, head_dim, v_dim = dims
    key = (
        n,
        length,
        dims,
        dtype,
        tuple(sorted(params.items())),
        torch.get_num_threads(),
        attend is _one_thread_bits,
    )

    def check() -> bool:
        shapes = [(n, h, length, d) for h, d in ((heads, head_dim), (kv_heads, head_dim),
                                                 (kv_heads, v_dim))]  # fmt: skip
        for probe in _attention_probes(shapes[0], shapes[1], shapes[2], dtype):
            # As the forward lays them out: token-major rows [n, L, heads, D] seen as
            # [n, heads, L, D].
            q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in probe)
            with _attending():
                together = attend(q, k, v, params)
                for i in range(n):
                    alone = attend(q[i : i + 1], k[i : i + 1], v[i : i + 1], params)
                    if not torch.equal(together[i : i + 1], alone):
                        return False
        return True

    return _shared_calls(key, check)


def layer_route(
    device: torch.device, dtype: torch.dtype, params: dict[str, Any], head_dim: int, v_dim: int
) -> Route:
    """The kernel an attention call with these settings runs on ``device`` (``choose_route``
    over what this torch build and GPU offer; CPU: the per-sequence SDPA or eager path)."""
    return choose_route(
        device_type=device.type,
        dtype=dtype,
        softcap=params["softcap"],
        dropout=params["dropout"],
        window=params["sliding_window"],
        head_dim=head_dim,
        v_dim=v_dim,
        support=op_support(device.index) if device.type == "cuda" else _NO_VARLEN,
    )


_NO_VARLEN = OpSupport()


_routes_seen: contextvars.ContextVar[dict[int, str] | None] = contextvars.ContextVar(
    "oldlogit_routes_seen", default=None
)


@contextmanager
def recording_routes() -> Iterator[dict[int, str]]:
    """Layer index → the attention route its calls took in this context (``route_name``: e.g.
    "oldlogit_invariant/varlen-flash", "oldlogit_invariant/eager"), for a spec to report."""
    seen: dict[int, str] = {}
    token = _routes_seen.set(seen)
    try:
        yield seen
    finally:
        _routes_seen.reset(token)


def config_attention_name(config: Any, dtype: torch.dtype, device: torch.device) -> str:
    """The attention a spec reports for a model of ``config`` computing in ``dtype`` on
    ``device``: ``route_name`` of the route its layers take (several joined by "+", e.g. a
    windowed fp32 layer beside global ones), decided by the same ``layer_route`` as a call.
    On CPU every layer is SDPA or eager per sequence, as before."""
    text = getattr(config, "get_text_config", lambda: config)()
    heads = int(getattr(text, "num_attention_heads", 1) or 1)
    head_dim = int(getattr(text, "head_dim", 0) or getattr(text, "hidden_size", heads) // heads)
    window = getattr(text, "sliding_window", None)
    layer_types = getattr(text, "layer_types", None) or ()
    use_window = getattr(text, "use_sliding_window", window is not None)
    windows = {
        window if (use_window and window and t != "full_attention") else None
        for t in (layer_types or ["sliding_attention" if use_window else "full_attention"])
    }
    params = {
        "softcap": getattr(text, "attn_logit_softcapping", None),
        "dropout": 0.0,  # dropout on in a forward is refused (ops.ActiveDropout)
        "scaling": head_dim**-0.5,
    }
    kernels = sorted(
        {
            layer_route(device, dtype, {**params, "sliding_window": w}, head_dim, head_dim).kernel
            for w in windows
        }
    )
    return f"{ATTENTION_NAME}/{'+'.join(kernels)}"


def route_name(route: Route) -> str:
    """The attention a spec reports for ``route``, e.g. "oldlogit_invariant/varlen-flash"."""
    return f"{ATTENTION_NAME}/{route.kernel}"


def _varlen_call(route: Route, params: dict[str, Any], support: OpSupport) -> VarlenCall:
    """The one kernel call of ``route`` (FLASH or EFFICIENT) with this layer's settings."""
    scale, window = float(params["scaling"]), params["sliding_window"]
    if route.kernel == FLASH:
        return functools.partial(flash_varlen, scale=scale, window=window, support=support)
    if route.kernel == EFFICIENT:
        return functools.partial(efficient_varlen, scale=scale)
    raise ValueError(f"{route.kernel} is not a varlen route")


def _per_sequence_varlen(params: dict[str, Any]) -> VarlenCall:
    """A varlen call made of per-sequence ``_segment_attention`` calls over the rows each
    sequence's cumulative lengths mark: what the varlen kernels compute, on any device (the
    CPU tests' stand-in, proving the packing and unpacking around the kernel)."""

    def call(q: Tensor, k: Tensor, v: Tensor, plan: VarlenPlan) -> Tensor:
        bounds = [int(x) for x in plan.cu_seqlens.tolist()]
        parts = []
        for start, end in itertools.pairwise(bounds):
            # [1, h, L, D] views of this sequence's rows, as the per-sequence path makes them
            one = [t[start:end].transpose(0, 1)[None] for t in (q, k, v)]
            res = _segment_attention(*one, **params)  # [1, H, L, Dv]
            parts.append(res[0].transpose(0, 1))
        return torch.cat(parts)

    return call


def _varlen_attention(
    query: Tensor, key: Tensor, value: Tensor, plan: VarlenPlan, call: VarlenCall
) -> Tensor:
    """[B, H(kv), T, D] → [B, T, H, Dv] by one ``call`` over the plan's token-major rows."""
    batch, heads, length = query.shape[:3]
    if plan.total == 0:  # every token is padding: nothing attends, the rows stay 0
        return query.new_zeros(batch, length, heads, value.shape[-1])
    q, k, v = (pack_rows(t, plan) for t in (query, key, value))
    return unpack_rows(call(q, k, v, plan), plan)


_registered = False


def register() -> None:
    """Make ``ATTENTION_NAME`` an attention implementation transformers knows (idempotent).

    No mask function is registered on purpose: transformers then builds no [B, 1, T, T] mask
    for this implementation, and the segment plan says everything the mask would.
    """
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, invariant_attention)
    _registered = True
