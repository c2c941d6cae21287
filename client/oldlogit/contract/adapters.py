"""Adapter versions: a LoRA adapter's config, its tensor names, and what makes it fit a base.

In: a config (ours, or PEFT's ``adapter_config.json``) and the adapter's tensor table (names,
dtypes, shapes); out: the canonical ``AdapterConfig`` (its JSON goes into the adapter's hash,
``weights.adapter_sha256``) and, against the base model's specs, the refusals by name. Tensors
are ``<module>.lora_A`` [r, in] and ``<module>.lora_B`` [out, r], ``<module>`` named as in the
base's weights (``<module>.weight`` [out, in]). Torch-free; both sides check with it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from oldlogit.contract.errors import InvalidRequest, WeightsMismatch

__all__ = [
    "ADAPTER_CONFIG_KEY",
    "AdapterConfig",
    "check_adapter_tensors",
    "peft_tensor_name",
]

# The safetensors ``__metadata__`` key an adapter upload carries its canonical config under.
ADAPTER_CONFIG_KEY = "adapter_config"
# The adapter dtypes (torch's names, as ``oldlogit.parity.lora.LoraSpec`` has them) and their
# safetensors names.
ADAPTER_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}
# PEFT options whose adapters are not a plain LoRA term on a linear: refused by name.
_PEFT_REFUSED = {
    "use_dora": "DoRA",
    "fan_in_fan_out": "fan_in_fan_out (Conv1D layers)",
    "modules_to_save": "modules_to_save (fully trained modules)",
    "rank_pattern": "per-module ranks (rank_pattern)",
    "alpha_pattern": "per-module alphas (alpha_pattern)",
    "layers_to_transform": "layers_to_transform",
}


def _dtype(name: object) -> str:
    s = str(name).removeprefix("torch.")
    by_st = {st: torch for torch, st in ADAPTER_DTYPES.items()}
    out = s if s in ADAPTER_DTYPES else by_st.get(s)
    if out is None:
        raise InvalidRequest(
            f"the adapter's dtype {name!r} is not one of {sorted(ADAPTER_DTYPES)}",
            parameter="adapter",
        )
    return out


@dataclass(frozen=True)
class AdapterConfig:
    """What an adapter version computes besides its tensors; the fields and canonical form of
    ``oldlogit.parity.lora.LoraSpec.as_dict``: ``target_modules`` the adapted linears' module
    names in the base's weights, sorted; ``dtype`` torch's name (``float32``); ``alpha`` a
    float."""

    rank: int
    alpha: float
    use_rslora: bool
    target_modules: tuple[str, ...]
    dtype: str

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise InvalidRequest(f"rank must be an int >= 1, got {self.rank!r}", parameter="rank")
        alpha = float(self.alpha)
        if not math.isfinite(alpha):
            raise InvalidRequest(f"alpha must be finite, got {self.alpha!r}", parameter="alpha")
        mods = tuple(sorted({str(m) for m in self.target_modules}))
        if not mods or not all(mods):
            raise InvalidRequest(
                f"target_modules must be module names, got {self.target_modules!r}",
                parameter="target_modules",
            )
        object.__setattr__(self, "alpha", alpha)
        object.__setattr__(self, "use_rslora", bool(self.use_rslora))
        object.__setattr__(self, "target_modules", mods)
        object.__setattr__(self, "dtype", _dtype(self.dtype))

    @property
    def safetensors_dtype(self) -> str:
        return ADAPTER_DTYPES[self.dtype]

    @property
    def scaling(self) -> float:
        """PEFT's scaling of the LoRA term: alpha / r, or alpha / sqrt(r) under rsLoRA."""
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["target_modules"] = list(self.target_modules)
        return d

    def to_json(self) -> str:
        """The canonical JSON (sorted keys, no spaces) the adapter's hash is over."""
        return json.dumps(self.as_dict(), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> AdapterConfig:
        want = {"rank", "alpha", "use_rslora", "target_modules", "dtype"}
        if not isinstance(d, Mapping) or set(d) != want:
            got = sorted(d) if isinstance(d, Mapping) else type(d).__name__
            raise InvalidRequest(
                f"an adapter config has exactly the keys {sorted(want)}, got {got}",
                parameter="adapter_config",
            )
        mods = d["target_modules"]
        if isinstance(mods, str) or not isinstance(mods, (list, tuple)):
            raise InvalidRequest("target_modules must be a list", parameter="target_modules")
        return cls(d["rank"], d["alpha"], d["use_rslora"], tuple(mods), d["dtype"])

    @classmethod
    def from_json(cls, raw: str) -> AdapterConfig:
        try:
            d = json.loads(raw)
        except ValueError as exc:
            raise InvalidRequest(
                f"the adapter config is not JSON: {exc}", parameter="adapter_config"
            ) from exc
        return cls.from_dict(d)

    @classmethod
    def from_peft(
        cls, peft: Mapping[str, Any], tensors: Mapping[str, tuple[str, tuple[int, ...]]]
    ) -> AdapterConfig:
        """From PEFT's ``adapter_config.json`` and the adapter's tensors (ours: names as
        ``peft_tensor_name`` gives them): options that are not a plain LoRA are refused."""
        if str(peft.get("peft_type", "LORA")).upper() != "LORA":
            raise InvalidRequest(
                f"peft_type {peft.get('peft_type')!r} is not LoRA", parameter="adapter"
            )
        if peft.get("bias", "none") != "none":
            raise InvalidRequest(
                f"bias={peft.get('bias')!r}: adapters that train biases are not served",
                parameter="adapter",
            )
        for key, what in _PEFT_REFUSED.items():
            if peft.get(key):
                raise InvalidRequest(f"{what} is not served as an adapter", parameter="adapter")
        dtypes = {dt for dt, _ in tensors.values()}
        if len(dtypes) != 1:
            raise WeightsMismatch(
                f"the adapter's tensors mix dtypes {sorted(dtypes)}", parameter="adapter"
            )
        return cls(
            int(peft["r"]),
            float(peft["lora_alpha"]),
            bool(peft.get("use_rslora", False)),
            tuple(sorted({n.rsplit(".", 1)[0] for n in tensors})),
            dtypes.pop(),
        )


def peft_tensor_name(key: str, adapter_name: str = "default") -> str:
    """Our name for a PEFT state-dict key (``base_model.model.<module>.lora_A[.<adapter>].weight``
    -> ``<module>.lora_A``); ``WeightsMismatch`` for keys that are not LoRA A/B weights."""
    name = key.removeprefix("base_model.model.")
    for ab in ("lora_A", "lora_B"):
        for tail in (f".{ab}.{adapter_name}.weight", f".{ab}.weight"):
            if name.endswith(tail):
                return name[: -len(tail)].replace(".base_layer", "") + f".{ab}"
    raise WeightsMismatch(
        f"the adapter's tensor {key!r} is not a LoRA A/B weight (embedding or DoRA adapters, "
        "and trained biases, are not served)",
        parameter="adapter",
        details={"tensor": key},
    )


def check_adapter_tensors(
    config: AdapterConfig,
    tensors: Mapping[str, tuple[str, tuple[int, ...]]],
    base_specs: Mapping[str, tuple[str, tuple[int, ...]]],
) -> list[str]:
    """The adapted modules (sorted), once every tensor fits ``config`` and the base
    (``base_specs``: the base model's ``{name: (dtype, shape)}``); ``WeightsMismatch`` naming
    the first tensor that does not."""

    def bad(name: str, why: str) -> WeightsMismatch:
        return WeightsMismatch(
            f"the adapter's tensor {name!r} {why}", parameter="adapter", details={"tensor": name}
        )

    pairs: dict[str, dict[str, tuple[str, tuple[int, ...]]]] = {}
    for name, (dtype, shape) in sorted(tensors.items()):
        module, _, ab = name.rpartition(".")
        if ab not in ("lora_A", "lora_B") or not module:
            raise bad(name, "is not named <module>.lora_A or <module>.lora_B")
        if dtype != config.safetensors_dtype:
            raise bad(name, f"is {dtype}, the config says {config.dtype}")
        if len(shape) != 2:
            raise bad(name, f"has shape {list(shape)}; LoRA factors are 2-D")
        pairs.setdefault(module, {})[ab] = (dtype, tuple(shape))
    if sorted(pairs) != list(config.target_modules):
        missing = sorted(set(config.target_modules) - set(pairs))
        extra = sorted(set(pairs) - set(config.target_modules))
        raise WeightsMismatch(
            f"the adapter's tensors and target_modules differ: no tensors for {missing[:4]}, "
            f"tensors of modules not targeted {extra[:4]}",
            parameter="adapter",
        )
    for module, both in sorted(pairs.items()):
        if set(both) != {"lora_A", "lora_B"}:
            half = ({"lora_A", "lora_B"} - set(both)).pop()
            raise bad(f"{module}.{half}", "is missing")
        (r_a, n_in), (n_out, r_b) = both["lora_A"][1], both["lora_B"][1]
        if r_a != config.rank or r_b != config.rank:
            raise bad(
                f"{module}.lora_A", f"has rank {r_a} (lora_B: {r_b}); the config says {config.rank}"
            )
        base = base_specs.get(f"{module}.weight")
        if base is None:
            raise bad(
                f"{module}.lora_A", f"adapts {module!r}, which the base model has no weight of"
            )
        if tuple(base[1]) != (n_out, n_in):
            raise bad(
                f"{module}.lora_A",
                f"makes a [{n_out}, {n_in}] update; the base's {module}.weight is {list(base[1])}",
            )
    return sorted(pairs)
