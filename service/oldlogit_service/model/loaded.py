"""Model skeletons and weights: one parameter-free module per deployment, weights per call.

In: an HF-format directory (config.json + safetensors). Out: a ``LoadedModel`` (the skeleton
with parameters on the meta device, real buffers, the canonical weight names/dtypes/shapes and
the names checkpoints may use instead, ``layout``). Must not hold any version's weights: every
forward gets its weights bound for the call (``oldlogit.parity.skeleton.bound_weights``), so
one skeleton serves every version. A version's weights are the model's ``state_dict()`` without
tied duplicates: its parameters and its *persistent* buffers, i.e. the buffers a checkpoint
carries and the forward reads (DeepSeek-V3's routing bias ``e_score_correction_bias``);
non-persistent buffers (rotary ``inv_freq``) are computed from the config and stay in the
skeleton. Reading checkpoints onto these names is ``checkpoints``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from oldlogit.contract.layout import WeightLayout
from oldlogit.contract.numerics import config_fields
from oldlogit.contract.types import MoeInfo
from oldlogit.parity import DEFAULT_TILE_ROWS, NumericsSpec, Profile
from oldlogit.parity.attention import config_attention_name
from oldlogit.parity.kernels import kernel_set
from oldlogit.parity.numerics import hardware_name, transformers_version
from oldlogit.parity.skeleton import buffer_digests, reference_buffers
from oldlogit_service.model.backends import (
    ModelBackend,
    TransformersBackend,
)
from oldlogit_service.model.checkpoints import layout_of

logger = logging.getLogger(__name__)

__all__ = [
    "LoadedModel",
    "ModelBackend",
    "ParamSpec",
    "TransformersBackend",
    "UnsupportedModel",
    "dtype_from_name",
    "dtype_name",
    "load_model",
    "model_from_config",
    "resolve_device",
    "safetensors_dtype_name",
    "weight_layout_info",
]

ParamSpec = tuple[str, tuple[int, ...]]  # (safetensors dtype string, shape)

_DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
}
_SAFETENSORS_NAMES: dict[torch.dtype, str] = {
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float32: "F32",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


class UnsupportedModel(RuntimeError):
    """The model directory describes an architecture oldlogit cannot serve; the message is one
    line that names it and says why (``oldlogit serve`` prints it and exits 2)."""


_MAX_POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")
_FALLBACK_MAX_POSITIONS = 1 << 20


def dtype_from_name(name: str | torch.dtype) -> torch.dtype:
    """``"bfloat16"`` → ``torch.bfloat16`` (a torch.dtype passes through)."""
    if isinstance(name, torch.dtype):
        return name
    key = name.removeprefix("torch.")
    if key not in _DTYPES:
        raise ValueError(f"unsupported dtype {name!r}: use one of {sorted(_DTYPES)}")
    return _DTYPES[key]


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` → ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def safetensors_dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` → ``"BF16"``, the dtype string safetensors headers use."""
    if dtype not in _SAFETENSORS_NAMES:
        raise ValueError(f"no safetensors name for {dtype}")
    return _SAFETENSORS_NAMES[dtype]


def resolve_device(device: str | torch.device) -> torch.device:
    """``"auto"`` is CUDA when available, else CPU; ``"cuda"`` without CUDA is refused."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    resolved = torch.device(device)
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("device 'cuda' requested but CUDA is not available: use --device cpu")
        if resolved.index is None:  # tensors report cuda:N; compare like with like
            resolved = torch.device("cuda", torch.cuda.current_device())
    return resolved


# -------------------------------------------------------------------------------- loaded model


@dataclass
class LoadedModel:
    """The deployment's model: a skeleton (no parameter memory) plus what the service reports."""

    backend: ModelBackend
    module: nn.Module  # parameters on meta, buffers on ``device``
    config: dict[str, Any]
    model_type: str
    architecture: str
    dtype: torch.dtype
    device: torch.device
    param_specs: dict[str, ParamSpec]  # canonical weight name → (safetensors dtype, shape)
    vocab_size: int
    max_positions: int
    num_parameters: int
    nbytes: int  # bytes of one version's weights in the serving dtype
    aliases: dict[str, str]  # tied duplicate name → canonical name (e.g. lm_head.weight)
    buffer_names: frozenset[str]  # non-persistent buffers: never part of a version
    layout: WeightLayout  # param_specs, aliases and the names checkpoints use instead
    attn_implementation: str | None = None  # e.g. "sdpa": part of the numerics
    # "invariant": the skeleton is patched once for its lifetime (oldlogit.parity) so that
    # every forward is batch-invariant; "hf": the unpatched transformers forward.
    profile: Profile = "hf"
    tile_rows: int | None = None
    tp_chunks: int = 0  # the tensor-parallel definition's chunk count (0: off)
    # (layer index, sliding window; 0: none) each attention layer computed with in the start-up
    # self-check (``oldlogit.parity.attention.recording_windows``); empty until then.
    windows: tuple[tuple[int, int], ...] = ()

    @property
    def dtype_name(self) -> str:
        return dtype_name(self.dtype)

    def numerics_spec(self, lm_head_fp32: bool) -> NumericsSpec:
        """What decides this deployment's bits besides weights and tokens (docs/exactness.md,
        "What parity requires"); part of every result-cache key and of ``/v1/info``."""
        return NumericsSpec(
            profile=self.profile,
            dtype=self.dtype_name,
            device_kind=self.device.type,
            tile_rows=self.tile_rows,
            threads=torch.get_num_threads() if self.device.type == "cpu" else 0,
            lm_head_fp32=lm_head_fp32,
            attention=(
                config_attention_name(self.module.config, self.dtype, self.device)
                if self.profile == "invariant" and self.device.type == "cuda"
                else self.attn_implementation or "eager"
            ),
            torch_version=torch.__version__,
            buffers=buffer_digests(reference_buffers(self.module)),
            transformers_version=transformers_version(),
            tp_chunks=self.tp_chunks,
            config=config_fields(getattr(self.module, "config", None)),
            windows=self.windows,
            hardware=hardware_name(self.device),
            kernels=kernel_set(self.device),
        )

    def moe_info(self) -> MoeInfo | None:
        """The routing a ``RoutedExperts`` record describes (``oldlogit.parity.routing``): the
        MoE layers, experts and top-k of a transformers mixture-of-experts model; else None."""
        if not isinstance(self.backend, TransformersBackend):
            return None
        from oldlogit.parity.routing import moe_layout

        layout = moe_layout(self.module)
        if layout is None:
            return None
        return MoeInfo(
            layers=list(layout.layers),
            num_experts=layout.num_experts,
            top_k=layout.top_k,
            num_hidden_layers=layout.num_hidden_layers,
        )

    def weight_dtype(self, name: str) -> torch.dtype:
        """The serving dtype of weight ``name`` (the model dtype, or float32 for the tensors
        the model keeps in float32)."""
        st = self.param_specs[name][0]
        return next(d for d, s in _SAFETENSORS_NAMES.items() if s == st)

    def head_dtype_name(self, lm_head_fp32: bool) -> str:
        return "float32" if lm_head_fp32 else self.dtype_name

    def hidden_states(
        self, weights: Mapping[str, Tensor], input_ids: Tensor, attention_mask: Tensor | None
    ) -> Tensor:
        """[B, T] → [B, T, H] through the backend (the decoder only, no head)."""
        return self.backend.hidden_states(self.module, weights, input_ids, attention_mask)

    def head(self, weights: Mapping[str, Tensor]) -> tuple[Tensor, Tensor | None]:
        return self.backend.head(self.module, weights)

    def head_logits(self, weights: Mapping[str, Tensor], hidden: Tensor, fp32: bool) -> Tensor:
        """Logits of hidden rows [C, H] → [C, V] by the model's own head path.

        A transformers model applies everything it does after its decoder (the lm_head, logit
        soft-capping, logit scaling: ``oldlogit.parity.head_logits``); other backends are a
        plain projection by ``head``. With ``fp32`` the hidden states and the head weight are
        cast to float32 before the projection.
        """
        if isinstance(self.backend, TransformersBackend):
            from oldlogit.parity.logprobs import head_logits

            # [1, C, H] → [1, C, V]
            rows = hidden.contiguous()[None]
            return head_logits(self.module, rows, weights=weights, lm_head_fp32=fp32)[0]
        from oldlogit_service.model.numerics import head_logits_chunk

        head_weight, head_bias = self.head(weights)
        return head_logits_chunk(hidden, head_weight, head_bias, fp32)


def model_from_config(
    config: Mapping[str, Any],
    *,
    dtype: str | torch.dtype = "bfloat16",
    device: str | torch.device = "auto",
    backend: ModelBackend | None = None,
    numerics: Profile = "invariant",
    tile_rows: int = DEFAULT_TILE_ROWS,
    tp_chunks: int = 0,
) -> LoadedModel:
    """Build the skeleton for ``config`` and describe it (see ``load_model``).

    ``numerics="invariant"`` patches the skeleton for good with ``oldlogit.parity``'s
    batch-invariant forward (``tile_rows`` rows per GEMM tile; ``tp_chunks`` > 0: its
    tensor-parallel definition); it needs a transformers model.
    """
    backend = backend if backend is not None else TransformersBackend()
    if numerics not in ("invariant", "hf"):
        raise ValueError(f"numerics must be 'invariant' or 'hf', got {numerics!r}")
    if numerics == "invariant" and not isinstance(backend, TransformersBackend):
        raise ValueError(
            f"the invariant numerics need a transformers model; {type(backend).__name__} "
            "serves with numerics='hf'"
        )
    torch_dtype = dtype_from_name(dtype)
    torch_device = resolve_device(device)
    config = dict(config)
    name = _architecture_name(config)
    try:
        module = backend.build(config, torch_dtype)
    except (ValueError, KeyError, TypeError, AttributeError, ImportError) as exc:
        raise UnsupportedModel(
            f"cannot serve {name}: transformers builds no causal LM from its config.json "
            f"({_one_line(exc)})"
        ) from exc
    for sub in module.modules():
        for buffer_name, buffer in list(sub._buffers.items()):
            if buffer is not None:
                sub._buffers[buffer_name] = buffer.to(torch_device)

    params = dict(module.named_parameters())  # dedups tied parameters: the canonical names
    canonical_by_id = {id(p): n for n, p in params.items()}
    aliases = {
        n: canonical_by_id[id(p)]
        for n, p in module.named_parameters(remove_duplicate=False)
        if n not in params
    }
    # A version's weights: the state dict (parameters and persistent buffers) without tied
    # duplicates, in state-dict order.
    state = {n: t for n, t in module.state_dict(keep_vars=True).items() if n not in aliases}
    persistent = frozenset(n for n in state if n not in params)
    specs: dict[str, ParamSpec] = {
        n: (safetensors_dtype_name(t.dtype), tuple(t.shape)) for n, t in state.items()
    }
    ignored = frozenset(n for n, _ in module.named_buffers() if n not in persistent)
    try:
        head_weight, _ = backend.head(module, params)
    except (TypeError, KeyError) as exc:
        raise UnsupportedModel(f"cannot serve {name}: {_one_line(exc)}") from exc
    if numerics == "invariant":
        from oldlogit.parity import patch_numerics

        try:
            # For its lifetime.
            patch_numerics(module, tile_rows=tile_rows, strict=True, tp_chunks=tp_chunks)
        except (TypeError, RuntimeError, ValueError) as exc:
            raise UnsupportedModel(
                f"cannot serve {name} with the invariant numerics: {_one_line(exc)}"
            ) from exc
    max_positions = next((int(config[k]) for k in _MAX_POSITION_KEYS if k in config), None)
    if max_positions is None:
        logger.warning("config has no max positions; assuming %d", _FALLBACK_MAX_POSITIONS)
        max_positions = _FALLBACK_MAX_POSITIONS
    architectures = config.get("architectures") or [type(module).__name__]
    return LoadedModel(
        backend=backend,
        module=module,
        config=config,
        model_type=str(config.get("model_type", type(module).__name__.lower())),
        architecture=str(architectures[0]),
        dtype=torch_dtype,
        device=torch_device,
        param_specs=specs,
        vocab_size=int(head_weight.shape[0]),
        max_positions=max_positions,
        num_parameters=sum(p.numel() for p in params.values()),
        nbytes=sum(t.numel() * t.element_size() for t in state.values()),
        aliases=aliases,
        buffer_names=ignored,
        layout=layout_of(module, specs, aliases, ignored),
        attn_implementation=getattr(getattr(module, "config", None), "_attn_implementation", None),
        profile=numerics,
        tile_rows=tile_rows if numerics == "invariant" else None,
        tp_chunks=tp_chunks if numerics == "invariant" else 0,
    )


def weight_layout_info(layout: WeightLayout) -> dict[str, Any]:
    """The ``Info`` fields that describe ``layout``
    (``oldlogit.contract.types.Info.weight_layout``)."""
    from oldlogit.contract.types import SourceInfo, TensorInfo

    return {
        "weight_specs": {
            n: TensorInfo(dtype=dt, shape=list(shape)) for n, (dt, shape) in layout.specs.items()
        },
        "tied_weights": dict(layout.tied),
        "weight_sources": {
            n: SourceInfo(templates=list(src.templates), count=src.count)
            for n, src in layout.sources.items()
        },
        "ignored_weights": sorted(layout.ignored),
    }


def _architecture_name(config: Mapping[str, Any]) -> str:
    archs = config.get("architectures") or []
    kind = f"model_type {config.get('model_type', '?')!r}"
    return f"{archs[0]} ({kind})" if archs else kind


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 200 else text[:197] + "..."


def load_model(
    model_dir: str | Path,
    *,
    dtype: str | torch.dtype = "bfloat16",
    device: str | torch.device = "auto",
    backend: ModelBackend | None = None,
    numerics: Profile = "invariant",
    tile_rows: int = DEFAULT_TILE_ROWS,
    tp_chunks: int = 0,
) -> LoadedModel:
    """The skeleton for an HF-format directory's config.json (weights are not read here)."""
    config_path = Path(model_dir) / "config.json"
    if not config_path.is_file():
        raise UnsupportedModel(f"{config_path} not found: --model needs an HF-format directory")
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError) as exc:
        raise UnsupportedModel(f"{config_path} is not readable JSON: {_one_line(exc)}") from exc
    if not isinstance(config, dict):
        raise UnsupportedModel(f"{config_path} does not hold a JSON object")
    loaded = model_from_config(
        config,
        dtype=dtype,
        device=device,
        backend=backend,
        numerics=numerics,
        tile_rows=tile_rows,
        tp_chunks=tp_chunks,
    )
    logger.info(
        "model %s (%s): %d parameters, %s on %s, %s numerics",
        loaded.architecture,
        loaded.model_type,
        loaded.num_parameters,
        loaded.dtype_name,
        loaded.device,
        loaded.profile,
    )
    return loaded
