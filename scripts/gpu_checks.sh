#!/usr/bin/env bash
# The checks that need a CUDA GPU, in one go: the `gpu`-marked tests (they skip without CUDA),
# then the figures that run on the GPU (`oldlogit bench invariant`, `serving` and `throughput`
# with --device cuda). Run from a source checkout whose Python has the service's dependencies
# (`make install` on a GPU machine, or PYTHONPATH=client:service:. with them installed).
#
#   bash scripts/gpu_checks.sh [OUT_DIR]     (default /tmp/oldlogit-gpu)
#
# OUT_DIR receives gpu-tests.log and one results folder per figure run. The exit status is the
# tests' (a figure that fails is reported and does not hide a test failure, nor the reverse).
set -uo pipefail
out=${1:-/tmp/oldlogit-gpu}
py=${PYTHON:-python3}
mkdir -p "$out"
cd "$(dirname "$0")/.."

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
"$py" - <<'PY' || exit 1
import torch, transformers
assert torch.cuda.is_available(), "no CUDA device visible to torch"
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}) on {torch.cuda.get_device_name(0)};"
      f" transformers {transformers.__version__}")
PY

# 1. Every gpu-marked test; with CUDA present none of them may skip for want of it.
"$py" -m pytest -m gpu -q -ra -p no:cacheprovider --continue-on-collection-errors \
    tests/unit tests/integration/test_tensor_parallel_serving.py 2>&1 | tee "$out/gpu-tests.log"
status=${PIPESTATUS[0]}

# 2. The figures on the GPU: the invariant forward against transformers' own (the table's
# shapes), and the service against its in-process engine at a 12-layer, 0.5B-wide model.
"$py" -m oldlogit_service.cli bench invariant --device cuda --out "$out/bench-invariant" \
    || echo "gpu_checks: bench invariant failed"
"$py" -m oldlogit_service.cli bench serving --device cuda --dtype bfloat16 \
    --hidden 896 --layers 12 --vocab 32768 --seqs 64 --seq-len 512 \
    --out "$out/bench-serving" || echo "gpu_checks: bench serving failed"
# 3. The GPU-shaped targets (concurrent-vs-naive, versions-vs-naive, forward-roofline), the
# naive baseline on the GPU too; the suite's small default model (16 versions are written).
"$py" -m oldlogit_service.cli bench throughput --device cuda --out "$out/bench-throughput" \
    || echo "gpu_checks: bench throughput failed"
exit "$status"
