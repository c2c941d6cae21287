"""Tensor-parallel numerics: the same bits at tensor-parallel degree 1, 2, 4 or 8.

In: a patched model's linears and its head's logits, on one device or split over the ranks of
a ``torch.distributed`` group (a trainer's ``parallelize_module`` over a 1-D device mesh, or
the service's ranks under ``use``). Out: the definition below, which fixes every reduction
that a split could reorder, so a token's bits never depend on the degree — the numerics
option ``NumericsSpec.tp_chunks`` (C, default ``DEFAULT_TP_CHUNKS`` = 8; any degree dividing C):

- **column-parallel linears** (q/k/v, gate/up, the head's vocabulary; every linear the model's
  plan does not mark row-parallel): rows through the fixed-shape tiles (``tiles``); an output
  column's bits are those of a GEMM over column blocks of N/C columns. A rank's (or a single
  device's) one GEMM over its columns is used where a probe showed it gives those bits on this
  process's kernels (``_columns_verified``); else the blocks run one by one.
- **row-parallel linears** (o_proj, down_proj: the plan's ``rowwise``): the reduction
  dimension K cut into C chunks of K/C; each chunk's partial product computed in float32
  (inputs cast, rows tiled); the C partials summed in one fixed binary tree
  (((p0+p1)+(p2+p3))+((p4+p5)+(p6+p7))); the bias (float32) added; the result cast to the
  input's dtype. A rank computes its C/d chunks and the ranks combine by gathering the partials
  (rank order = chunk order) and summing them locally in that tree — never a library
  all-reduce, whose order is unspecified.
- **the head's log-softmax** over the vocabulary in C chunks of V/C: per chunk its max m_c and
  Σ exp(x − m_c) (``kernels.cpu.blockwise`` exp; one reduction per row, in sub-blocks beyond
  ``kernels.cpu.GRAIN``), combined as M = max m_c, S = tree Σ s_c·exp(m_c − M),
  logprob = (x_t − M) − log S. Raw logprobs (temperature only) combine the ranks' statistics;
  top-k/top-p first gather the full rows, filter them as the single-device pipeline does
  (``logprobs.processed_logprobs``), then take the same chunked log-softmax over what
  survives.
- **CPU threads**: ranks run with fewer threads than one process. Each GEMM shape's tile is
  checked once against a one-thread run (``_threads_verified``) and refused by name if a
  thread count changes its bits; pointwise ops run in blocks one thread computes
  (``kernels.cpu.blockwise``); reductions run one row per thread (below torch's parallel grain);
  attention gives a one-thread run's bits (``attention.thread_count_free``: each call shape
  compared once, one that differs runs on one thread). So the
  definition's bits do not depend on the thread count, and ``NumericsSpec`` does not compare
  threads between two tensor-parallel sides.
- **MoE layers** are refused by name (``check_degree``); embeddings, norms and rotary tables
  are replicated (a vocabulary-split embedding sums one row with zeros: exact).

One device is degree 1 of the same definition. Costlier than the single-device default (the
row-parallel partials are float32 GEMMs over K/C), so it is an option, never the default.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor, nn

from oldlogit.contract.numerics import DEFAULT_TP_CHUNKS

from .attention import InvariantNumericsError, one_thread
from .kernels.cpu import GRAIN, blockwise
from .kernels.probes import Probe, probe_randn
from .tiles import tiled_linear, tiled_mm

__all__ = [
    "DEFAULT_TP_CHUNKS",
    "ShardRules",
    "TensorParallel",
    "TensorParallelError",
    "active",
    "check_degree",
    "check_rank_shards",
    "chunk_stats",
    "chunked_logprobs",
    "column_linear",
    "degree_at_rest",
    "gather_parts",
    "linear",
    "local",
    "log_normaliser",
    "placement_of",
    "rank_of",
    "row_linear",
    "row_parallel",
    "rowwise_modules",
    "shard_rules",
    "shard_weight",
    "tree_sum",
    "use",
    "whole_vocabulary",
]


class TensorParallelError(InvariantNumericsError, ValueError):
    """A tensor-parallel setup the definition cannot serve (named in the message)."""


@dataclass(frozen=True)
class TensorParallel:
    """A rank of a tensor-parallel group: ``group`` (a ProcessGroup; None at degree 1), this
    process's ``rank`` in it and the ``degree``."""

    group: Any = None
    rank: int = 0
    degree: int = 1
    mesh_dim: int = 0  # a DTensor's: the device-mesh dimension it is split over

    def __post_init__(self) -> None:
        if self.degree < 1 or not 0 <= self.rank < self.degree:
            raise TensorParallelError(
                f"tensor_parallel: rank {self.rank} of degree {self.degree} is not a rank"
            )
        if self.degree > 1 and self.group is None:
            raise TensorParallelError("tensor_parallel: a degree above 1 needs a process group")


_local = threading.local()


def active() -> TensorParallel | None:
    """The group the calling thread's forwards run over (``use``), if any."""
    tp: TensorParallel | None = getattr(_local, "tp", None)
    return tp


@contextmanager
def use(tp: TensorParallel) -> Iterator[None]:
    """Run this thread's patched forwards tensor-parallel over ``tp.group``: every rank calls
    with the same inputs, each with its own shard of the weights (``shard_weight``); every rank
    gets the whole answer. Collectives happen inside the forward, so ranks enter together."""
    before = active()
    _local.tp = tp
    try:
        yield
    finally:
        _local.tp = before


@contextmanager
def row_parallel() -> Iterator[None]:
    """Mark the ``F.linear`` calls made inside as a row-parallel linear's (the patch wraps the
    plan's rowwise modules' forwards in it; the numerics' mode reads it: ``linear``)."""
    before = getattr(_local, "rowwise", False)
    _local.rowwise = True
    try:
        yield
    finally:
        _local.rowwise = before


def linear(
    x: Any, weight: Any, bias: Any, *, chunks: int, tile_rows: int, whole: bool = False
) -> Any:
    """``F.linear`` by the definition (the numerics' mode calls it under ``tp_chunks``): a
    row-parallel call (``row_parallel``) through ``row_linear``, any other through
    ``column_linear``. DTensor weights (torch's ``parallelize_module``) compute on their local
    shards over their mesh and hand back the DTensor ``RowwiseParallel`` / ``ColwiseParallel``
    expect (replicated / split by the last dimension); plain ones run over the group of ``use``
    (the service's ranks hold plain shard tensors), alone without one. ``whole``: a plain
    weight that ranks hold whole although the definition splits it by output (a head tied to
    the replicated embedding): each rank takes its rows."""
    rowwise = bool(getattr(_local, "rowwise", False))
    _local.rowwise = False  # one mark, one call (the module's own F.linear)
    tp = rank_of(weight)
    placement = placement_of(weight) if tp is not None else None
    sharded = placement is not None
    # A DTensor split over its mesh runs over that mesh; a replicated one alone; a plain one
    # over the ranks of ``use`` (the service's shards), alone without.
    group = tp if sharded else (active() if tp is None else None)
    w_l, b_l = local(weight), local(bias)
    if whole and tp is None and group is not None and group.degree > 1 and not rowwise:
        part = int(w_l.shape[0]) // group.degree
        w_l = w_l.narrow(0, group.rank * part, part)
        b_l = None if b_l is None else b_l.narrow(0, group.rank * part, part)
    if sharded and not rowwise and hasattr(x, "placements"):
        # A replicated input to a column split: each rank's input gradient is a partial sum
        # (its columns' share), summed over the mesh by DTensor in the backward.
        from torch.distributed.tensor import Partial, Replicate

        grads: list[Any] = [Replicate()] * x.device_mesh.ndim
        grads[tp.mesh_dim if tp is not None else 0] = Partial()
        x_l = x.to_local(grad_placements=grads)
    else:
        x_l = local(x)
    if rowwise:
        out = row_linear(x_l, w_l, b_l, chunks=chunks, tile_rows=tile_rows, tp=group)
    else:
        if placement == "rowwise":
            raise TensorParallelError(
                f"tp_chunks: a linear weight {list(weight.shape)} split by its input "
                "(Shard(1)) is not one of the model plan's rowwise layers: its sums cross "
                "ranks in an order the definition does not fix"
            )
        degree = group.degree if group is not None else 1
        out = column_linear(x_l, w_l, b_l, blocks=chunks // degree, tile_rows=tile_rows)
    if tp is None:
        return out
    from torch.distributed.tensor import DTensor, Replicate, Shard

    placements: list[Any] = [Replicate()] * weight.device_mesh.ndim
    if sharded and not rowwise:
        placements[tp.mesh_dim] = Shard(-1)
    return DTensor.from_local(out, weight.device_mesh, placements, run_check=False)


# ---------------------------------------------------------------------------- the plan

Placement = Literal["colwise", "rowwise"]


def _plan_patterns(core: nn.Module) -> dict[str, str]:
    """The model's tensor-parallel plan (transformers': the config's ``base_model_tp_plan``
    under the base model's prefix, and the causal LM's ``_tp_plan`` for the head), as module
    path pattern → style."""
    config = getattr(core, "config", None)
    base = getattr(config, "base_model_tp_plan", None) or {}
    prefix = str(getattr(core, "base_model_prefix", "") or "")
    plan = {(f"{prefix}.{k}" if prefix else k): str(v) for k, v in dict(base).items()}
    for k, v in dict(getattr(core, "_tp_plan", None) or {}).items():
        plan[str(k)] = str(v)
    return plan


def _matches(pattern: str, name: str) -> bool:
    return re.fullmatch(re.escape(pattern).replace(r"\*", r"[^.]+"), name) is not None


def check_rank_shards(core: nn.Module) -> None:
    """Refuse, by name, a model whose decoder the service's ranks cannot run on plain shards
    (``shard_rules``: every linear split by output, the plan's rowwise ones by input): a
    decoder linear its plan gives any other style ("colwise_gather_output",
    "rowwise_split_input", "packed_colwise", …) is one whose code needs the whole output, or
    a weight packed from several parts, so a contiguous half would compute something else.
    (The head is not the decoder's: its vocabulary rows are gathered by the definition.)
    A trainer's own ``parallelize_module`` plan carries such gathers itself, so this is the
    service's check only."""
    config = getattr(core, "config", None)
    base = dict(getattr(config, "base_model_tp_plan", None) or {})
    other = {k: str(v) for k, v in base.items() if str(v) not in ("colwise", "rowwise")}
    prefix = str(getattr(core, "base_model_prefix", "") or "")
    for name, module in core.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        local = name[len(prefix) + 1 :] if prefix and name.startswith(prefix + ".") else name
        for pattern, style in other.items():
            if _matches(pattern, local):
                model_type = getattr(config, "model_type", type(core).__name__)
                raise TensorParallelError(
                    f"tensor_parallel: {model_type}'s plan gives {name} the style {style!r}: "
                    "the service's ranks hold plain column and row shards, which this layer's "
                    "code cannot use. Serve it at --tensor-parallel 1 with --tp-chunks "
                    "(the same bits as any degree)"
                )


def rowwise_modules(core: nn.Module) -> dict[str, nn.Linear]:
    """The model's row-parallel linears (path → module) by its plan; refused by name when the
    model has no plan (``TensorParallelError``)."""
    plan = _plan_patterns(core)
    if not any(style.startswith("rowwise") for style in plan.values()):
        raise TensorParallelError(
            f"tp_chunks: {type(core).__name__} has no tensor-parallel plan "
            "(config.base_model_tp_plan with rowwise layers): its row-parallel sums are unknown"
        )
    found: dict[str, nn.Linear] = {}
    for name, module in core.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        styles = [s for p, s in plan.items() if _matches(p, name)]
        if any(s.startswith("rowwise") for s in styles):
            found[name] = module
    if not found:
        raise TensorParallelError(
            f"tp_chunks: no linear of {type(core).__name__} matches its plan's rowwise entries"
        )
    return found


# Where transformers' own tensor parallelism (``from_pretrained(..., tp_plan=...)``) puts the
# code that splits a module: forward hooks (transformers 5.5–5.22, plain local shards) or a
# replaced forward (later releases, DTensor parameters).
_TRANSFORMERS_TP = ("transformers.integrations.tensor_parallel", "transformers.distributed")


def refuse_transformers_tp(core: nn.Module) -> None:
    """Refuse, by name, a model split by transformers' own tensor parallelism: its row-parallel
    layers all-reduce their partial sums with ``torch.distributed`` (an order no definition
    fixes), and its shards may be plain tensors that do not say they are split — the
    numerics would run and silently give other bits than one device."""
    for name, module in core.named_modules():
        code = [module.__dict__.get("forward")]
        code += [*module._forward_pre_hooks.values(), *module._forward_hooks.values()]
        if any(str(getattr(fn, "__module__", "")).startswith(_TRANSFORMERS_TP) for fn in code):
            raise TensorParallelError(
                f"{name or type(core).__name__} is split by transformers' own tensor "
                "parallelism (from_pretrained(..., tp_plan=...)): its row-parallel layers "
                "all-reduce partial sums with torch.distributed, in an order oldlogit cannot "
                "fix. Load the model without tp_plan and split it with torch's "
                "parallelize_module (ColwiseParallel / RowwiseParallel over a DeviceMesh; "
                "docs/trainers.md), then trainer_numerics(model, tp_chunks=8)"
            )


@dataclass(frozen=True)
class ShardRules:
    """How each canonical weight name splits over ranks: dim 0 (a column-parallel weight or
    bias, the head), dim 1 (a row-parallel weight), or not at all (replicated)."""

    dims: Mapping[str, int]

    def dim(self, name: str) -> int | None:
        return self.dims.get(name)


def shard_rules(model: nn.Module) -> ShardRules:
    """The split of every weight of ``model`` (a transformers causal LM itself, not a wrapper;
    its parameters may be on the meta device) by its tensor-parallel plan: linears not marked
    row-parallel are split by output (dim 0, bias too), row-parallel ones by input (dim 1, bias
    replicated), the head by vocabulary (dim 0); a linear the plan does not name is split by
    output too, so every linear is column- or row-parallel. Embeddings, norms and buffers are
    replicated (a head tied to the embedding is then held whole: each rank takes its rows at
    the forward, ``linear(whole=True)``)."""
    core = model
    rowwise = rowwise_modules(core)
    dims: dict[str, int] = {}
    for name, module in core.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        if name in rowwise:
            dims[f"{name}.weight"] = 1
        else:  # column-parallel (the plan's colwise linears, the head; any other linear too)
            dims[f"{name}.weight"] = 0
            if module.bias is not None:
                dims[f"{name}.bias"] = 0
    return ShardRules(dims)


def shard_weight(name: str, tensor: Tensor, rank: int, degree: int, rules: ShardRules) -> Tensor:
    """Rank ``rank``'s part of weight ``name`` at ``degree``: a contiguous copy of its 1/degree
    slice along the rule's dimension (the whole tensor when replicated)."""
    dim = rules.dim(name)
    if dim is None or degree == 1:
        return tensor
    size = int(tensor.shape[dim])
    if size % degree:
        raise TensorParallelError(
            f"tensor_parallel: {name} has {size} rows along dim {dim}, not divisible by "
            f"degree {degree}"
        )
    part = size // degree
    return tensor.narrow(dim, rank * part, part).contiguous()


def check_degree(config: Any, degree: int, chunks: int) -> None:
    """Refuse, naming the setting, a degree the definition cannot serve for ``config``."""
    if chunks <= 0:
        raise TensorParallelError(f"tp_chunks must be positive, got {chunks}")
    if degree < 1:
        raise TensorParallelError(f"tensor_parallel must be >= 1, got {degree}")
    if chunks % degree:
        raise TensorParallelError(
            f"tensor_parallel {degree} does not divide tp_chunks {chunks}: a rank must hold "
            "whole chunks"
        )
    text = getattr(config, "get_text_config", lambda: config)()
    experts = [
        getattr(text, a, 0) or 0
        for a in ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
    ]
    if any(int(e) > 0 for e in experts if isinstance(e, int)):
        raise TensorParallelError(
            f"tp_chunks: {getattr(text, 'model_type', 'this')} is a mixture-of-experts model; "
            "its experts are not split by the tensor-parallel definition (serve it with "
            "tp_chunks 0 on one device)"
        )
    sizes = {
        "num_attention_heads": getattr(text, "num_attention_heads", None),
        "num_key_value_heads": getattr(text, "num_key_value_heads", None)
        or getattr(text, "num_attention_heads", None),
    }
    for name, value in sizes.items():
        if value is not None and int(value) % degree:
            raise TensorParallelError(
                f"tensor_parallel {degree} does not divide {name} {value}: each rank must hold "
                "whole heads"
            )
    for name in ("hidden_size", "intermediate_size", "vocab_size"):
        value = getattr(text, name, None)
        if value is not None and int(value) % chunks:
            raise TensorParallelError(
                f"tp_chunks {chunks} does not divide {name} {value}: the definition cuts it "
                "into equal chunks"
            )
    heads = sizes["num_attention_heads"]
    head_dim = getattr(text, "head_dim", None) or (
        int(text.hidden_size) // int(heads) if heads else None
    )
    if heads and head_dim and (int(heads) * int(head_dim)) % chunks:
        raise TensorParallelError(
            f"tp_chunks {chunks} does not divide the attention output width "
            f"{int(heads) * int(head_dim)} (heads × head_dim)"
        )


# ---------------------------------------------------------------------------- the definition


def tree_sum(parts: Tensor, *, inplace: bool = False) -> Tensor:
    """parts [n, ...] → [...]: pairwise sums in one fixed binary tree (an odd count carries its
    last part up a level). Elementwise adds only: exact the same at any size or thread count.
    ``inplace``: the sums overwrite ``parts`` (no graph; the same adds)."""
    while parts.shape[0] > 1:
        n = parts.shape[0]
        left, right = parts[0 : n - n % 2 : 2], parts[1 : n - n % 2 : 2]
        paired = left.add_(right) if inplace else left + right
        parts = torch.cat([paired, parts[n - 1 :]]) if n % 2 else paired
    return parts[0]


_verified = Probe()


def _threads_verified(
    n: int, k: int, dtype: torch.dtype, device: torch.device, tile_rows: int, bias: bool
) -> None:
    """Refuse (by name) a tile GEMM shape whose bits change with the CPU thread count."""
    threads = torch.get_num_threads()
    if device.type != "cpu" or threads == 1:
        return
    key = ("threads", n, k, dtype, tile_rows, bias, threads)

    def check() -> bool:
        x, w, *b = probe_randn(
            (tile_rows, k), (n, k), *([(n,)] if bias else []), dtype=dtype, device=device
        )
        here = tiled_mm(x, w, tile_rows, *b)
        with one_thread():
            one = tiled_mm(x, w, tile_rows, *b)
        return bool(torch.equal(here, one))

    if not _verified(key, check):
        raise TensorParallelError(
            f"tp_chunks: on this CPU a {tile_rows}×{k}·{k}×{n} {dtype} GEMM gives other bits "
            f"at {threads} threads than at 1: run every rank and the trainer with the same "
            "thread count"
        )


def _columns_verified(
    n: int, k: int, dtype: torch.dtype, device: torch.device, blocks: int, tile_rows: int
) -> bool:
    """Whether one tile GEMM over n output columns gives each column the bits of the GEMMs
    over ``blocks`` equal column blocks (the definition), on this process's kernels."""
    key = ("columns", n, k, dtype, device, blocks, tile_rows, torch.get_num_threads())

    def check() -> bool:
        x, w = probe_randn((tile_rows, k), (n, k), dtype=dtype, device=device)
        whole = tiled_mm(x, w, tile_rows)
        parts = [tiled_mm(x, wb, tile_rows) for wb in w.chunk(blocks)]
        return bool(torch.equal(whole, torch.cat(parts, dim=1)))

    return _verified(key, check)


def column_linear(
    x: Tensor, weight: Tensor, bias: Tensor | None, *, blocks: int, tile_rows: int
) -> Tensor:
    """A column-parallel (or replicated) linear: x [..., K] · weight [n, K]ᵀ (+ bias) through
    the row tiles, its columns in ``blocks`` blocks of the definition (one GEMM where that was
    verified to give the blocks' bits). ``blocks`` is C / degree: the blocks this rank holds."""
    n, k = int(weight.shape[0]), int(weight.shape[1])
    _threads_verified(n, k, weight.dtype, weight.device, tile_rows, bias is not None)
    blocks = max(1, min(blocks, n))
    if blocks == 1 or _columns_verified(n, k, weight.dtype, weight.device, blocks, tile_rows):
        return tiled_linear(x, weight, bias, tile_rows=tile_rows)
    parts = [
        tiled_linear(x, wb, None if bias is None else bb, tile_rows=tile_rows)
        for wb, bb in zip(
            weight.chunk(blocks),
            bias.chunk(blocks) if bias is not None else [None] * blocks,
            strict=True,
        )
    ]
    return torch.cat(parts, dim=-1)


class _GatherParts(torch.autograd.Function):
    """[c, ...] per rank → [degree·c, ...] in rank order; the backward keeps this rank's rows
    (the gathered tensor is replicated: every rank computes the same from it)."""

    @staticmethod
    def forward(ctx: Any, local: Tensor, group: Any, rank: int, degree: int) -> Tensor:
        import torch.distributed as dist

        local = local.contiguous()
        parts = [torch.empty_like(local) for _ in range(degree)]
        dist.all_gather(parts, local, group=group)
        ctx.rank, ctx.rows = rank, int(local.shape[0])
        return torch.cat(parts)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        lo = ctx.rank * ctx.rows
        return grad[lo : lo + ctx.rows], None, None, None


def gather_parts(local: Tensor, tp: TensorParallel | None) -> Tensor:
    """Every rank's ``local`` [c, ...] stacked in rank order (differentiable); itself at degree
    1."""
    if tp is None or tp.degree == 1:
        return local
    out: Tensor = _GatherParts.apply(local, tp.group, tp.rank, tp.degree)  # type: ignore[no-untyped-call]
    return out


def row_linear(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    *,
    chunks: int,
    tile_rows: int,
    tp: TensorParallel | None = None,
) -> Tensor:
    """A row-parallel linear by the definition: x [..., K/d] and this rank's weight [N, K/d]
    (d = ``tp.degree``, 1 without ``tp``) → [..., N], the same on every rank."""
    degree = 1 if tp is None else tp.degree
    local_chunks = chunks // degree
    k = int(weight.shape[1])
    if chunks % degree or k % local_chunks:
        raise TensorParallelError(
            f"tp_chunks {chunks}: a row-parallel weight {list(weight.shape)} at degree "
            f"{degree} does not cut into {local_chunks} equal chunks"
        )
    width = k // local_chunks
    n = int(weight.shape[0])
    _threads_verified(n, width, torch.float32, weight.device, tile_rows, False)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k).float()  # [M, K/d]
    w32 = weight.float()  # [N, K/d]
    graph = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    if graph:
        partials = torch.stack(
            [
                tiled_linear(
                    x2[:, c * width : (c + 1) * width],
                    w32[:, c * width : (c + 1) * width],
                    tile_rows=tile_rows,
                )
                for c in range(local_chunks)
            ]
        )  # [C/d, M, N] float32
    else:  # the same GEMMs, each chunk's rows contiguous and written in place
        m = int(x2.shape[0])
        xs = x2.reshape(m, local_chunks, width).transpose(0, 1).contiguous()  # [C/d, M, w]
        partials = x2.new_empty(local_chunks, m, n)
        for c in range(local_chunks):
            tiled_mm(xs[c], w32[:, c * width : (c + 1) * width], tile_rows, out=partials[c])
    total = tree_sum(gather_parts(partials, tp), inplace=not graph)  # [M, N]
    if bias is not None:
        total = total + bias.float()
    return total.to(x.dtype).reshape(*lead, n)


# ---------------------------------------------------------------------------- the head


def chunk_stats(x: Tensor, chunks: int) -> tuple[Tensor, Tensor]:
    """x [s, V'] float32 (V' = the vocabulary this rank holds, ``chunks`` equal chunks of it)
    → (max [chunks, s], Σ exp(x − max) [chunks, s]). The max is exact in any order; x − max
    is a fresh contiguous [s, chunks, V/C] whatever x's strides; exp runs in blocks
    (``kernels.cpu.blockwise``); each (row, chunk) sums its V/C values in one reduction of its own
    (sub-blocks of ``GRAIN`` elements in a tree beyond that) — the same for any number of rows or
    chunks beside it."""
    rows, vocab = int(x.shape[0]), int(x.shape[-1])
    if vocab % chunks:
        raise TensorParallelError(
            f"tp_chunks {chunks} does not divide this rank's vocabulary {vocab}"
        )
    parts = x.reshape(rows, chunks, vocab // chunks)  # [s, C', V/C]
    m = parts.amax(dim=-1)  # [s, C']
    shift = torch.where(torch.isinf(m) & (m < 0), torch.zeros_like(m), m)  # all −inf: 0
    e = blockwise(torch.exp, parts - shift[..., None])  # [s, C', V/C]
    if e.shape[-1] <= GRAIN:
        total = e.sum(dim=-1)
    else:
        blocks = torch.split(e, GRAIN, dim=-1)
        total = tree_sum(torch.stack([b.sum(dim=-1) for b in blocks]))
    return m.t(), total.t()


def log_normaliser(maxes: Tensor, sums: Tensor) -> tuple[Tensor, Tensor]:
    """(M [s], log S [s]) from every chunk's statistics [C, s], in the definition's order."""
    top = maxes.amax(dim=0)  # [s]: the top token is always kept, so finite
    scale = blockwise(torch.exp, maxes - top[None, :])  # [C, s]; exp(−inf) = 0
    total = tree_sum(sums * scale)  # [s]
    return top, blockwise(torch.log, total)


def whole_vocabulary(x: Tensor, tp: TensorParallel | None) -> Tensor:
    """Rows [..., V/d] of this rank's vocabulary slice → the whole rows [..., V] (every
    rank's slice, in rank order; exact). Itself without ``tp`` or at degree 1."""
    if tp is None or tp.degree == 1:
        return x
    return torch.cat(list(gather_parts(x[None], tp).unbind(0)), dim=-1)


def chunked_logprobs(
    x: Tensor, targets: Tensor, *, chunks: int, tp: TensorParallel | None = None
) -> Tensor:
    """The definition's log-softmax at ``targets`` [s]: x [s, V'] float32 rows (temperature
    applied, −inf where a filter removed a token) — this rank's vocabulary slice over ``tp``,
    the whole rows without. The ranks combine their chunks' statistics and the one rank that
    holds each target gives its value; every rank returns the same [s]."""
    degree = 1 if tp is None else tp.degree
    maxes, sums = chunk_stats(x, chunks // degree)  # [C/d, s] each
    vocab_local = int(x.shape[-1])
    lo = (0 if tp is None else tp.rank) * vocab_local
    here = (targets >= lo) & (targets < lo + vocab_local)
    local_t = torch.where(here, targets - lo, torch.zeros_like(targets))
    mine = torch.where(here, x.gather(-1, local_t[:, None]).squeeze(-1), x.new_zeros(()))
    if degree > 1:
        stats = gather_parts(torch.stack([maxes, sums]).transpose(0, 1).contiguous(), tp)
        maxes, sums = stats[:, 0], stats[:, 1]  # [C, s] each, chunk order
        owners = gather_parts(torch.stack([mine, here.to(x.dtype)]), tp)  # [2·d, s]
        values, held = owners[0::2], owners[1::2]  # [d, s] each
        picked = (values * held).sum(dim=0)  # exactly one rank holds each target
    else:
        picked = mine
    top, log_total = log_normaliser(maxes, sums)
    return (picked - top) - log_total


def rank_of(weight: Any) -> TensorParallel | None:
    """The tensor-parallel group a DTensor weight is split over: the one dimension of its
    device mesh it is sharded on (a 2-D mesh's ``tp`` under FSDP2, replicated over ``dp`` at
    the forward), or its 1-D mesh; degree 1 for one replicated over every dimension; None for
    a plain tensor. A weight split over two mesh dimensions at the forward is refused by name."""
    mesh = getattr(weight, "device_mesh", None)
    if mesh is None:
        return None
    split = [i for i, p in enumerate(getattr(weight, "placements", ())) if hasattr(p, "dim")]
    if len(split) > 1:
        raise TensorParallelError(
            f"tp_chunks: a weight {list(weight.shape)} split over {len(split)} dimensions of "
            f"the device mesh {tuple(mesh.shape)} at the forward: only one tensor-parallel "
            "dimension is covered"
        )
    if not split and mesh.ndim > 1:
        return TensorParallel()
    dim = split[0] if split else 0
    return TensorParallel(
        mesh.get_group(dim), int(mesh.get_local_rank(dim)), int(mesh.size(dim)), dim
    )


def degree_at_rest(param: Any) -> int:
    """The tensor-parallel degree of a parameter as the trainer holds it between steps: its
    1-D mesh's size, or on a 2-D mesh (FSDP2 over TP) the ``tp`` dimension's (the inner one
    when the dimensions are unnamed); 1 for a plain tensor."""
    mesh = getattr(param, "device_mesh", None)
    if mesh is None:
        return 1
    if mesh.ndim == 1:
        return int(mesh.size())
    names = list(getattr(mesh, "mesh_dim_names", None) or ())
    dim = names.index("tp") if "tp" in names else mesh.ndim - 1
    return int(mesh.size(dim))


def placement_of(weight: Any) -> Placement | None:
    """ "colwise" (Shard(0)) or "rowwise" (Shard(1)) for a DTensor linear weight; None for a
    plain or replicated one."""
    for p in getattr(weight, "placements", ()):
        dim = getattr(p, "dim", None)
        if dim == 0:
            return "colwise"
        if dim in (1, -1):
            return "rowwise"
    return None


def local(t: Any) -> Any:
    """A DTensor's local shard (differentiable); anything else as it is."""
    to_local: Callable[[], Tensor] | None = getattr(t, "to_local", None)
    return to_local() if to_local is not None and hasattr(t, "placements") else t
