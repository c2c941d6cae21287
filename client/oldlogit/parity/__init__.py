"""Trainer parity: one batch-invariant forward for the trainer and the service.

    from oldlogit.parity import trainer_numerics, token_logprobs
    with trainer_numerics(model):                     # forward + backward batch-invariant
        logp = token_logprobs(model, input_ids, attention_mask, temperature=0.7)  # [B, T]

Under ``trainer_numerics`` every matmul row goes through fixed-shape tiles and attention runs
per sequence over its own keys, so a token's logprob depends only on its sequence and the
weights — never on micro-batch size, padding side or packing — and equals the service's answer
bitwise (same dtype, device kind, tile rows and, on CPU, thread count). Importing this package
does not import torch; the names below import it when first used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from oldlogit.contract.numerics import (
    BUFFER_CONVENTION,
    DEFAULT_TILE_ROWS,
    PROFILES,
    NumericsMismatch,
    NumericsSpec,
    Profile,
    SamplingParams,
)

if TYPE_CHECKING:
    from .attention import InvariantNumericsError
    from .canary import ParityBroken, VerifyReport, verify
    from .compare import ParityReport, compare
    from .logprobs import decoder_hidden, head_logits, processed_logprobs, token_logprobs
    from .numerics import (
        ActiveDropout,
        NumericsPatch,
        RandomForward,
        UncoveredMatmul,
        local_spec,
        patch_numerics,
        trainer_numerics,
        unwrap_model,
    )
    from .tiles import tiled_linear, tiled_mm
    from .trace import TraceStage, forward_trace

__all__ = [
    "BUFFER_CONVENTION",
    "DEFAULT_TILE_ROWS",
    "PROFILES",
    "ActiveDropout",
    "InvariantNumericsError",
    "NumericsMismatch",
    "NumericsPatch",
    "NumericsSpec",
    "ParityBroken",
    "ParityReport",
    "Profile",
    "RandomForward",
    "SamplingParams",
    "TraceStage",
    "UncoveredMatmul",
    "VerifyReport",
    "compare",
    "decoder_hidden",
    "forward_trace",
    "head_logits",
    "local_spec",
    "patch_numerics",
    "processed_logprobs",
    "tiled_linear",
    "tiled_mm",
    "token_logprobs",
    "trainer_numerics",
    "unwrap_model",
    "verify",
]

_LAZY = {
    "InvariantNumericsError": "attention",
    "ParityReport": "compare",
    "compare": "compare",
    "decoder_hidden": "logprobs",
    "head_logits": "logprobs",
    "processed_logprobs": "logprobs",
    "token_logprobs": "logprobs",
    "ActiveDropout": "numerics",
    "NumericsPatch": "numerics",
    "RandomForward": "numerics",
    "UncoveredMatmul": "numerics",
    "local_spec": "numerics",
    "patch_numerics": "numerics",
    "trainer_numerics": "numerics",
    "unwrap_model": "numerics",
    "tiled_linear": "tiles",
    "tiled_mm": "tiles",
    "TraceStage": "trace",
    "forward_trace": "trace",
    "ParityBroken": "canary",
    "VerifyReport": "canary",
    "verify": "canary",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'oldlogit.parity' has no attribute {name!r}")
    from importlib import import_module

    value = getattr(import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
