#!/usr/bin/env bash
# The checks that need a CUDA GPU, as ONE call on the lent GPU machine (at most 9 minutes), one
# results JSON. Before the call, here (network), once: `bash scripts/gpu_wheels.sh` (.whl/, the
# packages the image lacks, ~25 MiB). Then the device call, exactly:
#
#   run(command="bash scripts/gpu_checks.sh", carry=[".whl"], timeout_s=600)
#
# and commit the returned gpu-checks.json as docs/perf/gpu-<card>-<date>.json (e.g.
# docs/perf/gpu-h100-2026-12-01.json; the card from machine.device_name). The script needs no
# `make install`: with a .whl/ folder it installs the wheels into $SITE (default /tmp/site) and
# runs from this checkout with PYTHONPATH=$SITE:client:service:. on the image's python3 (its
# torch 2.11 + CUDA, triton 3.6).
#
#   bash scripts/gpu_checks.sh [OUT_DIR]              (default $OUT, else /tmp/oldlogit-gpu)
#   bash scripts/gpu_checks.sh --rehearse OUT_DIR     the same steps on the CPU, tiny sizes
#
# Steps, in priority order, each under its own time budget (benchmarks/gpu_checks.py): the
# machine (nvidia-smi, torch/CUDA/triton/transformers versions, capability); the `gpu`-marked
# tests (they skip without CUDA); the Triton kernels' tests (tests/unit/test_cuda_kernels.py,
# compiled on the GPU); invariant-vs-plain, patched-step-cost and models-vs-hf-forward
# (the service over gRPC with its start-up self-check) at Qwen2.5-1.5B's layer shapes; then
# `bench serving` and `bench throughput` on the GPU while time remains. A step that fails is
# recorded with the tail of its output and the next one runs. OUT_DIR receives gpu-checks.json
# (rewritten after every step), gpu-tests.log/.xml, kernel-tests.log/.xml and steps.log. The
# exit status is 0 when the tests passed (1 when one failed or did not finish), whatever the
# figures.
#
# Environment: PYTHON (default python3), WHEELS (default .whl; with --rehearse none unless set),
# SITE (default /tmp/site), BUDGET_S (whole script, default 540; rehearsal 240), ONLY (some
# steps by name, e.g. ONLY="invariant-vs-plain models-vs-hf-forward": a second call that
# re-runs what the first could not finish).
set -uo pipefail
start=$SECONDS
rehearse=()
if [[ ${1:-} == --rehearse ]]; then
  rehearse=(--rehearse)
  shift
fi
out=${1:-${OUT:-/tmp/oldlogit-gpu}}
mkdir -p "$out"
out=$(cd "$out" && pwd)
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
site=${SITE:-/tmp/site}
if ((${#rehearse[@]})); then
  wheels=${WHEELS:-}
  budget=${BUDGET_S:-240}
else
  wheels=${WHEELS:-.whl}
  budget=${BUDGET_S:-540}
fi

wheel_note="no wheels installed (the Python's own packages)"
if [[ -n $wheels ]] && compgen -G "$wheels/*.whl" >/dev/null; then
  t=$SECONDS
  if "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$site" "$wheels"/*.whl >"$out/steps.log" 2>&1; then
    wheel_note="$(ls "$wheels"/*.whl | wc -l) wheels from $wheels into $site ($((SECONDS - t)) s)"
  else
    wheel_note="wheel install FAILED ($((SECONDS - t)) s): $(tail -c 600 "$out/steps.log")"
  fi
  export PYTHONPATH="$site:$PWD/client:$PWD/service:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="$PWD/client:$PWD/service:$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
echo "gpu_checks: $wheel_note"

# The driver writes gpu-checks.json after each step; `timeout` is the backstop that ends it
# (SIGINT, then SIGKILL) inside the budget, the JSON then holds every step that finished.
left=$((budget - (SECONDS - start) - 10))
only=()
if [[ -n ${ONLY:-} ]]; then
  read -ra names <<<"$ONLY"
  only=(--only "${names[@]}")
fi
timeout --signal=INT --kill-after=15 "$((left + 10))" \
  "$py" -m benchmarks.gpu_checks "$out" "${rehearse[@]}" --budget-s "$left" \
  --wheels "$wheel_note" "${only[@]}"
status=$?
echo "gpu_checks: exit $status after $((SECONDS - start)) s; results in $out/gpu-checks.json"
exit "$status"
