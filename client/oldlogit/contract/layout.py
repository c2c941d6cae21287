"""A model's weight layout: the canonical tensor table and the other names weights arrive under.

In: the names a trainer or a checkpoint holds (``model.state_dict()`` keys, a safetensors
header) and the service's ``WeightLayout`` (``Client.info().weight_layout()``). Out: an
``Assembly`` that says, for every canonical tensor, which input tensors make it up, in order —
or a ``WeightsMismatch`` naming the offending tensor. Names only: no tensor data, no torch.

What maps onto a canonical name (the service's ``model.named_parameters()`` without tied
duplicates, plus the persistent buffers that change the forward):
- the canonical name itself;
- a tied duplicate (``lm_head.weight`` when the head is tied to the embedding), known from
  the model's own tie table: dropped when the canonical tensor is there too, else renamed.
  A dropped duplicate must hold the canonical tensor's very bits: a trainer whose weights
  differ there does not tie them, and its logprobs are not the served model's. The callers,
  which hold the bytes, compare (``Assembly.tied``, ``check_tied``) and refuse, naming it;
- a checkpoint layout: transformers keeps mixture-of-experts weights fused
  (``mlp.experts.gate_up_proj`` [E, 2I, H]) while hub checkpoints hold one tensor per expert
  and projection (``mlp.experts.3.gate_proj.weight`` [I, H]), sometimes under other module
  names (Mixtral's ``block_sparse_moe``). A ``WeightSource`` lists those tensors in the order
  their rows make up the canonical tensor, so assembling is a concatenation of raw bytes;
- names under known wrapper prefixes (``_orig_mod.`` from torch.compile, ``module.`` from
  DDP/DataParallel, FSDP's ``_fsdp_wrapped_module.``, activation checkpointing's
  ``_checkpoint_wrapped_module.``), which are stripped;
- non-persistent buffers some checkpoints still carry (rotary ``inv_freq``): ignored.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from oldlogit.contract.errors import WeightsMismatch

__all__ = [
    "WRAPPER_PREFIXES",
    "WRAPPER_SEGMENTS",
    "Assembly",
    "WeightLayout",
    "WeightSource",
    "check_tied",
    "strip_wrappers",
]

# Prefixes a wrapper puts in front of every name, and segments wrappers insert anywhere.
WRAPPER_PREFIXES = ("_orig_mod.", "module.", "_forward_module.")
WRAPPER_SEGMENTS = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.")
_EXPERT = "{expert}"


def strip_wrappers(name: str) -> str:
    """``name`` without the wrapper prefixes and segments (see the module docstring)."""
    for segment in WRAPPER_SEGMENTS:
        name = name.replace(segment, "")
    changed = True
    while changed:
        changed = False
        for prefix in WRAPPER_PREFIXES:
            if name.startswith(prefix):
                name, changed = name[len(prefix) :], True
    return name


@dataclass(frozen=True)
class WeightSource:
    """A canonical tensor made of checkpoint tensors: its rows are, in order, those of
    ``[t.replace("{expert}", str(e)) for e in range(count) for t in templates]``.

    One template and ``count`` 1 is a plain rename. Each source tensor has the canonical
    tensor's trailing dimensions, so the canonical bytes are the sources' bytes back to back.
    """

    name: str
    templates: tuple[str, ...]
    count: int = 1

    def names(self) -> list[str]:
        if self.count == 1 and not any(_EXPERT in t for t in self.templates):
            return list(self.templates)
        return [t.replace(_EXPERT, str(e)) for e in range(self.count) for t in self.templates]

    @classmethod
    def from_names(cls, name: str, names: list[str]) -> WeightSource:
        """The most compact ``WeightSource`` that lists ``names`` (expert templates when the
        names follow the e-major, projection-minor pattern; else the names themselves)."""
        for per_expert in range(1, len(names)):
            if len(names) % per_expert:
                continue
            count = len(names) // per_expert
            if count < 2:
                break
            templates = _templates(names[:per_expert], names[per_expert : 2 * per_expert])
            if templates is not None:
                source = cls(name, templates, count)
                if source.names() == names:
                    return source
        return cls(name, tuple(names), 1)


def _templates(first: list[str], second: list[str]) -> tuple[str, ...] | None:
    """Templates with ``{expert}`` where expert 0's names differ from expert 1's by 0 → 1."""
    out = []
    for a, b in zip(first, second, strict=True):
        parts_a, parts_b = a.split("."), b.split(".")
        if len(parts_a) != len(parts_b):
            return None
        diff = [i for i, (x, y) in enumerate(zip(parts_a, parts_b, strict=True)) if x != y]
        if len(diff) != 1 or (parts_a[diff[0]], parts_b[diff[0]]) != ("0", "1"):
            return None
        parts_a[diff[0]] = _EXPERT
        out.append(".".join(parts_a))
    return tuple(out)


@dataclass(frozen=True)
class Assembly:
    """How given tensors make up a version's canonical weights.

    ``parts``: canonical name → the input names whose bytes, back to back, are that tensor
    (one name for most tensors). ``dropped``: input name → why it is not sent. ``tied``: a
    dropped tied duplicate → the input name sent for its canonical tensor, whose bits it must
    hold (``check_tied``).
    """

    parts: Mapping[str, tuple[str, ...]]
    dropped: Mapping[str, str] = field(default_factory=dict)
    tied: Mapping[str, str] = field(default_factory=dict)


def check_tied(
    assembly: Assembly, same: Callable[[str, str], bool], *, parameter: str = "weights"
) -> None:
    """Refuse weights whose tied duplicate differs from the tensor sent for it (``same(a,
    b)``: whether input tensors a and b hold the same dtype, shape and bits), naming it."""
    for duplicate, kept in assembly.tied.items():
        if not same(duplicate, kept):
            raise WeightsMismatch(
                f"the weights' {duplicate!r} differs from {kept!r}, which the served model "
                f"ties it to (one tensor): the trainer's model does not tie them, so its "
                f"logprobs are not the served model's. Serve a model whose config unties them "
                f"(tie_word_embeddings=false), or tie them in the trainer",
                parameter=parameter,
                details={"tensor": duplicate, "tied_to": kept},
            )


@dataclass(frozen=True)
class WeightLayout:
    """The canonical weights of a model (``specs``: name → (safetensors dtype, shape)) and the
    other names they may arrive under; see the module docstring."""

    specs: Mapping[str, tuple[str, tuple[int, ...]]]
    tied: Mapping[str, str] = field(default_factory=dict)  # duplicate name → canonical name
    sources: Mapping[str, WeightSource] = field(default_factory=dict)  # canonical → layout
    ignored: frozenset[str] = frozenset()  # non-persistent buffers: never weights

    def _source_index(self) -> dict[str, tuple[str, int]]:
        index: dict[str, tuple[str, int]] = {}
        for canonical, source in self.sources.items():
            for i, name in enumerate(source.names()):
                index[name] = (canonical, i)
        return index

    def check_parts(self, canonical: str, shapes: list[tuple[int, ...]], parameter: str) -> None:
        """Refuse source tensors that cannot make up ``canonical``, naming it: one tensor must
        have its shape; split ones its element count and trailing dimensions."""
        shape = tuple(self.specs[canonical][1])
        if len(shapes) == 1:
            if tuple(shapes[0]) != shape:
                raise WeightsMismatch(
                    f"the weights' tensor {canonical!r} has shape {list(shapes[0])}, the model "
                    f"expects {list(shape)}",
                    parameter=parameter,
                    details={"tensor": canonical},
                )
            return
        total = sum(math.prod(s) for s in shapes)
        tail = shape[2:] if len(shape) >= 3 else None
        if total != math.prod(shape) or (tail is not None and any(s[1:] != tail for s in shapes)):
            raise WeightsMismatch(
                f"the weights' parts of {canonical!r} have shapes {[list(s) for s in shapes[:3]]}"
                f"{'…' if len(shapes) > 3 else ''}, which do not make up its shape {list(shape)}",
                parameter=parameter,
                details={"tensor": canonical},
            )

    def assemble(
        self, names: Iterable[str], *, parameter: str = "weights", partial: bool = False
    ) -> Assembly:
        """Map input names onto the canonical tensors; refuse anything else, naming it.

        ``partial``: the names are one rank's share of the weights (a publish session's part),
        so canonical tensors may be missing; a per-expert tensor must still be whole.
        """
        given = list(names)
        index = self._source_index() if self.sources else {}
        canonical_of: dict[str, tuple[str, int]] = {}  # input name → (canonical, part index)
        claimed: dict[tuple[str, int], str] = {}  # (canonical, part index) → input name
        dropped: dict[str, str] = {}
        for raw in given:
            name = raw
            if not self._known(name, index):
                stripped = strip_wrappers(raw)
                if self._known(stripped, index):
                    name = stripped
            if name in self.specs:
                _claim(canonical_of, claimed, raw, (name, -1), parameter)
            elif name in self.tied:
                canonical_of[raw] = (self.tied[name], -2)  # resolved below
            elif name in index:
                _claim(canonical_of, claimed, raw, index[name], parameter)
            elif name in self.ignored:
                dropped[raw] = "a buffer the model computes itself"
            else:
                raise WeightsMismatch(
                    f"the weights hold tensor {raw!r}, which the model does not have",
                    parameter=parameter,
                    details={"tensor": raw},
                )
        direct = {c for c, i in canonical_of.values() if i == -1}
        by_source: dict[str, dict[int, str]] = {}
        tied_to: dict[str, str] = {}  # dropped duplicate → its canonical name
        for raw, (canonical, i) in list(canonical_of.items()):
            if i == -2:  # a tied duplicate: dropped beside its canonical tensor (same bits)
                if canonical in direct or canonical in by_source:
                    dropped[raw] = f"tied to {canonical!r}"
                    tied_to[raw] = canonical
                    del canonical_of[raw]
                    continue
                canonical_of[raw] = (canonical, -1)
                direct.add(canonical)
            elif i >= 0:
                by_source.setdefault(canonical, {})[i] = raw
        parts: dict[str, tuple[str, ...]] = {}
        for raw, (canonical, i) in canonical_of.items():
            if i < 0:
                if canonical in parts:
                    raise WeightsMismatch(
                        f"the weights hold {canonical!r} twice (as {parts[canonical][0]!r} and "
                        f"{raw!r})",
                        parameter=parameter,
                        details={"tensor": canonical},
                    )
                parts[canonical] = (raw,)
        for canonical, found in by_source.items():
            if canonical in parts:
                raise WeightsMismatch(
                    f"the weights hold {canonical!r} both whole and per expert",
                    parameter=parameter,
                    details={"tensor": canonical},
                )
            wanted = self.sources[canonical].names()
            missing = [n for i, n in enumerate(wanted) if i not in found]
            if missing:
                raise WeightsMismatch(
                    f"the weights hold part of {canonical!r} per expert but lack {missing[0]!r}"
                    + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""),
                    parameter=parameter,
                    details={"tensor": missing[0]},
                )
            parts[canonical] = tuple(found[i] for i in range(len(wanted)))
        missing = [n for n in self.specs if n not in parts]
        if missing and not partial:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise WeightsMismatch(
                f"the weights lack tensor {missing[0]!r}{more}",
                parameter=parameter,
                details={"tensor": missing[0]},
            )
        tied = {d: parts[c][0] for d, c in tied_to.items() if len(parts.get(c, ())) == 1}
        return Assembly({n: parts[n] for n in self.specs if n in parts}, dropped, tied)

    def _known(self, name: str, index: Mapping[str, tuple[str, int]]) -> bool:
        return name in self.specs or name in self.tied or name in index or name in self.ignored

    @property
    def nbytes(self) -> int:
        from oldlogit.contract.weights import DTYPE_ITEMSIZE

        return sum(math.prod(shape) * DTYPE_ITEMSIZE[dt] for dt, shape in self.specs.values())


def _claim(
    canonical_of: dict[str, tuple[str, int]],
    claimed: dict[tuple[str, int], str],
    raw: str,
    target: tuple[str, int],
    parameter: str,
) -> None:
    if target in claimed:
        raise WeightsMismatch(
            f"the weights hold {target[0]!r} twice (as {claimed[target]!r} and {raw!r})",
            parameter=parameter,
            details={"tensor": target[0]},
        )
    canonical_of[raw] = target
    claimed[target] = raw
