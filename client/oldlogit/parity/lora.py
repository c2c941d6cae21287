"""LoRA adapter versions: the definition, and the service's side of it.

In: an adapter — a ``LoraSpec`` (rank, alpha, rsLoRA, target modules, tensor dtype) and its
``lora_A`` [r, in] / ``lora_B`` [out, r] per target linear — from PEFT (``adapter_from_peft``:
a model, a ``save_pretrained`` directory or a state dict with its config). Out: the
definition — PEFT's unmerged single-adapter forward under the invariant numerics, per target
linear ``(base(x) + lora_B(lora_A(x.to(A.dtype))) * scaling).to(base(x).dtype)``, never a
merge — on rows of a packed batch (``serving_adapters``: the base GEMM once over all rows,
each adapter's rows, its ranges gathered, through one lora_A and one lora_B ``F.linear`` call,
tiled by the numerics' mode, its term added in place on its rows). The
trainer side (PEFT's own ``Linear.forward``, vouched for) is ``lora_trainer``.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "Adapter",
    "LoraSpec",
    "adapter_from_peft",
    "check_adapter",
    "serving_adapters",
]

_DTYPES = ("bfloat16", "float16", "float32")
_SPEC_KEYS = ("alpha", "dtype", "rank", "target_modules", "use_rslora")
# PEFT config keys that select a LoRA variant or train more than lora_A/lora_B: another
# function than the definition (docs/exactness.md, "LoRA adapters").
_REFUSED_CONFIG = {
    "use_dora": "DoRA (use_dora=True) adds a weight-norm term: train with use_dora=False",
    "lora_bias": "LoRA biases (lora_bias=True): train with lora_bias=False",
    "fan_in_fan_out": "fan_in_fan_out=True (Conv1D bases): only nn.Linear bases are supported",
    "modules_to_save": (
        "modules_to_save trains full copies of modules the base version does not hold: "
        "publish those as a full version instead"
    ),
    "trainable_token_indices": "trainable_token_indices trains embedding rows: not supported",
    "rank_pattern": "rank_pattern gives layers other ranks: one rank per adapter",
    "alpha_pattern": "alpha_pattern gives layers other alphas: one alpha per adapter",
    "target_parameters": "target_parameters (LoRA on raw parameters) is not supported",
    "alora_invocation_tokens": "aLoRA (alora_invocation_tokens) is not supported",
    "use_bdlora": "block-diagonal LoRA (use_bdlora) is not supported",
    "arrow_config": "Arrow routing (arrow_config) is not supported",
    "velora_config": "VeLoRA (velora_config) is not supported",
    "monteclora_config": "MonteCLoRA (monteclora_config) is not supported",
    "kasa_config": "KaSA (kasa_config) is not supported",
    "layer_replication": "layer_replication changes the base model's layers: not supported",
}


@dataclass(frozen=True)
class LoraSpec:
    """An adapter's configuration: ``rank``, ``alpha``, rsLoRA, the base model's target
    linears (sorted, fully qualified state-dict module names) and its tensors' dtype.
    ``as_dict()`` is JSON-able and canonical (``json.dumps(..., sort_keys=True)`` hashes it)."""

    rank: int
    alpha: float
    use_rslora: bool
    target_modules: tuple[str, ...]
    dtype: str

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank <= 0:
            raise ValueError(f"rank must be a positive int, got {self.rank!r}")
        if not isinstance(self.alpha, (int, float)) or not math.isfinite(self.alpha):
            raise ValueError(f"alpha must be a finite number, got {self.alpha!r}")
        object.__setattr__(self, "alpha", float(self.alpha))
        if not isinstance(self.use_rslora, bool):
            raise ValueError(f"use_rslora must be a bool, got {self.use_rslora!r}")
        targets = tuple(self.target_modules)
        if not targets or not all(isinstance(t, str) and t for t in targets):
            raise ValueError(f"target_modules must be non-empty names, got {targets!r}")
        if list(targets) != sorted(set(targets)):
            raise ValueError("target_modules must be sorted and unique")
        object.__setattr__(self, "target_modules", targets)
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}")

    @property
    def scaling(self) -> float:
        """PEFT's ``alpha / r``, or ``alpha / sqrt(r)`` with rsLoRA (the same Python float)."""
        return self.alpha / math.sqrt(self.rank) if self.use_rslora else self.alpha / self.rank

    def as_dict(self) -> dict[str, Any]:
        """The spec as JSON-able values (target modules as a list)."""
        return {
            "alpha": self.alpha,
            "dtype": self.dtype,
            "rank": self.rank,
            "target_modules": list(self.target_modules),
            "use_rslora": self.use_rslora,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> LoraSpec:
        """The spec ``as_dict`` gave; other or missing keys raise ValueError naming them."""
        keys = set(data)
        if keys != set(_SPEC_KEYS):
            missing, extra = sorted(set(_SPEC_KEYS) - keys), sorted(keys - set(_SPEC_KEYS))
            raise ValueError(f"LoraSpec dict: missing keys {missing}, unknown keys {extra}")
        return cls(
            rank=data["rank"],
            alpha=data["alpha"],
            use_rslora=data["use_rslora"],
            target_modules=tuple(data["target_modules"]),
            dtype=data["dtype"],
        )


@dataclass(frozen=True, eq=False)
class Adapter:
    """A LoRA adapter: its spec and tensors ``"<module>.lora_A"`` [r, in] and
    ``"<module>.lora_B"`` [out, r] per target module (``check_adapter`` validates them
    against a base). Compared and hashed by identity."""

    spec: LoraSpec
    tensors: Mapping[str, Tensor]

    def __post_init__(self) -> None:
        object.__setattr__(self, "tensors", MappingProxyType(dict(self.tensors)))


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def check_adapter(adapter: Adapter, base_shapes: Mapping[str, tuple[int, ...]]) -> None:
    """Raise ValueError naming what does not fit: a target module the base lacks, a tensor
    missing or unexpected, ``lora_A``/``lora_B`` shapes against the base's in/out features,
    the rank or dtype of the config against the tensors'. ``base_shapes``: ``"<m>.weight"``
    → shape."""
    spec = adapter.spec
    expected = {f"{m}.lora_{ab}" for m in spec.target_modules for ab in "AB"}
    extra = sorted(set(adapter.tensors) - expected)
    if extra:
        raise ValueError(f"tensors {extra[:4]}: not the lora_A/lora_B of a target module")
    for module in spec.target_modules:
        shape = base_shapes.get(f"{module}.weight")
        if shape is None:
            raise ValueError(f"target module {module!r}: the base has no {module}.weight")
        if len(shape) != 2:
            raise ValueError(f"target module {module!r}: its weight {list(shape)} is not 2-D")
        out_f, in_f = int(shape[0]), int(shape[1])
        for ab in "AB":
            name = f"{module}.lora_{ab}"
            tensor = adapter.tensors.get(name)
            if tensor is None:
                raise ValueError(f"tensor {name!r} is missing")
            if tensor.dim() != 2:
                raise ValueError(f"{name} is {list(tensor.shape)}, not 2-D")
            if _dtype_name(tensor.dtype) != spec.dtype:
                raise ValueError(f"dtype: the config says {spec.dtype}, {name} is {tensor.dtype}")
        a, b = adapter.tensors[f"{module}.lora_A"], adapter.tensors[f"{module}.lora_B"]
        if a.shape[0] != spec.rank or b.shape[1] != spec.rank:
            raise ValueError(
                f"rank: the config says {spec.rank}, {module}.lora_A is {list(a.shape)} and "
                f"{module}.lora_B {list(b.shape)}"
            )
        if a.shape[1] != in_f:
            raise ValueError(
                f"{module}.lora_A is {list(a.shape)}: in_features {a.shape[1]}, the base's "
                f"{module}.weight {list(shape)} takes {in_f}"
            )
        if b.shape[0] != out_f:
            raise ValueError(
                f"{module}.lora_B is {list(b.shape)}: out_features {b.shape[0]}, the base's "
                f"{module}.weight {list(shape)} gives {out_f}"
            )


# -- from PEFT ------------------------------------------------------------------------------

_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.(?P<adapter>[^.]+))?\.weight$")


def adapter_from_peft(source: Any, *, adapter_name: str = "default") -> Adapter:
    """The adapter ``adapter_name`` of ``source``: a PeftModel (or a model holding PEFT LoRA
    layers), a ``save_pretrained`` directory (adapter_config.json + adapter_model.safetensors)
    or a ``(state_dict, config_dict)`` pair (``adapter_name`` picks among keys that name their
    adapter, as a model's ``state_dict()`` does; saved files name none). Module names become the
    base model's; tensors are copied. What the definition does not cover raises ValueError."""
    if isinstance(source, nn.Module):
        return _from_module(source, adapter_name)
    if isinstance(source, (str, os.PathLike)):
        return _from_directory(Path(source), adapter_name)
    if isinstance(source, tuple) and len(source) == 2 and isinstance(source[1], Mapping):
        state, config = source
        if not isinstance(state, Mapping):
            raise ValueError("source: the pair's first item must be a state dict")
        return _from_state(state, config, adapter_name)
    raise ValueError(
        f"source: a PeftModel, a save_pretrained directory or (state_dict, config), got "
        f"{type(source).__name__}"
    )


def _from_directory(path: Path, adapter_name: str) -> Adapter:
    config_path, weights = path / "adapter_config.json", path / "adapter_model.safetensors"
    if not config_path.is_file() or not weights.is_file():
        raise ValueError(
            f"source: {path} holds no adapter_config.json and adapter_model.safetensors "
            "(save_pretrained with safe_serialization=True writes them)"
        )
    from safetensors.torch import load_file

    config = json.loads(config_path.read_text())
    return _from_state(load_file(str(weights)), config, adapter_name)


def _refuse_config(config: Mapping[str, Any]) -> None:
    peft_type = config.get("peft_type", "LORA")
    if str(getattr(peft_type, "value", peft_type)).upper() != "LORA":
        raise ValueError(f"source: a {peft_type} adapter, not LoRA")
    for key, why in _REFUSED_CONFIG.items():
        if config.get(key):
            raise ValueError(f"source: {why}")
    if config.get("bias", "none") != "none":
        raise ValueError(
            f"source: bias={config['bias']!r} trains the base's biases, which the base version "
            "does not hold: train with bias='none'"
        )


def _from_state(state: Mapping[str, Any], config: Mapping[str, Any], name: str) -> Adapter:
    _refuse_config(config)
    tensors: dict[str, Tensor] = {}
    for key, value in state.items():
        bare = key.removeprefix("base_model.model.")
        match = _KEY.match(bare)
        if match is None:
            raise ValueError(
                f"source: key {key!r} is not a LoRA lora_A/lora_B weight (embeddings, DoRA "
                "magnitudes, LoRA biases and saved modules are not supported)"
            )
        if match["adapter"] is not None and match["adapter"] != name:
            continue
        module = match["module"].replace(".base_layer", "")
        if not isinstance(value, Tensor):
            raise ValueError(f"source: {key!r} is not a tensor")
        tensors[f"{module}.lora_{match['ab']}"] = value.detach().clone()
    if not tensors:
        raise ValueError(f"adapter_name: no lora_A/lora_B tensors of adapter {name!r}")
    modules = sorted({n.rsplit(".", 1)[0] for n in tensors})
    for module in modules:
        if f"{module}.lora_A" not in tensors or f"{module}.lora_B" not in tensors:
            raise ValueError(f"source: {module} has only one of lora_A and lora_B")
    _check_targets(config.get("target_modules"), modules, config.get("exclude_modules"))
    dtypes = {t.dtype for t in tensors.values()}
    if len(dtypes) != 1:
        raise ValueError(f"source: the tensors are in several dtypes {sorted(map(str, dtypes))}")
    for key in ("r", "lora_alpha"):
        if not isinstance(config.get(key), (int, float)) or isinstance(config.get(key), bool):
            raise ValueError(f"source: the config's {key!r} is {config.get(key)!r}")
    rank = int(config["r"])
    for module in modules:
        a, b = tensors[f"{module}.lora_A"], tensors[f"{module}.lora_B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != rank or b.shape[1] != rank:
            raise ValueError(
                f"source: the config says r={rank}, {module}.lora_A is {list(a.shape)} and "
                f"lora_B {list(b.shape)}"
            )
    spec = LoraSpec(
        rank=rank,
        alpha=float(config["lora_alpha"]),
        use_rslora=bool(config.get("use_rslora", False)),
        target_modules=tuple(modules),
        dtype=_dtype_name(dtypes.pop()),
    )
    return Adapter(spec, tensors)


def _check_targets(targets: Any, modules: Sequence[str], exclude: Any) -> None:
    """Each module holding tensors matches the config's target_modules (names, suffixes, a
    regex or "all-linear", as PEFT allows) and no exclude_modules entry."""

    def matches(pattern: Any, module: str) -> bool:
        if pattern is None:
            return False
        if isinstance(pattern, str):
            if pattern == "all-linear":
                return True
            return re.fullmatch(pattern, module) is not None
        return any(module == t or module.endswith(f".{t}") for t in pattern)

    for module in modules:
        if targets is not None and not matches(targets, module):
            raise ValueError(f"source: {module} holds tensors but target_modules={targets!r}")
        if exclude and matches(exclude, module) and exclude != "all-linear":
            raise ValueError(f"source: {module} holds tensors but exclude_modules={exclude!r}")


def _from_module(model: nn.Module, name: str) -> Adapter:
    from .lora_trainer import lora_layers, peft_refusal
    from .numerics import unwrap_model

    config = getattr(model, "peft_config", None)
    if isinstance(config, Mapping):
        if name not in config:
            raise ValueError(f"adapter_name: {name!r} is not one of {sorted(config)}")
        cfg = config[name]
        _refuse_config(cfg.to_dict() if hasattr(cfg, "to_dict") else vars(cfg))
    core = unwrap_model(model)
    found = lora_layers(core)
    tensors: dict[str, Tensor] = {}
    params: set[tuple[int, float, bool]] = set()
    for module_name, layer in found:
        if name not in layer.lora_A:
            continue
        why = peft_refusal(core, module_name, layer, [name])
        if why is not None:
            raise ValueError(f"source: {why}")
        tensors[f"{module_name}.lora_A"] = layer.lora_A[name].weight.detach().clone()
        tensors[f"{module_name}.lora_B"] = layer.lora_B[name].weight.detach().clone()
        params.add((int(layer.r[name]), float(layer.lora_alpha[name]), layer.use_rslora[name]))
    if not tensors:
        raise ValueError(f"adapter_name: no LoRA layer of the model holds adapter {name!r}")
    if len(params) != 1:
        raise ValueError(f"source: layers differ in (rank, alpha, rsLoRA): {sorted(params)}")
    rank, alpha, rslora = params.pop()
    dtypes = {t.dtype for t in tensors.values()}
    if len(dtypes) != 1:
        raise ValueError(f"source: the tensors are in several dtypes {sorted(map(str, dtypes))}")
    modules = tuple(sorted({n.rsplit(".", 1)[0] for n in tensors}))
    spec = LoraSpec(rank, alpha, rslora, modules, _dtype_name(dtypes.pop()))
    return Adapter(spec, tensors)


# -- the service's forward ------------------------------------------------------------------

_Group = tuple[int, int, Tensor, Tensor, float]  # rows [start, stop), lora_A, lora_B, scaling


@contextmanager
def serving_adapters(
    model: nn.Module, rows: Sequence[tuple[int, int, Adapter | None]]
) -> Iterator[None]:
    """Within the block, each target linear of ``model`` gives rows [start, stop) of its
    flattened output (leading dims as one row axis) PEFT's single-adapter forward of that
    row's adapter (None: the base alone): the base runs once over all rows, then each
    adapter's rows (its ranges gathered) go through its own lora_A/lora_B ``F.linear`` — row
    tiles under the invariant numerics, so a row's bits do not depend on the rows beside it —
    and its term is added in place on its rows. Reads the tensors from the
    adapters (weights bound per call work); not thread-safe for one model."""
    spans = sorted((int(s), int(e), a) for s, e, a in rows)
    last = 0
    for start, stop, _ in spans:
        if start < last or stop <= start:
            raise ValueError(f"rows: [{start}, {stop}) is empty or overlaps another range")
        last = stop
    modules = dict(model.named_modules())
    head_getter = getattr(model, "get_output_embeddings", None)
    head = head_getter() if callable(head_getter) else None
    groups: dict[str, list[_Group]] = {}
    for start, stop, adapter in spans:
        if adapter is None:
            continue
        scaling = adapter.spec.scaling
        for target in adapter.spec.target_modules:
            module = modules.get(target)
            if not isinstance(module, nn.Linear):
                raise ValueError(f"rows: target module {target!r} is not a linear of the model")
            if module is head:
                raise ValueError(f"rows: target module {target!r} is the head: not supported")
            a = adapter.tensors[f"{target}.lora_A"]
            b = adapter.tensors[f"{target}.lora_B"]
            groups.setdefault(target, []).append((start, stop, a, b, scaling))
    installed: list[tuple[nn.Module, bool, Any]] = []
    try:
        for target, spans_of in groups.items():
            module = modules[target]
            if getattr(module.forward, "_oldlogit_lora", False):
                raise RuntimeError(f"serving_adapters is active on {target} already")
            had = "forward" in module.__dict__
            installed.append((module, had, module.__dict__.get("forward")))
            module.__dict__["forward"] = _adapted(module.forward, spans_of)
        yield
    finally:
        for module, had, old in reversed(installed):
            if had:
                module.__dict__["forward"] = old
            else:
                del module.__dict__["forward"]


def _plan(groups: list[_Group]) -> list[tuple[Tensor, Tensor, float, list[tuple[int, int]]]]:
    """The groups by adapter (its lora_A/lora_B tensors), in first-row order, each adapter's
    row ranges sorted with touching ranges joined: one lora_A and one lora_B call per adapter
    over all its rows (a tiled ``F.linear`` gives each row the bits it gets alone)."""
    plan: dict[tuple[int, int, float], tuple[Tensor, Tensor, float, list[tuple[int, int]]]] = {}
    for start, stop, a, b, scaling in groups:
        entry = plan.setdefault((id(a), id(b), scaling), (a, b, scaling, []))
        spans = entry[3]
        if spans and spans[-1][1] == start:
            spans[-1] = (spans[-1][0], stop)
        else:
            spans.append((start, stop))
    return list(plan.values())


def _adapted(call: Any, groups: list[_Group]) -> Any:
    plan = _plan(groups)
    last_row = max(stop for _, stop, _, _, _ in groups)

    def forward(x: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        result: Tensor = call(x, *args, **kwargs)
        flat_x = x.reshape(-1, x.shape[-1])
        flat = result.reshape(-1, result.shape[-1])
        n = int(flat.shape[0])
        if last_row > n:
            bad = next((s, e) for s, e, *_ in groups if e > n)
            raise ValueError(f"rows: [{bad[0]}, {bad[1]}) beyond the forward's {n} rows")
        if result.requires_grad or flat.data_ptr() != result.data_ptr():
            return _joined(result, flat, flat_x, groups)
        _add_terms(flat, flat_x, plan)
        return result

    forward._oldlogit_lora = True  # type: ignore[attr-defined]
    return forward


def _add_terms(
    flat: Tensor, flat_x: Tensor, plan: list[tuple[Tensor, Tensor, float, list[tuple[int, int]]]]
) -> None:
    """Each adapter's term added in place on its rows of ``flat`` (the base output, [M, N]):
    the bits of ``(flat[rows] + lora_B(lora_A(x[rows])) * scaling).to(flat.dtype)`` (PEFT's
    order; an in-place add computes in the promoted dtype and casts once on the store, as the
    out-of-place add and ``.to`` do). One lora_A and one lora_B ``F.linear`` per adapter over
    its rows gathered (row tiles: a row's bits do not depend on the other rows)."""
    for a, b, scaling, spans in plan:
        if a.device != flat_x.device:
            a, b = a.to(flat_x.device), b.to(flat_x.device)
        if len(spans) == 1:
            rows = flat_x[spans[0][0] : spans[0][1]]
        else:
            rows = torch.cat([flat_x[s:e] for s, e in spans])
        rows = rows if rows.dtype == a.dtype else rows.to(a.dtype)  # PEFT's input cast
        term = F.linear(F.linear(rows, a), b)
        term.mul_(scaling)  # the bits of term * scaling
        at = 0
        for s, e in spans:
            flat[s:e].add_(term[at : at + e - s])
            at += e - s


def _joined(result: Tensor, flat: Tensor, flat_x: Tensor, groups: list[_Group]) -> Tensor:
    """The same values out of place (autograd records them; or an output that is no view)."""
    n = int(flat.shape[0])
    pieces: list[Tensor] = []
    at = 0
    for start, stop, a, b, scaling in groups:
        if start > at:
            pieces.append(flat[at:start])
        if a.device != flat_x.device:
            a, b = a.to(flat_x.device), b.to(flat_x.device)
        rows = flat_x[start:stop]
        rows = rows if rows.dtype == a.dtype else rows.to(a.dtype)  # PEFT's input cast
        # PEFT's order: result + lora_B(lora_A(x)) * scaling (promoting), then back.
        pieces.append(
            (flat[start:stop] + F.linear(F.linear(rows, a), b) * scaling).to(result.dtype)
        )
        at = stop
    if at < n:
        pieces.append(flat[at:])
    return torch.cat(pieces).reshape(result.shape)
