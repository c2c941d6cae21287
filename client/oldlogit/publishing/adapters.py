"""What ``Client.publish_adapter`` sends: an adapter's LoRA tensors as one safetensors stream.

In: a PEFT ``save_pretrained`` directory or a PEFT state dict with its config (read here,
torch-free), or our names and ``AdapterConfig`` (``oldlogit.contract.adapters``; the client
converts a PEFT model to these). Out: an ``AdapterUpload``: the stream (the canonical config in
its metadata), and its hash over a base's (``weights.adapter_sha256``). Never imports torch.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from oldlogit.contract.adapters import (
    ADAPTER_CONFIG_KEY,
    AdapterConfig,
    peft_tensor_name,
)
from oldlogit.contract.errors import InvalidRequest
from oldlogit.contract.safetensors import (
    SafetensorsStream,
    TensorSource,
    file_sources,
    hash_sources,
)
from oldlogit.contract.weights import adapter_hash_prefix
from oldlogit.publishing.sources import state_dict_sources

__all__ = ["PEFT_CONFIG", "PEFT_WEIGHTS", "AdapterUpload"]

PEFT_CONFIG = "adapter_config.json"
PEFT_WEIGHTS = "adapter_model.safetensors"


@dataclass(frozen=True)
class AdapterUpload:
    """An adapter ready to send: its canonical config and its tensors as a stream."""

    config: AdapterConfig
    stream: SafetensorsStream

    def sha256(self, base_sha256: str) -> str:
        """The adapter version's weight hash over a base with weight hash ``base_sha256``."""
        prefix = adapter_hash_prefix(self.config.to_json(), base_sha256)
        return hash_sources(self.stream.tensors, self.stream.files, prefix=prefix)

    @classmethod
    def _of(
        cls, config: AdapterConfig, sources: list[TensorSource], files: list[Path] | None = None
    ) -> AdapterUpload:
        meta = {"format": "pt", ADAPTER_CONFIG_KEY: config.to_json()}
        return cls(config, SafetensorsStream(sources, files=files, metadata=meta))

    @classmethod
    def from_tensors(cls, config: AdapterConfig, tensors: Mapping[str, Any]) -> AdapterUpload:
        """Tensors under our names (``<module>.lora_A`` / ``.lora_B``: torch or numpy)."""
        return cls._of(config, state_dict_sources(tensors))

    @classmethod
    def from_peft_state_dict(
        cls, state_dict: Mapping[str, Any], peft_config: Mapping[str, Any]
    ) -> AdapterUpload:
        """A PEFT adapter state dict (``get_peft_model_state_dict``) and its config dict."""
        tensors = {peft_tensor_name(k): v for k, v in state_dict.items()}
        sources = state_dict_sources(tensors)
        table = {s.name: (s.dtype, s.shape) for s in sources}
        return cls._of(AdapterConfig.from_peft(peft_config, table), sources)

    @classmethod
    def from_directory(cls, path: str | os.PathLike[str]) -> AdapterUpload:
        """A PEFT ``save_pretrained`` directory: ``adapter_config.json`` and
        ``adapter_model.safetensors``, read without loading the tensors."""
        d = Path(path)
        cfg, weights = d / PEFT_CONFIG, d / PEFT_WEIGHTS
        if not cfg.is_file() or not weights.is_file():
            raise InvalidRequest(
                f"{d} is not a PEFT adapter directory: it needs {PEFT_CONFIG} and {PEFT_WEIGHTS}",
                parameter="adapter",
            )
        try:
            peft_config = json.loads(cfg.read_text())
        except ValueError as exc:
            raise InvalidRequest(f"{cfg}: not JSON ({exc})", parameter="adapter") from exc
        found, files = file_sources(weights)
        sources = [dataclasses.replace(s, name=peft_tensor_name(s.name)) for s in found]
        table = {s.name: (s.dtype, s.shape) for s in sources}
        return cls._of(AdapterConfig.from_peft(peft_config, table), sources, files)
