"""Checkpoint layouts and weight loading: a directory's tensors onto the model's canonical names.

In: a model skeleton (``LoadedModel``) and tensors under any name the model's
``WeightLayout`` accepts (``oldlogit.contract.layout``: canonical, tied duplicates, hub checkpoint
layouts such as one tensor per expert, wrapper prefixes). Out: the canonical weights,
contiguous, in ``param_specs`` order — or ``WeightsMismatch`` naming the tensor.

``derive_sources`` learns a model's checkpoint layouts from transformers itself: it runs
transformers' save-side conversion (``revert_weight_conversion``, the inverse of what
``from_pretrained`` applies) on small tag tensors whose values say which canonical row they
are, and reads off which checkpoint tensor holds which rows. Only layouts that are a
reordering of whole rows are kept (stacked experts, concatenated gate/up projections,
renames); anything else is left out, and such a checkpoint is refused by name.
"""

from __future__ import annotations

import json
import logging
import math
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open
from torch import Tensor, nn

from oldlogit.contract.errors import WeightsMismatch
from oldlogit.contract.layout import WeightLayout, WeightSource

if TYPE_CHECKING:
    from oldlogit_service.model.loaded import LoadedModel

logger = logging.getLogger(__name__)

__all__ = [
    "canonical_file",
    "canonicalize_weights",
    "derive_sources",
    "layout_of",
    "load_weights",
    "weight_files",
]

# A 2-D tensor above this many elements gets a [rows, 1] tag (conversions move whole rows of
# big matrices); smaller ones are tagged whole, so e.g. stacked expert biases are followed.
_FULL_TAG_ELEMENTS = 1 << 20


def _tag_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    if len(shape) >= 3:
        return (shape[0], shape[1], *([1] * (len(shape) - 2)))
    if len(shape) == 2 and shape[0] * shape[1] > _FULL_TAG_ELEMENTS:
        return (shape[0], 1)
    return shape


def derive_sources(
    module: nn.Module, specs: Mapping[str, tuple[str, tuple[int, ...]]]
) -> dict[str, WeightSource]:
    """Canonical name → ``WeightSource`` for every tensor a hub checkpoint holds differently
    (renamed or split); see the module docstring. Empty when transformers knows no
    conversion for this model or its conversion is not a reordering of rows."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # pragma: no cover - transformers without checkpoint conversions
        return {}
    offsets: list[tuple[int, int, str, tuple[int, ...]]] = []  # (start, rows, name, tag shape)
    tags: dict[str, Tensor] = {}
    total = 0
    for name, (_, shape) in specs.items():
        tshape = _tag_shape(shape)
        rows = math.prod(tshape)
        offsets.append((total, rows, name, tshape))
        tags[name] = (torch.arange(rows, dtype=torch.float64) + total).reshape(tshape)
        total += rows
    try:
        revert: Any = revert_weight_conversion  # untyped: wants a PreTrainedModel
        reverted: Mapping[str, Tensor] = revert(module, dict(tags))
    except Exception as exc:  # a conversion that does not work on row tags
        logger.warning("no checkpoint layouts for %s: %s", type(module).__name__, exc)
        return {}
    starts = torch.tensor([o[0] for o in offsets], dtype=torch.float64)
    pieces: dict[str, list[tuple[int, str]]] = {}  # canonical → [(first row, source name)]
    unusable: set[str] = set()
    for source_name, tag in reverted.items():
        flat = tag.detach().reshape(-1)
        if flat.numel() == 0:
            continue
        first = float(flat[0])
        i = int(torch.searchsorted(starts, torch.tensor([first]), right=True)[0]) - 1
        start, rows, name, tshape = offsets[i]
        trailing = tshape[2:] if len(tshape) >= 3 else ()
        contiguous = bool(
            torch.equal(flat, torch.arange(first, first + flat.numel(), dtype=torch.float64))
        )
        inside = first - start + flat.numel() <= rows
        shape_ok = not trailing or tuple(tag.shape[-len(trailing) :]) == trailing
        if not (contiguous and inside and shape_ok) or tag.dtype != torch.float64:
            unusable.add(name)
            continue
        pieces.setdefault(name, []).append((int(first - start), source_name))
    out: dict[str, WeightSource] = {}
    for name, found in pieces.items():
        found.sort()
        names = [n for _, n in found]
        if name in unusable or names == [name]:
            continue
        out[name] = WeightSource.from_names(name, names)
    return out


def canonicalize_weights(
    model: LoadedModel, tensors: Mapping[str, Tensor], *, cast: bool = True
) -> dict[str, Tensor]:
    """Map a checkpoint's tensors onto the canonical names, checked against ``param_specs``.

    Accepts every name ``model.layout`` does (tied duplicates are dropped, never compared: a
    checkpoint the model is served from is tied on loading, as transformers ties it;
    per-expert tensors are stacked into the fused tensor; wrapper prefixes are stripped;
    saved non-persistent buffers are ignored). Missing or unexpected names and wrong shapes
    raise ``WeightsMismatch`` naming the tensor. With ``cast`` tensors are cast to the
    tensor's serving dtype, else a dtype difference is refused too. The result is
    contiguous, on the tensors' own device, in ``param_specs`` order.
    """
    assembly = model.layout.assemble(tensors)
    out: dict[str, Tensor] = {}
    for name, (st_dtype, shape) in model.param_specs.items():
        parts = [tensors[p] for p in assembly.parts[name]]
        model.layout.check_parts(name, [tuple(p.shape) for p in parts], "weights")
        if len(parts) == 1:
            tensor = parts[0].reshape(shape)
        else:
            tensor = torch.cat([p.reshape(-1) for p in parts]).reshape(shape)
        want = _torch_dtype(st_dtype)
        if tensor.dtype != want:
            if not cast:
                raise WeightsMismatch(
                    f"tensor {name!r} has dtype {str(tensor.dtype).removeprefix('torch.')}, "
                    f"the model serves {str(want).removeprefix('torch.')}",
                    parameter="weights",
                    details={"tensor": name},
                )
            tensor = tensor.to(want)
        out[name] = tensor.contiguous()
    return out


def _torch_dtype(st_dtype: str) -> torch.dtype:
    from oldlogit.contract.weights import torch_dtype

    return torch_dtype(st_dtype)


def weight_files(model_dir: Path) -> list[Path]:
    """The safetensors files of an HF-format directory (index, single file or any shards)."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        return [model_dir / f for f in sorted(set(weight_map.values()))]
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    return sorted(model_dir.glob("*.safetensors"))


def load_weights(model_dir: str | Path, model: LoadedModel) -> dict[str, Tensor] | None:
    """The directory's safetensors weights (one file or sharded), canonical and cast to the
    serving dtype, on CPU; None when the directory holds no safetensors weights."""
    model_dir = Path(model_dir)
    files = weight_files(model_dir)
    if not files:
        if any(model_dir.glob("*.bin")):
            logger.warning("%s holds only .bin weights; oldlogit reads safetensors", model_dir)
        return None
    tensors: dict[str, Tensor] = {}
    for path in files:
        if not path.is_file():
            raise WeightsMismatch(
                f"weight file {path.name} listed in the index is missing", parameter="weights"
            )
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                if name in tensors:
                    raise WeightsMismatch(
                        f"tensor {name!r} appears in more than one shard",
                        parameter="weights",
                        details={"tensor": name},
                    )
                tensors[name] = f.get_tensor(name)
    logger.info("read %d tensors from %d file(s) in %s", len(tensors), len(files), model_dir)
    return canonicalize_weights(model, tensors, cast=True)


def layout_of(
    module: nn.Module,
    specs: Mapping[str, tuple[str, tuple[int, ...]]],
    aliases: Mapping[str, str],
    ignored: frozenset[str],
) -> WeightLayout:
    """The model's ``WeightLayout`` (see ``oldlogit.contract.layout``)."""
    return WeightLayout(
        specs=dict(specs),
        tied=dict(aliases),
        sources=derive_sources(module, specs),
        ignored=ignored,
    )


def canonical_file(path: Path, layout: WeightLayout, staging: Path) -> Path | None:
    """A safetensors file or shard directory under other names (a hub checkpoint's
    per-expert tensors, tied duplicates, wrapper prefixes) rewritten under the canonical names
    into ``staging`` — tensors streamed back to back, never loaded — or None when its names
    are canonical already. Refuses what the layout cannot map, naming the tensor."""
    from oldlogit.contract.safetensors import SafetensorsStream
    from oldlogit.contract.weights import shard_headers

    where, _ = shard_headers(path)
    if set(where) == set(layout.specs):
        return None
    stream = SafetensorsStream.from_path(path, layout)
    out = staging / f"canonical-{uuid.uuid4().hex}.safetensors.part"
    try:
        with open(out, "wb") as f:
            for chunk in stream.chunks():
                f.write(chunk)
    except BaseException:
        out.unlink(missing_ok=True)
        raise
    return out
