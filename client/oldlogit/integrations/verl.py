"""verl: π_old from the service for a verl batch, and verl's own π_θ under the same numerics.

``compute_old_log_prob(client, batch, ...)``: π_old for a verl rollout batch, in the shape of
verl's ``compute_log_prob``. In: a verl-style batch — a mapping, or anything with a ``.batch``
mapping (``DataProto``) — holding ``input_ids`` [bs, T] (prompt left-padded, response
right-padded), ``attention_mask`` [bs, T], ``responses`` [bs, R] (the last R columns of
``input_ids``) and optionally ``response_mask`` [bs, R] (else ``attention_mask[:, -R:]``);
``position_ids`` is not needed (the service counts positions per sequence). Versions:
``policy_version`` for the whole batch, or ``versions`` per sample [bs] or per response token
[bs, R] (a partial rollout that spans versions). Out: ``{"old_log_probs": [bs, R],
"old_log_probs_mask": [bs, R]}``, float32 and 0 where unscored, torch when the batch is.
MoE routing replay (verl's ``router_replay`` R3): a ``routed_experts`` batch key [bs, T, L, K]
aligned with ``input_ids`` (L: every decoder layer, as vLLM records it, or the MoE layers
only) is replayed by the service: the MoE layers' columns are kept (``Client.info().moe``), and
padding rows and each sequence's last row (zeros in verl) are not sent.
verl itself is never imported.

``patch_verl_engine(engine, client, version=N)``: verl's FSDP actor (``FSDPEngineWithLMHead``, or a
``TrainingWorker`` / ``ActorRolloutRefWorker`` holding one) computes its log-probs — in
``compute_log_prob`` and in the policy update, whose loss takes π_θ / π_old — bitwise equal to
the service's at the same weights, so at zero staleness verl's PPO ratio is exactly 1:
- the engine's module runs under ``oldlogit.parity.patch_numerics(module,
  like=client.info().numerics_spec())`` (forward and backward; FSDP2/FSDP1 mixed precision and
  verl's autocast are judged by the patch);
- the engine's ``prepare_model_outputs`` keeps verl's entropy / Σπ² / distillation outputs but
  its ``log_probs`` are ``oldlogit.parity.processed_logprobs`` of the model's raw logits
  (float32, ÷ temperature, log_softmax — the service's op order; verl's
  ``logits / temperature`` in the logits' dtype + ``logprobs_from_logits`` is another
  function), for ``use_remove_padding`` on (one packed row, positions restarting per sequence)
  and off (right-padded [bs, T]), with per-sample temperatures;
- options that bypass the model's logits or its per-sequence forward are refused by name:
  ``use_fused_kernels``, ``use_liger``, Ulysses sequence parallelism. Activation checkpointing
  (verl's default) is fine: its recompute runs under the same numerics.
verl's LoRA actor (``lora_rank > 0``: a PEFT model under FSDP2) is patched the same way;
``VerlEnginePatch.publish_adapter(version, base_version=B)`` publishes its adapter, gathered and
in FSDP's ``param_dtype`` as the forward computes it, as an adapter version over the version
``B`` of the weights verl loaded.
With ``version=`` (the published version the weights are) the parity canary
(``oldlogit.parity.verify``) runs at once, on every rank; ``VerlEnginePatch.verify(version)``
repeats it. The returned ``VerlEnginePatch`` undoes everything (``restore()``, or use it as a
context manager). verl's log-probs ignore top-k/top-p, so ask the service with ``top_k=0, top_p=1``.
Importing this module imports neither verl nor torch; ``patch_verl_engine`` imports both.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from oldlogit.contract.errors import InvalidRequest

__all__ = ["VerlEnginePatch", "compute_old_log_prob", "patch_verl_engine"]


def _get(batch: Mapping[str, Any], key: str, required: bool = True) -> Any:
    if key in batch:
        return batch[key]
    if required:
        raise InvalidRequest(f"the batch has no {key!r}", parameter=key)
    return None


def _np(x: Any) -> np.ndarray[Any, Any]:
    if hasattr(x, "detach"):
        return np.asarray(x.detach().cpu().numpy())
    return np.asarray(x)


def compute_old_log_prob(
    client: Any,
    data: Any,
    *,
    policy_version: int | None = None,
    versions: Any = None,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
) -> dict[str, Any]:
    """The response tokens' π_old from the service (see the module docstring).

    ``client``: an ``oldlogit.Client``. ``temperature``/``top_k``/``top_p``: the rollout's
    sampling (verl passes ``temperature`` in ``meta_info``).
    """
    batch: Mapping[str, Any] = getattr(data, "batch", data)
    input_ids = _get(batch, "input_ids")
    attention_mask = _get(batch, "attention_mask")
    responses = _get(batch, "responses")
    ids, resp = _np(input_ids), _np(responses)
    if ids.ndim != 2 or resp.ndim != 2 or resp.shape[0] != ids.shape[0]:
        raise InvalidRequest(
            f"input_ids [bs, T] and responses [bs, R] expected, got {list(ids.shape)} and "
            f"{list(resp.shape)}",
            parameter="responses",
        )
    bs, total = ids.shape
    width = resp.shape[1]
    if width > total:
        raise InvalidRequest("responses are longer than input_ids", parameter="responses")
    response_mask = _get(batch, "response_mask", required=False)
    mask = _np(attention_mask)[:, total - width :] if response_mask is None else _np(response_mask)
    if mask.shape != (bs, width):
        raise InvalidRequest(
            f"response_mask must be [bs, R] = {[bs, width]}, got {list(mask.shape)}",
            parameter="response_mask",
        )
    scored = mask != 0
    if not np.array_equal(np.where(scored, ids[:, total - width :], 0), np.where(scored, resp, 0)):
        raise InvalidRequest(
            "responses are not the last R columns of input_ids", parameter="responses"
        )
    full_mask = np.zeros((bs, total), dtype=np.int64)
    full_mask[:, total - width :] = scored
    token_versions = None
    if versions is not None:
        v = _np(versions).astype(np.int64)
        if v.shape == (bs,):
            token_versions = v
        elif v.shape == (bs, width):
            token_versions = np.full((bs, total), -1, dtype=np.int64)
            token_versions[:, total - width :] = v
        else:
            raise InvalidRequest(
                f"versions must be per sample [{bs}] or per response token [{bs}, {width}], "
                f"got {list(v.shape)}",
                parameter="versions",
            )
    routed = _get(batch, "routed_experts", required=False)
    if routed is not None:
        routed = _moe_columns(client, _np(routed), (bs, total))
    out = client.logprobs_padded(
        input_ids,
        attention_mask,
        response_mask=full_mask,
        policy_version=policy_version,
        versions=token_versions,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        routed_experts=routed,
    )
    return {
        "old_log_probs": out.logprobs[:, total - width :],
        "old_log_probs_mask": out.mask[:, total - width :],
    }


def _moe_columns(client: Any, routed: np.ndarray[Any, Any], shape: tuple[int, int]) -> Any:
    """verl's ``routed_experts`` [bs, T, L, K] with the MoE layers' columns only (L may be
    every decoder layer, as vLLM records it)."""
    if routed.ndim != 4 or routed.shape[:2] != shape:
        raise InvalidRequest(
            f"routed_experts must be [bs, T, layers, top_k] with [bs, T] = {list(shape)}, got "
            f"{list(routed.shape)}",
            parameter="routed_experts",
        )
    moe = client.info().moe
    if moe is None:
        raise InvalidRequest(
            "the batch holds routed_experts but the service serves a dense model",
            parameter="routed_experts",
        )
    if routed.shape[2] == len(moe.layers):
        return routed.astype(np.int64)
    if routed.shape[2] == moe.num_hidden_layers:
        return routed[:, :, list(moe.layers)].astype(np.int64)
    raise InvalidRequest(
        f"routed_experts holds {routed.shape[2]} layers; the model has {moe.num_hidden_layers} "
        f"decoder layers, {len(moe.layers)} of them MoE",
        parameter="routed_experts",
    )


# ------------------------------------------------------------------ verl's own actor, patched

# verl settings under which the engine's log-probs cannot be the parity function's, with the fix.
_REFUSED = (
    (
        "use_fused_kernels",
        "verl computes log-probs inside a fused linear+log-softmax kernel that never "
        "materialises the logits, so they cannot go through oldlogit.parity: set "
        "actor_rollout_ref.model.use_fused_kernels=False",
    ),
    (
        "use_liger",
        "liger-kernel replaces the model's RMSNorm/SwiGLU/RoPE with fused kernels the service "
        "does not run: set actor_rollout_ref.model.use_liger=False",
    ),
)


def _engine_of(target: Any) -> Any:
    """The verl engine in ``target``: an engine, a ``TrainingWorker`` (``.engine``) or an
    ``ActorRolloutRefWorker`` (``.actor.engine``)."""
    for path in ((), ("engine",), ("actor", "engine")):
        obj = target
        for attr in path:
            obj = getattr(obj, attr, None)
        if obj is not None and hasattr(obj, "prepare_model_outputs") and hasattr(obj, "module"):
            return obj
    raise TypeError(
        f"{type(target).__name__} is not a verl engine with a built module (FSDPEngineWithLMHead, "
        "or a TrainingWorker / ActorRolloutRefWorker after init_model/reset)"
    )


def _refuse(engine: Any) -> None:
    from oldlogit.parity import NumericsMismatch

    model_config = getattr(engine, "model_config", None)
    engine_config = getattr(engine, "engine_config", None)
    for option, fix in _REFUSED:
        for where, cfg in (("model", model_config), ("engine", engine_config)):
            if cfg is not None and bool(getattr(cfg, option, False)):
                raise NumericsMismatch(f"verl {where} config {option}=True: {fix}")
    core = getattr(engine.module, "_fsdp_wrapped_module", engine.module)
    backend = getattr(core, "_verl_fused_kernels_backend", None)
    if backend is not None:
        raise NumericsMismatch(
            f"the model's forward was replaced by verl's fused-kernel forward "
            f"(use_fused_kernels=True, backend {backend!r}): {_REFUSED[0][1]}"
        )
    sp = int(getattr(engine, "ulysses_sequence_parallel_size", 1) or 1)
    if sp > 1:
        raise NumericsMismatch(
            f"verl ulysses_sequence_parallel_size={sp}: each rank runs a slice of the packed "
            "sequence with all-to-all attention, not the per-sequence forward the service runs: "
            "set ulysses_sequence_parallel_size=1"
        )
    if getattr(getattr(engine, "model_config", None), "model_type", "language_model") not in (
        "language_model",
        None,
    ):
        raise TypeError("patch_verl_engine patches a causal LM actor/ref engine, not a critic")


def _parity_log_probs(output: Any, output_args: Mapping[str, Any], micro_batch: Any) -> Any:
    """verl's ``log_probs`` (a nested [bs, j] tensor) as ``processed_logprobs`` of the raw
    logits: the service's function of each token."""
    import torch

    from oldlogit.parity import SamplingParams, processed_logprobs

    tu = importlib.import_module("verl.utils.tensordict_utils")
    use_remove_padding = tu.get_non_tensor_data(micro_batch, "use_remove_padding", True)
    input_ids = micro_batch["input_ids"]  # nested [bs, j]
    cu_seqlens = input_ids.offsets()
    total = int(cu_seqlens[-1])
    logits = output.logits
    if hasattr(logits, "full_tensor"):  # DTensor (tensor parallel): the whole vocabulary
        logits = logits.full_tensor()
    temperature = micro_batch["temperature"]
    targets = output_args["input_ids_rmpad_rolled"]  # [total(+pad)]: the next token
    if use_remove_padding:
        rows = logits.squeeze(0)[:total]  # [total, V]; drops pad_to_length's trailing pad
        per_row = output_args["temperature_rmpad"][:total]
    else:
        lengths = cu_seqlens.diff().tolist()
        rows = torch.cat([logits[b, :n] for b, n in enumerate(lengths)])  # [total, V]
        per_row = output_args["temperature"].repeat_interleave(cu_seqlens.diff())
    targets = targets[:total].long()
    device_type = rows.device.type
    with torch.autocast(device_type, enabled=False):
        if not isinstance(temperature, torch.Tensor):
            # One temperature: the caller's own number, as the service receives it.
            return torch.nested.nested_tensor_from_jagged(
                processed_logprobs(rows, targets, SamplingParams(float(temperature))), cu_seqlens
            )
        out = torch.zeros(total, dtype=torch.float32, device=rows.device)
        for value in torch.unique(per_row).tolist():
            idx = (per_row == value).nonzero().squeeze(-1)
            lp = processed_logprobs(
                rows.index_select(0, idx), targets.index_select(0, idx), SamplingParams(value)
            )
            out = out.index_put((idx,), lp)
        return torch.nested.nested_tensor_from_jagged(out, cu_seqlens)


class VerlEnginePatch:
    """A verl engine whose log-probs go through ``oldlogit.parity``; ``restore()`` undoes it.

    ``numerics``: the ``oldlogit.parity.NumericsPatch`` on the engine's module.
    """

    def __init__(self, engine: Any, numerics: Any, client: Any = None) -> None:
        self.engine = engine
        self.numerics = numerics
        self.client = client
        self._undo: list[Callable[[], None]] = [numerics.restore]

    def verify(self, version: int, *, temperature: float = 1.0) -> Any:
        """The parity canary (``oldlogit.parity.verify``) on the engine's module at ``version``
        (the published version its weights are): call it on every rank (FSDP's gathers are
        collective). Returns the ``VerifyReport``; raises ``ParityBroken`` naming the first
        divergence."""
        from oldlogit.parity import verify

        if self.client is None:
            raise ValueError("verify needs the client: patch_verl_engine(target, client)")
        return verify(self.engine.module, self.client, version, temperature=temperature)

    def publish_adapter(self, version: int, *, base_version: int) -> Any:
        """Publish the engine's LoRA adapter (verl ``lora_rank > 0``) as adapter version
        ``version`` over ``base_version`` (the published version holding the weights verl
        loaded under the adapter): the factors gathered from their shards and cast to FSDP's
        ``param_dtype``, as the forward computes them (``oldlogit.parity.published_adapter``).
        Call it on every rank (the gathers are collective); rank 0 publishes, and every rank
        returns its ``PublishResult`` once the version is there (or raises its error)."""
        import torch.distributed as dist

        from oldlogit.parity.canary import published_adapter

        if self.client is None:
            raise ValueError("publish_adapter needs the client: patch_verl_engine(target, client)")
        adapter = published_adapter(self.engine.module)
        if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            return self.client.publish_adapter(version, adapter, base_version=base_version)
        outcome: list[Any] = [None]
        if dist.get_rank() == 0:
            try:
                outcome[0] = self.client.publish_adapter(
                    version, adapter, base_version=base_version
                )
            except Exception as exc:  # every rank raises it, none asks for a missing version
                outcome[0] = exc
        dist.broadcast_object_list(outcome, src=0)
        if isinstance(outcome[0], BaseException):
            raise outcome[0]
        return outcome[0]

    def _wrap(self, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
        engine = self.engine
        had = name in vars(engine)
        old = vars(engine).get(name)
        setattr(engine, name, make(getattr(engine, name)))

        def undo() -> None:
            if had:
                setattr(engine, name, old)
            else:
                delattr(engine, name)

        self._undo.append(undo)

    def restore(self) -> None:
        while self._undo:
            self._undo.pop()()

    def __enter__(self) -> VerlEnginePatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.restore()


def patch_verl_engine(
    target: Any, numerics: Any, *, version: int | None = None, strict: bool = True
) -> VerlEnginePatch:
    """Make a verl engine's log-probs the service's function (see the module docstring).

    ``target``: a verl ``FSDPEngineWithLMHead`` (or a subclass), or a ``TrainingWorker`` /
    ``ActorRolloutRefWorker`` whose model is built. ``numerics``: an ``oldlogit.Client`` (its
    ``info().numerics_spec()`` is adopted) or an ``oldlogit.parity.NumericsSpec``. ``version``:
    the published version the engine's weights are now; with a client, the parity canary runs
    on it at once (every rank must patch: the canary's gathers are collective) and raises
    ``ParityBroken`` naming the first divergence before any step. ``strict``: passed to
    ``patch_numerics``. Raises ``oldlogit.parity.NumericsMismatch`` naming the verl option or
    numerics setting that cannot match the service.
    """
    from oldlogit.parity import NumericsMismatch, patch_numerics

    engine = _engine_of(target)
    _refuse(engine)
    spec = numerics.info().numerics_spec() if hasattr(numerics, "info") else numerics
    tu = importlib.import_module("verl.utils.tensordict_utils")
    client = numerics if hasattr(numerics, "info") else None
    handle = VerlEnginePatch(
        engine, patch_numerics(engine.module, like=spec, strict=strict), client
    )
    try:

        def inputs(original: Callable[..., Any]) -> Callable[..., Any]:
            def prepare_model_inputs(micro_batch: Any, *a: Any, **k: Any) -> Any:
                if tu.get_non_tensor_data(micro_batch, "use_fused_kernels", False):
                    raise NumericsMismatch(f"verl batch use_fused_kernels=True: {_REFUSED[0][1]}")
                return original(micro_batch, *a, **k)

            return prepare_model_inputs

        def outputs(original: Callable[..., Any]) -> Callable[..., Any]:
            fn_globals: dict[str, Any] = getattr(
                getattr(original, "__func__", original), "__globals__", {}
            )

            def skipped(logits: Any, labels: Any, *a: Any, **k: Any) -> Any:
                return logits.new_zeros(labels.shape, dtype=logits.dtype)  # replaced below

            def prepare_model_outputs(
                output: Any, output_args: Any, micro_batch: Any, logits_processor_func: Any
            ) -> Any:
                if tu.get_non_tensor_data(micro_batch, "distillation_only", False):
                    return original(output, output_args, micro_batch, logits_processor_func)
                # verl's own log-probs are computed and then replaced: skip their kernel.
                swap = fn_globals.get("logprobs_from_logits")
                if swap is not None:
                    fn_globals["logprobs_from_logits"] = skipped
                try:
                    result = original(output, output_args, micro_batch, logits_processor_func)
                finally:
                    if swap is not None:
                        fn_globals["logprobs_from_logits"] = swap
                result["log_probs"] = _parity_log_probs(output, output_args, micro_batch)
                return result

            return prepare_model_outputs

        handle._wrap("prepare_model_inputs", inputs)
        handle._wrap("prepare_model_outputs", outputs)
        if version is not None and client is not None:
            handle.verify(version)
    except BaseException:
        handle.restore()
        raise
    return handle
