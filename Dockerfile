# syntax=docker/dockerfile:1
# oldlogit: `oldlogit serve` in a small non-root image. CPU by default (the PyTorch CPU wheel);
# for GPUs build with a CUDA base and the matching wheel index, e.g.
#   docker build -t oldlogit:cpu .
#   docker build -t oldlogit:cuda \
#     --build-arg BASE_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04 \
#     --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 .
# Both stages start from the same base, so the virtual environment built in the first one
# runs unchanged in the second (same interpreter path); only /opt/venv is carried over.
ARG BASE_IMAGE=python:3.11-slim-bookworm

FROM ${BASE_IMAGE} AS base
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# CUDA bases have no Python; python:* bases have it and skip this. Versions follow the base.
# hadolint ignore=DL3008
RUN if ! command -v python3 >/dev/null; then \
      apt-get update \
      && apt-get install -y --no-install-recommends python3 python3-venv \
      && rm -rf /var/lib/apt/lists/*; \
    fi
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

FROM base AS build
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src
# torch first and alone, from the index that matches the base (CPU or CUDA): the pin in
# constraints.txt keeps the second install from resolving another torch.
COPY constraints.txt ./
RUN pip install --index-url "${TORCH_INDEX}" "torch==2.13.0"
COPY pyproject.toml README.md ./
COPY client ./client
COPY service ./service
RUN pip install -c constraints.txt ".[service]"

FROM base AS runtime
ARG UID=10001
RUN useradd --system --uid "${UID}" --user-group --create-home --home-dir /home/oldlogit \
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
# Healthy = can serve (/readyz). The port comes from the same variable the server reads.
HEALTHCHECK --interval=10s --timeout=5s --start-period=300s --retries=3 \
  CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/readyz' % os.environ.get('OLDLOGIT_HTTP_PORT', '8000'), timeout=4)"]
ENTRYPOINT ["oldlogit"]
CMD ["serve", "--demo"]
