"""The trainer side of routing replay in another environment (``.venv-verl``: transformers 5.5.3).

Run as ``python -m tests.integration.routing_worker SPEC OUT``: SPEC is a JSON file mapping each
MoE family to its model directory, a padded batch (``input_ids``, ``attention_mask``) and a
routing record aligned with it (``routed_experts`` [B, T, L, k]); OUT receives, per family, the
float32 logprobs ``token_logprobs`` computes replaying it under ``trainer_numerics`` (as hex, so
the bits travel) and this environment's transformers release.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import torch
import transformers
from transformers import AutoModelForCausalLM

from oldlogit.parity import token_logprobs, trainer_numerics


def main(spec_path: str, out_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    out: dict[str, object] = {"transformers": transformers.__version__, "families": {}}
    for arch, case in spec["families"].items():
        model = AutoModelForCausalLM.from_pretrained(case["dir"], dtype=torch.float32).eval()
        with trainer_numerics(model, tile_rows=spec["tile_rows"]), torch.no_grad():
            lp = token_logprobs(
                model,
                torch.tensor(case["input_ids"]),
                torch.tensor(case["attention_mask"]),
                routed_experts=torch.tensor(case["routed_experts"]),
            )
        out["families"][arch] = lp.numpy().astype(np.float32).tobytes().hex()  # type: ignore[index]
    with open(out_path, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
