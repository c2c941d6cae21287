"""TRL: a ``GRPOTrainer`` whose π_old comes from an oldlogit service.

In: TRL's ``GRPOTrainer`` arguments plus ``oldlogit=Client(...)``. While it trains:
- every optimizer step's weights are published as version ``first_version + global_step`` (a
  delta against the previous step; ``first_version`` holds the starting weights), so the
  weights each batch of samples is generated with are a version the service holds;
- each generated batch's ``old_per_token_logps`` is the service's π_old at the version it was
  generated with (``Client.logprobs_padded`` on TRL's prompt + completion layout, at TRL's
  temperature) — also for the steps that reuse those samples after the weights moved on
  (``steps_per_generation``/``num_iterations`` > 1), where TRL alone would recompute or skip;
- π_θ is ``oldlogit.parity.token_logprobs`` with the model patched for the whole run
  (``patch_numerics``, the service's numerics via ``like=``), so at zero staleness
  π_θ / π_old is exactly 1 and later the ratio measures staleness only.
With ``peft_config`` (or a PEFT LoRA model) each version is an adapter version
(``Client.publish_adapter``) over one base version holding the weights under the adapter:
``base_version=B`` names a base the service holds (its weights checked by hash), otherwise
the trainer publishes the base itself at ``first_version`` and the adapters from
``first_version + 1``; a LoRA term the parity patch does not vouch for is refused by name.
``patch=False`` keeps TRL's own π_θ (then the ratio also holds the numerics gap). With the patch,
the first scored version is checked by ``oldlogit.parity.verify`` (a canary scored on both
sides; ``ParityBroken`` names the first diverging stage) before any step trains on it, and
again every ``verify_every`` steps if set. TRL's liger paths (``use_liger_kernel``,
``use_liger_loss``) compute with fused kernels the service does not run: refused by name.
Imports trl and torch (this module only).
"""

from __future__ import annotations

from typing import Any

import torch
import trl
from transformers import TrainerCallback

from oldlogit.parity import NumericsMismatch, patch_numerics, token_logprobs, verify
from oldlogit.parity.canary import published_adapter, published_sha256
from oldlogit.parity.lora_trainer import adapter_tensor, lora_layers
from oldlogit.parity.numerics import unwrap_model
from oldlogit.parity.setups import clean_name

__all__ = ["OldLogitGRPOTrainer"]


class _PublishEachStep(TrainerCallback):
    def __init__(self, trainer: OldLogitGRPOTrainer) -> None:
        self.trainer = trainer

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.trainer.publish_weights()


class OldLogitGRPOTrainer(trl.GRPOTrainer):  # type: ignore[misc,name-defined]
    """``trl.GRPOTrainer`` with π_old from the service; see the module docstring.

    ``oldlogit``: the ``Client`` (a write token if the service needs one). ``first_version``:
    the version of the starting weights (versions only grow: start past what the service
    already holds). ``patch``: run π_θ under the service's numerics. ``cast``: publish
    floating weights in the serving dtype (e.g. float32 masters to a bfloat16 service).
    ``watermark_lag``: after each generation, tell the service it will never be asked below
    ``version - watermark_lag`` (None: never). ``verify``: run the parity canary on the first
    scored version (with ``patch``); ``verify_every``: and every that many versions after.
    ``base_version``: with LoRA, the published version holding the base weights (None: the
    trainer publishes them at ``first_version``; see the module docstring).
    """

    def __init__(
        self,
        *args: Any,
        oldlogit: Any,
        first_version: int = 0,
        patch: bool = True,
        cast: bool = False,
        watermark_lag: int | None = None,
        verify: bool = True,
        verify_every: int | None = None,
        base_version: int | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        for flag in ("use_liger_kernel", "use_liger_loss"):
            if patch and getattr(self.args, flag, False):
                raise NumericsMismatch(
                    f"GRPOConfig({flag}=True) computes the policy's logprobs with liger-kernel's "
                    "fused kernels, which the service does not run: set "
                    f"{flag}=False (or patch=False, without bitwise parity)"
                )
        self.verify = verify and patch
        self.verify_every = verify_every
        self.verified_version: int | None = None
        self.oldlogit = oldlogit
        self.first_version = first_version
        self.oldlogit_cast = cast
        self.watermark_lag = watermark_lag
        self.numerics = (
            patch_numerics(self.model, like=oldlogit.info().numerics_spec()) if patch else None
        )
        self.published_version = -1
        self.generated_version = -1  # the version the buffered samples were generated with
        # LoRA: adapter versions over ``base_version``; the first step's version follows it.
        self.base_version: int | None = None
        self.step_version = first_version  # the version of global_step 0
        try:
            if lora_layers(unwrap_model(self.model)):
                self._set_base(base_version)
            elif base_version is not None:
                raise ValueError("base_version: the model has no PEFT LoRA layers (no peft_config)")
        except BaseException:
            if self.numerics is not None:
                self.numerics.restore()  # a refused trainer leaves the model as it was
            raise
        self.add_callback(_PublishEachStep(self))
        self.publish_weights()

    def _set_base(self, base_version: int | None) -> None:
        """The base version the adapters go over: published here at ``first_version`` (a no-op
        when the service holds those weights there), or one the service holds, checked."""
        from oldlogit.contract.errors import WeightsMismatch

        model = self.accelerator.unwrap_model(self.model)
        if base_version is None:
            core = unwrap_model(model)
            state = {
                clean_name(k): v.detach()
                for k, v in core.state_dict().items()
                if not adapter_tensor(k)  # the weights under the adapter, as before PEFT
            }
            self.oldlogit.publish(self.first_version, state, cast=self.oldlogit_cast)
            self.base_version, self.step_version = self.first_version, self.first_version + 1
            return
        if self.first_version <= base_version:
            raise ValueError(
                f"first_version {self.first_version}: the adapter versions come after "
                f"base_version {base_version}; start past it"
            )
        ours = published_sha256(model, self.oldlogit.info())
        theirs = self.oldlogit.version(base_version).weight_sha256
        if ours != theirs:
            raise WeightsMismatch(
                f"the model's base weights are not version {base_version}'s (sha256 "
                f"{ours[:12]}… here, {theirs[:12]}… there): pass the version holding the "
                "weights under the adapter, or base_version=None to publish them",
                parameter="base_version",
            )
        self.base_version = base_version

    def publish_weights(self) -> None:
        """Publish the current weights (with LoRA: the adapter over ``base_version``) as
        version ``step_version + global_step`` (once)."""
        version = self.step_version + int(self.state.global_step)
        if version <= self.published_version:
            return
        model = self.accelerator.unwrap_model(self.model)
        if self.base_version is not None:
            adapter = published_adapter(model)  # the active adapter, as the forward runs it
            self.oldlogit.publish_adapter(version, adapter, base_version=self.base_version)
        else:
            state = {k: v.detach() for k, v in model.state_dict().items()}
            self.oldlogit.publish(
                version, state, delta=True, fallback_full=True, cast=self.oldlogit_cast
            )
        self.published_version = version

    def _maybe_verify(self, version: int) -> None:
        """The parity canary at ``version`` (the weights the model holds now): raises
        ``ParityBroken`` naming the first divergence before a step trains on the samples."""
        if not self.verify:
            return
        last = self.verified_version
        due = last is None or (
            self.verify_every is not None and version - last >= self.verify_every
        )
        if not due:
            return
        verify(
            self.accelerator.unwrap_model(self.model),
            self.oldlogit,
            version,
            temperature=self.temperature,
        )
        self.verified_version = version

    def _get_per_token_logps_and_entropies(
        self,
        model: torch.nn.Module,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        logits_to_keep: int,
        batch_size: int | None = None,
        compute_entropy: bool = False,
        compute_aux_loss: bool = False,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        if self.numerics is None or any(v is not None for v in kwargs.values()):
            return super()._get_per_token_logps_and_entropies(  # type: ignore[no-any-return]
                model,
                input_ids,
                attention_mask,
                logits_to_keep,
                batch_size,
                compute_entropy,
                compute_aux_loss,
                **kwargs,
            )
        logps = token_logprobs(
            model,
            input_ids,
            attention_mask,
            logits_to_keep=logits_to_keep,
            temperature=self.temperature,
        )
        entropies = aux = None
        if compute_entropy or compute_aux_loss:
            # Not part of the ratio: TRL's own head (a fused chunked matmul the strict patch
            # would refuse) over the patched decoder; detached statistics only.
            strict, self.numerics.strict = self.numerics.strict, False
            try:
                with torch.set_grad_enabled(compute_aux_loss and torch.is_grad_enabled()):
                    _, entropies, aux = super()._get_per_token_logps_and_entropies(
                        model,
                        input_ids,
                        attention_mask,
                        logits_to_keep,
                        batch_size,
                        compute_entropy,
                        compute_aux_loss,
                    )
            finally:
                self.numerics.strict = strict
        return logps, entropies, aux

    def _generate_and_score_completions(self, inputs: Any) -> dict[str, Any]:
        self.publish_weights()  # the weights these samples are generated with
        version = self.published_version
        self._maybe_verify(version)
        out: dict[str, Any] = super()._generate_and_score_completions(inputs)
        prompt_ids, comp_ids = out["prompt_ids"], out["completion_ids"]
        width = prompt_ids.shape[1]
        served = self.oldlogit.logprobs_padded(
            torch.cat([prompt_ids, comp_ids], 1),
            torch.cat([out["prompt_mask"], out["completion_mask"]], 1),
            score_from=width,
            policy_version=version,
            temperature=self.temperature,
            use_cache=False,
        )
        out["old_per_token_logps"] = served.logprobs[:, width:].to(comp_ids.device)
        self.generated_version = version
        if self.watermark_lag is not None and version - self.watermark_lag > 0:
            self.oldlogit.set_watermark(version - self.watermark_lag)
        return out
