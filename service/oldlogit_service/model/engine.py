"""The engine: one version's weights and a batch of jobs in, float32 logprobs out (torch only).

A job is a token sequence, the sorted positions to score and the sampling settings; the answer
for position p is log p(token_ids[p] | token_ids[:p]). Knows nothing of versions, requests,
queues or the wire, and never imports asyncio, pydantic, HTTP, gRPC or Redis.

How a batch runs depends on the model's numerics profile (``LoadedModel.profile``):
- ``invariant`` (default): the distinct sequences are packed into one [1, N] row per forward
  (≤ ``max_batch_tokens`` tokens, positions restarting at 0 per sequence), the decoder runs
  once under ``oldlogit.parity``'s batch-invariant numerics, and the model's own head path runs
  on the scored rows only, a bounded number at a time. Fixed-shape tiles and per-sequence
  attention make every row's bits independent of what else is packed, so the answer is bitwise
  equal to ``reference_logprobs`` (the sequence alone) — and to a trainer under
  ``trainer_numerics``.
- ``hf``: the unpatched transformers forward, which is not batch-invariant: ``deterministic``
  gives each distinct sequence its own unpadded batch-1 forward and runs the model's own head
  path (lm_head, soft-capping, logit scaling) on the reference's fixed row chunks
  (``numerics.head_chunk_bounds``), only where a row is scored;
  ``fast`` pads sequences of similar length into [B, T_max] forwards and is off by up to a few
  ulps (``measure_fast_mode_deviation``).
Jobs with identical token_ids (and routing) share one forward: the same computation, so the
same bits. MoE routing (invariant profile): a job's ``routing`` record is packed with its rows
and replayed (``oldlogit.parity.routing``), and ``record_routing`` returns what the forward
used (``Engine.score``).
A trace job (``Job.trace``) runs alone through ``Engine.trace``: the digests of every stage of
the sequence's forward (``oldlogit.parity.trace.forward_trace``, the function trainers run).
A job with a LoRA adapter (``Job.adapter``, an adapter version over the batch's weights) gets
it on its rows (``oldlogit.parity.lora.serving_adapters``): jobs of several adapters and of the
bare weights share one forward, each linear's base GEMM once over all rows.
"""

from __future__ import annotations

import collections
import hashlib
import itertools
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor

from oldlogit.contract.errors import InvalidRequest, OutOfMemory
from oldlogit.parity import routing
from oldlogit.parity.logprobs import decoder_hidden, row_logits
from oldlogit.parity.lora import Adapter, LoraSpec, check_adapter, serving_adapters
from oldlogit.parity.trace import TraceStage, forward_trace
from oldlogit_service.model.backends import TransformersBackend
from oldlogit_service.model.loaded import LoadedModel
from oldlogit_service.model.numerics import (
    HEAD_CHUNK_ROWS,
    SamplingParams,
    head_chunk_bounds,
    processed_logprobs,
)

logger = logging.getLogger(__name__)

__all__ = [
    "Engine",
    "EngineMode",
    "Job",
    "LoraWeights",
    "NumericsCheckFailed",
    "SamplingParams",
    "Scored",
    "measure_fast_mode_deviation",
    "self_check",
]

EngineMode = Literal["deterministic", "fast"]

# Scored rows per head call of the packed and padded paths: bounds the [rows, V] logits alive at
# once, in the head's dtype (their float32 copies are made a few rows at a time:
# ``oldlogit.parity.logprobs.PROCESS_BYTES``). Every head call streams the whole head weight,
# so fewer, larger calls are faster: at Qwen2.5-0.5B's shapes in bf16 (a 272 MB head) 508
# scored rows took 416 ms in calls of 384 + 128 rows and 399 ms in one. Not numerics: under
# tiles a row's logits do not depend on which rows share the call, and the padded path makes
# no bitwise promise.
HEAD_LOGITS_BYTES = 256 * 1024**2
# On a GPU, 1 GiB: each head call is a few launches of Python and kernels, and at Qwen2.5-1.5B's
# shapes (vocab 151,936, bf16) 256 MiB is 832 rows — a 16 × 512 batch's head in 10 calls where
# 3 do (gpu_profile's engine rows, docs/performance.md "On a GPU").
HEAD_LOGITS_BYTES_GPU = 1024**3

# On CPU a packed forward covers at most this many bytes of its widest activation ([tokens,
# intermediate]), so that the pointwise steps between GEMMs (norms, rotary, SiLU × up) work in
# cache instead of streaming hundreds of MB through memory, and the GEMMs get cache-sized row
# blocks: measured on a 2-core CPU (hidden 256, fp32, 64 × 512 tokens), 32,768-token forwards
# took 4.7 s and 4,096-token ones 2.7-2.9 s for the same bits. Not numerics: under the
# invariant profile a row's bits do not depend on what else is packed. A GPU keeps whole
# batches (``max_batch_tokens``).
CPU_FORWARD_BYTES = 12 * 1024**2


def cpu_forward_tokens(config: Mapping[str, object], dtype: torch.dtype, tile_rows: int) -> int:
    """Tokens per packed forward on CPU (``CPU_FORWARD_BYTES``), a whole number of tiles, at
    least 512."""
    text = config.get("text_config")
    cfg = text if isinstance(text, Mapping) else config
    widths = [cfg.get("intermediate_size"), cfg.get("hidden_size")]
    width = max((int(w) for w in widths if isinstance(w, int) and w > 0), default=4096)
    tokens = CPU_FORWARD_BYTES // (width * dtype.itemsize)
    tile = max(1, tile_rows)
    return max(512, tokens - tokens % tile)


# Adapter hashes whose tensors were checked against the model (no tensors kept: the store holds
# an adapter's tensors in its tiers, under their budgets, pinned while its jobs run).
ADAPTERS_CHECKED = 4096


@dataclass(frozen=True, eq=False)
class LoraWeights:
    """A LoRA adapter a job runs with over the batch's weights, named by its hash: its
    ``LoraSpec.as_dict()`` and tensors (``<module>.lora_A`` [r, in], ``.lora_B`` [out, r]),
    on the serving device when the store pinned them there (else copied for each batch)."""

    sha256: str
    spec: Mapping[str, Any]
    tensors: Mapping[str, Tensor]


class NumericsCheckFailed(RuntimeError):
    """A packed batch differs from the same sequences run alone: the invariant profile cannot
    be promised on this platform (raised by ``self_check`` at start-up)."""


@dataclass(frozen=True)
class Job:
    """One sequence to score: logprobs at ``positions`` of ``token_ids`` under ``sampling``.

    ``trace=True``: the stages of the sequence's forward instead (``Engine.trace``); the
    scheduler runs it beside the batch of its version, never packed with it.
    MoE models under the invariant numerics: ``routing`` [T, L, k] forces the experts each
    position's forward goes to (−1 rows route freely; ``oldlogit.parity.routing``), and
    ``record_routing`` returns the routing the forward used (``Scored.routing``).
    """

    token_ids: Tensor  # [T] int64, CPU
    positions: Tensor  # [S] int64, sorted, unique, each in [1, T)
    sampling: SamplingParams = field(default_factory=SamplingParams)
    trace: bool = False
    routing: Tensor | None = None  # [T, L, k] integer expert ids, CPU; −1 rows: free
    record_routing: bool = False
    adapter: LoraWeights | None = None  # applied on this job's rows only


@dataclass(frozen=True)
class Scored:
    """A job's answer: its logprobs and, with ``Job.record_routing``, the routing its forward
    used for rows 0 … T − 2 (the ones the scored logprobs depend on)."""

    logprobs: Tensor  # [S] float32, CPU
    routing: Tensor | None = None  # [T − 1, L, k] int32, CPU


@dataclass
class _Group:
    """Jobs over the same token_ids (and routing): one forward serves them all."""

    token_ids: Tensor  # [T] int64, CPU
    job_indices: list[int]
    routing: Tensor | None = None  # [T, L, k], as the jobs give it
    record: bool = False  # some job wants the routing back
    recorded: Tensor | None = None  # [T − 1, L, k] int32, CPU, once run
    adapter: LoraWeights | None = None  # the jobs' adapter (all the same)


class Engine:
    """Runs jobs against one version's weights; see the module docstring for the modes."""

    def __init__(
        self,
        model: LoadedModel,
        *,
        mode: EngineMode = "deterministic",
        lm_head_fp32: bool = False,
        head_chunk_rows: int = HEAD_CHUNK_ROWS,
        max_batch_tokens: int = 65536,
    ) -> None:
        if mode not in ("deterministic", "fast"):
            raise ValueError(f"mode must be 'deterministic' or 'fast', got {mode!r}")
        if head_chunk_rows <= 0 or max_batch_tokens <= 0:
            raise ValueError("head_chunk_rows and max_batch_tokens must be positive")
        self.model = model
        self.mode: EngineMode = mode
        self.lm_head_fp32 = lm_head_fp32
        self.head_chunk_rows = head_chunk_rows
        self.max_batch_tokens = max_batch_tokens
        # Tokens per packed forward (the invariant profile): the batch on a GPU, cache-sized
        # blocks of it on CPU (``CPU_FORWARD_BYTES``).
        self.forward_tokens = max_batch_tokens
        if model.device.type == "cpu":
            self.forward_tokens = min(
                max_batch_tokens,
                cpu_forward_tokens(model.config, model.dtype, model.tile_rows or 0),
            )
        budget = HEAD_LOGITS_BYTES_GPU if model.device.type == "cuda" else HEAD_LOGITS_BYTES
        self.head_rows = max(1, budget // (self.head_dtype.itemsize * max(1, model.vocab_size)))
        tile = model.tile_rows or 0
        if tile and self.head_rows > tile:
            # Whole tiles per head call: only the last call's last tile is padded.
            self.head_rows -= self.head_rows % tile
        self._warned_weights_device = False
        self._checked: collections.OrderedDict[str, LoraSpec] = collections.OrderedDict()
        # The MoE blocks a routing record describes (None: a dense model, or no replay here).
        self.moe = (
            routing.moe_layout(model.module)
            if model.profile == "invariant" and isinstance(model.backend, TransformersBackend)
            else None
        )

    @property
    def head_dtype(self) -> torch.dtype:
        return torch.float32 if self.lm_head_fp32 else self.model.dtype

    def run(self, weights: Mapping[str, Tensor], jobs: Sequence[Job]) -> list[Tensor]:
        """Logprobs for each job: [S] float32 on CPU, in job order. One version per call."""
        return [scored.logprobs for scored in self.score(weights, jobs)]

    def score(self, weights: Mapping[str, Tensor], jobs: Sequence[Job]) -> list[Scored]:
        """``run``, with the routing each job that asks for it (``Job.record_routing``) ran
        under."""
        for job in jobs:
            _check_job(job)
            if (job.routing is not None or job.record_routing) and self.moe is None:
                raise InvalidRequest(
                    f"routing replay and return_routing need a mixture-of-experts model served "
                    f"under the invariant numerics; this deployment serves "
                    f"{self.model.architecture} ({self.model.profile!r})",
                    parameter="routed_experts",
                )
        if not jobs:
            return []
        padded = self.model.profile != "invariant" and self.mode == "fast"
        if padded and any(job.adapter is not None for job in jobs):
            raise InvalidRequest(
                "adapter versions are not served in --mode fast under --numerics hf (padded "
                "forwards): use deterministic mode or the invariant numerics",
                parameter="policy_version",
            )
        with _map_oom(), torch.inference_mode():
            weights = self._on_device(weights)
            groups = _group_by_sequence(jobs)
            if self.model.profile == "invariant":
                # An adapter's sequences side by side (the order stable otherwise): its rows in
                # the fewest forwards and ranges, one lora_A/lora_B call each (row bits do not
                # depend on the packing).
                groups.sort(key=lambda g: "" if g.adapter is None else g.adapter.sha256)
                outs = self._run_packed(weights, jobs, groups)
            elif self.mode == "deterministic":
                outs = self._run_deterministic(weights, jobs, groups)
            else:
                outs = self._run_fast(weights, jobs, groups)
            sizes = [int(job.positions.shape[0]) for job in jobs]
            # One device → host copy per call.
            flat = torch.cat(outs).cpu() if outs else torch.empty(0, dtype=torch.float32)
            recorded: dict[int, Tensor | None] = {}
            for g in groups:
                for i in g.job_indices:
                    recorded[i] = g.recorded if jobs[i].record_routing else None
            return [Scored(lp, recorded[i]) for i, lp in enumerate(torch.split(flat, sizes))]

    def trace(self, weights: Mapping[str, Tensor], job: Job) -> list[TraceStage]:
        """The digests of every stage of one forward of ``job.token_ids`` alone, in forward
        order: ``forward_trace`` on the skeleton with this version's weights, as a trainer runs
        it on its own model (the same module paths). Transformers models only."""
        _check_job(job)
        if not isinstance(self.model.backend, TransformersBackend):
            raise InvalidRequest(
                f"this deployment serves {self.model.architecture} through "
                f"{type(self.model.backend).__name__}: a trace digests the stages of a "
                "transformers model's forward, and this model has none to digest"
            )
        with _map_oom(), torch.inference_mode():
            weights = self._on_device(weights)
            ids = job.token_ids[None].to(self.model.device)  # [1, T]
            with self._lora([(0, int(ids.shape[1]), job.adapter)]):
                return forward_trace(
                    self.model.module,
                    ids,
                    sampling=job.sampling,
                    weights=weights,
                    lm_head_fp32=self.lm_head_fp32,
                )

    # ----------------------------------------------------------------- invariant: packed

    def _run_packed(
        self, weights: Mapping[str, Tensor], jobs: Sequence[Job], groups: list[_Group]
    ) -> list[Tensor]:
        device = self.model.device
        outs: list[Tensor] = [torch.empty(0)] * len(jobs)
        for batch in _token_batches(groups, self.forward_tokens):
            lengths = [int(g.token_ids.shape[0]) for g in batch]
            ids = torch.cat([g.token_ids for g in batch])  # [N]: the sequences back to back
            pos = torch.cat([torch.arange(n, dtype=torch.int64) for n in lengths])  # [N]
            ids_dev = ids.to(device, non_blocking=True)
            pos_dev = pos.to(device, non_blocking=True)
            starts = [0, *itertools.accumulate(lengths)][:-1]
            # The batch's routing: its groups' records packed as the rows are (free: −1).
            replay = self._packed_routing(batch, starts, sum(lengths), device)

            def logits(
                rows: Tensor, ids_dev: Tensor = ids_dev, pos_dev: Tensor = pos_dev
            ) -> Iterator[tuple[int, Tensor]]:
                # One forward; the model's own head path (soft-capping, scaling) on the rows.
                return row_logits(
                    self.model.module,
                    ids_dev[None, :],
                    rows,
                    position_ids=pos_dev[None, :],
                    weights=weights,
                    lm_head_fp32=self.lm_head_fp32,
                    max_rows=self.head_rows,
                )

            placed = list(zip(batch, starts, strict=True))
            # Each adapter on its groups' rows; the base weights' GEMMs once over all rows.
            loras = [
                (st, st + n, g.adapter) for g, st, n in zip(batch, starts, lengths, strict=True)
            ]
            with (
                self._lora(loras),
                routing.use(replay) if replay is not None else nullcontext(),
            ):
                self._score(jobs, placed, ids_dev, logits, outs)
                if replay is not None and replay.record and not replay.recorded:
                    # Nothing scored, so no forward ran: run the decoder for the routing alone.
                    decoder_hidden(
                        self.model.module,
                        ids_dev[None, :],
                        position_ids=pos_dev[None, :],
                        weights=weights,
                    )
            if replay is not None and replay.record:
                self._keep_recorded(replay, placed)
        return outs

    def _keep_recorded(self, replay: routing.Routing, placed: list[tuple[_Group, int]]) -> None:
        """Each recording group's rows 0 … T − 2 of the routing one packed forward used."""
        assert self.moe is not None
        used = torch.stack([replay.recorded[j] for j in range(len(self.moe.layers))], dim=1).to(
            "cpu", torch.int32
        )  # [N, L, k]
        for g, start in placed:
            if g.record:
                g.recorded = used[start : start + int(g.token_ids.shape[0]) - 1].clone()

    def _packed_routing(
        self, batch: list[_Group], starts: list[int], total: int, device: torch.device
    ) -> routing.Routing | None:
        """The ``Routing`` of one packed forward (None: every row free, nothing recorded)."""
        forcing = any(g.routing is not None for g in batch)
        record = any(g.record for g in batch)
        if not (forcing or record):
            return None
        assert self.moe is not None  # score() refused routing for a model without MoE blocks
        forced = None
        if forcing:
            width = (len(self.moe.layers), self.moe.top_k)
            forced = torch.full((total, *width), -1, dtype=torch.int32)  # [N, L, k]
            for g, start in zip(batch, starts, strict=True):
                if g.routing is not None:
                    forced[start : start + int(g.token_ids.shape[0])] = g.routing
            forced = forced.to(device, non_blocking=True)
        return routing.Routing(forced=forced, record=record)

    def _score(
        self,
        jobs: Sequence[Job],
        placed: list[tuple[_Group, int]],
        ids_flat: Tensor,
        logits: Callable[[Tensor], Iterator[tuple[int, Tensor]]],
        outs: list[Tensor],
    ) -> None:
        """Score every job of ``placed`` (group, row offset of its sequence in ``ids_flat``):
        ``logits(rows)`` yields the scored rows' logits chunk by chunk, then each job's
        processing runs on its rows."""
        device = ids_flat.device
        segments: list[tuple[int, int, int]] = []  # (job index, offset, length)
        flat_rows: list[Tensor] = []
        offset = 0
        for g, start in placed:
            for i in g.job_indices:
                rows = jobs[i].positions - 1 + start  # hidden row p - 1 predicts token p
                flat_rows.append(rows)
                segments.append((i, offset, int(rows.shape[0])))
                offset += int(rows.shape[0])
        all_rows = torch.cat(flat_rows).to(device, non_blocking=True)  # [S]
        all_targets = ids_flat.index_select(0, all_rows + 1)  # [S]
        result = torch.empty(offset, dtype=torch.float32, device=device)  # [S]
        # Consecutive jobs with the same sampling are processed as one run of rows (the
        # processing is row-wise: the same bits either way).
        runs: list[tuple[SamplingParams, int, int]] = []  # (sampling, start, end) in [0, S)
        for i, seg_start, seg_len in segments:
            if runs and runs[-1][0] == jobs[i].sampling and runs[-1][2] == seg_start:
                runs[-1] = (runs[-1][0], runs[-1][1], seg_start + seg_len)
            elif seg_len:
                runs.append((jobs[i].sampling, seg_start, seg_start + seg_len))
        if offset:
            for a, chunk in logits(all_rows):  # chunk: [w, V] for rows a .. a + w
                b_end = a + int(chunk.shape[0])
                for sampling, run_start, run_end in runs:
                    lo, hi = max(a, run_start), min(b_end, run_end)
                    if hi > lo:
                        result[lo:hi] = processed_logprobs(
                            chunk[lo - a : hi - a],
                            all_targets[lo:hi],
                            sampling,
                            tp_chunks=self.model.tp_chunks,
                        )
        for i, seg_start, seg_len in segments:
            outs[i] = result[seg_start : seg_start + seg_len]

    # ------------------------------------------------------------------------ deterministic

    def _run_deterministic(
        self, weights: Mapping[str, Tensor], jobs: Sequence[Job], groups: list[_Group]
    ) -> list[Tensor]:
        device = self.model.device
        outs: list[Tensor] = [torch.empty(0)] * len(jobs)
        for group in groups:
            n = int(group.token_ids.shape[0])
            ids = group.token_ids.to(device, non_blocking=True)  # [T]
            # The reference's forward: the whole sequence, alone, unpadded, no mask.
            with self._lora([(0, n, group.adapter)]):
                hidden = self.model.hidden_states(weights, ids[None, :], None)[0]  # [T, H]
            members = [(jobs[i], i) for i in group.job_indices]
            # Hidden row r predicts token r + 1, so position p is scored from row p - 1.
            rows_cpu = {i: job.positions - 1 for job, i in members}  # [S] each, sorted
            rows_dev = {i: rows.to(device, non_blocking=True) for i, rows in rows_cpu.items()}
            for _, i in members:
                outs[i] = torch.empty(rows_cpu[i].shape[0], dtype=torch.float32, device=device)
            for start, end in head_chunk_bounds(n, self.head_chunk_rows):
                spans = []  # (job, index, lo, hi): the job's scored rows [lo, hi) in this chunk
                for job, i in members:
                    lo = int(torch.searchsorted(rows_cpu[i], start))
                    hi = int(torch.searchsorted(rows_cpu[i], end))
                    if hi > lo:
                        spans.append((job, i, lo, hi))
                if not spans:
                    continue  # no scored row here: the reference computes it, we need not
                # [C, V]: the model's own head path (soft-capping, scaling) on the fixed chunk
                logits = self.model.head_logits(weights, hidden[start:end], self.lm_head_fp32)
                for job, i, lo, hi in spans:
                    rows = rows_dev[i][lo:hi]  # [s], inside [start, end)
                    # Select in the head dtype: only scored rows ever exist in float32.
                    picked = logits.index_select(0, rows - start)  # [s, V]
                    outs[i][lo:hi] = processed_logprobs(picked, ids[rows + 1], job.sampling)
        return outs

    # -------------------------------------------------------------------------------- fast

    def _run_fast(
        self, weights: Mapping[str, Tensor], jobs: Sequence[Job], groups: list[_Group]
    ) -> list[Tensor]:
        device = self.model.device
        outs: list[Tensor] = [torch.empty(0)] * len(jobs)
        for batch in _length_batches(groups, self.max_batch_tokens):
            t_max = max(int(g.token_ids.shape[0]) for g in batch)
            ids = torch.zeros(len(batch), t_max, dtype=torch.int64)  # [B, T_max], right padded
            mask = torch.zeros(len(batch), t_max, dtype=torch.int64)  # [B, T_max]
            for b, g in enumerate(batch):
                ids[b, : g.token_ids.shape[0]] = g.token_ids
                mask[b, : g.token_ids.shape[0]] = 1
            ids_dev = ids.to(device, non_blocking=True)
            mask_dev = mask.to(device, non_blocking=True)
            hidden = self.model.hidden_states(weights, ids_dev, mask_dev)  # [B, T_max, H]
            hidden_flat = hidden.reshape(-1, hidden.shape[-1])  # [B * T_max, H]

            def logits(
                rows: Tensor, hidden_flat: Tensor = hidden_flat
            ) -> Iterator[tuple[int, Tensor]]:
                for a in range(0, int(rows.shape[0]), self.head_rows):
                    picked = hidden_flat.index_select(0, rows[a : a + self.head_rows])
                    yield a, self.model.head_logits(weights, picked, self.lm_head_fp32)

            placed = [(g, b * t_max) for b, g in enumerate(batch)]
            self._score(jobs, placed, ids_dev.reshape(-1), logits, outs)
        return outs

    # ------------------------------------------------------------------------------ helpers

    def _lora(
        self, rows: Sequence[tuple[int, int, LoraWeights | None]]
    ) -> AbstractContextManager[None]:
        """``serving_adapters`` over the rows that have an adapter (nothing when none has);
        one ``Adapter`` per hash, so an adapter's ranges share its tensors (copied to the
        device once) and run as one group."""
        if all(a is None for _, _, a in rows):
            return nullcontext()
        made: dict[str, Adapter] = {}
        for _, _, a in rows:
            if a is not None and a.sha256 not in made:
                made[a.sha256] = self._adapter(a)
        return serving_adapters(
            self.model.module, [(s, e, made[a.sha256]) for s, e, a in rows if a is not None]
        )

    def _adapter(self, lora: LoraWeights) -> Adapter:
        """The adapter on the serving device (its tensors as the store pinned them), checked
        against the model once per hash."""
        device = self.model.device
        tensors = {k: t.to(device, non_blocking=True) for k, t in lora.tensors.items()}
        spec = self._checked.get(lora.sha256)
        if spec is not None:
            self._checked.move_to_end(lora.sha256)
            return Adapter(spec, tensors)
        got = Adapter(LoraSpec.from_dict(lora.spec), tensors)
        try:
            check_adapter(got, {n: shape for n, (_, shape) in self.model.param_specs.items()})
        except ValueError as exc:
            raise InvalidRequest(f"the adapter does not fit this model: {exc}") from exc
        # LoRA's definition is PEFT's on nn.Linear: a MoE router or fused experts (2-D weights
        # of other modules) would see other rows than a linear's, and PEFT cannot train them.
        modules = dict(self.model.module.named_modules())
        head = getattr(self.model.module, "get_output_embeddings", lambda: None)()
        for m in got.spec.target_modules:
            if head is not None and modules.get(m) is head:
                raise InvalidRequest(
                    f"the adapter targets {m}, the model's head: not supported (train the "
                    "adapter without it)",
                    parameter="policy_version",
                )
            if not isinstance(modules.get(m), torch.nn.Linear):
                raise InvalidRequest(
                    f"the adapter targets {m} ({type(modules.get(m)).__name__}), not an "
                    "nn.Linear of the model: LoRA adapters apply to linear layers only (a MoE "
                    "router or the fused experts is not one); train the adapter without it",
                    parameter="policy_version",
                )
        self._checked[lora.sha256] = got.spec
        while len(self._checked) > ADAPTERS_CHECKED:
            self._checked.popitem(last=False)
        return got

    def _on_device(self, weights: Mapping[str, Tensor]) -> Mapping[str, Tensor]:
        device = self.model.device
        if all(t.device == device for t in weights.values()):
            return weights
        if not self._warned_weights_device:
            # The store should hand over device-resident weights; copying per call is slow.
            logger.warning("weights are not on %s: copying them for every call", device)
            self._warned_weights_device = True
        return {k: v.to(device, non_blocking=True) for k, v in weights.items()}


def _check_job(job: Job) -> None:
    ids, pos = job.token_ids, job.positions
    if job.routing is not None and (
        job.routing.dim() != 3 or int(job.routing.shape[0]) != int(ids.shape[0])
    ):
        raise ValueError(
            f"routing must be [T, L, k] with T = {int(ids.shape[0])}, got {list(job.routing.shape)}"
        )
    if ids.dim() != 1 or ids.dtype != torch.int64:
        raise ValueError(f"token_ids must be a 1-D int64 tensor, got {ids.dtype} {list(ids.shape)}")
    if pos.dim() != 1 or pos.dtype != torch.int64 or pos.device.type != "cpu":
        raise ValueError("positions must be a 1-D int64 CPU tensor")
    if pos.numel():
        if int(pos[0]) < 1 or int(pos[-1]) >= ids.shape[0]:
            raise ValueError(f"positions must lie in [1, {ids.shape[0]})")
        if pos.numel() > 1 and not bool((pos[1:] > pos[:-1]).all()):
            raise ValueError("positions must be sorted and unique")
    if not job.sampling.temperature > 0:
        raise ValueError("temperature must be > 0")


def _group_by_sequence(jobs: Sequence[Job]) -> list[_Group]:
    groups: dict[tuple[bytes, bytes | None, str | None], _Group] = {}
    for i, job in enumerate(jobs):
        ids = job.token_ids.cpu()
        replay = None if job.routing is None else job.routing.cpu().to(torch.int32)
        # A record is large (T × L × k ids): jobs share a forward by its digest.
        digest = None if replay is None else hashlib.sha256(replay.numpy().tobytes()).digest()
        lora = job.adapter
        key = (ids.numpy().tobytes(), digest, None if lora is None else lora.sha256)
        if key not in groups:
            groups[key] = _Group(token_ids=ids, job_indices=[], routing=replay, adapter=lora)
        groups[key].job_indices.append(i)
        groups[key].record |= job.record_routing
    return list(groups.values())


def _token_batches(groups: list[_Group], max_batch_tokens: int) -> Iterator[list[_Group]]:
    """Groups in order, packed back to back while their total length stays within the budget
    (a longer sequence goes alone)."""
    batch: list[_Group] = []
    tokens = 0
    for g in groups:
        t = int(g.token_ids.shape[0])
        if batch and tokens + t > max_batch_tokens:
            yield batch
            batch, tokens = [], 0
        batch.append(g)
        tokens += t
    if batch:
        yield batch


def _length_batches(groups: list[_Group], max_batch_tokens: int) -> Iterator[list[_Group]]:
    """Groups sorted by length, packed while B * T_max stays within the token budget."""
    batch: list[_Group] = []
    for g in sorted(groups, key=lambda g: int(g.token_ids.shape[0])):
        t = int(g.token_ids.shape[0])  # the longest so far, since sorted
        if batch and (len(batch) + 1) * t > max_batch_tokens:
            yield batch
            batch = []
        batch.append(g)
    if batch:
        yield batch


@contextmanager
def _map_oom() -> Iterator[None]:
    """Translate allocator failures into the service's ``OutOfMemory`` at one boundary."""
    try:
        yield
    except torch.OutOfMemoryError as exc:
        _release_cache()
        raise OutOfMemory(f"out of memory in the forward: {exc}") from exc
    except RuntimeError as exc:
        if "out of memory" not in str(exc).lower():
            raise
        _release_cache()
        raise OutOfMemory(f"out of memory in the forward: {exc}") from exc


def _release_cache() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def measure_fast_mode_deviation(
    model: LoadedModel,
    weights: Mapping[str, Tensor],
    *,
    num_sequences: int = 16,
    min_len: int = 2,
    max_len: int = 300,
    sampling: SamplingParams = SamplingParams(),
    lm_head_fp32: bool = False,
    max_batch_tokens: int = 65536,
    seed: int = 0,
) -> float:
    """Max |fast − deterministic| over random sequences and all their positions.

    The deterministic engine equals the reference bitwise, so this is the deviation from the
    reference. Positions where exactly one side is −inf (support changed) count as +inf.
    """
    gen = np.random.default_rng(seed)
    jobs = []
    for _ in range(num_sequences):
        n = int(gen.integers(min_len, max_len + 1))
        ids = torch.from_numpy(gen.integers(0, model.vocab_size, size=n).astype(np.int64))
        jobs.append(Job(ids, torch.arange(1, n, dtype=torch.int64), sampling))
    exact = Engine(model, mode="deterministic", lm_head_fp32=lm_head_fp32).run(weights, jobs)
    fast = Engine(
        model, mode="fast", lm_head_fp32=lm_head_fp32, max_batch_tokens=max_batch_tokens
    ).run(weights, jobs)
    worst = 0.0
    for e, f in zip(exact, fast, strict=True):
        both_inf = torch.isneginf(e) & torch.isneginf(f)
        diff = (e - f).abs().masked_fill(both_inf, 0.0)
        if diff.numel():
            worst = max(worst, float(diff.max()))  # NaN-free: inputs are finite or −inf
    return worst


def self_check(
    engine: Engine,
    weights: Mapping[str, Tensor],
    *,
    lengths: Sequence[int] = (2, 7, 40, 67, 130),
    seed: int = 0,
) -> int:
    """Score random sequences packed together and each alone; raise ``NumericsCheckFailed``
    unless every logprob is bitwise equal. Returns the number of logprobs compared. Records the
    sliding window each attention layer computed with in ``engine.model.windows``.

    The lengths span one, two and three tiles and odd remainders, so both a padded last tile
    and a row's place in its tile are exercised.
    """
    gen = torch.Generator().manual_seed(seed)
    limit = min(engine.model.max_positions, engine.max_batch_tokens)
    jobs = []
    for n in lengths:
        n = max(2, min(int(n), limit))
        ids = torch.randint(0, engine.model.vocab_size, (n,), generator=gen, dtype=torch.int64)
        jobs.append(Job(ids, torch.arange(1, n, dtype=torch.int64)))
    from oldlogit.parity.attention import InvariantNumericsError, recording_windows

    try:
        with recording_windows() as windows:
            packed = engine.run(weights, jobs)
    except InvariantNumericsError as exc:  # e.g. a matmul outside the tiles (strict mode)
        raise NumericsCheckFailed(f"{engine.model.architecture}: {exc}") from exc
    if windows:  # the sliding window each layer computed with (/v1/info; like= holds a trainer)
        engine.model.windows = tuple(sorted(windows.items()))
    compared = 0
    for job, together in zip(jobs, packed, strict=True):
        (alone,) = engine.run(weights, [job])
        if not torch.equal(together, alone):
            diff = (together - alone).abs().nan_to_num(posinf=float("inf"))
            raise NumericsCheckFailed(
                f"{engine.model.architecture}: a packed batch differs from the same sequence "
                f"run alone (length "
                f"{int(job.token_ids.shape[0])}, max |Δ| {float(diff.max()):.3g}): the "
                f"{engine.model.profile!r} numerics are not batch-invariant on this platform"
            )
        compared += int(alone.shape[0])
    return compared
