"""Per-token processed logprobs: the one pipeline a trainer and the service both run.

In: an HF causal LM (under ``trainer_numerics`` or plain) and token ids. Out: float32
logprobs of each token given its prefix, after the sampler's processing: logits → float32 →
÷ temperature → top-k → top-p (renormalised) → log_softmax → gather. ``token_logprobs`` is
the trainer's call (autograd on, [B, T] aligned with the input); ``decoder_hidden`` and
``head_logits`` split the same forward for the service, which runs the decoder once and the
model's own head path on the scored rows only, a bounded number at a time.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections.abc import Callable, Iterator, Mapping
from contextlib import nullcontext
from typing import Any

import torch
from torch import Tensor, nn

from oldlogit.contract.numerics import SamplingParams

from . import routing, tensor_parallel
from .attention import plan_segments, planned
from .kernels import for_device
from .numerics import active_patch, head_fp32_override, run_plain, unwrap_model
from .skeleton import bound_weights

__all__ = [
    "PROCESS_ROWS",
    "decoder_hidden",
    "head_logits",
    "processed_logprobs",
    "row_logits",
    "token_logprobs",
]

# Rows per slice of the float32 processing stage: bounds [rows, V] float32 temporaries (the
# top-p sort holds several of them). Processing is row-wise, so the slice size is not numerics
# (on CPU a row's bits do not depend on the row count; on CUDA the processing runs Triton row
# kernels for that reason: ``_cuda_processed``).
# At most PROCESS_BYTES of float32 per temporary: small enough for the allocator to reuse freed
# memory, where larger blocks are mapped fresh (and page-faulted) on every slice — measured on
# CPU at a 151,936-token vocabulary: 508 rows in 64-row slices 5× slower than in 13-row ones.
PROCESS_ROWS = 64
PROCESS_BYTES = 8 * 1024**2


def processed_logprobs(
    logits_rows: Tensor, targets: Tensor, sampling: SamplingParams, *, tp_chunks: int = 0
) -> Tensor:
    """Logprob of ``targets`` under the processed distribution of each row.

    logits_rows: [S, V] any float dtype; targets: [S] int64 on the same device → [S] float32.
    Steps (each row-independent): float32 → / temperature → top-k (ties at the k-th value kept)
    → top-p (keep a token iff the probability mass strictly before it in the stable descending
    order is < top_p, so the top token is always kept) → log_softmax → gather. A target outside
    the kept support gets −inf, never NaN. Differentiable; a few rows at a time (PROCESS_ROWS,
    PROCESS_BYTES). ``tp_chunks`` > 0: the tensor-parallel definition's log-softmax
    (``_tensor_parallel_rows``; under ``tensor_parallel.use`` the rows are this
    rank's vocabulary slice).
    """
    if not sampling.temperature > 0:
        raise ValueError(f"temperature must be > 0, got {sampling.temperature}")
    if logits_rows.dim() != 2 or targets.dim() != 1 or logits_rows.shape[0] != targets.shape[0]:
        raise ValueError(
            f"expected logits [S, V] and targets [S], got {list(logits_rows.shape)} and "
            f"{list(targets.shape)}"
        )
    step = max(1, min(PROCESS_ROWS, PROCESS_BYTES // (4 * max(1, logits_rows.shape[-1]))))
    if not tp_chunks and for_device(logits_rows.device) == "cuda":
        return _cuda_processed(logits_rows, targets, sampling, step)
    if tp_chunks:

        def rows_of(lg: Tensor, tg: Tensor) -> Tensor:
            return _tensor_parallel_rows(lg, tg, sampling, tp_chunks)
    else:

        def rows_of(lg: Tensor, tg: Tensor) -> Tensor:
            return _processed_rows(lg, tg, sampling)

    # One split, not a slice per step: a slice's backward is a zero-filled [S, V] gradient per
    # step (then summed); the split's is one concatenation of the steps' gradients.
    parts = [
        rows_of(lg, tg)
        for lg, tg in zip(torch.split(logits_rows, step), torch.split(targets, step), strict=True)
    ]
    if not parts:
        return logits_rows.new_empty(0, dtype=torch.float32)
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _cuda_processed(logits: Tensor, targets: Tensor, sampling: SamplingParams, step: int) -> Tensor:
    """The CUDA definition's processing (``kernels.for_device``): Triton kernels that compute
    one row per program, so a row's bits do not depend on the rows beside it
    (kernels/cuda/log_softmax.py, row_cumsum.py). Temperature only: one fused call over all
    rows (float32 cast, ÷ temperature, log-softmax, gather). With top-k/top-p: slices of
    ``step`` rows (bounded [s, V] temporaries; not numerics, rows being independent), each
    filtered as ``filter_rows`` does with the kernels' softmax and prefix sum, then the fused
    call at temperature 1."""
    from .kernels.cuda import log_softmax as kernels

    if logits.shape[0] == 0:
        return logits.new_empty(0, dtype=torch.float32)
    vocab = logits.shape[-1]
    if not ((0 < sampling.top_k < vocab) or sampling.top_p < 1.0):
        out: Tensor = kernels.token_logprobs(logits, targets, sampling.temperature)
        return out
    parts = []
    for a in range(0, targets.shape[0], step):
        x = _cuda_filter(logits[a : a + step].float(), sampling)
        parts.append(kernels.token_logprobs(x, targets[a : a + step], 1.0))
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _cuda_filter(x: Tensor, sampling: SamplingParams) -> Tensor:
    """``filter_rows`` with the CUDA definition's row kernels for its softmax and prefix sum
    (which tokens are removed takes no gradient)."""
    from .kernels.cuda.log_softmax import log_softmax
    from .kernels.cuda.row_cumsum import row_cumsum

    if sampling.temperature != 1.0:
        x = x / sampling.temperature
    if 0 < sampling.top_k < x.shape[-1]:
        kth = torch.topk(x, sampling.top_k, dim=-1).values[:, -1:]  # [s, 1]: exact selection
        x = x.masked_fill(x < kth, float("-inf"))
    if sampling.top_p < 1.0:
        with torch.no_grad():
            probs = torch.exp(log_softmax(x.detach()))  # [s, V]
            sorted_probs, order = torch.sort(probs, dim=-1, descending=True, stable=True)
            cumulative = row_cumsum(sorted_probs)  # [s, V]
            before = torch.cat([torch.zeros_like(cumulative[:, :1]), cumulative[:, :-1]], dim=-1)
            keep = torch.empty_like(before, dtype=torch.bool).scatter_(
                -1, order, before < sampling.top_p
            )
        x = x.masked_fill(~keep, float("-inf"))
    return x


def _processed_rows(logits: Tensor, targets: Tensor, sampling: SamplingParams) -> Tensor:
    x = filter_rows(logits.float(), sampling)  # [s, V]
    logprobs = torch.log_softmax(x, dim=-1)  # [s, V]
    return logprobs.gather(-1, targets[:, None]).squeeze(-1)  # [s]


def _tensor_parallel_rows(
    logits: Tensor, targets: Tensor, sampling: SamplingParams, chunks: int
) -> Tensor:
    """The tensor-parallel definition's processing (``tensor_parallel.chunked_logprobs``):
    ``logits`` [s, V'] is this rank's vocabulary slice under ``tensor_parallel.use``, the
    whole rows otherwise. Temperature only: the ranks' chunk statistics combine; top-k/top-p
    first gather the whole rows and filter them as ``filter_rows`` does."""
    tp = tensor_parallel.active()
    degree = 1 if tp is None else tp.degree
    x = logits.float()
    vocab = int(x.shape[-1]) * degree
    if (0 < sampling.top_k < vocab) or sampling.top_p < 1.0:
        whole = filter_rows(tensor_parallel.whole_vocabulary(x, tp), sampling)  # [s, V]
        return tensor_parallel.chunked_logprobs(whole, targets, chunks=chunks)
    if sampling.temperature != 1.0:
        x = x / sampling.temperature
    return tensor_parallel.chunked_logprobs(x, targets, chunks=chunks, tp=tp)


def filter_rows(x: Tensor, sampling: SamplingParams) -> Tensor:
    """float32 rows [s, V] → ÷ temperature → top-k → top-p, −inf where a token is removed."""
    vocab = x.shape[-1]
    if sampling.temperature != 1.0:  # dividing by 1.0 is exact: skipped, the same bits
        x = x / sampling.temperature
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
    return x


def _sampling(temperature: float, top_k: int, top_p: float) -> SamplingParams:
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature!r}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 = off), got {top_k!r}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
    return SamplingParams(float(temperature), int(top_k), float(top_p))


def _call(
    model: nn.Module,
    weights: Mapping[str, Tensor] | None,
    lm_head_fp32: bool | None,
    kwargs: dict[str, Any],
) -> Any:
    """One model call: patched or plain, with ``weights`` substituted when given."""

    def run() -> Any:
        if weights is None:
            return model(**kwargs)
        with bound_weights(model, weights):
            return model(**kwargs)

    patch = active_patch(model)
    if patch is None:
        return run_plain(model, bool(lm_head_fp32), run)
    token = head_fp32_override(lm_head_fp32)
    try:
        return run()
    finally:
        token.var.reset(token)


def token_logprobs(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor | None = None,
    *,
    position_ids: Tensor | None = None,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    lm_head_fp32: bool | None = None,
    logits_to_keep: int | None = None,
    weights: Mapping[str, Tensor] | None = None,
    routed_experts: Tensor | None = None,
) -> Tensor:
    """Per-token processed logprobs with autograd: [B, T] aligned with ``input_ids``.

    Entry [b, t] is log p(input_ids[b, t] | its sequence's tokens before t); it is 0 where
    there is no such prefix (a sequence's first token, padding), so masked losses stay finite,
    and −inf for a token outside the top-k/top-p support. With ``logits_to_keep=K`` only the
    last K tokens are scored (TRL's completion layout) and the result is [B, K].
    ``lm_head_fp32`` defaults to the patch's setting (plain model: off). ``weights`` runs the
    model with these tensors instead of its own (``skeleton.bound_weights``, as
    ``torch.func.functional_call`` would).
    Under ``trainer_numerics`` the values are bitwise equal to the service's answer for the
    same sequence, whatever the batch, padding side or packing.
    ``routed_experts`` (MoE models, under ``trainer_numerics``): [B, T, L, k] expert ids
    aligned with ``input_ids`` — entry [b, t, j] the experts MoE layer j sends the token at
    [b, t] to, −1 rows route freely, padding rows and each sequence's last row are ignored —
    replayed in the forward and its backward (docs/exactness.md, "Routing replay"); the
    service's answer with the same record.
    """
    sampling = _sampling(temperature, top_k, top_p)
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [batch, seq], got {list(input_ids.shape)}")
    batch, length = int(input_ids.shape[0]), int(input_ids.shape[1])
    if logits_to_keep is not None and not 0 < logits_to_keep < length:
        raise ValueError(f"logits_to_keep must be in [1, {length - 1}], got {logits_to_keep}")
    plan = plan_segments(batch, length, attention_mask, position_ids)
    segments = plan[0]
    real = torch.zeros(batch, length, dtype=torch.bool)  # [B, T]: a token of some sequence
    scored = torch.zeros(batch, length, dtype=torch.bool)  # [B, T]: has a prefix in its sequence
    for b, s, e in segments.rows:
        real[b, s:e] = True
        scored[b, s + 1 : e] = True
    first = 1 if logits_to_keep is None else length - logits_to_keep
    rows = length if logits_to_keep is None else logits_to_keep + 1
    replay = None
    if routed_experts is not None:
        needed = torch.zeros(batch, length, dtype=torch.bool)  # [B, T]: a scored token's prefix
        for b, s, e in segments.rows:
            needed[b, s : e - 1] = True
        replay = replay_routing(model, routed_experts, needed, input_ids.device)
    with (
        routing.use(replay) if replay is not None else nullcontext(),
        planned(batch, length, attention_mask, position_ids, plan),  # the forward's plan too
    ):
        out = _call(
            model,
            weights,
            lm_head_fp32,
            {
                "input_ids": input_ids,
                "attention_mask": attention_mask,
                "position_ids": position_ids,
                "logits_to_keep": 0 if logits_to_keep is None else rows,
                "use_cache": False,
            },
        )
    logits = out.logits if hasattr(out, "logits") else out[0]  # [B, rows, V]
    patch = active_patch(model)
    tp_chunks = patch.tp_chunks if patch is not None else 0
    if tp_chunks:
        logits = _whole_vocabulary(model, logits)
    # Logits row r is position length - rows + r and predicts the token after it; the scored
    # targets [first, length) are rows lo … lo + Q - 1.
    lo = first - 1 - (length - rows)
    width = length - first
    vocab = logits.shape[-1]
    device = logits.device
    # Targets of every logits row (a dummy 0 after the last position), flattened [B * rows].
    targets = torch.cat(
        [input_ids[:, length - rows + 1 :], input_ids.new_zeros(batch, 1)], dim=1
    ).reshape(-1)
    # The processing is row-wise, so it runs over spans of consecutive logits rows of real
    # tokens (views, no gather of [S, V] rows); the rows in a span that are not scored (a
    # sequence's last token) are computed and dropped — only tokens of sequences, never padding.
    covered = real[:, length - rows :].reshape(-1)  # [B * rows]
    flat_logits = logits.reshape(batch * rows, vocab)
    lp = torch.zeros(batch * rows, dtype=torch.float32, device=device)
    spans = _spans(covered)
    # The logits rows cut once at the spans' edges (one split: its backward is one
    # concatenation, where a slice per span would add a zero-filled [B * rows, V] gradient each).
    edges = sorted({0, batch * rows, *(e for span in spans for e in span)})
    pieces = dict(
        zip(
            edges[:-1],
            torch.split(flat_logits, [b - a for a, b in itertools.pairwise(edges)]),
            strict=True,
        )
    )
    for a, c in spans:
        lp[a:c] = processed_logprobs(pieces[a], targets[a:c].long(), sampling, tp_chunks=tp_chunks)
    if not spans and flat_logits.requires_grad:
        # Nothing to score (a micro-batch of padding only, e.g. a data-parallel rank's filler):
        # zeros that still hang on the graph, so the trainer's backward runs and gives 0.
        lp = lp + flat_logits.reshape(-1)[:0].sum()
    result = lp.view(batch, rows)[:, lo : lo + width]  # columns: positions [first, length)
    mask = scored[:, first:].to(device)  # [B, Q]
    result = torch.where(mask, result, result.new_zeros(()))
    if logits_to_keep is None:  # aligned with input_ids: position 0 has no prefix
        result = torch.cat([result.new_zeros(batch, 1), result], dim=1)
    return result


def _whole_vocabulary(model: nn.Module, logits: Any) -> Tensor:
    """A tensor-parallel head's logits over the whole vocabulary: a DTensor gathered, a local
    vocabulary slice (``use_local_output``) gathered over the head weight's mesh; exact."""
    if hasattr(logits, "full_tensor"):
        full: Tensor = logits.full_tensor()
        return full
    head = unwrap_model(model).get_output_embeddings()  # type: ignore[operator]
    tp = tensor_parallel.rank_of(head.weight)
    if tp is None or tp.degree == 1 or int(logits.shape[-1]) == int(head.weight.shape[0]):
        return logits  # type: ignore[no-any-return]
    return tensor_parallel.whole_vocabulary(logits, tp)


def replay_routing(
    model: nn.Module, routed_experts: Tensor, needed: Tensor, device: torch.device
) -> routing.Routing:
    """A [B, T, L, k] record aligned with a batch as the forward's ``Routing`` over its
    [B * T] rows; ``needed`` [B, T] marks the rows a scored logprob depends on (a sequence's
    tokens but its last): the others — padding, each sequence's last token, whatever they hold
    (verl leaves zeros there) — route freely, as the service routes a sequence's last row.
    Checked by the service's rule (``oldlogit.contract.routing.check_routing``)."""
    from oldlogit.contract.routing import check_routing

    patch = active_patch(model)
    if patch is None:
        raise ValueError("routed_experts replays routing under trainer_numerics only")
    layout = patch.moe
    if layout is None:
        raise ValueError(
            f"routed_experts: {type(unwrap_model(model)).__name__} has no MoE layers whose "
            "routing oldlogit replays"
        )
    batch, length = int(needed.shape[0]), int(needed.shape[1])
    shape = [batch, length, len(layout.layers), layout.top_k]
    if list(routed_experts.shape) != shape:
        raise ValueError(
            f"routed_experts must be [batch, seq, MoE layers, top_k] = {shape}, got "
            f"{list(routed_experts.shape)}"
        )
    ids = routed_experts.detach().to("cpu", torch.int64).numpy().copy()  # [B, T, L, k]
    ids[~needed.numpy()] = -1  # no logprob depends on these rows: free
    for b in range(batch):
        check_routing(
            ids[b],
            layers=len(layout.layers),
            top_k=layout.top_k,
            num_experts=layout.num_experts,
            parameter=f"routed_experts[{b}]",
        )
    forced = torch.from_numpy(ids.reshape(batch * length, *shape[2:]))
    return routing.Routing(forced=forced.to(device))


def _spans(mask: Tensor) -> list[tuple[int, int]]:
    """[start, end) of each run of True in a 1-D bool tensor (CPU)."""
    edges = torch.diff(
        mask.to(torch.int8),
        prepend=mask.new_zeros(1, dtype=torch.int8),
        append=mask.new_zeros(1, dtype=torch.int8),
    )
    starts = (edges == 1).nonzero().flatten().tolist()
    ends = (edges == -1).nonzero().flatten().tolist()
    return list(zip(starts, ends, strict=True))


# ---------------------------------------------------------------------------- service split

_head_locks: weakref.WeakKeyDictionary[nn.Module, threading.Lock] = weakref.WeakKeyDictionary()
_head_locks_guard = threading.Lock()


def decoder_hidden(
    model: nn.Module,
    input_ids: Tensor,
    *,
    position_ids: Tensor | None = None,
    attention_mask: Tensor | None = None,
    weights: Mapping[str, Tensor] | None = None,
) -> Tensor:
    """The final hidden states [B, T, H] of the model's own forward (no logits computed).

    The model is called as a whole (so a patch plans segments and positions), with an empty
    ``logits_to_keep``; a hook on ``get_decoder()`` keeps its ``last_hidden_state``.
    """
    core = unwrap_model(model)
    decoder = core.get_decoder()  # type: ignore[operator]
    captured: list[Tensor] = []

    def hook(_m: nn.Module, _a: Any, output: Any) -> None:
        captured.append(
            output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]
        )

    handle = decoder.register_forward_hook(hook)
    try:
        _call(
            model,
            weights,
            None,
            {
                "input_ids": input_ids,
                "attention_mask": attention_mask,
                "position_ids": position_ids,
                "logits_to_keep": torch.empty(0, dtype=torch.long, device=input_ids.device),
                "use_cache": False,
            },
        )
    finally:
        handle.remove()
    if len(captured) != 1:
        raise RuntimeError(f"expected one decoder call, saw {len(captured)}")
    return captured[0]


def head_logits(
    model: nn.Module,
    hidden: Tensor,
    *,
    weights: Mapping[str, Tensor] | None = None,
    lm_head_fp32: bool | None = None,
) -> Tensor:
    """The model's own head path on given rows: hidden [B, n, H] → logits [B, n, V].

    Runs the causal LM's forward with its decoder answering ``hidden``, so whatever the model
    does after the decoder (lm_head, logit soft-capping, logit scaling) is applied. Under the
    invariant numerics a row's logits do not depend on which other rows are passed. Calls on
    one model are serialised (the decoder is swapped for the call).
    """
    from transformers.modeling_outputs import MoeModelOutputWithPast

    core = unwrap_model(model)
    decoder = core.get_decoder()  # type: ignore[operator]
    with _head_locks_guard:
        lock = _head_locks.setdefault(core, threading.Lock())
    dummy = torch.zeros(hidden.shape[0], hidden.shape[1], dtype=torch.long, device=hidden.device)

    def answer(*_a: Any, **_k: Any) -> Any:
        return MoeModelOutputWithPast(last_hidden_state=hidden)

    with lock:
        had = "forward" in decoder.__dict__
        old: Callable[..., Any] | None = decoder.__dict__.get("forward")
        decoder.forward = answer
        try:
            out = _call(
                model,
                weights,
                lm_head_fp32,
                {"input_ids": dummy, "logits_to_keep": 0, "use_cache": False},
            )
        finally:
            if had:
                decoder.forward = old
            else:
                del decoder.forward
    logits: Tensor = out.logits if hasattr(out, "logits") else out[0]
    return logits


def row_logits(
    model: nn.Module,
    input_ids: Tensor,
    rows: Tensor,
    *,
    position_ids: Tensor | None = None,
    weights: Mapping[str, Tensor] | None = None,
    lm_head_fp32: bool | None = None,
    max_rows: int,
) -> Iterator[tuple[int, Tensor]]:
    """Logits of chosen rows of one forward, at most ``max_rows`` rows at a time.

    input_ids [1, N] (a packed row), rows [S] int64 (indices into N) → yields (offset into
    ``rows``, logits [w, V]). When every row fits in one chunk the model runs once with
    ``logits_to_keep=rows``; otherwise the decoder runs once and the head path per chunk.
    """
    count = int(rows.shape[0])
    if count <= max_rows:
        out = _call(
            model,
            weights,
            lm_head_fp32,
            {
                "input_ids": input_ids,
                "position_ids": position_ids,
                "logits_to_keep": rows,
                "use_cache": False,
            },
        )
        logits = out.logits if hasattr(out, "logits") else out[0]  # [1, S, V]
        yield 0, logits[0]
        return
    hidden = decoder_hidden(model, input_ids, position_ids=position_ids, weights=weights)[0]
    for a in range(0, count, max_rows):
        chunk = hidden.index_select(0, rows[a : a + max_rows])[None]  # [1, w, H]
        yield a, head_logits(model, chunk, weights=weights, lm_head_fp32=lm_head_fp32)[0]
