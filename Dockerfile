# oldlogit: `oldlogit serve` in a small non-root image. CPU by default (the PyTorch CPU wheel);
# for GPUs build with a CUDA base and the matching wheel index. `make image` (which runs
# scripts/build_image.sh) does either:
#   docker build -t oldlogit:latest .
#   docker build -t oldlogit:latest-cuda \
#     --build-arg BASE_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04 \
#     --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 .
# Behind a proxy that re-signs TLS, or with no route to TORCH_INDEX, put a CA bundle or a local
# torch wheel in deploy/docker/build-extras/ (see its README): the build stage uses them, the
# final image never contains them. No `# syntax=` line: BuildKit's built-in frontend and the
# legacy builder both read this file, so a build pulls no frontend image.
# Both stages start from the same base, so the virtual environment built in the first one
# runs unchanged in the second (same interpreter path); only /opt/venv is carried over.
ARG BASE_IMAGE=python:3.11-slim-bookworm

FROM ${BASE_IMAGE} AS base
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# CUDA and plain Debian bases have no Python; python:* bases have it and skip this.
# hadolint ignore=DL3008
RUN if ! command -v python3 >/dev/null; then \
      apt-get update \
      && apt-get install -y --no-install-recommends python3 \
      && rm -rf /var/lib/apt/lists/*; \
    fi
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

FROM base AS build
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
# The venv module is needed here only (Debian splits it out; python:* bases have it).
# hadolint ignore=DL3008
RUN if ! python3 -c 'import ensurepip' 2>/dev/null; then \
      apt-get update \
      && apt-get install -y --no-install-recommends python3-venv \
      && rm -rf /var/lib/apt/lists/*; \
    fi \
    && python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src
COPY deploy/docker/build-extras/ /tmp/build-extras/
COPY constraints.txt ./
# torch first and alone: a local wheel if one was handed in, else from the index that matches
# the base (CPU or CUDA). The pin in constraints.txt keeps every install from resolving another
# torch (an unpinned one pulls GBs of CUDA wheels). A handed-in CA goes to this stage's
# /etc/pip.conf, which pip's isolated build environments read too.
RUN if [ -f /tmp/build-extras/ca.pem ]; then \
      printf '[global]\ncert = /tmp/build-extras/ca.pem\n' > /etc/pip.conf; \
    fi \
    && if [ -n "$(find /tmp/build-extras -name 'torch-*.whl')" ]; then \
      pip install -c constraints.txt --find-links /tmp/build-extras "torch==2.13.0"; \
    else \
      pip install -c constraints.txt --index-url "${TORCH_INDEX}" "torch==2.13.0"; \
    fi
COPY pyproject.toml README.md ./
COPY client ./client
COPY service ./service
# Then trim what `oldlogit serve` never uses at run time: the installers, C/C++ headers and
# CMake files (for building extensions), static libraries, test suites and test binaries.
RUN pip install -c constraints.txt ".[service]" \
    && pip uninstall -y -q pip setuptools wheel \
    && site=$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') \
    && rm -rf "$site"/torch/include "$site"/torch/share/cmake "$site"/torch/bin/protoc* \
              "$site"/torch/bin/test_* "$site"/torch/bin/*Test \
    && find "$site" -name '*.a' -delete \
    && find "$site" -depth -type d \( -name tests -o -name test \) \
         -not -path '*/torch/testing/*' -exec rm -rf {} + \
    && python -c 'import oldlogit_service.server'

FROM base AS runtime
ARG UID=10001
# uid and gid both 10001: what deploy/k8s runs as (runAsUser, runAsGroup, fsGroup).
RUN groupadd --system --gid "${UID}" oldlogit \
    && useradd --system --uid "${UID}" --gid "${UID}" --create-home --home-dir /home/oldlogit \
      oldlogit \
    && mkdir -p /snapshots \
    && chown oldlogit:oldlogit /snapshots
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    OLDLOGIT_HOST=0.0.0.0 \
    OLDLOGIT_HTTP_PORT=8000 \
    OLDLOGIT_GRPC_PORT=50051 \
    OLDLOGIT_SNAPSHOT_DIR=/snapshots
USER ${UID}
WORKDIR /home/oldlogit
EXPOSE 8000 50051
VOLUME ["/snapshots"]
# Healthy = can serve (/readyz), on the plain probe port if OLDLOGIT_HEALTH_PORT is set (what
# TLS needs), else on the HTTP port: the same variables the server reads.
HEALTHCHECK --interval=10s --timeout=5s --start-period=300s --retries=3 \
  CMD ["python", "-c", "import os, urllib.request; e = os.environ; urllib.request.urlopen('http://127.0.0.1:%s/readyz' % e.get('OLDLOGIT_HEALTH_PORT', e.get('OLDLOGIT_HTTP_PORT', '8000')), timeout=4)"]
ENTRYPOINT ["oldlogit"]
CMD ["serve", "--demo"]
