"""What a batch-invariant forward's numbers depend on, written down without torch.

In: settings a trainer or a service runs with. Out: a ``NumericsSpec`` whose ``key`` names the
numerics in cache keys and ``/v1/info``, and ``mismatches`` that say which setting two sides
disagree on. Imported by the torch-free client; never imports torch.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from typing import Any, Literal

__all__ = [
    "BUFFER_CONVENTION",
    "CONFIG_FIELDS",
    "DEFAULT_TILE_ROWS",
    "DEFAULT_TP_CHUNKS",
    "NUMERICS_REVISION",
    "PROFILES",
    "NumericsMismatch",
    "NumericsSpec",
    "Profile",
    "SamplingParams",
    "config_fields",
]

# Rows per GEMM tile in the invariant profile. Part of the numerics: a trainer and the service
# must use the same value (changing it changes last bits). 64 rows keep short sequences cheap on
# CPU (padding a sequence costs at most 63 rows per matmul) and measured as fast as one plain
# GEMM for float32 (docs/exactness.md).
DEFAULT_TILE_ROWS = 64

# The tensor-parallel definition's chunk count (``NumericsSpec.tp_chunks``): a row-parallel
# matmul's reduction dimension, and the head's vocabulary, are cut into this many chunks whose
# float32 partial results are combined in one fixed binary-tree order, so the bits are the same
# at every tensor-parallel degree that divides it (1, 2, 4 and 8 for 8). Part of the numerics:
# a trainer and the service must use the same count (docs/exactness.md, "Tensor parallelism").
DEFAULT_TP_CHUNKS = 8

# Bumped whenever oldlogit changes the bits it computes for the same settings (a kernel, an op's
# blocking, the order of a reduction). Part of the numerics: a trainer and a service on
# different revisions may disagree in last bits, and result caches keyed on another revision
# are never read. 3: on a GPU, reductions over the last dimension in fixed row blocks,
# attention operands as fresh copies and cuDNN's attention kernel off (CPU bits unchanged).
# 4: the CUDA definition's kernels (``NumericsSpec.kernels``): one GEMM per linear over all rows
# (cuBLASLt where probed row-invariant, else Triton), Triton row kernels for sums, means,
# RMSNorm and the head's processing (CPU bits unchanged).
NUMERICS_REVISION = 4

# How the service gets the floating buffers a forward reads that are not weights (rotary
# ``inv_freq``, embedding scales): built from the config at the serving dtype by transformers'
# own constructors, never cast afterwards (``skeleton.py``). Reported in /v1/info; a trainer
# under ``trainer_numerics`` computes with the same values.
BUFFER_CONVENTION = "config"

# Model config fields that decide a forward's bits beyond its weights and buffers, as scalars
# every supported transformers release writes the same way (a trainer whose config says another
# ``rms_norm_eps`` or soft-cap computes another function). Rotary settings are covered by the
# buffers they build. Sliding windows and layer types are left out, as releases spell their
# defaults differently: the windows each layer computes with are compared instead
# (``NumericsSpec.windows``).
CONFIG_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "tie_word_embeddings",
    "hidden_act",
    "hidden_activation",
    "rms_norm_eps",
    "layer_norm_eps",
    "attention_bias",
    "mlp_bias",
    "attn_logit_softcapping",
    "final_logit_softcapping",
    "query_pre_attn_scalar",
    "logit_scale",
    "logits_scaling",
    "embedding_multiplier",
    "residual_multiplier",
    "attention_multiplier",
    "num_experts_per_tok",
    "norm_topk_prob",
    "routed_scaling_factor",
    "n_group",
    "topk_group",
)


def config_fields(config: Any) -> tuple[tuple[str, str], ...]:
    """``CONFIG_FIELDS`` of a transformers config (its text part), name → JSON value; fields
    the config does not set are left out."""
    if config is None:
        return ()
    text = getattr(config, "get_text_config", None)
    cfg = text() if callable(text) else config
    out = []
    for name in CONFIG_FIELDS:
        value = getattr(cfg, name, None)
        if value is not None:
            out.append((name, json.dumps(value, sort_keys=True, default=str)))
    return tuple(out)


Profile = Literal["invariant", "hf"]
PROFILES: tuple[Profile, ...] = ("invariant", "hf")


class NumericsMismatch(ValueError):
    """Two sides run different numerics, so their logprobs cannot be bitwise equal."""


@dataclass(frozen=True)
class SamplingParams:
    """The sampler's settings. ``temperature=1, top_k=0, top_p=1`` is the raw distribution.

    ``top_k=0`` (or ≥ vocab) and ``top_p>=1`` switch the filter off. The service validates
    ranges at its edge; here they are only asserted.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    @property
    def is_raw(self) -> bool:
        return self.temperature == 1.0 and self.top_k <= 0 and self.top_p >= 1.0


@dataclass(frozen=True)
class NumericsSpec:
    """Everything besides weights and tokens that decides a logprob's bits.

    ``profile``: ``invariant`` (fixed-shape tiles, per-sequence attention: one forward for
    trainer and service) or ``hf`` (the unpatched HF forward of the sequence alone).
    ``tile_rows`` is None for ``hf``. ``threads`` is the CPU intra-op thread count (on CUDA it
    does not enter the numerics and is reported as 0). ``revision`` is oldlogit's numerics
    revision (0: unknown, an older service); ``torch_version`` the torch build computing them
    ("": unknown) — kernels change between builds. ``tp_chunks`` (0: off) selects the
    tensor-parallel definition (``oldlogit.parity.tensor_parallel``): the same bits at any
    tensor-parallel degree dividing it, and on CPU at any thread count (each GEMM shape is
    checked against one thread at first use), so ``threads`` is then reported, not compared.
    """

    profile: Profile
    dtype: str  # "bfloat16" | "float16" | "float32"
    device_kind: str  # "cpu" | "cuda"
    tile_rows: int | None
    threads: int
    lm_head_fp32: bool
    attention: str = ""  # the attention kernel, e.g. "oldlogit_invariant/sdpa" or "sdpa"
    revision: int = NUMERICS_REVISION
    torch_version: str = ""
    buffers: tuple[tuple[str, str], ...] = ()
    transformers_version: str = ""
    tp_chunks: int = 0
    config: tuple[tuple[str, str], ...] = ()  # ``config_fields`` of the model
    # (layer index, the sliding window its attention computes with; 0: none), as the service's
    # model ran them (recorded at its start-up; empty: unknown). Not compared up front: a
    # trainer's attention calls are held to them wherever the two would differ for a forward's
    # lengths (``oldlogit.parity.attention.expecting_windows``).
    windows: tuple[tuple[int, int], ...] = ()
    # The processor the kernels were picked for ("": unknown, an older service): on CPU the
    # instruction set ATen's kernels use (AVX2 and AVX-512 give other bits, measured), on CUDA
    # the GPU's name and compute capability (cuBLAS picks kernels per architecture).
    hardware: str = ""
    # The kernel set computing the forward ("": unknown, an older service): "cpu/tiles", or the
    # CUDA definition's — one GEMM per linear (cuBLASLt where a probe seeded from the shape
    # shows its rows invariant, else the named Triton GEMM), Triton row kernels, and the
    # library versions the GEMM choice depends on (oldlogit.parity.kernels.kernel_set).
    kernels: str = ""

    @property
    def key(self) -> str:
        """One string naming these numerics (result-cache keys, logs)."""
        tiles = f"tile={self.tile_rows}" if self.tile_rows else "tile=-"
        head = "head=float32" if self.lm_head_fp32 else f"head={self.dtype}"
        buffers = (
            hashlib.sha256(repr(self.buffers).encode()).hexdigest()[:12] if self.buffers else "-"
        )
        return (
            f"{self.profile}/{self.dtype}/{self.device_kind}/{tiles}/threads={self.threads}/"
            f"{head}/{self.attention or '-'}/rev={self.revision}/torch={self.torch_version or '-'}"
            f"/tf={self.transformers_version or '-'}/buffers={buffers}"
            + (f"/tp_chunks={self.tp_chunks}" if self.tp_chunks else "")
            + (f"/hw={self.hardware}" if self.hardware else "")
            + (f"/kernels={self.kernels}" if self.kernels else "")
        )

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def mismatches(self, other: NumericsSpec) -> list[str]:
        """The settings in which ``other`` differs from this spec, as readable sentences.

        The attention name is not compared: it is derived from the profile on both sides.
        """
        out = []
        for name in ("profile", "dtype", "device_kind", "tile_rows", "lm_head_fp32", "tp_chunks"):
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine != theirs:
                out.append(f"{name}: {mine!r} here, {theirs!r} there")
        if self.revision != other.revision:
            out.append(
                f"numerics revision: {self.revision} here, {other.revision} there (oldlogit "
                "releases with different numerics: run the same release on both sides)"
            )
        if self.torch_version and other.torch_version and self.torch_version != other.torch_version:
            out.append(f"torch: {self.torch_version} here, {other.torch_version} there")
        if self.hardware and other.hardware and self.hardware != other.hardware:
            out.append(
                f"hardware: {self.hardware} here, {other.hardware} there (kernels are picked "
                "per processor: run the trainer's forward on the service's kind)"
            )
        if self.kernels and other.kernels and self.kernels != other.kernels:
            out.append(
                f"kernels: {self.kernels} here, {other.kernels} there (another kernel set or "
                "library build computes other bits: run both sides on the same one)"
            )
        cpu = self.device_kind == "cpu" and other.device_kind == "cpu"
        thread_free = self.tp_chunks > 0 and other.tp_chunks > 0
        if cpu and not thread_free and self.threads != other.threads:
            out.append(
                f"threads: {self.threads} here, {other.threads} there (CPU kernels may split "
                f"their work by thread count: torch.set_num_threads({other.threads}) for the "
                "scoring calls, or OMP_NUM_THREADS for the service)"
            )
        if self.buffers and other.buffers:
            out += _map_mismatches("buffer", self.buffers, other.buffers, "absent")
        if self.config and other.config:
            # A field one side sets and the other leaves unset (a soft-cap switched off with
            # None) is a difference too; every supported release sets the same fields
            # (tests/integration/test_parity_oldest_transformers.py).
            out += _map_mismatches("config", self.config, other.config, "unset")
        return out


def _map_mismatches(
    label: str,
    mine: tuple[tuple[str, str], ...],
    theirs: tuple[tuple[str, str], ...],
    missing: str,
) -> list[str]:
    """'label name: value here, value there' for each name either side holds differently."""
    a, b = dict(mine), dict(theirs)
    return [
        f"{label} {name}: {a.get(name, missing)} here, {b.get(name, missing)} there"
        for name in sorted(set(a) | set(b))
        if a.get(name, missing) != b.get(name, missing)
    ]
