#!/usr/bin/env bash
# A side venv with a real verl (0.9.1) on the OLDEST transformers the `trainer` extra accepts
# (5.5.3; pyproject.toml: >=5.5.3,<5.24), for tests/integration/test_verl_actor.py (pytest -m verl):
# verl's own FSDP actor computes π_θ under oldlogit.parity and must equal the service bitwise.
#
#   scripts/trainer_venv.sh            # creates/refreshes ./.venv-verl (idempotent)
#   VENV=/path scripts/trainer_venv.sh # elsewhere
#
# torch is pinned by constraints.txt in every install step (an unpinned torch resolves to
# multi-GB CUDA wheels). A stamp keyed on this script's checksum (and constraints.txt,
# pyproject.toml) makes a second run a no-op.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv-verl}
TRANSFORMERS_VERSION=5.5.3
VERL_VERSION=0.9.1
# verl requires peft unpinned; its LoRA actor (lora_rank > 0) runs PEFT's lora.Linear, which
# oldlogit.parity vouches for by source hash at peft 0.21 only
# (client/oldlogit/parity/lora_trainer.py, LINEAR_FORWARD_SOURCES).
PEFT_VERSION=0.21.2
key=$(cat "$0" constraints.txt pyproject.toml | cksum | cut -d' ' -f1)
stamp="$VENV/.installed-$key"

if [[ -f $stamp ]]; then
  echo "$VENV is up to date ($stamp)"
  exit 0
fi

start=$SECONDS
test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
pip=("$VENV/bin/python" -m pip install -q -c constraints.txt)
"$VENV/bin/python" -m pip install -q --upgrade pip
"${pip[@]}" "torch==2.13.0"
# verl's wheel requires ray[default], tensordict<=0.10, hydra, datasets, wandb, ...: all pure
# Python or CPU wheels. Its `fsdp`/`cpu` extras pin torch 2.11 + CUDA packages: not installed.
# verl.workers.engine_workers also imports uvicorn and fastapi (via verl.checkpoint_engine ->
# verl.workers.rollout.utils), which only its `verl-core` extra lists.
"${pip[@]}" "transformers==$TRANSFORMERS_VERSION" "verl==$VERL_VERSION" "peft==$PEFT_VERSION" \
  fastapi uvicorn
# oldlogit itself (editable) with its client dependencies only (numpy, pydantic, httpx, grpcio,
# protobuf, msgpack, sniffio): no extra, so nothing here can move transformers or torch.
"${pip[@]}" -e . "pytest>=8"
"$VENV/bin/python" -m pip check || true
"$VENV/bin/python" - <<EOF
import peft, torch, transformers, verl, oldlogit.parity, oldlogit.integrations.verl  # noqa: F401
from verl.workers.engine.fsdp.transformer_impl import FSDPEngine  # noqa: F401
from verl.workers.engine_workers import ActorRolloutRefWorker, TrainingWorker  # noqa: F401
assert torch.__version__.split("+")[0] == "2.13.0", torch.__version__
assert transformers.__version__ == "$TRANSFORMERS_VERSION", transformers.__version__
assert verl.__version__ == "$VERL_VERSION", verl.__version__
assert peft.__version__ == "$PEFT_VERSION", peft.__version__
print("torch", torch.__version__, "transformers", transformers.__version__, "verl", verl.__version__,
      "peft", peft.__version__)
EOF
rm -f "$VENV"/.installed-*
touch "$stamp"
echo "$VENV ready in $((SECONDS - start)) s"
