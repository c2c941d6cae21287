"""Contract types: what a request and a response *mean*, shared by server and client.

Arrays are numpy (token ids int64, logprobs float32). A ``SequenceResult`` holds the full-length
array (NaN where not scored, always at position 0); on the wire only the scored values travel
(see ``scored_mask``), and ``wire`` / the proto converters (``convert``) put them back in place.
These types check only shapes and types; the service's ``validate`` stage checks meaning and
raises errors from ``errors`` that name the parameter.
"""

from __future__ import annotations

import math
import numbers
import re
from typing import Annotated, Any, Literal

import numpy as np
import numpy.typing as npt
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    WithJsonSchema,
    model_validator,
)

from oldlogit.contract.errors import InvalidRequest
from oldlogit.contract.layout import WeightLayout, WeightSource
from oldlogit.contract.numerics import NumericsSpec

__all__ = [
    "FloatArray",
    "Info",
    "IntArray",
    "LeaseInfo",
    "LogprobsRequest",
    "LogprobsResponse",
    "MoeInfo",
    "OpenSession",
    "PublishResult",
    "RankInfo",
    "RoutedExperts",
    "RoutingIds",
    "Sampling",
    "Sequence",
    "SequenceResult",
    "SessionInfo",
    "SourceInfo",
    "TensorInfo",
    "Trace",
    "TraceRequest",
    "TraceStageInfo",
    "VersionInfo",
    "scored_mask",
]

NOT_SCORED = -1  # the per-token version that means "not scored" (typically the prompt)
MAX_VERSION = 2**63 - 1  # the largest policy version: versions travel as int64 (gRPC, msgpack)
SHA256_HEX = re.compile(r"[0-9a-fA-F]{64}")


def check_version(version: object, parameter: str = "policy_version") -> int:
    """A policy version as an int in [0, 2**63 - 1] (int64 on every wire), or ``InvalidRequest``
    naming ``parameter``."""
    if (
        isinstance(version, bool)
        or not isinstance(version, numbers.Integral)
        or not 0 <= int(version) <= MAX_VERSION
    ):
        raise InvalidRequest(
            f"{parameter} must be an integer in [0, 2**63 - 1], got {version!r}",
            parameter=parameter,
        )
    return int(version)


def _as_int_array(value: Any) -> npt.NDArray[np.int64]:
    # Validators may only raise ValueError (pydantic turns it into a validation error that
    # names the field); anything else would surface as a 500.
    try:
        return _to_int_array(value)
    except ValueError:
        raise
    except Exception as exc:
        raise ValueError(f"expected a list of integers ({type(exc).__name__})") from exc


def _to_int_array(value: Any) -> npt.NDArray[np.int64]:
    if isinstance(value, np.ndarray):
        arr = value
    elif hasattr(value, "detach") and hasattr(
        value, "cpu"
    ):  # a torch tensor, without importing torch
        arr = value.detach().cpu().numpy()
    else:
        if value is None or isinstance(value, (str, bytes, dict, int, float)):
            raise ValueError("expected a list of integers")
        items = list(value)
        if any(isinstance(x, bool) or not isinstance(x, (int, np.integer)) for x in items):
            raise ValueError("expected a list of integers")
        arr = np.asarray(items) if items else np.zeros(0, dtype=np.int64)
    if arr.ndim != 1:
        raise ValueError(f"expected a 1-D array of integers, got shape {tuple(arr.shape)}")
    if (
        arr.size
        and arr.dtype.kind not in "iu"
        and (arr.dtype.kind != "f" or not np.all(np.isfinite(arr) & (arr == np.round(arr))))
    ):
        raise ValueError("expected integers")
    if arr.size and arr.dtype == object:
        raise ValueError("integer out of range")
    lim = np.iinfo(np.int64)
    if arr.size and (arr.max() > lim.max or arr.min() < lim.min):
        raise ValueError("integer out of range")
    return np.ascontiguousarray(arr, dtype=np.int64)


def _as_float_array(value: Any) -> npt.NDArray[np.float32]:
    try:
        if isinstance(value, np.ndarray):
            arr = value
        elif hasattr(value, "detach") and hasattr(value, "cpu"):
            arr = value.detach().cpu().float().numpy()
        else:
            if value is None or isinstance(value, (str, bytes, dict)):
                raise ValueError("expected a list of numbers")
            arr = np.asarray([_float_from_wire(v) for v in value], dtype=np.float32)
    except ValueError:
        raise
    except Exception as exc:
        raise ValueError(f"expected a list of numbers ({type(exc).__name__})") from exc
    if arr.ndim != 1:
        raise ValueError(f"expected a 1-D array of floats, got shape {tuple(arr.shape)}")
    return np.ascontiguousarray(arr, dtype=np.float32)


def _float_from_wire(v: Any) -> float:
    # JSON has no infinity: the documented encoding of −inf is the string "-inf" (also "inf",
    # "nan" for completeness).
    if isinstance(v, str):
        return float(v)
    if v is None:
        return float("nan")
    return float(v)


def _float_to_json(v: float) -> float | str:
    if np.isfinite(v):
        return float(v)
    if np.isnan(v):
        return "nan"
    return "-inf" if v < 0 else "inf"


IntArray = Annotated[
    npt.NDArray[np.int64],
    BeforeValidator(_as_int_array),
    PlainSerializer(lambda a: [int(x) for x in a.tolist()], return_type=list[int]),
    WithJsonSchema({"type": "array", "items": {"type": "integer"}}),
]
FloatArray = Annotated[
    npt.NDArray[np.float32],
    BeforeValidator(_as_float_array),
    PlainSerializer(lambda a: [_float_to_json(x) for x in a.tolist()], return_type=list[Any]),
    WithJsonSchema(
        {
            "type": "array",
            "items": {"anyOf": [{"type": "number"}, {"enum": ["-inf", "inf", "nan"]}]},
            "description": 'float32 values; JSON has no infinity, so -inf is the string "-inf"',
        }
    ),
]


def _as_routing_ids(value: Any) -> npt.NDArray[np.int32]:
    try:
        if isinstance(value, np.ndarray):
            arr = value
        elif hasattr(value, "detach") and hasattr(value, "cpu"):  # a torch tensor
            arr = value.detach().cpu().numpy()
        else:
            if value is None or isinstance(value, (str, bytes, dict, int, float)):
                raise ValueError("expected nested lists of integers [rows, layers, top_k]")
            arr = np.asarray(value)
            if arr.size == 0:
                arr = arr.astype(np.int64)
    except ValueError:
        raise
    except Exception as exc:
        raise ValueError(f"expected nested lists of integers ({type(exc).__name__})") from exc
    if arr.ndim == 1 and arr.size == 0:  # no rows (JSON's [] carries no inner shape)
        arr = arr.reshape(0, 0, 0)
    if arr.ndim != 3:
        raise ValueError(f"expected [rows, layers, top_k] integers, got shape {tuple(arr.shape)}")
    if arr.size and arr.dtype.kind not in "iu":
        raise ValueError(f"expected integers, got {arr.dtype}")
    lim = np.iinfo(np.int32)
    if arr.size and (int(arr.max()) > lim.max or int(arr.min()) < lim.min):
        raise ValueError("expert id out of the int32 range")
    return np.ascontiguousarray(arr, dtype=np.int32)


RoutingIds = Annotated[
    npt.NDArray[np.int32],
    BeforeValidator(_as_routing_ids),
    PlainSerializer(lambda a: a.tolist(), return_type=list[Any]),
    WithJsonSchema(
        {
            "type": "array",
            "items": {"type": "array", "items": {"type": "array", "items": {"type": "integer"}}},
            "description": "[rows, MoE layers, top_k] expert ids; a row of -1: no record",
        }
    ),
]


class _Model(BaseModel):
    model_config = ConfigDict(arbitrary_types_allowed=True, extra="forbid")


class Sampling(_Model):
    """The sampler's settings: logprobs are of the distribution the sampler drew from.

    ``temperature=1, top_k=0, top_p=1`` is the raw distribution.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0


class RoutedExperts(_Model):
    """A MoE routing record (``oldlogit.contract.routing``; docs/exactness.md, "Routing
    replay"): ``ids[r, j]`` are the top_k expert ids MoE layer j (the model's MoE layers in
    decoder order, ``Info.moe.layers``) chose when the forward processed the token at position
    ``start + r``. A row of all −1 has no record: that position routes freely. Shapes and
    types only here; the service's ``validate`` checks the meaning against the model."""

    ids: RoutingIds
    start: int = Field(default=0, ge=0)


class Sequence(_Model):
    """One sequence to score.

    Either ``policy_version`` (+ ``score_from``, default 1: positions ≥ score_from are scored
    with that version) or ``versions`` (one per token, −1 = not scored). Position 0 is never
    scored. ``sampling`` overrides the request's sampling for this sequence.
    ``routed_experts`` (MoE models): the experts each position's forward is sent to (its rows
    end at position n − 2 or n − 1; −1 rows and positions before its ``start`` route freely),
    the same record for every version the sequence is scored with.
    """

    token_ids: IntArray
    policy_version: int | None = None
    score_from: int | None = None
    versions: IntArray | None = None
    sampling: Sampling | None = None
    routed_experts: RoutedExperts | None = None

    def scored_mask(self) -> npt.NDArray[np.bool_]:
        return scored_mask(len(self.token_ids), self.policy_version, self.score_from, self.versions)

    def per_token_versions(self) -> npt.NDArray[np.int64]:
        """The versions array this sequence stands for (−1 where not scored)."""
        n = len(self.token_ids)
        if self.versions is not None:
            out = self.versions.copy()
            if n:
                out[0] = NOT_SCORED
            return out
        out = np.full(n, NOT_SCORED, dtype=np.int64)
        if self.policy_version is not None:
            out[max(1, self.score_from if self.score_from is not None else 1) :] = (
                self.policy_version
            )
        return out


def scored_mask(
    n: int,
    policy_version: int | None,
    score_from: int | None,
    versions: npt.NDArray[np.int64] | None,
) -> npt.NDArray[np.bool_]:
    """Which positions of an n-token sequence are scored (and travel on the wire).

    Shared by server and client so both agree which values the compact wire array holds.
    """
    if versions is not None:
        mask = np.asarray(versions[:n]) >= 0
        mask = np.pad(mask, (0, max(0, n - len(mask))))
    else:
        mask = np.zeros(n, dtype=bool)
        if policy_version is not None:
            start = max(1, score_from if score_from is not None else 1)
            mask[start:] = True
    if n:
        mask[0] = False
    return mask


class LogprobsRequest(_Model):
    sequences: list[Sequence]
    sampling: Sampling = Field(default_factory=Sampling)
    proxy: Literal["ewma"] | None = None  # serve the approximate EWMA proxy (never exact)
    allow_inexact: bool = False  # fall back to an approximation when the version is gone
    use_cache: bool = True
    timeout_s: float | None = None  # server-side deadline; clients set it from their timeout
    # MoE models: return the routing each (sequence, version) forward used, for replay (R2).
    return_routing: bool = False


class SequenceResult(_Model):
    logprobs: FloatArray  # [n] float32; NaN where not scored (always at 0), −inf outside support
    versions: list[int]  # distinct versions used, ascending
    weight_sha256: dict[int, str]  # version → weight sha256 it was computed with
    exact: bool = True
    cached: bool = False
    # With ``return_routing``: one record per entry of ``versions`` (that version's forward),
    # rows 0 … n − 2 (start 0): the routing the scored logprobs depend on.
    routed_experts: list[RoutedExperts] | None = None


class LogprobsResponse(_Model):
    results: list[SequenceResult]


class TraceRequest(_Model):
    """One sequence to trace at one version (``Client.trace``, ``POST /v1/trace``).

    The service runs ``oldlogit.parity.trace.forward_trace`` on ``token_ids`` alone with the
    version's weights and the sampler's settings (applied by the final logprobs stage). The
    service checks the meaning: 2 to min(``MAX_TRACE_TOKENS``, max_seq_len) tokens in the
    vocabulary, a known version, sampling as for logprobs.
    """

    token_ids: IntArray
    policy_version: int
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def sampling(self) -> Sampling:
        return Sampling(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p)


class TraceStageInfo(_Model):
    """One stage of a forward, digested (``oldlogit.parity.trace.TraceStage`` on the wire)."""

    name: str  # the module path, e.g. "model.layers.1.mlp", or "logprobs"
    dtype: str  # of its (first) output tensor, e.g. "bfloat16"
    shape: list[int] = Field(default_factory=list)  # of its (first) output tensor
    sha256: str  # over dtype, shape and raw bytes of every tensor it output
    total: float  # float64 sum of the finite values
    absmax: float  # max |x| over the finite values


class Trace(_Model):
    """The stages of one forward at a version, in the order it ran them: compare with a
    trainer's ``forward_trace`` (``oldlogit.parity.trace.first_divergence``)."""

    policy_version: int
    weight_sha256: str  # the weights the forward ran with
    numerics: str  # the service's numerics key (``NumericsSpec.key``)
    stages: list[TraceStageInfo] = Field(default_factory=list)


class VersionInfo(_Model):
    policy_version: int
    weight_sha256: str
    nbytes: int  # bytes of the full weights in the serving dtype (an adapter: its tensors')
    tiers: list[str]  # where it is resident now: "device", "host", "disk"
    kind: str = "keyframe"  # "keyframe", "patch" (docs/delta-snapshots.md) or "adapter"
    parent: int | None = None
    leases: int = 0
    created_at: float = 0.0  # unix seconds of the publish
    adapter_of: int | None = None  # an adapter version's base version


class PublishResult(_Model):
    policy_version: int
    weight_sha256: str
    created: bool  # False when it was an idempotent re-publish of the same weights
    nbytes: int = 0
    kind: str = "keyframe"


class LeaseInfo(_Model):
    lease_id: str
    policy_version: int
    holder: str
    ttl_s: float
    expires_at: float  # unix seconds


SESSION_ID = re.compile(r"[A-Za-z0-9_-]{8,64}")
MAX_SESSION_MEMBERS = 4096
MAX_SESSION_TTL_S = 86400.0


class OpenSession(_Model):
    """Opens a multi-rank publish session (docs/multi-rank-publishing.md).

    Checked once, here, wherever it is made (the client, the HTTP body, the gRPC message): a
    bad field raises ``InvalidRequest`` naming it.
    """

    session_id: str
    policy_version: int
    members: int
    delta: bool = False
    parent: int | None = None
    sha256: str | None = None  # the whole version's hash, if the caller knows it
    ttl_s: float | None = None  # idle seconds before the session is aborted (default 600)

    @model_validator(mode="after")
    def _check(self) -> OpenSession:
        if not SESSION_ID.fullmatch(self.session_id):
            raise InvalidRequest(
                "session_id must be 8-64 characters of A-Z a-z 0-9 _ -", parameter="session_id"
            )
        check_version(self.policy_version)
        if self.parent is not None:
            check_version(self.parent, "parent")
        if not 1 <= self.members <= MAX_SESSION_MEMBERS:
            raise InvalidRequest(
                f"members must be in [1, {MAX_SESSION_MEMBERS}]", parameter="members"
            )
        if self.delta and self.parent is None:
            raise InvalidRequest("a delta session needs its parent", parameter="parent")
        if not self.delta and self.parent is not None:
            raise InvalidRequest("parent applies to delta sessions only", parameter="parent")
        if self.sha256 is not None and not SHA256_HEX.fullmatch(self.sha256):
            raise InvalidRequest("sha256 must be 64 hex digits", parameter="sha256")
        if self.ttl_s is not None and not (
            math.isfinite(self.ttl_s) and 0 < self.ttl_s <= MAX_SESSION_TTL_S
        ):
            raise InvalidRequest(
                f"ttl_s must be in (0, {MAX_SESSION_TTL_S:g}] seconds", parameter="ttl_s"
            )
        return self


class SessionInfo(_Model):
    """A multi-rank publish session (docs/multi-rank-publishing.md)."""

    session_id: str
    policy_version: int
    members: int
    delta: bool = False
    parent: int | None = None
    state: str = "open"  # "open" | "published" | "failed" | "aborted"
    committed: list[int] = Field(default_factory=list)  # ranks whose part is committed
    parts: dict[int, str] = Field(default_factory=dict)  # rank → the service's part hash
    result: PublishResult | None = None  # the version, once published
    error: str = ""  # why it failed or was aborted
    expires_in_s: float = 0.0  # idle time left before it is aborted


class TensorInfo(_Model):
    """One weight tensor: safetensors dtype name and shape."""

    dtype: str
    shape: list[int] = Field(default_factory=list)


class SourceInfo(_Model):
    """Where a hub checkpoint keeps a canonical weight (``layout.WeightSource``)."""

    templates: list[str] = Field(default_factory=list)
    count: int = 1


class MoeInfo(_Model):
    """A mixture-of-experts model's routing shape: what a ``RoutedExperts`` record holds."""

    layers: list[int] = Field(default_factory=list)  # decoder layer index of each MoE layer
    num_experts: int = 0  # routed experts per MoE layer (shared experts not counted)
    top_k: int = 0  # experts per token per MoE layer
    num_hidden_layers: int = 0  # decoder layers (vLLM's and SGLang's layer dimension)


class RankInfo(_Model):
    """One tensor-parallel rank of a replica (``Info.ranks``): its process, device and CPU
    threads, and the bytes of its part of the versions per tier."""

    rank: int
    pid: int = 0
    device: str = ""
    threads: int = 0
    device_bytes: int = 0
    device_budget_bytes: int = 0
    device_versions: int = 0
    host_bytes: int = 0
    disk_bytes: int = 0


class Info(_Model):
    model_type: str  # e.g. "qwen2"
    architecture: str  # e.g. "Qwen2ForCausalLM"
    vocab_size: int
    max_positions: int
    num_parameters: int
    dtype: str  # "bfloat16" | "float16" | "float32"
    head_dtype: str  # "float32" with --lm-head-fp32, else the model dtype
    device: str
    mode: str  # "deterministic" | "fast"
    fast_mode_max_abs_deviation: float | None = None
    limits: dict[str, float] = Field(default_factory=dict)
    versions: list[int] = Field(default_factory=list)
    watermark: int | None = None
    server_version: str = ""
    # The numerics besides dtype and device (docs/exactness.md): the profile
    # ("invariant" or "hf"), rows per GEMM tile (invariant only), CPU intra-op threads (0 on
    # CUDA), the fp32 head switch, the attention kernel, oldlogit's numerics revision (0 from an
    # older server) and the torch build.
    numerics: str = "hf"
    tile_rows: int | None = None
    threads: int = 0
    lm_head_fp32: bool = False
    attention: str = ""
    numerics_revision: int = 0
    torch_version: str = ""
    # The forward's non-weight floating buffers (name → "dtype:sha256[:16]"), how the service
    # obtains them ("config": built from config.json at the serving dtype, never cast), and the
    # transformers release of the modeling code (docs/exactness.md).
    buffers: dict[str, str] = Field(default_factory=dict)
    buffer_convention: str = ""
    transformers_version: str = ""
    # Model config fields that decide the bits beyond weights and buffers (rms_norm_eps,
    # soft-caps, routing top-k, …): name → JSON value (``contract.numerics.CONFIG_FIELDS``).
    numerics_config: dict[str, str] = Field(default_factory=dict)
    # Layer index → the sliding window its attention computes with (0: none), as the model ran
    # at start-up (empty: unknown, e.g. tensor-parallel ranks): a trainer under
    # ``trainer_numerics(like=...)`` whose attention would see other keys is refused.
    attention_windows: dict[int, int] = Field(default_factory=dict)
    # The processor the kernels were picked for (CPU instruction set; GPU name and compute
    # capability): a trainer on another kind computes other bits ("": unknown).
    hardware: str = ""
    # The kernel set computing the forward (``NumericsSpec.kernels``; "": an older server), and
    # on CUDA each GEMM shape's kernel as chosen so far ("NxK dtype ... on GPU" → "cublaslt" or
    # "triton"; decided by a probe seeded from the shape, so a trainer on the same platform
    # chooses alike).
    kernels: str = ""
    gemm_choices: dict[str, str] = Field(default_factory=dict)
    # The tensor-parallel definition's chunk count (0: off; docs/exactness.md, "Tensor
    # parallelism"): part of the numerics a trainer must match.
    tp_chunks: int = 0
    # The ranks of this replica (``--tensor-parallel``; 1 on one device) and each one's part.
    tensor_parallel: int = 1
    ranks: list[RankInfo] = Field(default_factory=list)
    # The weights a version holds and the other names they arrive under (docs/trainers.md,
    # "Publishing what a trainer holds"): what ``Client.publish`` maps a trainer's state dict onto.
    weight_specs: dict[str, TensorInfo] = Field(default_factory=dict)
    tied_weights: dict[str, str] = Field(default_factory=dict)
    weight_sources: dict[str, SourceInfo] = Field(default_factory=dict)
    ignored_weights: list[str] = Field(default_factory=list)
    # Mixture-of-experts models: the routing a ``RoutedExperts`` record describes (None: dense).
    moe: MoeInfo | None = None

    def weight_layout(self) -> WeightLayout:
        """The model's ``layout.WeightLayout`` (empty specs on an older server)."""
        return WeightLayout(
            specs={n: (t.dtype, tuple(t.shape)) for n, t in self.weight_specs.items()},
            tied=dict(self.tied_weights),
            sources={
                n: WeightSource(n, tuple(s.templates), s.count)
                for n, s in self.weight_sources.items()
            },
            ignored=frozenset(self.ignored_weights),
        )

    def numerics_spec(self) -> NumericsSpec:
        """These numerics as ``oldlogit.parity.NumericsSpec``: pass it as
        ``trainer_numerics(model, like=...)`` to run a trainer with the very same numerics."""
        return NumericsSpec(
            profile="invariant" if self.numerics == "invariant" else "hf",
            dtype=self.dtype,
            device_kind=self.device.split(":")[0],
            tile_rows=self.tile_rows,
            threads=self.threads,
            lm_head_fp32=self.lm_head_fp32,
            attention=self.attention,
            revision=self.numerics_revision,
            torch_version=self.torch_version,
            buffers=tuple(sorted(self.buffers.items())),
            transformers_version=self.transformers_version,
            tp_chunks=self.tp_chunks,
            config=tuple(sorted(self.numerics_config.items())),
            windows=tuple(sorted(self.attention_windows.items())),
            hardware=self.hardware,
            kernels=self.kernels,
        )
