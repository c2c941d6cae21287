"""Op-level rules of the invariant numerics: what each torch call becomes under the patch.

In: every torch function call a patched model makes (a ``TorchFunctionMode``) — but those of
the invariant attention's SDPA path, which calls nothing ruled and runs outside the mode
(``attention.invariant_attention``). Out: the same call made batch-invariant, or refused:
- ``F.linear`` runs through fixed-shape tiles (``tiles.tiled_linear``: on CPU the tiles of
  kernels/cpu.py, on CUDA one GEMM over all rows, kernels/cuda/gemm_choice.py), the head
  optionally in float32; under ``tp_chunks`` through the tensor-parallel definition
  (``tensor_parallel.linear``: DTensor weights over their mesh, plain ones over the ranks of
  ``tensor_parallel.use``);
- ``torch.topk`` follows one explicit rule (``stable_topk``), so MoE routing picks the same
  experts, in the same order, whatever the batch — or, under a replayed routing, the given
  experts (``routing.routed_topk``);
- pointwise transcendental ops on CPU (sigmoid, SiLU, GELU, tanh, exp, …) run on contiguous,
  64-aligned blocks of at most one thread's grain: torch's CPU loops compute the elements of a
  vector body and of a scalar tail with different code, and which elements fall in a tail
  depends on the tensor's size — i.e. on the number of rows (measured: fp32 sigmoid/SiLU and
  GELU-tanh in bf16 change bits; tests/unit/test_parity_ops.py) — ``kernels.cpu.blockwise``;
- a reduction over the last dimension of a GPU tensor (sum, mean, var, norm, logsumexp, …: an
  RMSNorm's mean) runs in fixed blocks of rows, or a sum/mean on CUDA as one row per program:
  CUDA picks a reduction's launch configuration from the number of rows —
  ``rowwise.last_dim_rows``;
- any other matmul with a contracted dimension > 1 raises ``UncoveredMatmul`` (strict mode);
- a random draw raises ``RandomForward`` (strict mode): no other forward — the service's
  least of all — can give the same bits. A dropout that is on (training, p > 0: an
  ``nn.Dropout`` of a model in ``train()``, the attention's ``attention_dropout``) raises its
  subclass ``ActiveDropout``; any other draw (Mixtral's ``router_jitter_noise`` in training:
  ``uniform_``, ``rand``, ``normal_``, …) ``RandomForward`` itself.
Must not know about models, segments or the service.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from . import attention, routing, tensor_parallel
from .attention import InvariantNumericsError
from .kernels import cpu
from .rowwise import REDUCTIONS, last_dim_rows
from .tiles import tiled_linear

__all__ = [
    "RULED_ANYWHERE",
    "ActiveDropout",
    "RandomForward",
    "TileMode",
    "UncoveredMatmul",
    "stable_topk",
]


class UncoveredMatmul(InvariantNumericsError):
    """The model ran a matmul the invariant numerics do not cover (its rows could change bits)."""


class RandomForward(InvariantNumericsError):
    """The model drew random numbers in its forward: bits no other forward reproduces."""


class ActiveDropout(RandomForward):
    """The model ran a dropout that is on: a random mask no other forward reproduces."""


def _contracted(func: Callable[..., Any], args: tuple[Any, ...]) -> int:
    """The length of the contracted dimension of a matmul-family call (1 = exact products)."""
    try:
        if func in (torch.einsum,):
            equation = str(args[0]).replace(" ", "")
            inputs, arrow, output = equation.partition("->")
            letters = re.sub(r"[^a-zA-Z]", "", inputs)
            if not arrow:  # implicit output: the letters that appear once
                output = "".join(c for c in letters if letters.count(c) == 1)
            return 2 if set(letters) - set(output) else 1
        a = args[0]
        if func in (torch.addmm, torch.baddbmm, torch.Tensor.addmm, torch.Tensor.baddbmm):
            a = args[1]
        if isinstance(a, Tensor) and a.dim() >= 1:
            return int(a.shape[-1])
    except (IndexError, TypeError):
        pass
    return 2


_MATMULS: frozenset[Callable[..., Any]] = frozenset(
    {
        torch.matmul,
        torch.mm,
        torch.bmm,
        torch.addmm,
        torch.baddbmm,
        torch.einsum,
        torch.Tensor.matmul,
        torch.Tensor.__matmul__,
        torch.Tensor.__rmatmul__,
        torch.Tensor.mm,
        torch.Tensor.bmm,
        torch.Tensor.addmm,
        torch.Tensor.baddbmm,
        F.bilinear,
        F.scaled_dot_product_attention,
        *(f for f in (getattr(torch, "_grouped_mm", None), getattr(F, "grouped_mm", None)) if f),
    }
)
# Matmuls whose left operand's rows are independent: x [..., K] @ w [K, N] with a 2-D right
# operand is a linear layer written by hand (Falcon's ``hidden @ weight.T``).
_ROW_MATMULS: frozenset[Callable[..., Any]] = frozenset(
    {torch.matmul, torch.mm, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.Tensor.mm}
)
_TOPKS: frozenset[Callable[..., Any]] = frozenset({torch.topk, torch.Tensor.topk})

# Dropouts, with whether each is on when its ``training`` argument is not given.
_DROPOUTS: dict[Callable[..., Any], bool] = {
    F.dropout: True,
    F.dropout1d: True,
    F.dropout2d: True,
    F.dropout3d: True,
    F.alpha_dropout: False,
    F.feature_alpha_dropout: False,
    **{
        f: True
        for name in ("dropout", "alpha_dropout", "feature_dropout", "feature_alpha_dropout")
        for f in (getattr(torch, name, None), getattr(torch, name + "_", None))
        if f is not None
    },
}


# Random draws (factories, in-place samplers): whatever the seed, no other forward has them.
_RANDOM: frozenset[Callable[..., Any]] = frozenset(
    f
    for owner, names in (
        (
            torch,
            (
                "rand",
                "rand_like",
                "randn",
                "randn_like",
                "randint",
                "randint_like",
                "randperm",
                "normal",
                "bernoulli",
                "multinomial",
                "poisson",
                "binomial",
            ),
        ),
        (
            torch.Tensor,
            (
                "uniform_",
                "normal_",
                "bernoulli",
                "bernoulli_",
                "random_",
                "exponential_",
                "geometric_",
                "cauchy_",
                "log_normal_",
                "multinomial",
            ),
        ),
        (F, ("gumbel_softmax",)),
    )
    for f in (getattr(owner, name, None) for name in names)
    if f is not None
)


def _dropout_on(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> float:
    """The probability of a dropout call that is on (training and p > 0), else 0."""
    p = args[1] if len(args) > 1 else kwargs.get("p", 0.5)
    training = args[2] if len(args) > 2 else kwargs.get("training", kwargs.get("train"))
    if training is None:
        training = _DROPOUTS[func]
    try:
        return float(p) if bool(training) and float(p) > 0 else 0.0
    except (TypeError, ValueError):
        return 1.0  # not a number we can read: treat it as on


# Unary pointwise functions whose CPU vector and scalar code may round differently.
_POINTWISE: frozenset[Callable[..., Any]] = frozenset(
    {
        F.silu,
        F.gelu,
        F.mish,
        F.softplus,
        F.elu,
        F.selu,
        F.celu,
        F.logsigmoid,
        F.hardswish,
        *(
            f
            for name in (
                "sigmoid",
                "tanh",
                "exp",
                "expm1",
                "log",
                "log1p",
                "erf",
                "cos",
                "sin",
                "rsqrt",
                "sqrt",
                "pow",
                "reciprocal",
            )
            for f in (getattr(torch, name), getattr(torch.Tensor, name))
        ),
        torch.Tensor.__pow__,
    }
)


def stable_topk(x: Tensor, k: int, dim: int = -1, largest: bool = True, sorted: bool = True) -> Any:
    """``torch.topk`` with an explicit rule: values in descending (``largest``) order, ties to
    the lower index. A stable sort of the row, cut at k: per row, exact, and independent of the
    other rows and of the kernel torch would pick for the batch's shape (``sorted`` is moot:
    the result is always sorted). Returns ``torch.return_types.topk`` like ``torch.topk``.
    """
    values, indices = torch.sort(x, dim=dim, descending=largest, stable=True)
    return torch.return_types.topk((values.narrow(dim, 0, k), indices.narrow(dim, 0, k)))


def _topk_args(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Tensor, int, int, bool]:
    names = ("input", "k", "dim", "largest", "sorted")
    bound = {**dict(zip(names, args, strict=False)), **kwargs}
    dim = int(bound.get("dim", -1))
    return bound["input"], int(bound["k"]), dim, bool(bound.get("largest", True))


# Every function a rule of ``TileMode`` may apply to, whatever its settings.
RULED_ANYWHERE: frozenset[Callable[..., Any]] = (
    frozenset({F.linear})
    | _TOPKS
    | _POINTWISE
    | _MATMULS
    | _RANDOM
    | set(_DROPOUTS)
    | set(REDUCTIONS)
)


class TileMode(TorchFunctionMode):
    """The rules of the module docstring. ``tile_rows=None`` (the plain profile) changes
    nothing but the head's dtype when ``fp32`` asks for it; ``gpu=False`` (a model on CPU)
    leaves the reduction rule out of the per-call path; ``cuda``: the CUDA definition's
    kernels (``kernels.for_device``)."""

    def __init__(
        self,
        tile_rows: int | None,
        strict: bool,
        head: nn.Module | None,
        fp32: bool,
        tp_chunks: int = 0,
        tied_head: bool = False,
        gpu: bool = True,
        cuda: bool = False,
    ) -> None:
        super().__init__()
        self.tp_chunks = tp_chunks
        self.tied_head = tied_head  # the head's weight is the (replicated) embedding's
        self.tile_rows = tile_rows
        self.strict = strict
        # The head module, not its weight: under ``functional_call`` the weight it holds is
        # swapped in after the mode is entered.
        self.head = head
        self.head_fp32 = fp32
        # What a rule applies to; every other call (views, adds, a tensor's attributes: most
        # of a forward's few hundred) passes straight through.
        self._ruled = frozenset({F.linear}) | (
            frozenset()
            if tile_rows is None
            else _TOPKS | _POINTWISE | _MATMULS | _RANDOM | set(_DROPOUTS)
        )
        # The CUDA definition's kernels (``kernels.for_device``): regions.py's norm takes them.
        self.cuda = tile_rows is not None and cuda
        if tile_rows is not None and gpu:  # a CPU model's reductions pass straight through
            self._ruled = self._ruled | set(REDUCTIONS)

    def call(self, func: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``func(*args, **kwargs)`` as this mode runs it when the call reaches it: through its
        rule where one applies, as it is otherwise (``regions``: known code that runs outside
        the mode hands its ruled calls here)."""
        if func in self._ruled:
            return self.__torch_function__(func, (Tensor,), args, kwargs)
        return func(*args, **kwargs)

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if func not in self._ruled:
            return func(*args, **kwargs) if kwargs else func(*args)
        kwargs = kwargs or {}
        if func is F.linear:
            x: Tensor = args[0] if len(args) > 0 else kwargs["input"]
            weight: Tensor = args[1] if len(args) > 1 else kwargs["weight"]
            bias: Tensor | None = args[2] if len(args) > 2 else kwargs.get("bias")
            head_call = (self.head_fp32 or self.tied_head) and weight is getattr(
                self.head, "weight", None
            )
            if self.head_fp32 and head_call:
                # fp32 head: hidden states and head weight cast before the projection.
                x = x.float()
                weight = weight.float()
                bias = None if bias is None else bias.float()
            if self.tile_rows is None:
                return F.linear(x, weight, bias)
            if self.tp_chunks:  # the tensor-parallel definition (any degree, DTensor or not)
                return tensor_parallel.linear(
                    x,
                    weight,
                    bias,
                    chunks=self.tp_chunks,
                    tile_rows=self.tile_rows,
                    whole=head_call and self.tied_head,
                )
            if type(weight).__name__ == "DTensor":
                # FSDP gathers its shards before a layer computes; a weight still sharded here
                # is tensor parallelism: its row-parallel sums cross ranks in an order the
                # tiles do not fix.
                raise InvariantNumericsError(
                    f"F.linear on a DTensor weight {list(weight.shape)} placed "
                    f"{tuple(getattr(weight, 'placements', ()))}: tensor parallelism "
                    "(parallelize_module) needs the tensor-parallel definition: "
                    "trainer_numerics(model, tp_chunks=8), or like= a service started with "
                    "--tp-chunks 8"
                )
            return tiled_linear(x, weight, bias, tile_rows=self.tile_rows)
        if self.tile_rows is None:
            return func(*args, **kwargs)
        if func in _TOPKS:
            x, k, dim, largest = _topk_args(args, kwargs)
            # A MoE block's routing top-k under a replayed routing takes the given experts
            # (``routing.routed_topk``); otherwise the stable rule's result, as it is.
            return routing.routed_topk(x, k, dim, largest, stable_topk(x, k, dim, largest))
        if func in REDUCTIONS:
            reduced = last_dim_rows(func, args, kwargs)
            return func(*args, **kwargs) if reduced is None else reduced
        if func in _POINTWISE and _cpu_float(args):
            return cpu.blockwise(func, *args, **kwargs)
        if self.strict and func in _DROPOUTS:
            p = _dropout_on(func, args, kwargs)
            if p:
                raise ActiveDropout(
                    f"a dropout with p={p:g} is on in this forward (a module in train() mode: "
                    "nn.Dropout, the attention's attention_dropout): its mask is random, so "
                    "no forward of the service gives these logprobs. Score with the dropout "
                    "probabilities at 0 (config attention_dropout / hidden_dropout / "
                    "resid_pdrop = 0; TRL: disable_dropout=True) or in model.eval() "
                    "(strict=False runs it anyway, without the guarantee)"
                )
        if self.strict and func in _RANDOM:
            raise RandomForward(
                f"{getattr(func, '__name__', func)} draws random numbers in this forward (a "
                "module in train() mode: Mixtral's router_jitter_noise, layer drop, noise "
                "injection): no forward of the service gives these logprobs. Score with that "
                "noise off (its config value at 0) or in model.eval() (strict=False runs it "
                "anyway, without the guarantee)"
            )
        if func in _ROW_MATMULS and not self.tp_chunks and not attention.in_attention():
            operand = _row_operand(args, kwargs)
            if operand is not None:  # rows through the tiles, as F.linear(x, operand.T)
                return tiled_linear(args[0], operand.t(), None, tile_rows=self.tile_rows)
        if (
            self.strict
            and func in _MATMULS
            and not attention.in_attention()
            and _contracted(func, args) > 1
        ):
            shapes = [list(a.shape) for a in args if isinstance(a, Tensor)]
            raise UncoveredMatmul(
                f"{getattr(func, '__name__', func)} on {shapes} runs outside oldlogit's tiles: "
                "its rows could change bits with the batch. This model is not supported under "
                "trainer_numerics (strict=False runs it anyway, without the guarantee)"
            )
        return func(*args, **kwargs)


def _row_operand(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Tensor | None:
    """The right operand of ``x @ w`` when it is a plain 2-D floating tensor [K, N] with K > 1
    and x [..., K] has rows (a linear layer written as a matmul); else None."""
    if kwargs or len(args) != 2:
        return None
    x, w = args
    if not (isinstance(x, Tensor) and isinstance(w, Tensor)) or type(w).__name__ == "DTensor":
        return None
    if x.dim() < 2 or w.dim() != 2 or x.shape[-1] != w.shape[0] or w.shape[0] < 2:
        return None
    if not (x.is_floating_point() and x.dtype == w.dtype and x.device == w.device):
        return None
    return w


def _cpu_float(args: tuple[Any, ...]) -> bool:
    x = args[0] if args else None
    return (
        isinstance(x, Tensor)
        and x.is_cpu
        and x.is_floating_point()
        and x.numel() > 0
        and (len(args) == 1 or not any(isinstance(a, Tensor) and a.numel() > 1 for a in args[1:]))
    )
