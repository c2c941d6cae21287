#!/usr/bin/env bash
# The wheels scripts/gpu_checks.sh installs on the lent GPU machine, which has no network: the
# packages the service, its client, the `gpu` tests and the GPU figures import that its image
# ('cuda': torch 2.11.0+cu130, triton 3.6, transformers 5.17, Python 3.12) lacks, or holds in a
# version outside pyproject.toml's ranges. Downloaded here, into .whl/ (ignored by git and by
# the Docker context), and carried along: run(..., carry=[".whl"]).
#
#   bash scripts/gpu_wheels.sh               # .whl/ for CPython 3.12 on manylinux x86-64
#   PY_VERSION=3.11 DEST=/tmp/w bash scripts/gpu_wheels.sh   # another Python (the CPU rehearsal)
#
# Never torch, triton or a CUDA library: the checks run on the image's own. One version of each
# (two stop the whole install there). The versions are the ones `make install` resolves here,
# so the checks run the code tested here; the total is printed (it travels in the working tree,
# 64 MiB in all). Idempotent: a wheel already in DEST is not fetched again.
set -euo pipefail
cd "$(dirname "$0")/.."

DEST=${DEST:-.whl}
PY_VERSION=${PY_VERSION:-3.12}
PYTHON=${PYTHON:-$([[ -x .venv/bin/python ]] && echo .venv/bin/python || echo python3)}

# name==version   why the image's own will not do
WHEELS=(
  transformers==5.23.0          # image: 5.17; the service extra pins >=5.23,<5.24
  peft==0.21.2                  # dev pins >=0.21,<0.22; the image's is of unknown version
  fastapi==0.165.0              # absent
  starlette==1.10.0             # absent (fastapi's)
  opentelemetry-api==1.45.2     # absent (fastapi's)
  pydantic==2.14.4              # absent (the client's contract)
  pydantic-core==2.50.5         # absent (pydantic's; compiled)
  annotated-types==0.8.0        # absent (pydantic's)
  typing-inspection==0.4.5      # absent (pydantic's)
  typing-extensions==4.16.0     # pydantic-core needs >=4.16; the image's is of unknown version
  pydantic-settings==2.16.3     # absent (the service's settings)
  python-dotenv==1.2.4          # absent (pydantic-settings')
  uvicorn==0.54.0               # absent (HTTP); its [standard] extras are optional, left out
  grpcio==1.85.3                # >=1.85.1 (health/reflection); the image's is of unknown version
  grpcio-health-checking==1.85.1  # absent
  grpcio-reflection==1.85.1     # absent
  protobuf==7.36.2              # >=7.35.1,<8; the image's is of unknown version
  redis==8.1.0                  # absent (scale-out; imported by the cluster module)
  prometheus-client==0.26.0     # >=0.20; the image's is of unknown version
  sniffio==1.3.1                # absent (httpcore's async path, pyproject's dependencies)
  pytest-asyncio==1.5.0         # absent (the suite's asyncio_mode = "auto")
  py-spy==0.4.3                 # absent (the profile step samples the server with it)
)

mkdir -p "$DEST"
pyver=${PY_VERSION//./}
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_5_x86_64 \
  manylinux1_x86_64; do
  platforms+=(--platform "$p")
done
# Strip the comments: one name==version a line.
specs=()
for w in "${WHEELS[@]}"; do specs+=("${w%%#*}"); done
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version "$PY_VERSION" \
  --implementation cp --abi "cp$pyver" --abi abi3 --abi none "${platforms[@]}" \
  --platform any -d "$DEST" "${specs[@]}"
# One version of each: a wheel left from an older list would be installed beside the new one.
"$PYTHON" - "$DEST" "${specs[@]}" <<'PY'
import re, sys
from pathlib import Path

dest, specs = Path(sys.argv[1]), sys.argv[2:]
norm = lambda s: re.sub(r"[-_.]+", "_", s).lower()
want = {norm(s.split("==")[0]): s.split("==")[1] for s in specs}
stale = []
for whl in sorted(dest.glob("*.whl")):
    name, version = whl.name.split("-")[:2]
    if want.get(norm(name)) != version:
        stale.append(whl.name)
        whl.unlink()
if stale:
    print("gpu_wheels: removed wheels not in the list:", ", ".join(stale))
missing = sorted(set(want) - {norm(w.name.split("-")[0]) for w in dest.glob("*.whl")})
if missing:
    sys.exit(f"gpu_wheels: no wheel for {missing}")
total = sum(w.stat().st_size for w in dest.glob("*.whl"))
print(f"gpu_wheels: {len(want)} wheels in {dest}/, {total / 2**20:.1f} MiB")
PY
