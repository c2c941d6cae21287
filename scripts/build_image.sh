#!/usr/bin/env bash
# Builds the oldlogit image (`make image` runs this). On a machine with registry access it is
# a plain `docker build` of the Dockerfile's defaults; the inputs below cover the rest:
#
#   VARIANT       cpu (default) or cuda: picks the defaults of BASE_IMAGE, TORCH_INDEX, IMAGE
#   IMAGE         tag to build (oldlogit:latest, or oldlogit:latest-cuda)
#   BASE_IMAGE    cpu: python:3.11-slim-bookworm; if that is neither here nor pullable, the
#                 local Debian base of scripts/make_base_images.sh is built and used instead
#   TORCH_INDEX   the PyTorch wheel index (https://download.pytorch.org/whl/cpu or .../cu128)
#   TORCH_WHEEL   a local torch==2.13.0 wheel to install instead (cpu: found in
#                 $PIP_FIND_LINKS when it matches the base's Python); "none" to never use one
#   CA_BUNDLE     a CA bundle pip must trust in the build stage (default: $PIP_CERT if set);
#                 "none" to hand in none. Never part of the final image.
#   BUILD_NETWORK network of the build containers (host: the host's route out and proxy)
#   DOCKER_BUILD_FLAGS  more flags for docker build
#
# --dry-run prints the docker build command and changes nothing (no Docker needed).
set -euo pipefail
cd "$(dirname "$0")/.."

dry_run=0
[[ ${1:-} == --dry-run ]] && dry_run=1
VARIANT=${VARIANT:-cpu}
case $VARIANT in
  cpu)
    default_base=python:3.11-slim-bookworm
    default_index=https://download.pytorch.org/whl/cpu
    default_tag=oldlogit:latest
    ;;
  cuda)
    default_base=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04
    default_index=https://download.pytorch.org/whl/cu128
    default_tag=oldlogit:latest-cuda
    ;;
  *)
    echo "build_image: VARIANT must be cpu or cuda, not '$VARIANT'" >&2
    exit 2
    ;;
esac
IMAGE=${IMAGE:-$default_tag}
TORCH_INDEX=${TORCH_INDEX:-$default_index}
BUILD_NETWORK=${BUILD_NETWORK:-host}
CA_BUNDLE=${CA_BUNDLE:-${PIP_CERT:-none}}
LOCAL_BASE=${LOCAL_IMAGE_PREFIX:-oldlogit-local}/python:3.11-bookworm
say() { echo "build_image: $*"; }

# The base: the variant's default unless given; for cpu, the local Debian base when the
# default can be neither found nor pulled (a host with no image registry).
if [[ -z ${BASE_IMAGE:-} ]]; then
  BASE_IMAGE=$default_base
  if [[ $dry_run == 0 && $VARIANT == cpu ]] && ! docker image inspect "$BASE_IMAGE" >/dev/null 2>&1 \
    && ! timeout 120 docker pull -q "$BASE_IMAGE" >/dev/null 2>&1; then
    say "$BASE_IMAGE cannot be pulled here: using $LOCAL_BASE (scripts/make_base_images.sh)"
    scripts/make_base_images.sh
    BASE_IMAGE=$LOCAL_BASE
  fi
fi

# A local torch wheel: given, or (cpu) the one in $PIP_FIND_LINKS built for the base's Python.
if [[ -z ${TORCH_WHEEL:-} && $VARIANT == cpu && $dry_run == 0 ]]; then
  TORCH_WHEEL=none
  for dir in ${PIP_FIND_LINKS:-}; do
    [[ -d $dir ]] || continue
    tag=$(docker run --rm --entrypoint python3 "$BASE_IMAGE" \
      -c 'import sys; print("cp%d%d" % sys.version_info[:2])' 2>/dev/null || true)
    for whl in "$dir"/torch-2.13.0+cpu-"$tag"-*linux*x86_64.whl; do
      [[ -n $tag && -f $whl ]] && TORCH_WHEEL=$whl && break 2
    done
  done
fi
TORCH_WHEEL=${TORCH_WHEEL:-none}

cmd=(docker build --network "$BUILD_NETWORK" -t "$IMAGE"
  --build-arg "BASE_IMAGE=$BASE_IMAGE" --build-arg "TORCH_INDEX=$TORCH_INDEX")
# shellcheck disable=SC2206  # word splitting intended: a list of flags
cmd+=(${DOCKER_BUILD_FLAGS:-} .)
# BuildKit where docker has it (buildx); otherwise the legacy builder, which needs no frontend
# image and reads this Dockerfile as it is.
docker_buildkit=1
if [[ $dry_run == 0 ]] && ! docker buildx version >/dev/null 2>&1; then
  docker_buildkit=0
fi
say "variant=$VARIANT base=$BASE_IMAGE torch=$([[ $TORCH_WHEEL != none ]] && echo "$TORCH_WHEEL" \
  || echo "$TORCH_INDEX") ca=$CA_BUNDLE builder=$([[ $docker_buildkit == 1 ]] && echo buildkit \
  || echo legacy)"
if [[ $dry_run == 1 ]]; then
  printf '%q ' "${cmd[@]}"
  echo
  exit 0
fi

# Stage the build-stage inputs (deploy/docker/build-extras/README.md) for this build and remove
# them again on exit; files someone put there by hand are used as they are and left alone.
extras=deploy/docker/build-extras
staged=()
cleanup() { ((${#staged[@]} == 0)) || rm -f "${staged[@]}"; }
trap cleanup EXIT
stage() { # SOURCE DEST
  if [[ -e $2 ]]; then
    say "using $2 as it is"
    return
  fi
  ln "$1" "$2" 2>/dev/null || cp "$1" "$2"
  staged+=("$2")
}
[[ $CA_BUNDLE == none ]] || stage "$CA_BUNDLE" "$extras/ca.pem"
[[ $TORCH_WHEEL == none ]] || stage "$TORCH_WHEEL" "$extras/$(basename "$TORCH_WHEEL")"

start=$SECONDS
DOCKER_BUILDKIT=$docker_buildkit "${cmd[@]}"
size=$(docker image inspect -f '{{.Size}}' "$IMAGE")
say "$IMAGE built in $((SECONDS - start)) s, $((size / 1000000)) MB"
